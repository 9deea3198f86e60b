"""cost/reshard.py: the one reading of ``reshard_after_forward`` ([Note: Reshard after forward])."""

from shard_planner.cost.reshard import Reshard, ReshardAfterForward, reshard_group_sizes, reshards_after_forward
from shard_planner.plan import Unit


def test_true_false_and_int():
    assert ReshardAfterForward.of(True, 8) == ReshardAfterForward(Reshard.ALWAYS, 8)
    assert ReshardAfterForward.of(False, 8) == ReshardAfterForward(Reshard.NEVER, 0)
    assert ReshardAfterForward.of(None, 8).kind is Reshard.NEVER  # FSDP2's default for the root
    assert ReshardAfterForward.of(4, 8) == ReshardAfterForward(Reshard.TO_GROUP, 4)


def test_an_int_equal_to_the_group_is_true():
    """DESIGN.md "FSDP2 facts": equal to the shard group size it silently behaves as True."""
    assert ReshardAfterForward.of(8, 8) == ReshardAfterForward.of(True, 8)


def test_bytes_kept_after_forward():
    assert ReshardAfterForward.of(True, 8).kept_after_forward_bytes(800.0) == 0.0
    assert ReshardAfterForward.of(False, 8).kept_after_forward_bytes(800.0) == 800.0
    assert ReshardAfterForward.of(4, 8).kept_after_forward_bytes(800.0) == 200.0
    assert ReshardAfterForward.of(4, 8).clone_bytes(800.0) == 200.0
    assert ReshardAfterForward.of(False, 8).clone_bytes(800.0) == 0.0


def test_reshards_and_groups():
    assert [reshards_after_forward(v) for v in (True, False, 2, None)] == [True, False, True, False]
    units = [Unit(("a",), 2), Unit(("b",), 4), Unit(("c",), 2), Unit(("d",), True), Unit(("e",), 8)]
    assert reshard_group_sizes(units, 8) == {2, 4}  # 8 == the group: True, no group of its own
