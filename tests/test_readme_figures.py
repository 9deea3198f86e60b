"""Every figure the README and docs/ quote comes from a report a benchmark writes (issue 36 items 3 and 14).

[Note: Figures in the documentation]
A measured or predicted figure in README.md or a page of docs/ is written as a Markdown link to the report it
comes from, under reports/: ``[75.3 GiB](reports/benchmarks/finetune.md)`` (from docs/,
``../reports/benchmarks/finetune.md``). The link text is the figure: one or more numbers, each with the
README's rounding, and optionally a unit after the last (``GiB``, ``tokens/s``, ``%``, ...). A figure holds
when each of its numbers, rounded to the figure's decimals, equals a number of the cited report (signs and
thousands separators aside) on a line that names the unit, or in a table whose header does. A block of
commands that a report lists is marked ``<!-- commands-from: PATH -->`` on the line before the code block: each
``shard-planner`` command in the block must appear, as written, in that report. The README quotes no figure
outside such links, nor do the pages moved from it (:func:`unlinked_figures`); a constant of the code or of a
profile is written as code (``usable_fraction = 0.8``), beside the file that holds it. To refresh a figure,
re-run its benchmark and update the figure this test names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOC_PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))
# Pages whose numbers have their own sources: frozen_facts.md tabulates its measured baseline itself; extending.md
# counts files; profiles.md quotes datasheets, each figure cited in its profiles/*.toml. Their links are checked,
# their other numbers are not.
OWN_SOURCES = ("extending.md", "frozen_facts.md", "profiles.md")

LINK = re.compile(r"\[([^\]\n]+)\]\(([^)\s]+)\)")
NUMBER = re.compile(r"(?<![\w.])[-+\u2212]?\d[\d,]*(?:\.\d+)?")
COMMANDS_FROM = re.compile(r"<!--\s*commands-from:\s*(\S+)\s*-->\s*\n```[^\n]*\n(.*?)\n```", re.S)
# A unit as a report may spell it in a column name or a line; a unit not listed must appear as written.
UNIT_SPELLINGS = {"%": ("%", "pct"), "tokens/s": ("tokens/s", "tokens_per_s", "tps"), "GiB": ("GiB", "gib"), "MiB": ("MiB", "mib"),
                  "s": ("s",), "ms": ("ms",)}
# What a page must not quote outside a link: a number with a unit a measurement or a prediction has.
FIGURE_UNITS = r"(?:GiB|MiB|TB/s|GB/s|tokens/s|ms|%|s\b)"


@dataclass(frozen=True)
class Figure:
    """One quoted figure: the page and line it is on, its text, the report it cites."""

    page: Path
    line: int
    text: str
    report: Path

    def where(self) -> str:
        return f"{shown(self.page)}:{self.line} [{self.text}]"


def prose(text: str) -> str:
    """The text without its fenced code blocks (kept as blank lines, so line numbers hold)."""
    return re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)


def quoted_figures(page: Path) -> list[Figure]:
    """The page's links to a report under reports/ whose text holds a number."""
    text = prose(page.read_text())
    out = []
    for m in LINK.finditer(text):
        label, target = m.group(1).strip("`"), m.group(2).split("#")[0]
        report = (page.parent / target).resolve()
        if NUMBER.search(label) and (ROOT / "reports") in report.parents:
            out.append(Figure(page, text.count("\n", 0, m.start()) + 1, label, report))
    return out


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


def numbers(text: str) -> list[str]:
    return [n.replace(",", "").replace("\u2212", "-").lstrip("+-") for n in NUMBER.findall(text)]


def rounds_to(value: str, figure: str) -> bool:
    """Whether the report's ``value`` rounded to the figure's decimals is the figure (either tie rule)."""
    places = Decimal(1).scaleb(-len(figure.partition(".")[2]))
    return any(Decimal(value).quantize(places, rounding=r) == Decimal(figure) for r in (ROUND_HALF_UP, ROUND_HALF_EVEN))


def unit_of(label: str) -> str:
    """The unit after the figure's last number ('' when none)."""
    last = list(NUMBER.finditer(label))[-1]
    return label[last.end():].strip()


