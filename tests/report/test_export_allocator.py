"""Every export states the CUDA caching allocator's setting the plan was judged with (cluster.expandable_segments),
as the environment assignment of its stack's launch (report/export/common.py ``allocator_env``)."""

import json
from dataclasses import replace

import pytest

from shard_planner.plan import Unit
from shard_planner.report.export import TARGETS, export_plan
from shard_planner.report.export.common import allocator_env
from tests.report.test_export import gpt2_plan, parse_yaml

pytestmark = pytest.mark.usefixtures("in_repository_root")

ON, OFF = "PYTORCH_ALLOC_CONF=expandable_segments:True", "PYTORCH_ALLOC_CONF=expandable_segments:False"


def _plan(expandable: bool):
    plan = gpt2_plan([Unit(("",), reshard_after_forward=False)] + [Unit((f"blocks.{i}",)) for i in range(4)])
    return replace(plan, cluster=replace(plan.cluster, expandable_segments=expandable))


def _launch_lines(target: str, text: str) -> list[str]:
    """The lines of the export that launch it: where the setting must stand."""
    match target:
        case "fsdp2":
            return [line for line in text.splitlines() if "torchrun" in line]
        case "torchtitan":
            return [line for line in text.splitlines() if "SHARD_PLANNER_BASE_CONFIG=llama3" in line]
        case "accelerate":
            return [line for line in text.splitlines() if line.startswith("# Use:")]
        case "deepspeed":
            return [line for line in json.loads(text)["_comment"] if "--deepspeed_config" in line]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("expandable, wanted, other", [(True, ON, OFF), (False, OFF, ON)])
def test_each_export_launches_with_the_judged_allocator_setting(target, expandable, wanted, other):
    plan = _plan(expandable)
    assert allocator_env(plan) == wanted
    text = export_plan(plan, target).text
    launches = _launch_lines(target, text)
    assert launches and all(wanted in line for line in launches), launches
    assert other not in text
    prose = " ".join(" ".join(line.strip().lstrip("#").split()) for line in text.splitlines())  # comments joined
    assert "judged to fit --mem with " + wanted in prose


def test_the_setting_is_a_comment_in_the_accelerate_config():
    """accelerate's config has no environment section: the setting is in its comments, not a key."""
    text = export_plan(_plan(True), "accelerate").text
    config = parse_yaml(text)
    assert "PYTORCH_ALLOC_CONF" not in json.dumps(config)
    assert any(ON in line for line in text.splitlines() if line.startswith("#"))
