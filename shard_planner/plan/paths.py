"""Where a file a plan records lies: one rule for every path in a plan file.

[Note: Paths in a plan file]
A plan records three kinds of file: its model file (``model.path``), a hardware profile given as a TOML
path (``cluster.profile``; a profile *name* is no path) and measured module times (``cluster.timings``).
Each is recorded twice when the plan is written (:func:`locate`): as an absolute path, and relative to
the plan file's folder (``model.relative_path``, ``cluster.profile_relative_path``,
``cluster.timings_relative_path``). Reading a plan, each resolves the same way (:func:`resolve`): beside
the plan file first (the relative path), then the recorded path itself (absolute, or, in plans written
before the relative paths, relative to the folder ``plan`` ran in: tried beside the plan file, then from
the current folder). So a plan runs from any folder, and a plan moved together with its files still finds
them. A path found nowhere stays as recorded, and the command that needs the file says it is missing.
"""

from __future__ import annotations

import os
from pathlib import Path


def locate(given: str, plan_path: str | os.PathLike) -> tuple[str, str | None]:
    """(absolute path, path relative to ``plan_path``'s folder) of ``given``, a path from the current folder,
    as a plan written to ``plan_path`` records it; ``(given, None)`` when it is not a file here (an
    importable ``package.module``, a profile name)."""
    p = Path(given)
    if not p.is_file():
        return given, None
    absolute = p.resolve()
    relative = os.path.relpath(absolute, Path(plan_path).resolve().parent)
    return str(absolute), Path(relative).as_posix()


def resolve(recorded: str, relative: str | None, plan_path: str | os.PathLike | None) -> str:
    """The file a plan read from ``plan_path`` records as ``recorded`` (and ``relative`` to the plan file), as
    an absolute path; ``recorded`` as given when no candidate is a file (See [Note: Paths in a plan file])."""
    given = Path(recorded)
    here = Path(plan_path).resolve().parent if plan_path is not None else None
    candidates = [here / relative] if here is not None and relative else []
    if here is not None and not given.is_absolute():
        candidates.append(here / given)
    candidates.append(given)
    for c in candidates:
        if c.is_file():
            return str(c.resolve())
    return recorded


def is_profile_path(profile: str) -> bool:
    """Whether a profile argument (``--profile``, ``cluster.profile``) names a TOML file rather than a profile
    of profiles/ by name."""
    return Path(profile).suffix == ".toml" or Path(profile).is_file()
