"""The report's tensor-parallel degrees (issue 30: the frontier with and without TP, with the reasons): a
"Tensor parallelism" section only for a plan that searched more than one degree, its figure one Pareto
frontier per solved degree in that degree's own throughput, its table a row per degree, the reason line
in the summary; a plan of one degree renders exactly as before the degree search.

``data/report_one_degree.md`` is report.md of ``make_plan(8, budget_gib=42)`` (the plan file alone) as
rendered at cdb4ed5, before the report knew about degrees, the version replaced by
``<version>``. A deliberate change to the report's text regenerates it (see
:func:`test_a_plan_of_one_degree_renders_as_before`)."""

from pathlib import Path

import pytest

from shard_planner import __version__
from shard_planner.report import write_report
from tests.models.report_fixtures import make_plan

DATA = Path(__file__).parent / "data"

pytestmark = pytest.mark.usefixtures("in_repository_root")


def one_degree_markdown(tmp_path) -> str:
    plan = make_plan(8, budget_gib=42)
    write_report(plan, tmp_path)
    return (tmp_path / "report.md").read_text().replace(__version__, "<version>")


def test_a_plan_of_one_degree_renders_as_before(tmp_path):
    # To regenerate after a deliberate change: write one_degree_markdown(tmp_path) to DATA / "report_one_degree.md".
    assert one_degree_markdown(tmp_path) == (DATA / "report_one_degree.md").read_text()