def report_contexts(report: Path) -> list[tuple[str, str]]:
    """(line, where its units are named) for each line of the report: a table row's header, else the line."""
    contexts, header = [], None
    for line in report.read_text().splitlines():
        is_row = line.lstrip().startswith("|")
        header = (header or line) if is_row else None
        contexts.append((line, f"{header} {line}" if is_row else line))
    return contexts


def names_unit(context: str, unit: str) -> bool:
    spellings = UNIT_SPELLINGS.get(unit, (unit,))
    return any(re.search(rf"(?<![A-Za-z]){re.escape(s)}(?![A-Za-z])", context) for s in spellings)


def figure_problem(fig: Figure) -> str | None:
    """Why the figure does not hold, or None."""
    if not fig.report.is_file():
        return f"{fig.where()}: cites {shown(fig.report)}, which does not exist"
    unit = unit_of(fig.text)
    candidates = [n for line, ctx in report_contexts(fig.report) if not unit or names_unit(ctx, unit)
                  for n in numbers(line)]
    missing = [n for n in numbers(fig.text) if not any(rounds_to(c, n) for c in candidates)]
    if missing:
        return (f"{fig.where()}: {', '.join(missing)} is not in {shown(fig.report)}"
                f"{f' on a line naming {unit!r}' if unit else ''} (re-run its benchmark and quote the report)")
    return None


def unlinked_figures(page: Path) -> list[str]:
    """Numbers with a measured unit in the page's prose outside a link and outside inline code."""
    text = re.sub(r"`[^`\n]*`", "", LINK.sub("", prose(page.read_text())))
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    pattern = re.compile(rf"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?\s?{FIGURE_UNITS}")
    return [f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1} {m.group(0)!r}"
            for m in pattern.finditer(text)]


def command_blocks(page: Path) -> list[tuple[Path, list[str]]]:
    """(cited report, the block's shard-planner commands) for each ``commands-from`` block of the page."""
    return [((page.parent / m.group(1)).resolve(),
             [line.strip() for line in m.group(2).splitlines() if line.strip().startswith("shard-planner")])
            for m in COMMANDS_FROM.finditer(page.read_text())]


ALL_FIGURES = [fig for page in DOC_PAGES for fig in quoted_figures(page)]


def test_the_readme_and_docs_quote_figures_from_reports():
    assert len(ALL_FIGURES) >= 20, "the figure links were not found: has the convention changed?"
    problems = [p for p in map(figure_problem, ALL_FIGURES) if p]
    assert not problems, "figures that differ from the report they cite:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", [p for p in DOC_PAGES if p.name not in OWN_SOURCES],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_figure_without_its_report(page):
    found = unlinked_figures(page)
    assert not found, "figures without a report (link each to the report it comes from):\n" + "\n".join(found)


def test_listed_commands_are_those_the_benchmark_ran():
    blocks = [b for page in DOC_PAGES for b in command_blocks(page)]
    assert blocks, "no commands-from block found"
    for report, commands in blocks:
        assert commands, f"a commands-from block citing {report} lists no shard-planner command"
        text = report.read_text()
        missing = [c for c in commands if c not in text]
        assert not missing, f"not the commands {report.relative_to(ROOT)} lists: {missing}"


@pytest.mark.parametrize("label, report_line, holds", [
    ("75.3 GiB", "| lora | 75.32 GiB | 7347 |", True),
    ("73.1 GiB", "| lora | 75.32 GiB | 7347 |", False),
    ("7,347 tokens/s", "| case | peak | tokens_per_s |\n| lora | 75.32 GiB | 7347 |", True),
    ("7,347 tokens/s", "| case | peak | step_s |\n| lora | 75.32 GiB | 7347 |", False),
    ("+8.5%", "FSDP alone is 8.47% behind", True),
    ("8.5 s", "FSDP alone is 8.47% behind", False),
    ("-5.6% to +1.1%", "errors -5.6%, +1.06%", True),
])
def test_a_figure_holds_only_where_its_report_says_it(tmp_path, label, report_line, holds):
    fake = tmp_path / "report.md"
    fake.write_text(report_line + "\n")
    problem = figure_problem(Figure(README, 1, label, fake))
    assert (problem is None) == holds, problem
