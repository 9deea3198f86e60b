"""Plan: the sharding decisions for one model on one cluster, and what the cost model predicts.

The JSON form is the contract every consumer reads (DESIGN.md, "What the plan file must contain").
Everything is validated on construction (``__post_init__``) and on load (:func:`load_plan`, which every
command that reads a plan uses): one walk over the JSON checks every field's type and range
(:mod:`shard_planner.plan.schema`, with :data:`PLAN_RULES`), and errors name the field by its JSON path
(``plan.json: units[3].activation_checkpoint must be true or false, got "yes"``).

Every file a plan records (its model file, a profile given as a TOML path, measured module times) is
written as an absolute path plus the path relative to the plan file (:func:`save_plan`) and resolved on
load (:func:`load_plan`), one rule for all three: See [Note: Paths in a plan file] in
shard_planner/plan/paths.py. A plan read with :func:`load_plan` holds absolute paths wherever the
command runs. The default report folder is beside the plan (:func:`report_dir_for`).

Units are listed in forward order. The root module (fqn ``""``) is always a unit of its own: FSDP2
wraps it last and it owns every parameter no other unit owns. Nested units are allowed (a unit for
``layers.0`` and one for ``layers.0.attention``); a parameter belongs to the innermost unit that
contains it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

from shard_planner.plan.checkpointing import DEFAULT_SAVE_OPS, SAVEABLE_OP_CLASSES, SELECTIVE
from shard_planner.plan.engine import ENGINES, FSDP2, SINGLE, engine_refusal
from shard_planner.errors import PlanError
from shard_planner.fileio import read_json, write_atomic
from shard_planner.plan.finetune import FineTune  # the plan file's "model.finetune": what was frozen and how
from shard_planner.plan.loss import LOSSES
from shard_planner.plan.numerics import Numerics  # the step's dtypes, from training.param_dtype and reduce_dtype
from shard_planner.parallel.mesh import Mesh  # the plan file's "mesh" section: the parallel degrees
from shard_planner.plan.points import (LAYOUT_JUDGED, FrontierPoint, LayoutOutcome, MeasuredPoint,  # noqa: F401
                                       layouts_from_degrees)  # (the plan file's points)
from shard_planner.plan.prediction import MEMORY_CATEGORIES, Prediction  # noqa: F401 (the plan file's "predicted")
from shard_planner.plan.schema import AnyOf, Bool, Int, ListOf, MapOf, Nullable, Number, Section, Text
from shard_planner.plan.paths import is_profile_path, locate, resolve
from shard_planner.parallel.tensor_parallel import TensorParallel  # the plan file's "tensor_parallel": how modules split

PLAN_SCHEMA_VERSION = 1
# Optimizer name -> (torch.optim class, keyword arguments beyond lr); the executor builds it, the FSDP2
# export writes it. Other hyper-parameters are PyTorch's defaults.
OPTIMIZER_TORCH = {"adamw": ("AdamW", {}), "adam": ("Adam", {}), "sgd": ("SGD", {}),
                   "sgd_momentum": ("SGD", {"momentum": 0.9})}
OPTIMIZERS = tuple(OPTIMIZER_TORCH)
DEFAULT_LR = 1e-3  # the learning rate of a plan whose model file's TRAINING names none
DTYPES = ("float32", "bfloat16", "float16")
# Training.gradient_sync: FSDP2 reduce-scatters every micro-step's gradients, or only the last one's
# (``set_requires_gradient_sync(False)`` on the others: unsharded gradients held in between).
GRADIENT_SYNCS = ("every_micro_step", "last_micro_step")
ROOT = ""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise PlanError(message)


def unit_name(modules: tuple[str, ...]) -> str:
    """A unit's short label: the module, or ``first..last`` for a group; ``<root>`` for the root."""
    if modules == (ROOT,):
        return "<root>"
    return modules[0] if len(modules) == 1 else f"{modules[0]}..{modules[-1]}"


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` call: one module, or a contiguous run of siblings grouped in a list."""

    modules: tuple[str, ...]
    reshard_after_forward: bool | int = True  # int: reshard to that many ranks (a divisor of the shard group)
    # False, True (full) or "selective": keep the outputs of the ``ac_save_ops`` op classes, recompute
    # the rest (shard_planner/plan/checkpointing.py; "selective" alone saves DEFAULT_SAVE_OPS)
    activation_checkpoint: bool | str = False
    ac_save_ops: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "modules", tuple(self.modules))
        _require(len(self.modules) > 0, "a unit needs at least one module")
        _require(len(set(self.modules)) == len(self.modules), f"unit {list(self.modules)} names a module twice")
        _require(ROOT not in self.modules or len(self.modules) == 1, "the root module must be a unit of its own")
        r = self.reshard_after_forward
        _require(isinstance(r, bool) or (isinstance(r, int) and r >= 2),
                 f"unit {self.name}: reshard_after_forward must be true, false or an int >= 2, got {r!r}")
        self._check_checkpointing()

    def _check_checkpointing(self) -> None:
        ac = self.activation_checkpoint
        _require(isinstance(ac, bool) or ac == SELECTIVE,
                 f'unit {self.name}: activation_checkpoint must be true, false or "selective", got {ac!r}')
        object.__setattr__(self, "ac_save_ops", tuple(self.ac_save_ops))
        if ac == SELECTIVE and not self.ac_save_ops:
            object.__setattr__(self, "ac_save_ops", DEFAULT_SAVE_OPS)
        _require(ac == SELECTIVE or not self.ac_save_ops,
                 f'unit {self.name}: ac_save_ops is for activation_checkpoint "selective" only')
        unknown = [c for c in self.ac_save_ops if c not in SAVEABLE_OP_CLASSES]
        _require(not unknown, f"unit {self.name}: ac_save_ops has unknown op class {unknown[:1]}; "
                              f"known: {', '.join(SAVEABLE_OP_CLASSES)}")

    @property
    def name(self) -> str:
        """A short label (:func:`unit_name`)."""
        return unit_name(self.modules)

    @property
    def is_root(self) -> bool:
        return self.modules == (ROOT,)


@dataclass(frozen=True)
class Prefetch:
    """How many units ahead all-gathers are issued explicitly (FSDP2 ``set_modules_to_*_prefetch``).

    forward=0 and backward=1 are FSDP2's defaults (backward prefetches one unit implicitly)."""

    forward: int = 0
    backward: int = 1

    def __post_init__(self):
        for name in ("forward", "backward"):
            v = getattr(self, name)
            _require(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 8,
                     f"prefetch.{name} must be an int from 0 to 8, got {v!r}")


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    profile: str  # a profile name (profiles/NAME.toml) or a path
    mem_budget_bytes: int  # per GPU
    # measured module times (shard-planner calibrate --model) the compute was priced from, a path; None: FLOPs
    timings: str | None = None
    # the CUDA caching allocator's mode the plan was made for and `run` sets (shard_planner/hardware/allocator_conf.py,
    # [Note: The allocator mode a plan runs with]); plans written before the field read True
    expandable_segments: bool = True
    # profile (when a TOML path) and timings relative to the plan file's folder, as written (None: not a path,
    # or a plan written before them, or a plan read with load_plan): See [Note: Paths in a plan file]
    profile_relative_path: str | None = None
    timings_relative_path: str | None = None

    def __post_init__(self):
        _require(isinstance(self.gpus, int) and self.gpus >= 1, f"cluster.gpus must be a positive int, got {self.gpus!r}")
        _require(self.timings is None or isinstance(self.timings, str),
                 f"cluster.timings must be a path or null, got {self.timings!r}")
        _require(isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1,
                 f"cluster.gpus_per_node must be a positive int, got {self.gpus_per_node!r}")
        _require(isinstance(self.mem_budget_bytes, int) and self.mem_budget_bytes > 0,
                 f"cluster.mem_budget_bytes must be a positive int, got {self.mem_budget_bytes!r}")


@dataclass(frozen=True)
class Training:
    micro_batch: int  # per GPU
    optimizer: str = "adamw"
    param_dtype: str = "bfloat16"  # MixedPrecisionPolicy.param_dtype: the compute dtype
    reduce_dtype: str = "float32"  # MixedPrecisionPolicy.reduce_dtype: gradient reduce-scatter dtype
    cpu_offload: bool = False  # CPUOffloadPolicy: sharded params, grads and optimizer states on the host
    lr: float = DEFAULT_LR
    # Gradient accumulation (cost/accumulation.py): micro-steps per optimizer step; whether gradients are
    # reduce-scattered every micro-step or only on the last (GRADIENT_SYNCS); whether parameters stay
    # gathered from one micro-step's backward to the next forward (set_reshard_after_backward(False) on
    # all but the last). The global batch is micro_batch x accumulation_steps x mesh.dp_size samples.
    accumulation_steps: int = 1
    gradient_sync: str = "every_micro_step"
    keep_params_gathered: bool = False
    # --global-batch (--global-batch-tokens in samples) the plan was asked to reach, which it reaches exactly
    # (solve/accumulation.py), recorded with accumulation or without; None: none was asked
    global_batch_asked: int | None = None
    # the dtype the executor casts the model's floating parameters to before training (the single-device
    # step: plan/engine.py, every parameter in the compute dtype); None: they train as built. Written when set
    stored_dtype: str | None = None
    # each parameter stepped as soon as its gradient is accumulated, its gradient freed then (torchtune's
    # optimizer_in_bwd; the single-device step only, without accumulation: plan/engine.py). Written when set
    optimizer_in_backward: bool = False

    def __post_init__(self):
        _require(isinstance(self.micro_batch, int) and self.micro_batch >= 1,
                 f"training.micro_batch must be a positive int, got {self.micro_batch!r}")
        _require(isinstance(self.accumulation_steps, int) and not isinstance(self.accumulation_steps, bool)
                 and self.accumulation_steps >= 1,
                 f"training.accumulation_steps must be a positive int, got {self.accumulation_steps!r}")
        _require(self.gradient_sync in GRADIENT_SYNCS,
                 f"training.gradient_sync must be one of {', '.join(GRADIENT_SYNCS)}, got {self.gradient_sync!r}")
        _require(self.accumulation_steps > 1 or (self.gradient_sync == GRADIENT_SYNCS[0] and not self.keep_params_gathered),
                 "training.gradient_sync and keep_params_gathered apply between micro-steps: with "
                 "accumulation_steps 1 they must be \"every_micro_step\" and false")
        _require(self.optimizer in OPTIMIZERS, f"training.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for name in ("param_dtype", "reduce_dtype"):
            _require(getattr(self, name) in DTYPES, f"training.{name} must be one of {', '.join(DTYPES)}")
        _require(self.stored_dtype in (None, *DTYPES),
                 f"training.stored_dtype must be one of {', '.join(DTYPES)} or absent, got {self.stored_dtype!r}")

    @cached_property  # a frozen dataclass's __dict__: built once per Training (the cost model asks per plan)
    def numerics(self) -> Numerics:
        """The step's numerics policy (plan/numerics.py [Note: One numerics policy]): every stage reads the dtypes
        of the plan's tensors and GEMMs from it, not from ``param_dtype`` and ``reduce_dtype``."""
        return Numerics(self.param_dtype, self.reduce_dtype, self.stored_dtype)


@dataclass(frozen=True)
class SolverInfo:
    method: str  # "cp-sat", "dp", "brute-force", "recipe", "given"
    status: str  # "OPTIMAL", "FEASIBLE", ...
    objective: float  # predicted step time in seconds of the chosen plan
    seconds: float  # wall time of the search


@dataclass(frozen=True)
class ModelRef:
    """The model file a plan was made for. ``path``: an absolute path in plan files written by ``plan``
    and ``tune`` (:func:`with_paths_located`), else as given (older plans: relative to where ``plan``
    ran), or an importable ``package.module``; ``relative_path``: the same file relative to the plan
    file's folder, so a plan and its model moved or checked out together still find each other (None in
    older plans). :func:`resolve_model_file` reads both."""

    path: str
    fingerprint: str
    seq_len: int | None = None
    relative_path: str | None = None
    hf_task: str | None = None  # a transformers config's --hf-task: what `run` and `export` rebuild it as
    # a transformers config's --lora / --qlora / --freeze, LoRA targets named: `run`, `export` and `report`
    # rebuild the same fine-tune (None: as transformers builds it; plans written before it have none)
    finetune: FineTune | None = None
    loss: str | None = None  # the loss over the output layer (plan/loss.py); None: the model file's own


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    cluster: Cluster
    mesh: Mesh
    training: Training
    units: tuple[Unit, ...]
    prefetch: Prefetch = field(default_factory=Prefetch)
    predicted: Prediction | None = None
    solver: SolverInfo | None = None
    frontier: tuple[FrontierPoint, ...] = ()
    baselines: tuple[FrontierPoint, ...] = ()
    schema_version: int = PLAN_SCHEMA_VERSION
    measurements: tuple[MeasuredPoint, ...] = ()  # plans run by `shard-planner tune` (optional)
    # how each module is split over mesh.tp ranks; None without tensor parallelism (plans before it have none)
    tensor_parallel: TensorParallel | None = None
    # each split of the model over ranks (tensor-parallel degree) `plan` searched, the chosen one's too
    # (solve/layout_search.py); () when one was
    layouts: tuple[LayoutOutcome, ...] = ()
    # the library that shards the plan and runs its collectives (plan/engine.py); written when it is not FSDP2,
    # so that plan files read and write as before the field (every one of them was FSDP2's)
    engine: str = FSDP2

    def __post_init__(self):
        object.__setattr__(self, "units", tuple(self.units))
        object.__setattr__(self, "frontier", tuple(self.frontier))
        object.__setattr__(self, "baselines", tuple(self.baselines))
        object.__setattr__(self, "measurements", tuple(self.measurements))
        object.__setattr__(self, "layouts", tuple(self.layouts))
        _require(self.schema_version == PLAN_SCHEMA_VERSION,
                 f"plan schema_version {self.schema_version!r} is not {PLAN_SCHEMA_VERSION}: re-run shard-planner plan")
        _require(self.mesh.world_size == self.cluster.gpus,
                 f"mesh {self.mesh.shape_text} does not use the cluster's {self.cluster.gpus} GPUs")
        refusal = engine_refusal(self.engine, self.mesh, self.training, GRADIENT_SYNCS[0])
        _require(refusal is None, refusal)
        _require(self.mesh.is_tp == (self.tensor_parallel is not None),
                 f"mesh.tp is {self.mesh.tp}: a plan has a tensor_parallel section exactly when mesh.tp is above 1")
        roots = [u for u in self.units if u.is_root]
        _require(len(roots) == 1, "a plan needs exactly one unit for the root module (modules: [\"\"])")
        seen: set[str] = set()
        for i, u in enumerate(self.units):  # units[i]: the JSON path of the unit in the plan file
            twice = sorted(seen.intersection(u.modules))
            _require(not twice, f"units[{i}]: module {twice[:1]} is in two units")
            seen.update(u.modules)
            r = u.reshard_after_forward
            if not isinstance(r, bool):
                _require(self.mesh.is_reshard_size(r),
                         f"units[{i}] (unit {u.name}): reshard_after_forward={r} must divide the shard group size "
                         f"{self.mesh.shard_group_size} and be smaller than it")

    @property
    def root(self) -> Unit:
        return next(u for u in self.units if u.is_root)

    @property
    def global_batch_samples(self) -> int:
        """Samples per optimizer step over the cluster: micro-batch x accumulation steps x data-parallel ranks."""
        return self.training.micro_batch * self.training.accumulation_steps * self.mesh.dp_size

    @property
    def accumulation_text(self) -> str:
        """For people: "" without accumulation or a global batch asked for, else e.g. ``global batch 512 =
        micro-batch 4 x 16 micro-steps x 8 GPUs, gradients reduce-scattered on the last micro-step only,
        parameters kept gathered between them``."""
        return self.accumulation_words()

    def accumulation_words(self, rank: str = "GPU") -> str:
        """:attr:`accumulation_text`, ``rank`` the word for one rank (profile.rank_word); with tensor
        parallelism the micro-batch is per data-parallel group of ``mesh.tp`` ranks."""
        tr = self.training
        ranks = f"{self.mesh.dp_size} {rank}s" if not self.mesh.is_tp else \
            f"{self.mesh.dp_size} data-parallel groups of {self.mesh.tp} {rank}s"
        if tr.accumulation_steps == 1:  # the global batch asked for is said without accumulation too
            return (f"global batch {self.global_batch_samples} (as asked) = micro-batch {tr.micro_batch} x "
                    f"{ranks}, no accumulation") if tr.global_batch_asked is not None else ""
        sync = "every micro-step" if tr.gradient_sync == GRADIENT_SYNCS[0] else "the last micro-step only"
        kept = ", parameters kept gathered between them" if tr.keep_params_gathered else ""
        how = (f"gradients reduce-scattered on {sync}{kept}" if self.engine != SINGLE
               else "gradients added into .grad")  # one device: nothing reduced (plan/engine.py)
        return (f"global batch {self.global_batch_samples} = micro-batch {tr.micro_batch} x {tr.accumulation_steps} "
                f"micro-steps x {ranks}, {how}")

    @property
    def inner_units(self) -> tuple[Unit, ...]:
        """Every unit but the root, in forward order."""
        return tuple(u for u in self.units if not u.is_root)

    def at_world_size(self, world_size: int) -> tuple["Plan", int | None]:
        """The plan to run on ``world_size`` ranks, and the world size it was re-derived from: itself and
        None when the sizes match, else :meth:`with_world_size` and the plan's own size."""
        if world_size == self.mesh.world_size:
            return self, None
        return self.with_world_size(world_size), self.mesh.world_size

    def with_world_size(self, world_size: int) -> "Plan":
        """The same decisions on ``world_size`` ranks: plain FSDP, keeping the tensor-parallel degree and
        styles when it divides ``world_size`` (dropping them otherwise); int reshard sizes that no longer
        divide the group become True. Predictions are dropped: they were for the old size."""
        mesh = self.mesh.at_world_size(world_size)
        units = tuple(
            u if isinstance(u.reshard_after_forward, bool) or mesh.is_reshard_size(u.reshard_after_forward)
            else replace(u, reshard_after_forward=True)
            for u in self.units
        )
        return replace(
            self,
            cluster=replace(self.cluster, gpus=world_size, gpus_per_node=min(self.cluster.gpus_per_node, world_size)),
            mesh=mesh,
            units=units,
            training=replace(self.training, global_batch_asked=None),  # another size, another global batch
            predicted=None,
            tensor_parallel=self.tensor_parallel if mesh.is_tp else None,
            layouts=(),  # searched for the old size
        )

    # ---- JSON ----
    def to_dict(self) -> dict:
        d = asdict(self)
        for u in d["units"]:  # written for selective units only: other units' JSON stays as before
            if not u["ac_save_ops"]:
                del u["ac_save_ops"]
        for name in ("finetune", "loss"):  # plans without a fine-tune or a loss read as they did before them
            if d["model"][name] is None:
                del d["model"][name]
        for name in _CLUSTER_RELATIVE_PATHS:  # plans without recorded paths read as they did before them
            if d["cluster"][name] is None:
                del d["cluster"][name]
        if self.mesh.tp == 1:  # plans without tensor parallelism read as they did before it
            d["mesh"].pop("tp")
            del d["tensor_parallel"]
        if self.engine == FSDP2:  # FSDP2 plans read as before the field: a plan file without one is FSDP2's
            del d["engine"]
        for name in ("stored_dtype", "optimizer_in_backward"):  # single-device fields: written when set
            if not d["training"][name]:
                del d["training"][name]
        if self.mesh.pp == 1:  # plans without pipeline stages (all of them today) read as before the field
            d["mesh"].pop("pp")
        if not self.layouts:  # plans of one layout read as they did before the layout search
            del d["layouts"]
        for outcome in d.get("layouts", ()):  # splits without pipeline stages read as before the field
            if outcome["split"]["pp"] == 1:
                outcome["split"].pop("pp")
        if self.training.accumulation_steps == 1:  # plans without accumulation read as they did before it
            for name in _ACCUMULATION_FIELDS:
                d["training"].pop(name)
        if self.training.global_batch_asked is None:  # plans made without --global-batch read as before it
            d["training"].pop("global_batch_asked")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @staticmethod
    def from_dict(d: dict) -> "Plan":
        """The plan in ``d`` (parsed JSON), every field checked (:mod:`shard_planner.plan.schema`): a bad one
        raises :class:`PlanError` naming its JSON path, e.g. ``units[3].activation_checkpoint``."""
        if not isinstance(d, dict):
            raise PlanError("a plan must be a JSON object")
        version = d.get("schema_version")
        if version is None:
            raise PlanError("plan has no schema_version: not a plan written by shard-planner plan")
        _require(version == PLAN_SCHEMA_VERSION,  # before the fields: another version has other fields
                 f"plan schema_version {version!r} is not {PLAN_SCHEMA_VERSION}: re-run shard-planner plan")
        return Section(Plan, PLAN_RULES).load(layouts_from_degrees(d), "")


_ACCUMULATION_FIELDS = ("accumulation_steps", "gradient_sync", "keep_params_gathered")
_CLUSTER_RELATIVE_PATHS = ("profile_relative_path", "timings_relative_path")

# What each plan-file field may hold beyond its type hint ("Class.field" -> kind); plan_schema reads the
# rest from the dataclasses above. One table, so every command reads a plan file the same way.
_COUNT, _BYTES, _SECONDS = Int(least=1), Int(least=0), Number(non_negative=True)
PLAN_RULES = {
    "ModelRef.seq_len": Nullable(_COUNT), "ModelRef.relative_path": Nullable(Text()),
    "ModelRef.hf_task": Nullable(Text()), "ModelRef.loss": Nullable(Text(LOSSES)),
    "FineTune.lora_rank": Nullable(_COUNT), "FineTune.lora_targets": ListOf(Text()), "FineTune.freeze": ListOf(Text()),
    "Cluster.gpus": _COUNT, "Cluster.gpus_per_node": _COUNT, "Cluster.mem_budget_bytes": _COUNT,
    "Cluster.profile_relative_path": Nullable(Text()), "Cluster.timings_relative_path": Nullable(Text()),
    "Mesh.shard": _COUNT, "Mesh.replicate": _COUNT, "Mesh.tp": _COUNT, "Mesh.pp": _COUNT,
    "TensorParallel.styles": MapOf(Text()),
    "Training.micro_batch": _COUNT, "Training.optimizer": Text(OPTIMIZERS),
    "Training.param_dtype": Text(DTYPES), "Training.reduce_dtype": Text(DTYPES), "Training.lr": Number(positive=True),
    "Training.accumulation_steps": _COUNT, "Training.gradient_sync": Text(GRADIENT_SYNCS),
    "Training.global_batch_asked": Nullable(_COUNT), "Training.stored_dtype": Nullable(Text(DTYPES)),
    "Training.optimizer_in_backward": Bool(),
    "Unit.modules": ListOf(Text(), min_len=1),
    "Unit.reshard_after_forward": AnyOf(Bool(), Int(least=2), wanted="true, false or an integer >= 2"),
    "Unit.activation_checkpoint": AnyOf(Bool(), Text((SELECTIVE,)), wanted='true, false or "selective"'),
    "Unit.ac_save_ops": ListOf(Text(SAVEABLE_OP_CLASSES)),
    "Prefetch.forward": Int(0, 8), "Prefetch.backward": Int(0, 8),
    "Prediction.peak_bytes": _BYTES, "Prediction.step_time_s": _SECONDS,
    "Prediction.memory_at_peak": MapOf(Int(), keys=MEMORY_CATEGORIES),
    "Prediction.samples_per_s": _SECONDS, "Prediction.tokens_per_s": Nullable(_SECONDS),
    "Prediction.exposed_comm_s": _SECONDS, "Prediction.mfu": Nullable(Number(non_negative=True)),
    "Prediction.reserved_peak_bytes": Nullable(_BYTES), "Prediction.no_retry_bytes": Nullable(_BYTES),
    "Prediction.alloc_retries_per_step": Nullable(Int(least=0)), "Prediction.alloc_retry_s": Nullable(_SECONDS),
    "SolverInfo.seconds": _SECONDS,
    "FrontierPoint.peak_bytes": _BYTES, "FrontierPoint.step_time_s": _SECONDS,
    "MeasuredPoint.world_size": _COUNT, "MeasuredPoint.peak_bytes": _BYTES, "MeasuredPoint.step_time_s": _SECONDS,
    "MeasuredPoint.predicted_peak_bytes": Nullable(_BYTES), "MeasuredPoint.predicted_step_time_s": Nullable(_SECONDS),
    "Plan.engine": Text(ENGINES),
    "ModelSplit.tp": _COUNT, "ModelSplit.pp": _COUNT, "LayoutOutcome.judged": Text(LAYOUT_JUDGED),
    **{f"LayoutOutcome.{name}": Nullable(_SECONDS) for name in ("step_time_s", "samples_per_s", "compute_s",
                                                                "exposed_comm_s", "split_comm_s")},
    "LayoutOutcome.peak_bytes": Nullable(_BYTES), "LayoutOutcome.samples_per_step": Nullable(_COUNT),
}


# ---- where a plan's files are: See [Note: Paths in a plan file] in shard_planner/plan/paths.py ----
def with_paths_located(plan: Plan, plan_path: str | os.PathLike) -> Plan:
    """``plan`` as it is written to ``plan_path``: each file it records (model, a profile's TOML path, module
    timings; paths from the current folder, or absolute) as an absolute path and relative to the plan file's
    folder. A ``package.module``, a profile name, or a path that is not a file here stays as given."""
    model, model_rel = locate(plan.model.path, plan_path)
    profile, profile_rel = locate(plan.cluster.profile, plan_path) if is_profile_path(plan.cluster.profile) \
        else (plan.cluster.profile, None)
    timings, timings_rel = locate(plan.cluster.timings, plan_path) if plan.cluster.timings else (None, None)
    return replace(plan, model=replace(plan.model, path=model, relative_path=model_rel),
                   cluster=replace(plan.cluster, profile=profile, profile_relative_path=profile_rel,
                                   timings=timings, timings_relative_path=timings_rel))


def with_paths_resolved(plan: Plan, plan_path: str | os.PathLike | None) -> Plan:
    """``plan``, read from ``plan_path``, with each file it records as an absolute path found from here (beside
    the plan first), its relative paths dropped; a file found nowhere stays as recorded."""
    c = plan.cluster
    profile = (resolve(c.profile, c.profile_relative_path, plan_path) if is_profile_path(c.profile)
               else c.profile)
    timings = resolve(c.timings, c.timings_relative_path, plan_path) if c.timings else None
    return replace(plan, model=replace(plan.model, path=resolve_model_file(plan.model, plan_path), relative_path=None),
                   cluster=replace(c, profile=profile, profile_relative_path=None,
                                   timings=timings, timings_relative_path=None))


def resolve_model_file(model: ModelRef, plan_path: str | os.PathLike | None = None) -> str:
    """The plan's model file as an absolute path, wherever the command runs (:func:`resolve`); an importable
    ``package.module`` (or a file found nowhere) is returned as given."""
    return resolve(model.path, model.relative_path, plan_path)


def report_dir_for(plan_path: str | os.PathLike) -> Path:
    """The default report folder of a plan file: beside it, ``DIR/<plan stem>.report/`` (two plans named
    plan.json in two folders keep two reports)."""
    p = Path(plan_path)
    return p.with_name(p.stem + ".report")


def load_plan(path: str | os.PathLike) -> Plan:
    """The plan in the file ``path``, every field checked, the files it records resolved
    (:func:`with_paths_resolved`)."""
    d = read_json(path, PlanError, "plan")
    try:
        return with_paths_resolved(Plan.from_dict(d), path)
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write ``plan`` to ``path`` atomically, the files it records located from there (:func:`with_paths_located`)."""
    write_atomic(path, with_paths_located(plan, path).to_json() + "\n")
