"""The one ownership / tie helper (shard_planner/ownership.py)."""

from shard_planner.ownership import innermost_unit, owners, split_groups, tie_groups


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
