"""What every exporter shares: the result type, the plan's uniform settings, and config emitters."""

from __future__ import annotations

import json
import re
import textwrap
from collections import Counter
from dataclasses import dataclass

from shard_planner.plan import Plan, Unit


@dataclass(frozen=True)
class Export:
    """One exported file, and what in the plan it could not say exactly (also written in the file)."""

    target: str  # "fsdp2" | "accelerate" | "torchtitan" | "deepspeed"
    text: str
    suffix: str  # ".py", ".yaml", ".toml", ".json"
    notes: tuple[str, ...] = ()  # "what the plan says -> the nearest setting used"


def uniform_reshard(plan: Plan) -> tuple[bool, list[str]]:
    """One reshard_after_forward for all units (what config-driven stacks take), and notes.

    Nearest choice when the plan mixes settings: True, the setting that needs the least memory, so a
    plan that fits still fits (at the cost of the all-gathers the plan avoided)."""
    values = Counter(u.reshard_after_forward for u in plan.inner_units)
    notes = []
    ints = sorted({v for v in values if not isinstance(v, bool)})
    if ints:
        notes.append(f"{sum(values[v] for v in ints)} unit(s) reshard to {', '.join(map(str, ints))} ranks after forward "
                     "(a partial reshard): not expressible here; using reshard after forward = true")
    bools = {v for v in values if isinstance(v, bool)}
    if len(bools) == 2 or (ints and False in bools):
        notes.append(f"the plan reshards {values[True]} unit(s) and keeps {values[False]} unit(s) gathered after "
                     "forward: one setting for all here; using true (less memory, more all-gathers than the plan)")
        return True, notes
    if ints:
        return True, notes
    return (bools.pop() if bools else True), notes


def split_number(fqn: str) -> tuple[str, int, str] | None:
    """``"enc.layers.3.attn"`` -> ("enc.layers.", 3, ".attn"): around the last all-digit path segment."""
    parts = fqn.split(".")
    for k in range(len(parts) - 1, -1, -1):
        if parts[k].isdigit():
            prefix = ".".join(parts[:k]) + ("." if k else "")
            suffix = ("." if k < len(parts) - 1 else "") + ".".join(parts[k + 1:])
            return prefix, int(parts[k]), suffix
    return None


def block_units(plan: Plan) -> list[Unit]:
    """The units of the repeated blocks (``layers.0``, ``layers.1``, ...): the largest set of units whose
    first module is numbered under the same parent. All inner units when nothing is numbered."""
    by_prefix: dict[tuple[str, str], list[Unit]] = {}
    for u in plan.inner_units:
        parsed = split_number(u.modules[0])
        if parsed is not None:
            by_prefix.setdefault((parsed[0], parsed[2]), []).append(u)
    return max(by_prefix.values(), key=len) if by_prefix else list(plan.inner_units)


def grouped_note(plan: Plan) -> list[str]:
    grouped = [u for u in plan.inner_units if len(u.modules) > 1]
    if not grouped:
        return []
    return [f"{len(grouped)} unit(s) group several modules into one fully_shard call (e.g. {grouped[0].name}): "
            "not expressible here; each module becomes its own unit (smaller, more all-gathers: peak memory "
            "the same or lower, step time may be longer than predicted)"]


def prefetch_notes(plan: Plan, *, where: str) -> list[str]:
    notes = []
    if plan.prefetch.forward > 0:
        notes.append(f"forward prefetch of {plan.prefetch.forward} unit(s): {where} does not expose it; nearest: "
                     "FSDP2's default (no explicit forward prefetch). The fsdp2 export sets it with "
                     "set_modules_to_forward_prefetch")
    if plan.prefetch.backward > 1:
        notes.append(f"backward prefetch of {plan.prefetch.backward} units: {where} does not expose it; nearest: "
                     "FSDP2's default of 1 unit")
    return notes


# ---- YAML (block style, the subset accelerate writes: nested mappings of scalars) ----

_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.,/-]*$")
_YAML_WORDS = {"y", "n", "yes", "no", "true", "false", "on", "off", "null", "~"}


def yaml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _YAML_WORDS:
        return text
    return "'" + text.replace("'", "''") + "'"


def emit_yaml(mapping: dict, indent: int = 0) -> list[str]:
    lines = []
    for key, value in mapping.items():
        pad = "  " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.extend(emit_yaml(value, indent + 1))
        else:
            lines.append(f"{pad}{key}: {yaml_scalar(value)}")
    return lines


# ---- TOML (tables of scalars, what torchtitan's job configs hold) ----

def toml_scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string is a JSON string for the characters we write


def emit_toml(tables: dict[str, dict], comments: dict[str, str] | None = None) -> list[str]:
    """``comments``: "table.key" -> a comment written on the line above that key."""
    comments = comments or {}
    lines: list[str] = []
    for name, table in tables.items():
        lines += ["", f"[{name}]"]
        for key, value in table.items():
            if f"{name}.{key}" in comments:
                lines.append(f"# {comments[f'{name}.{key}']}")
            lines.append(f"{key} = {toml_scalar(value)}")
    return lines


def comment_block(lines: list[str], prefix: str = "# ", width: int = 100) -> list[str]:
    """Comment lines wrapped at ``width``; a "- " bullet's continuation lines are indented under it."""
    out = []
    for line in lines:
        if not line:
            out.append(prefix.rstrip())
            continue
        indent = "  " if line.startswith("- ") else ""
        out += [f"{prefix}{part}" for part in textwrap.wrap(line, width - len(prefix), subsequent_indent=indent,
                                                           break_on_hyphens=False, break_long_words=False)]
    return out
