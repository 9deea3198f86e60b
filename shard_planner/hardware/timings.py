"""ModuleTimings: per-module forward and backward seconds measured on the real device.

The step-time model prices compute from traced FLOPs at one throughput plus a per-op overhead
(shard_planner/cost/time.py). Kernels far below matmul throughput (CPU flash-attention backward, small
elementwise ops) are priced wrong by any single number; ``shard-planner calibrate --model FILE``
measures every module instead (shard_planner/execute/module_timing.py) and writes this file. The cost
model uses it through ``profile.with_timings(load_timings(path))``.

Per module (fully qualified name; the root is ``""``), the forward and the backward of its whole
subtree, all its calls in one training step together, as an :class:`Affine` in the micro-batch
(least-squares line through the measured sizes). A container's own operations are its time minus its
nearest timed descendants' (``self_time``). ``loss_fwd_s`` / ``loss_bwd_s`` time ``loss_fn`` outside
every module.

JSON (``save_timings`` writes atomically, ``load_timings`` reads): every mismatch or malformed field
is one ProfileError line saying what to re-run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from shard_planner.errors import ProfileError
from shard_planner.fileio import read_json, write_atomic
from shard_planner.trace.types import ZERO, Affine

TIMINGS_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ModuleTime:
    """One module's subtree, all its calls in one step: seconds, affine in the micro-batch."""

    fwd_s: Affine
    bwd_s: Affine
    # how bwd_s was obtained: "hooks" (full backward pre-hook -> full backward hook) or "derived" (the
    # hook cannot time it: no input needs a gradient; see execute/module_timing.py)
    bwd_source: str = "hooks"


@dataclass(frozen=True)
class ModuleTimings:
    """Measured per-module compute times of one model on one device (see the module docstring)."""

    model_path: str
    fingerprint: str  # trace.structure.model_fingerprint of the built model (the trace records the same)
    param_dtype: str  # the dtype the parameters were cast to for the measurement ("bfloat16", "float32")
    device: str  # "cpu" or "cuda"
    device_name: str  # e.g. "NVIDIA H200" or the CPU model
    threads_per_rank: int  # torch.get_num_threads() in each measuring process
    world_size: int  # processes measuring at once (CPU: as the executor's ranks share the cores)
    micro_batches: tuple[int, ...]  # the measured sizes the Affines were fitted from
    date: str  # UTC, "YYYY-MM-DD HH:MM UTC"
    torch_version: str
    modules: dict[str, ModuleTime]  # fqn -> times; modules whose forward never ran are absent
    loss_fwd_s: Affine = ZERO
    loss_bwd_s: Affine = ZERO
    repeats: int = 0  # timed steps per micro-batch (medians over them)
    schema_version: int = TIMINGS_SCHEMA_VERSION
    notes: dict[str, str] = field(default_factory=dict)

    def check(self, fingerprint: str, param_dtype: str, what: str = "the model") -> None:
        """Raise one ProfileError line unless these timings were measured for ``fingerprint`` in ``param_dtype``."""
        if fingerprint != self.fingerprint:
            raise ProfileError(
                f"module timings of {self.model_path} were measured for a different model (structure fingerprint "
                f"{self.fingerprint}, {what} has {fingerprint}); re-run `shard-planner calibrate --model ...`")
        if param_dtype != self.param_dtype:
            raise ProfileError(
                f"module timings of {self.model_path} were measured in {self.param_dtype}, the plan computes in "
                f"{param_dtype}; re-run `shard-planner calibrate --model {self.model_path} --dtype {param_dtype}`")

    def self_time(self, fqn: str, children: dict[str, tuple[str, ...]]) -> ModuleTime | None:
        """``fqn``'s own operations: its time minus its nearest timed descendants' (``children``: the
        module tree, fqn -> direct children; untimed modules such as a never-called ModuleList are looked
        through). None when ``fqn`` itself was not timed."""
        own = self.modules.get(fqn)
        if own is None:
            return None
        fwd, bwd = own.fwd_s, own.bwd_s
        stack = list(children.get(fqn, ()))
        while stack:
            c = stack.pop()
            t = self.modules.get(c)
            if t is None:
                stack.extend(children.get(c, ()))
                continue
            fwd, bwd = fwd + t.fwd_s.scaled(-1.0), bwd + t.bwd_s.scaled(-1.0)
        return ModuleTime(fwd, bwd, own.bwd_source)

    # ---- JSON ----
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_dict(d: dict, source: str = "timings") -> "ModuleTimings":
        if not isinstance(d, dict):
            raise ProfileError(f"{source}: not a module-timings file (expected a JSON object)")
        if d.get("schema_version") != TIMINGS_SCHEMA_VERSION:
            raise ProfileError(f"{source}: module-timings schema version {d.get('schema_version')!r} is not "
                               f"{TIMINGS_SCHEMA_VERSION}; re-run `shard-planner calibrate --model ...`")
        try:
            d = dict(d)
            modules = {fqn: ModuleTime(fwd_s=Affine(**m["fwd_s"]), bwd_s=Affine(**m["bwd_s"]),
                                       bwd_source=m.get("bwd_source", "hooks"))
                       for fqn, m in d.pop("modules").items()}
            loss_fwd, loss_bwd = Affine(**d.pop("loss_fwd_s")), Affine(**d.pop("loss_bwd_s"))
            return ModuleTimings(modules=modules, loss_fwd_s=loss_fwd, loss_bwd_s=loss_bwd,
                                 micro_batches=tuple(int(b) for b in d.pop("micro_batches")), **d)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ProfileError(f"{source}: malformed module-timings file ({type(exc).__name__}: {exc}); "
                               "re-run `shard-planner calibrate --model ...`") from None


def save_timings(timings: ModuleTimings, path) -> None:
    """Write ``timings`` as JSON, whole or not at all."""
    write_atomic(path, timings.to_json() + "\n")


def load_timings(path) -> ModuleTimings:
    """Read a timings file written by ``shard-planner calibrate --model``; one ProfileError line if it is
    missing or malformed. Use it with ``profile.with_timings(load_timings(path))``."""
    return ModuleTimings.from_dict(read_json(path, ProfileError, "module-timings"), source=str(path))
