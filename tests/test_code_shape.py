"""The package's code shape (issue 11, must-show): no function over 80 lines and no file over 500 lines
in shard_planner/.

A function's length runs from its ``def`` line to its last line (decorators aside), nested functions
and methods each counted on their own as well as inside what holds them; a file's length is its number
of lines. The failure names every offender with its length, so a split knows where to start.
"""

from __future__ import annotations

import ast
from pathlib import Path

import shard_planner

PACKAGE_DIR = Path(shard_planner.__file__).resolve().parent
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500


def source_files() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def long_functions(path: Path, root: Path = PACKAGE_DIR.parent, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name (N lines)`` (file relative to ``root``) for each function or method of ``path``
    longer than ``limit``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(root)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                out.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return out


def file_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_package_has_source_files():
    files = source_files()
    assert len(files) > 50 and PACKAGE_DIR / "cli" / "main.py" in files  # the walk sees the whole package


def test_no_function_over_80_lines():
    offenders = [f for path in source_files() for f in long_functions(path)]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(offenders)


def test_no_file_over_500_lines():
    offenders = [f"{p.relative_to(PACKAGE_DIR.parent)} ({n} lines)" for p in source_files()
                 if (n := file_lines(p)) > MAX_FILE_LINES]
    assert not offenders, f"files over {MAX_FILE_LINES} lines: " + "; ".join(offenders)


def test_the_checks_find_a_long_function_and_count_lines(tmp_path):
    """The checks themselves: an 81-line function (a method too) is found and named, an 80-line one is not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    fake = tmp_path / "m.py"
    fake.write_text(f"def ok():\n{body}\n\n\ndef too_long():\n{body}\n    y = 1\n\n\n"
                    f"class C:\n    def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n        y = 1\n")
    assert long_functions(fake, root=tmp_path) == ["m.py:83 too_long (81 lines)", "m.py:167 method (81 lines)"]
    assert file_lines(fake) == 80 + 2 + 81 + 2 + 1 + 81
