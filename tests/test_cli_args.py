"""CLI argument handling shared by the commands: dtype choices, positive numbers, one-line errors."""

import pytest

from shard_planner.cli.main import build_parser
from shard_planner.units import DTYPE_NAMES


@pytest.mark.parametrize("command", [["trace", "m.py"], ["plan", "m.py", "--gpus", "8", "--mem", "40GB"]])
@pytest.mark.parametrize("dtype", sorted(DTYPE_NAMES))
def test_every_dtype_name_is_accepted_by_trace_and_plan(command, dtype):
    args = build_parser().parse_args([*command, "--dtype", dtype])
    assert args.dtype == dtype
