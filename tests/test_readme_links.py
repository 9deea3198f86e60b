"""The README and docs/ speak to users: they name only what a clone holds (issue 36 item 12).

The README once pointed to a DESIGN.md outside the repository and said examples/ had five files where it had
seven. Here: no link or path in README.md or docs/ leaves the repository, and docs/model-files.md names every
example file and counts them right.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
LINK_TARGET = re.compile(r"\]\(([^)\s#]+)")
COUNT_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
               "ten": 10}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_outside_the_repository(page):
    text = page.read_text()
    outside = [t for t in LINK_TARGET.findall(text) if "://" not in t
               and ROOT not in (page.parent / t).resolve().parents and (page.parent / t).resolve() != ROOT]
    outside += re.findall(r"\.\./shared/\S*", text)
    assert not outside, f"{page.relative_to(ROOT)} names what a clone does not hold: {outside}"


def test_the_examples_are_all_named_and_counted():
    text = (ROOT / "docs" / "model-files.md").read_text()
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
    assert [e for e in examples if f"`{e}`" not in text] == [], "docs/model-files.md leaves out an example"
    said = re.search(r"examples/ has (\w+)", text)
    assert said and COUNT_WORDS.get(said.group(1)) == len(examples), (
        f"docs/model-files.md says examples/ has {said and said.group(1)}; it has {len(examples)}")
