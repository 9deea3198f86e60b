"""What the planner is asked (:class:`PlanRequest`) and what it answers (:class:`PlanResult`).

    request = PlanRequest(gpus=8, mem_budget_bytes=40 * 2**30, profile=load_profile("h100-80gb"))
    result = plan_model(trace, request)
    result.plan, result.estimate, result.timings.cpsat_s

The request is built once, where the question comes in (the CLI, ``tune``, a benchmark), and passed
on whole; a variation is ``dataclasses.replace(request, mem_budget_bytes=...)``. The result carries the
chosen plan's :class:`~shard_planner.cost.types.Estimate` (memory timeline included), so the report and
the terminal summary never run the cost model again, and where the planner's time went.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.cost.fits import FitVerdict
from shard_planner.cost.types import Estimate
from shard_planner.errors import UserError
from shard_planner.parallel.tensor_parallel import TensorParallel
from shard_planner.plan import DEFAULT_LR, OPTIMIZERS, FrontierPoint, Plan
from shard_planner.plan.engine import ENGINES, SINGLE
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.solve.space import DEFAULT_MAX_GROUP_SIZE
from shard_planner.units import DTYPE_NAMES

DEFAULT_TIME_LIMIT_S = 1.0  # per CP-SAT solve; the planner runs several (solve/cpsat.py)
DEFAULT_FRONTIER_POINTS = 4


def requested_micro_batch(given: int | None, default: int, *, search_batch: bool, global_batch: bool) -> int | None:
    """:attr:`PlanRequest.micro_batch` for a command line: the micro-batch given; else None, which the planner
    searches, with ``search_batch`` or a global batch; else ``default`` (the model file's)."""
    if given is not None:
        return given
    return None if search_batch or global_batch else default


@dataclass(frozen=True)
class PlanRequest:
    """Everything :func:`shard_planner.solve.plan_model` needs besides the trace.

    ``mem_budget_bytes`` is ``--mem`` (the planner fills ``profile.tensor_budget_bytes`` of it);
    ``micro_batch`` None means 1, or the search when ``search_batch``; ``allow_offload``: CPU offload
    when nothing fits without it (never on a CPU profile). ``model_path``, ``profile_name`` and
    ``timings_path`` are what the plan records of where it came from and how it was priced
    (``cluster.profile``: ``profile.name`` when None; ``cluster.timings``: the file
    ``profile.module_timings`` came from)."""

    gpus: int
    mem_budget_bytes: int
    profile: HardwareProfile
    gpus_per_node: int = 8
    micro_batch: int | None = None
    search_batch: bool = False
    optimizer: str = "adamw"
    lr: float = DEFAULT_LR  # the model file's TRAINING["lr"]: the plan records it, the executor and exports use it
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    max_group_size: int = DEFAULT_MAX_GROUP_SIZE
    frontier_points: int = DEFAULT_FRONTIER_POINTS
    allow_offload: bool = True
    model_path: str | None = None
    profile_name: str | None = None
    timings_path: str | None = None
    simpler_within: float = 0.01  # the simplest plan this close to the fastest (solve/simpler.py); 0: the fastest
    # --global-batch (samples) or --global-batch-tokens per optimizer step over the cluster: the planner
    # searches micro-batch x accumulation steps x ranks = it (solve/accumulation.py); None: no accumulation
    global_batch_samples: int | None = None
    global_batch_tokens: int | None = None
    # The CUDA caching allocator's mode the plan runs with (cluster.expandable_segments, shard_planner/hardware/allocator_conf.py),
    # and the allocated peak the search may fill (None: profile.tensor_budget_bytes(mem_budget_bytes); set lower by
    # solve/survive.py when the answer does not survive --mem in the allocator simulation). allocator_check False:
    # on a GPU profile too the allocated peak alone decides, as on a CPU one (the solver's own tests, on
    # hand-written traces measured in MiB, where the allocator's 2-20 MiB pages would decide instead)
    expandable_segments: bool = True
    allocated_budget_bytes: int | None = None
    allocator_check: bool = True
    # how the model splits over the trace's tensor-parallel degree (trace.tp_size > 1; None without TP):
    # the plans of that degree record it (solve/layout_search.py searches the layouts, one trace each)
    tensor_parallel: TensorParallel | None = None
    # the ranks that will run the plan's step on this host, when not the plan's gpus (tune runs an 8-GPU plan
    # re-derived for 2 CPU ranks): the "N ranks share this host's cores" warning names them; None: gpus
    run_ranks: int | None = None
    # plans the search judges beside its own and may answer with: the layout screen's best (solve/layout_search.py
    # [Note: Screening the layouts]), so that a layout's full search is never slower than its screen
    start_plans: tuple[Plan, ...] = ()
    # the engine the plans run on (plan/engine.py ENGINES); None: solve/context.py ``planned_engine`` picks it
    engine: str | None = None
    # each parameter stepped in the backward as its gradient is ready (Training.optimizer_in_backward: one device)
    optimizer_in_backward: bool = False

    def __post_init__(self):
        if not _positive_int(self.gpus) or not _positive_int(self.gpus_per_node):
            raise UserError(f"--gpus and --gpus-per-node must be positive, got {self.gpus} and {self.gpus_per_node}")
        if self.micro_batch is not None and not _positive_int(self.micro_batch):
            raise UserError(f"--batch-size must be a positive int, got {self.micro_batch}")
        if not _positive_int(self.mem_budget_bytes):
            raise UserError(f"--mem must be a positive number of bytes, got {self.mem_budget_bytes}")
        if not self.time_limit_s > 0:
            raise UserError(f"--time-limit must be positive, got {self.time_limit_s}")
        if not _positive_int(self.max_group_size) or not _positive_int(self.frontier_points):
            raise UserError(f"max_group_size and frontier_points must be positive ints, got {self.max_group_size} "
                            f"and {self.frontier_points}")
        for name in ("global_batch_samples", "global_batch_tokens", "allocated_budget_bytes", "run_ranks"):
            if getattr(self, name) is not None and not _positive_int(getattr(self, name)):
                raise UserError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.global_batch_samples is not None and self.global_batch_tokens is not None:
            raise UserError("give the global batch in samples or in tokens, not both")
        if self.search_batch and (self.global_batch_samples or self.global_batch_tokens):
            raise UserError("a global batch searches the micro-batch already: drop --search-batch")
        if not 0 <= self.simpler_within < 1:
            raise UserError(f"simpler_within must be in [0, 1), got {self.simpler_within}")
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise UserError(f"lr must be a positive number, got {self.lr!r}")
        dtypes = set(DTYPE_NAMES.values())
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in dtypes:
                raise UserError(f"{name} must be one of {', '.join(sorted(dtypes))}, got {getattr(self, name)!r}")
        if self.engine is not None and self.engine not in ENGINES:
            raise UserError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.optimizer_in_backward and (self.gpus != 1 or self.engine not in (None, SINGLE)):
            raise UserError("--optimizer-in-backward steps each parameter in the backward on one device without "
                            "sharding: give --gpus 1 (and no --engine fsdp2)")
        if self.engine == SINGLE and self.gpus != 1:
            raise UserError(f"--engine single trains on one device, not {self.gpus} GPUs: give --gpus 1, or plan "
                            "several with --engine fsdp2")


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@dataclass(frozen=True)
class PlanTimings:
    """Where ``plan_model``'s wall time went. The stages (``screen_s`` .. ``simplify_s``, and ``other_s``:
    what falls between them, e.g. the chosen plan's estimate with its memory timeline) sum to
    ``total_s``; ``cpsat_s``, ``hints_s`` and ``simulate_s`` are the same time by kind of work, across
    the stages: the CP-SAT solves (building the program included), the heuristic covers that hint them,
    and the simulators' checks (the re-checks)."""

    screen_s: float
    solve_s: float
    frontier_s: float
    baselines_s: float
    polish_s: float
    simplify_s: float
    other_s: float
    total_s: float
    cpsat_s: float
    hints_s: float
    simulate_s: float
    simulated_plans: int  # distinct plans the simulators judged (each once: the memo)
    cpsat_solves: int
    # the layout search around the searches (solve/layout_search.py); the fields above are the chosen
    # layout's search alone
    layouts_screened: int = 0
    layout_screen_s: float = 0.0  # the screens, in this process
    layouts_searched: int = 0  # in full, the chosen one among them


@dataclass(frozen=True)
class PlanResult:
    """The chosen plan (with ``predicted``, ``solver``, ``frontier`` and ``baselines`` filled), the cost
    model's estimate of it (memory timeline included), and the planner's timings. ``fastest_step_time_s``:
    the fastest plan the planner found, before it preferred a simpler one within
    ``request.simpler_within`` (the plan's own step time when it did not)."""

    plan: Plan
    estimate: Estimate
    timings: PlanTimings
    fastest_step_time_s: float
    fit: FitVerdict | None = None  # the plan on a GPU of --mem (cost/fits.py); None on a CPU profile

    @property
    def frontier(self) -> tuple[FrontierPoint, ...]:
        return self.plan.frontier

    @property
    def baselines(self) -> tuple[FrontierPoint, ...]:
        return self.plan.baselines
