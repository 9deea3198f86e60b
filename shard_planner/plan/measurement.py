"""Measurement: what a real FSDP2 run of a plan measured, and how (written by ``shard-planner run``).

Peak memory is per rank; how it was measured is recorded because the methods differ:
``"storage-tracker"`` (CPU: live tensor storages, exact, see shard_planner/execute/memtrack.py) or
``"cuda max_memory_allocated"`` (GPU: the caching allocator's peak since ``reset_peak_memory_stats``,
with ``max_memory_reserved`` beside it). Step times are samples after warm-up, one per step (the
slowest rank's), with their median and spread.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from shard_planner.plan.comm import TP, CollectiveBytes, GroupCollectiveBytes
from shard_planner.errors import UserError
from shard_planner.fileio import read_json, write_atomic
from shard_planner.parallel.mesh import Mesh
from shard_planner.plan import Plan

MEASUREMENT_SCHEMA_VERSION = 1
MEMORY_METHODS = ("storage-tracker", "cuda max_memory_allocated")


class MeasurementError(UserError):
    """A measurement file is missing or malformed."""


def plan_fingerprint(plan: Plan) -> str:
    """A short hash of a plan's decisions (model fingerprint, cluster, mesh, training, units,
    prefetch): two plans
    with the same fingerprint run the same way, whatever their predictions say."""
    d = plan.to_dict()
    # the engine as the plan file writes it: only when it is not FSDP2, so FSDP2 plans keep their fingerprints
    decisions = {k: d[k] for k in ("cluster", "mesh", "training", "units", "prefetch", "engine") if k in d}
    decisions["model"] = {k: v for k, v in d["model"].items()  # where the file lies does not matter
                          if k not in ("path", "relative_path")}
    return hashlib.sha256(json.dumps(decisions, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RankMemory:
    rank: int
    peak_bytes: int  # storage-tracker peak (CPU) or torch.cuda.max_memory_allocated (GPU)
    reserved_bytes: int | None = None  # torch.cuda.max_memory_reserved (GPU only)
    peak_phase: str | None = None  # "forward", "backward" or "optimizer" (storage tracker only)
    # torch.cuda.memory_stats()["num_alloc_retries"] at the end of the timed steps: the caching allocator's
    # cache releases and retries since the rank started (build and warm-up included; GPU only)
    num_alloc_retries: int | None = None


@dataclass(frozen=True)
class RestoreCheck:
    """One restore of the run's checkpoint into a model built afresh (execute/checkpoint.py)."""

    world_size: int  # the world that restored it (the saving world's, or another: resharded on load)
    load_s: float  # dcp.load + set_state_dict, the slowest rank
    tensors_checked: int  # model and optimizer state entries compared with the saved ones
    tensors_differing: tuple[str, ...]  # their keys (empty: every one equal, bit for bit)
    losses_uninterrupted: tuple[float, ...]  # the next steps of the run that saved it
    losses_restored: tuple[float, ...]  # the same steps after the restore
    loss_tolerance_rel: float  # 0: must be equal exactly
    loss_tolerance_reason: str

    def __post_init__(self):
        for name in ("tensors_differing", "losses_uninterrupted", "losses_restored"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def max_loss_diff_rel(self) -> float:
        return max((abs(a - b) / abs(a) if a else abs(b) for a, b in zip(self.losses_uninterrupted,
                                                                      self.losses_restored)), default=0.0)

    @property
    def losses_match(self) -> bool:
        return (len(self.losses_restored) == len(self.losses_uninterrupted)
                and self.max_loss_diff_rel <= self.loss_tolerance_rel)

    @property
    def ok(self) -> bool:
        return not self.tensors_differing and self.losses_match


@dataclass(frozen=True)
class CheckpointResult:
    """``run --checkpoint``: the distributed checkpoint saved after the measured steps, and its restores."""

    saved_at_step: int  # the step the restored run starts with
    world_size: int  # of the saving world
    save_s: float  # get_state_dict + dcp.save, the slowest rank
    size_bytes: int  # the checkpoint folder on disk
    save_extra_peak_bytes: int  # the largest rise of memory while saving, over ranks
    save_memory_method: str  # "storage-tracker" (CPU) or "cuda max_memory_allocated"
    directory: str | None  # where it is kept (None: a temporary folder, removed)
    restores: tuple[RestoreCheck, ...]
    # frozen parameter elements the checkpoint leaves out (execute/checkpoint.py [Note: what a fine-tune's
    # checkpoint holds]): it holds the trainable ones and their optimizer state. 0: everything trains.
    frozen_params_left_out: int = 0

    def __post_init__(self):
        object.__setattr__(self, "restores", tuple(
            r if isinstance(r, RestoreCheck) else RestoreCheck(**r) for r in self.restores))

    @property
    def ok(self) -> bool:
        return bool(self.restores) and all(r.ok for r in self.restores)


@dataclass(frozen=True)
class Measurement:
    plan_fingerprint: str
    model_path: str
    world_size: int
    mesh_shard: int
    mesh_replicate: int
    micro_batch: int
    device: str  # "cpu" or "cuda"
    device_name: str  # e.g. "NVIDIA H200" or the CPU's description
    backend: str  # "gloo" or "nccl"
    torch_version: str
    memory_method: str  # one of MEMORY_METHODS
    memory: tuple[RankMemory, ...]  # one per rank, by rank
    step_time_s: tuple[float, ...]  # per timed step (after warm-up): the slowest rank's time
    timing_method: str  # "wall clock" or "cuda events"
    warmup_steps: int
    losses: tuple[float, ...]  # per step run (warm-up included), averaged over ranks
    rederived_from_world_size: int | None = None  # the plan's own world size when --world-size changed it
    # The plan's prediction, when it applies to this run (for a re-derived plan: the cost model's
    # re-estimate for this world size, or None).
    predicted_peak_bytes: int | None = None
    predicted_step_time_s: float | None = None
    # Of predicted_peak_bytes, what no allocator statistic shows (CUDA context, NCCL buffers: the
    # prediction's "overhead" category); comparison() leaves it out of the measured-against figure.
    predicted_overhead_bytes: int = 0
    # Collectives per step (cost/comm_bytes.py): counted on rank 0 in the first timed step (the same on
    # every rank and timed step when comm_same_every_step), and what the plan predicts.
    comm_measured: tuple[CollectiveBytes, ...] = ()
    comm_same_every_step: bool | None = None
    comm_predicted: tuple[CollectiveBytes, ...] | None = None
    checkpoint: CheckpointResult | None = None  # run --checkpoint
    # Every collective of the same step as comm_measured, per issuer (FSDP2 or DTensor: tensor parallelism) and
    # process group (its device-mesh dimension: "shard", "replicate", "tp"), execute/comm_count.py. comm_measured
    # is its FSDP2 part summed per (collective, group size); the tensor-parallel part is comm_tp.
    comm_by_group: tuple[GroupCollectiveBytes, ...] = ()
    mesh_tp: int = 1  # tensor-parallel degree (parallel/mesh.py); world_size = mesh_replicate x mesh_shard x mesh_tp
    # samples per optimizer step over the world: micro-batch x accumulation steps x data-parallel ranks (the tp
    # ranks of a group share one micro-batch: Plan.global_batch_samples); None in measurements before it
    samples_per_step: int | None = None
    data_ranks: tuple[int, ...] = ()  # per rank, its data-parallel rank (the micro-batch it trained on)
    rank_losses: tuple[tuple[float, ...], ...] = ()  # per rank, its own loss of every step run
    # the CUDA caching allocator's settings the ranks ran with (PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF;
    # shard_planner/hardware/allocator_conf.py); None on CPU, or when none was set (the allocator's defaults)
    allocator_conf: str | None = None
    # What the cost model predicts of comm_tp, per group and kind, from a trace of one rank at the plan's degree
    # (cost ``tp_collectives_per_step``, traced by execute/runner.py); None: no tensor parallelism, no trace
    # (it failed, logged), or a measurement from before it
    comm_tp_predicted: tuple[GroupCollectiveBytes, ...] | None = None
    schema_version: int = MEASUREMENT_SCHEMA_VERSION

    def __post_init__(self):
        object.__setattr__(self, "memory", tuple(
            m if isinstance(m, RankMemory) else RankMemory(**m) for m in self.memory))
        object.__setattr__(self, "step_time_s", tuple(float(t) for t in self.step_time_s))
        object.__setattr__(self, "losses", tuple(float(v) for v in self.losses))
        object.__setattr__(self, "comm_measured", _collectives(self.comm_measured))
        object.__setattr__(self, "comm_by_group", _group_collectives(self.comm_by_group))
        if self.comm_tp_predicted is not None:
            object.__setattr__(self, "comm_tp_predicted", _group_collectives(self.comm_tp_predicted))
        object.__setattr__(self, "data_ranks", tuple(int(d) for d in self.data_ranks))
        object.__setattr__(self, "rank_losses", tuple(tuple(float(v) for v in r) for r in self.rank_losses))
        if self.comm_predicted is not None:
            object.__setattr__(self, "comm_predicted", _collectives(self.comm_predicted))
        if isinstance(self.checkpoint, dict):
            object.__setattr__(self, "checkpoint", CheckpointResult(**self.checkpoint))
        if self.memory_method not in MEMORY_METHODS:
            raise MeasurementError(f"measurement: memory_method must be one of {MEMORY_METHODS}")
        if len(self.memory) != self.world_size:
            raise MeasurementError(f"measurement: {len(self.memory)} ranks of memory for world size {self.world_size}")

    # ---- summaries ----
    @property
    def mesh(self) -> Mesh:
        """The layout the run ran with (the file records its degrees as ``mesh_*`` fields, as before the
        layout type; every size is the layout's: shard_planner/parallel/mesh.py)."""
        return Mesh(shard=self.mesh_shard, replicate=self.mesh_replicate, tp=self.mesh_tp)

    @property
    def peak_bytes(self) -> int:
        """The largest peak over ranks (what must fit)."""
        return max(m.peak_bytes for m in self.memory)

    @property
    def reserved_bytes(self) -> int | None:
        values = [m.reserved_bytes for m in self.memory if m.reserved_bytes is not None]
        return max(values) if values else None

    @property
    def step_time_median_s(self) -> float:
        return statistics.median(self.step_time_s) if self.step_time_s else float("nan")

    @property
    def step_time_spread_s(self) -> float:
        """max - min of the timed steps."""
        return max(self.step_time_s) - min(self.step_time_s) if self.step_time_s else float("nan")

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second over the world at the median step time (data-parallel ranks' samples only)."""
        if self.samples_per_step is None or not self.step_time_s:
            return None
        return self.samples_per_step / self.step_time_median_s

    @property
    def comm_tp(self) -> tuple[GroupCollectiveBytes, ...]:
        """Tensor parallelism's collectives per step (DTensor's), per group and kind."""
        return tuple(c for c in self.comm_by_group if c.source == TP)

    @property
    def rederived(self) -> bool:
        return self.rederived_from_world_size is not None

    def comparison(self) -> list[tuple[str, float, float, float]]:
        """(quantity, predicted, measured, error in percent of measured) for what the plan predicted.

        Peak memory is compared without the predicted overhead (``predicted_overhead_bytes``): neither
        ``max_memory_allocated`` nor the storage tracker sees the CUDA context or NCCL's buffers."""
        rows = []
        if self.predicted_peak_bytes is not None:
            rows.append(("peak_bytes", float(self.predicted_peak_bytes - self.predicted_overhead_bytes),
                         float(self.peak_bytes)))
        if self.predicted_step_time_s is not None:
            rows.append(("step_time_s", float(self.predicted_step_time_s), self.step_time_median_s))
        return [(name, p, m, (p - m) / m * 100.0 if m else float("nan")) for name, p, m in rows]

    def comm_comparison(self) -> list[tuple[str, int, int | None, int | None]]:
        """(collective, group size, predicted bytes, measured bytes) per step, for every (collective, group
        size) either side has; None where a side has none."""
        predicted = {(c.collective, c.group_size): c.bytes for c in self.comm_predicted or ()}
        measured = {(c.collective, c.group_size): c.bytes for c in self.comm_measured}
        return [(c, g, predicted.get((c, g)), measured.get((c, g))) for c, g in sorted(set(predicted) | set(measured))]

    @property
    def comm_matches(self) -> bool | None:
        """Measured collectives equal the predicted ones exactly (None: no prediction)."""
        if self.comm_predicted is None:
            return None
        return tuple(self.comm_predicted) == tuple(self.comm_measured) and bool(self.comm_same_every_step)

    def comm_tp_comparison(self) -> list[tuple[str, str, int, tuple[int, int] | None, tuple[int, int] | None]]:
        """(collective, group, group size, predicted (calls, bytes), measured (calls, bytes)) per step of tensor
        parallelism, for every (group, collective, group size) either side has; None where a side has none."""
        predicted = _calls_and_bytes(self.comm_tp_predicted or ())
        measured = _calls_and_bytes(self.comm_tp)
        return [(c, g, n, predicted.get((g, c, n)), measured.get((g, c, n)))
                for g, c, n in sorted(set(predicted) | set(measured))]

    @property
    def comm_tp_matches(self) -> bool | None:
        """Tensor parallelism's measured collectives equal the predicted ones call for call and byte for byte,
        per group and kind, on every rank and timed step (None: no prediction)."""
        if self.comm_tp_predicted is None:
            return None
        return (_calls_and_bytes(self.comm_tp_predicted) == _calls_and_bytes(self.comm_tp)
                and bool(self.comm_same_every_step))

    # ---- JSON ----
    def to_dict(self) -> dict:
        d = asdict(self)
        d["summary"] = {  # derived, for people reading the file; ignored on load
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "step_time_median_s": self.step_time_median_s,
            "step_time_spread_s": self.step_time_spread_s,
            "comm_matches": self.comm_matches,
            "samples_per_s": self.samples_per_s,
            "comm_tp_bytes": sum(c.bytes for c in self.comm_tp),
            "comm_tp_matches": self.comm_tp_matches,
            "checkpoint_ok": self.checkpoint.ok if self.checkpoint is not None else None,
        }
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @staticmethod
    def from_dict(d: dict) -> "Measurement":
        if not isinstance(d, dict):
            raise MeasurementError("a measurement must be a JSON object")
        d = {k: v for k, v in d.items() if k != "summary"}
        if d.get("schema_version") != MEASUREMENT_SCHEMA_VERSION:
            raise MeasurementError(f"measurement schema_version {d.get('schema_version')!r} is not "
                                   f"{MEASUREMENT_SCHEMA_VERSION}")
        try:
            return Measurement(**d)
        except TypeError as exc:
            raise MeasurementError(f"measurement is malformed: {exc}") from None


def _collectives(items) -> tuple[CollectiveBytes, ...]:
    return tuple(c if isinstance(c, CollectiveBytes) else CollectiveBytes(**c) for c in items)


def _group_collectives(items) -> tuple[GroupCollectiveBytes, ...]:
    return tuple(c if isinstance(c, GroupCollectiveBytes) else GroupCollectiveBytes(**c) for c in items)


def _calls_and_bytes(items) -> dict[tuple[str, str, int], tuple[int, int]]:
    """(group, collective, group size) -> (calls, bytes) of ``items`` (GroupCollectiveBytes, one per key)."""
    return {(c.group, c.collective, c.group_size): (c.calls, c.bytes) for c in items}


def measurement_path_for(plan_path: str | os.PathLike) -> Path:
    """Where ``shard-planner run`` writes the measurement of a plan: ``measurement.json`` beside it."""
    return Path(plan_path).with_name("measurement.json")


def save_measurement(m: Measurement, path: str | os.PathLike) -> None:
    write_atomic(path, m.to_json() + "\n")


def load_measurement(path: str | os.PathLike) -> Measurement:
    d = read_json(path, MeasurementError, "measurement")
    try:
        return Measurement.from_dict(d)
    except MeasurementError as exc:
        raise MeasurementError(f"{path}: {exc}") from None
