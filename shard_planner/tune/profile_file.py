"""Write a fitted :class:`~shard_planner.hardware.profile.HardwareProfile` as a TOML file that
:func:`~shard_planner.hardware.profile.load_profile` reads back, with comments that say what was fitted, from
which runs, and where every other number came from."""

from __future__ import annotations

import math
import os
from dataclasses import fields

from shard_planner.fileio import write_atomic
from shard_planner.hardware.profile import HardwareProfile, Interconnect
from shard_planner.tune.fit import ProfileFit

# Profile fields each fitted factor changes (see shard_planner.tune.fit).
FITTED_FIELDS = {
    "compute_efficiency": "compute",
    "intra_node_busbw_bytes_per_s": "bandwidth",
    "inter_node_busbw_bytes_per_s": "bandwidth",
    "intra_node_latency_s": "latency",
    "inter_node_latency_s": "latency",
}
_SKIP = {"source", "notes", "interconnect", "peak_flops_per_s", "kernels",
         "module_timings"}  # per model, in their own file (shard_planner/hardware/timings.py): the plan records it


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot write {v} to a profile")
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if v is None:
        raise ValueError("TOML has no null")
    raise TypeError(f"cannot write {type(v).__name__} to a profile")


def _line(name: str, value, prior, fit: ProfileFit) -> str:
    text = f"{name} = {_toml_value(value)}"
    factor = FITTED_FIELDS.get(name)
    if factor is not None:
        text += f"  # fitted ({factor} factor): {value / prior:.4g} x the prior {prior!r}"
    return text


def profile_toml(fit: ProfileFit, prior: HardwareProfile, header: list[str]) -> str:
    """The TOML text of ``fit.profile``; ``header`` lines become leading comments."""
    p = fit.profile
    out = [f"# {line}" for line in header]
    out.append(f"# Prior profile: {prior.source or prior.name}. Lines marked 'fitted' were fitted by least squares "
               "to measured step times (shard_planner/tune/fit.py); every other number is the prior's, see its "
               "comments there.")
    out.append("# run   measured_s   predicted_before_s   predicted_after_s")
    for i, (m, b, a) in enumerate(zip(fit.measured_s, fit.predicted_before_s, fit.predicted_after_s), start=1):
        out.append(f"#  {i:>3}  {m:.6g}  {b:.6g}  {a:.6g}")
    for f in fields(HardwareProfile):
        if f.name in _SKIP:
            continue
        value = getattr(p, f.name)
        if value is None:
            continue
        out.append(_line(f.name, value, getattr(prior, f.name), fit))
    out.append("")
    out.append("[peak_flops_per_s]")
    for dtype, flops in p.peak_flops_per_s.items():
        out.append(f"{dtype} = {_toml_value(float(flops))}")
    out.append("")
    out.append("[interconnect]")
    for f in fields(Interconnect):
        out.append(_line(f.name, getattr(p.interconnect, f.name), getattr(prior.interconnect, f.name), fit))
    if p.kernels:
        out.append("")
        out.append("[kernels]  # the prior's kernel-model constants, unfitted: their sources are in the prior")
        subtables = {k: v for k, v in p.kernels.items() if isinstance(v, dict)}  # per dtype (cost/kernels.py)
        for k, v in p.kernels.items():
            if k not in subtables:
                out.append(f"{k} = {_kernel_value(v)}")
        for dtype, table in subtables.items():
            out += ["", f"[kernels.{dtype}]"] + [f"{k} = {_kernel_value(v)}" for k, v in table.items()]
    if p.notes:
        out.append("")
        out.append("[notes]")
        for k, v in p.notes.items():
            out.append(f"{_toml_value(str(k))} = {_toml_value(str(v))}")
    return "\n".join(out) + "\n"


def _kernel_value(v) -> str:
    return "[" + ", ".join(_toml_value(x) for x in v) + "]" if isinstance(v, (list, tuple)) else _toml_value(v)


def write_profile(path: str | os.PathLike, fit: ProfileFit, prior: HardwareProfile, header: list[str]) -> None:
    """Write the fitted profile atomically (whole or not at all)."""
    write_atomic(path, profile_toml(fit, prior, header))
