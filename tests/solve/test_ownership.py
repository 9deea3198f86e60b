"""The one ownership / tie helper (shard_planner/plan/ownership.py)."""

import pytest

from shard_planner.plan.ownership import innermost_unit, owners, split_groups, tie_groups
from tests.paths import EXAMPLES, MODELS


def test_innermost_unit_walks_up_to_the_nearest_wrapped_module():
    unit_of = {"": 0, "layers.1": 2, "layers.1.attn": 3}
    assert innermost_unit("layers.1.attn.q", unit_of) == 3
    assert innermost_unit("layers.1.mlp", unit_of) == 2
    assert innermost_unit("layers.10", unit_of) == 0  # not layers.1's child
    assert innermost_unit("norm", {"layers.0": 1}) is None
    assert owners({"": 0, "a": 1}, ["", "a", "a.b", "c"]) == {"": 0, "a": 1, "a.b": 1, "c": 0}


def test_tie_groups_are_connected_components():
    groups = tie_groups([("wte", ["lm_head"]), ("lm_head", ["wte"]), ("a", ["b"]), ("c", ["b"]), ("x", [])])
    assert sorted(map(sorted, groups)) == [["a", "b", "c"], ["lm_head", "wte"]]


def test_split_groups_names_the_groups_with_two_owners():
    groups = (frozenset({"wte", "lm_head"}), frozenset({"a", "b"}))
    unit_of = {"": 0, "wte": 1, "a": 2}
    assert split_groups(groups, lambda f: innermost_unit(f, unit_of)) == groups
    assert split_groups(groups, lambda f: innermost_unit(f, {"": 0, "a": 2})) == (frozenset({"a", "b"}),)
    assert split_groups(groups, lambda f: innermost_unit(f, {"": 0})) == ()


def test_contiguous_among_is_an_unbroken_run_in_any_listed_order():
    from shard_planner.plan.ownership import contiguous_among

    siblings = ["conv1", "norm1", "conv2", "norm2"]
    assert contiguous_among(siblings, ["norm1", "conv2"])
    assert contiguous_among(siblings, ["conv2", "norm1"])  # call order may differ from registration order
    assert not contiguous_among(siblings, ["norm1", "norm2"])  # conv2 holds parameters between them
    assert not contiguous_among(siblings, ["norm1", "drop"])  # not a sibling with parameters


@pytest.mark.parametrize("path", [str(EXAMPLES / "unet.py"), str(MODELS / "exec_call_order.py")])
def test_planner_groups_only_what_the_executor_applies(path):
    """Every grouped candidate of the search space passes apply_plan's group check on the real module
    tree: examples/unet.py's DoubleConv registers conv1, norm1, conv2, norm2; exec_call_order.py's
    embeddings are called word, kind, position but registered word, position, kind (word + kind is
    consecutive in call order, not a run of siblings)."""
    import torch

    from shard_planner.load.checked_plan import check_group
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.plan import Unit
    from shard_planner.solve.space import build_space
    from shard_planner.trace import trace_model
    space = build_space(trace_model(path, dtype="float32"), shard_group=2, gpus_per_node=8, max_group_size=4)
    with torch.device("meta"):
        model = load_model_file(path).build()
    groups = {tuple(it.fqn for it in space.items[c.start:c.stop]) for c in space.candidates if c.stop - c.start > 1}
    assert groups, "unet's space has grouped candidates"
    for modules in groups:
        check_group(model, Unit(modules))
