"""What one ``plan_model`` call shares: the request, the search spaces and linear models, the memo of
plans the simulators already judged, and the clock of where the time goes.

[Note: one call to the cost model] Every plan the planner judges goes through
:meth:`PlanContext.estimate`: the simulators without the memory timeline (nothing in the search reads
it), each distinct plan once per call (the screen, the solves, the sweep and the polish step meet the
same covers again). The context holds one ``CostModel(trace, profile)`` for the whole call: the linear
models take their module times and subtree sums from it, and the simulators their tables, schedules
and unit bytes, so nothing is rebuilt between the stages and no module-level cache is involved.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace

from shard_planner.plan.checkpointing import checkpointing_refusal
from shard_planner.cost.fits import FitVerdict, device_fit, smallest_mem_bytes
from shard_planner.cost.model import CostModel
from shard_planner.cost.types import Estimate
from shard_planner.errors import UserError
from shard_planner.plan import Cluster, Mesh, Plan, Prefetch, Training, Unit
from shard_planner.solve import cpsat
from shard_planner.solve.accumulation import NO_ACCUMULATION, resolve_global_batch
from shard_planner.cost.queries import UnitSetting
from shard_planner.solve.candidate_costs import CandidateCosts, candidate_costs
from shard_planner.solve.choice import GlobalChoice, prefetch_choices
from shard_planner.solve.linear import (MIB, LinearModel, build_linear_model, evaluate, unit_setting,
                                        with_accumulation, with_prefetch)
from shard_planner.dtypes import FLOAT_DTYPES
from shard_planner.plan.engine import FSDP2, SINGLE
from shard_planner.plan.finetune import is_adapter
from shard_planner.solve.request import PlanRequest, PlanTimings
from shard_planner.solve.simulate import cover_units, make_plan, single_device_units
from shard_planner.solve.space import SearchSpace, build_space
from shard_planner.trace.types import ModelTrace

logger = logging.getLogger(__name__)


def planned_engine(trace: ModelTrace, request: PlanRequest) -> str:
    """The engine ``request``'s plans run on (plan/engine.py): the one it names; else, at one GPU without
    tensor parallelism, the single-device step when it keeps the model's numerics (every floating parameter
    is already stored in the compute dtype, so casting the model changes nothing; LoRA adapters aside, which
    peft alone keeps in fp32 and torchtune builds in the model's dtype); else FSDP2, which on one GPU keeps
    fp32 weights as master weights under its MixedPrecisionPolicy (the summary says so: cli/plan.py). The
    optimizer in backward is the single-device step's (cost/engines/single.py [Note: Optimizer in backward])."""
    named = request.engine or (SINGLE if request.optimizer_in_backward else None)
    if named is not None:
        if named == SINGLE and trace.tp_size != 1:
            raise UserError(f"--engine single trains on one device without tensor parallelism, not at TP "
                            f"{trace.tp_size}: drop --tp or plan with --engine fsdp2")
        return named
    if request.gpus != 1 or trace.tp_size != 1:
        return FSDP2
    built = {dt for m in trace.modules if not is_adapter(m.fqn) for dt in m.param_bytes_by_dtype if dt in FLOAT_DTYPES}
    return SINGLE if built <= {request.param_dtype} else FSDP2


@dataclass(frozen=True)
class Checked:
    """A cover the simulators accepted (or the best they saw), with its numbers."""

    choice: GlobalChoice
    units: tuple[Unit, ...]
    peak_bytes: int
    step_time_s: float
    samples_per_s: float
    status: str  # the solver's status, or the recipe's title for a recipe's plan
    linear_peak_mib: int
    plan: Plan
    estimate: Estimate  # without the memory timeline (see [Note: one call to the cost model])
    method: str = "cp-sat"
    cover: tuple[int, ...] | None = None  # candidate indices (None for a recipe's plan)


def speed(c: Checked) -> tuple[float, int]:
    """The planner's ranking: faster first, then smaller."""
    return (c.samples_per_s, -c.peak_bytes)


class Clock:
    """Wall time by stage (one at a time) and by kind of work (across stages)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.stages: dict[str, float] = defaultdict(float)
        self.work: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] += time.perf_counter() - t0

    @contextmanager
    def doing(self, kind: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - t0)

    def add(self, kind: str, seconds: float) -> None:
        """One piece of work of ``kind`` that took ``seconds`` (timed elsewhere, e.g. in a thread)."""
        self.work[kind] += seconds
        self.counts[kind] += 1

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def timings(self, simulated_plans: int) -> PlanTimings:
        total = self.elapsed_s()
        named = ("screen", "solve", "frontier", "baselines", "polish", "simplify")
        return PlanTimings(
            **{f"{n}_s": self.stages[n] for n in named},
            other_s=max(0.0, total - sum(self.stages[n] for n in named)), total_s=total,
            cpsat_s=self.work["cpsat"], hints_s=self.work["hints"], simulate_s=self.work["simulate"],
            simulated_plans=simulated_plans, cpsat_solves=self.counts["cpsat"])


class PlanContext:
    """The request, caches of search spaces, linear models, heuristic covers and estimates, and the clock."""

    def __init__(self, trace: ModelTrace, request: PlanRequest):
        self.trace, self.request, self.profile = trace, request, request.profile
        asked = resolve_global_batch(request.global_batch_samples, request.global_batch_tokens,
                                     trace.tokens_per_sample, trace.model_path)
        self.engine = planned_engine(trace, request)
        single = self.engine == SINGLE  # every parameter cast to the compute dtype (plan/engine.py)
        self.training = Training(micro_batch=request.micro_batch or 1, optimizer=request.optimizer, lr=request.lr,
                                 param_dtype=request.param_dtype, reduce_dtype=request.reduce_dtype,
                                 global_batch_asked=asked.samples if asked is not None else None,
                                 stored_dtype=request.param_dtype if single else None,
                                 optimizer_in_backward=request.optimizer_in_backward)
        self.cluster = Cluster(gpus=request.gpus, gpus_per_node=min(request.gpus_per_node, request.gpus),
                               profile=request.profile_name or self.profile.name,
                               mem_budget_bytes=request.mem_budget_bytes, timings=request.timings_path,
                               expandable_segments=request.expandable_segments)
        # profile.tensor_budget_bytes(--mem): the allocated peak plans may fill (on a GPU the allocator
        # simulation judges what is shown: device_fit); lower when solve/survive.py re-solves
        self.shown_budget_bytes = self.profile.tensor_budget_bytes(request.mem_budget_bytes)
        self.budget_bytes = min(self.shown_budget_bytes, request.allocated_budget_bytes or self.shown_budget_bytes)
        self.budget_mib = self.budget_bytes // MIB
        self.time_limit_s = request.time_limit_s
        self.max_group_size = request.max_group_size
        # CPU offload is FSDP2's CPUOffloadPolicy: the single-device step has none
        self.allow_offload = request.allow_offload and self.profile.device != "cpu" and not single
        self.cost_model = CostModel(trace, request.profile)
        # the layouts searched: plain FSDP over every tp group (the trace's degree: ModelTrace.tp_size), and
        # HSDP with one node per shard group when there are several nodes
        hsdp = Mesh.per_node_hsdp(self.cluster.gpus, self.cluster.gpus_per_node, trace.tp_size)
        self.layouts = (Mesh.fsdp(self.cluster.gpus, trace.tp_size), *([hsdp] if hsdp is not None else []))
        refusal = checkpointing_refusal(trace.model_path, trace.forward_cache)
        if refusal is not None:  # the search space offers none (space.checkpointing_allowed)
            logger.warning("planning without activation checkpointing: %s", refusal)
        self.clock = Clock()
        self._spaces: dict[int, SearchSpace] = {}
        self._linear: dict[GlobalChoice, LinearModel] = {}
        # per choice without accumulation, its prefetch depths set aside: the first linear model built of it
        self._built: dict[GlobalChoice, LinearModel] = {}
        self._costs: dict[UnitSetting, CandidateCosts] = {}
        self._greedy: dict[tuple[GlobalChoice, int], tuple[int, ...] | None] = {}
        self._lagrangian: dict[GlobalChoice, tuple] = {}  # cpsat.lagrangian_covers, per linear model
        self._paths: dict[GlobalChoice, tuple] = {}  # cpsat.lagrangian_paths, per choice without accumulation
        self._estimates: dict[tuple, Estimate] = {}
        self._ahead: dict[tuple[GlobalChoice, float], Future] = {}
        self._threads: ThreadPoolExecutor | None = None

    def space(self, mesh: Mesh) -> SearchSpace:
        shard = mesh.shard_group_size
        if shard not in self._spaces:
            # a shard group's ranks are tp apart: a node holds gpus_per_node / tp of them (parallel/mesh.py)
            self._spaces[shard] = build_space(self.trace, shard_group=shard,
                                              gpus_per_node=mesh.shard_ranks_per_node(self.cluster.gpus_per_node),
                                              max_group_size=self.max_group_size,
                                              sharded=self.engine != SINGLE)
            if not self._spaces[shard].items:
                raise UserError(f"{self.trace.model_path}: the model has no modules with parameters to shard")
        return self._spaces[shard]

    def linear(self, choice: GlobalChoice) -> LinearModel:
        """The linear model of ``choice`` (built once: the screen, the solves and the sweep share it). One
        that differs from a built one only in accumulation or prefetch depths is derived from it
        (linear.py ``with_accumulation``, ``with_prefetch``: the same terms as a build)."""
        plain = replace(choice, accumulation=NO_ACCUMULATION)
        if choice != plain and choice not in self._linear:  # accumulation only adds to its base
            self._linear[choice] = with_accumulation(self.linear(plain), choice, self.training)
        if choice not in self._linear:
            depths_aside = replace(choice, prefetch=Prefetch(0, 0))
            built = self._built.get(depths_aside)
            if built is not None:  # the prefetch depths change only the time terms
                self._linear[choice] = with_prefetch(built, choice, self.candidate_costs(choice))
            else:
                self._linear[choice] = self._built[depths_aside] = build_linear_model(
                    self.trace, self.space(choice.mesh), choice, self.training, self.profile,
                    cost_model=self.cost_model, costs=self.candidate_costs(choice))
        return self._linear[choice]

    def candidate_costs(self, choice: GlobalChoice) -> CandidateCosts:
        """The unit costs of every candidate of ``choice``'s space under its setting, priced once per setting
        (solve/candidate_costs.py): the linear models of the choices that share a mesh and offload share
        them. The space and the profile follow from the setting's mesh (:meth:`space`; ``for_world``)."""
        setting = unit_setting(choice, self.training)
        if setting not in self._costs:
            profile = self.cost_model.for_world(choice.mesh.world_size).profile
            self._costs[setting] = candidate_costs(self.trace, self.space(choice.mesh), setting, profile)
        return self._costs[setting]

    def greedy(self, lm: LinearModel, budget_mib: int) -> tuple[int, ...] | None:
        """:func:`cpsat.greedy_cover` of ``lm`` at ``budget_mib``, once per pair (the screen's is the first
        solve's hint); its Lagrangian covers, which no budget changes, once per linear model, and their
        shortest paths, which accumulation does not change either (it adds to ``base`` only:
        ``with_accumulation``), once per choice without it."""
        key = (lm.choice, budget_mib)
        if key not in self._greedy:
            with self.clock.doing("hints"):
                if lm.choice not in self._lagrangian:
                    plain = replace(lm.choice, accumulation=NO_ACCUMULATION)
                    if plain not in self._paths:
                        self._paths[plain] = cpsat.lagrangian_paths(self.linear(plain))
                    shared = self.linear(plain).coeffs is lm.coeffs  # (``lm`` is this context's)
                    self._lagrangian[lm.choice] = cpsat.lagrangian_covers(lm, self._paths[plain] if shared else None)
                self._greedy[key] = cpsat.greedy_cover(lm, budget_mib, self._lagrangian[lm.choice])
        return self._greedy[key]

    def min_time(self, lm: LinearModel, budget_mib: int, **kwargs) -> cpsat.SolveResult:
        with self.clock.doing("cpsat"):
            return cpsat.solve_min_time(lm, budget_mib, **kwargs)

    def min_peak(self, lm: LinearModel, time_limit_s: float) -> cpsat.SolveResult:
        ahead = self._ahead.pop((lm.choice, time_limit_s), None)
        if ahead is not None:
            result = ahead.result()
            self.clock.add("cpsat", result.seconds)
            return result
        with self.clock.doing("cpsat"):
            return cpsat.solve_min_peak(lm, time_limit_s=time_limit_s)

    def min_peak_ahead(self, lm: LinearModel, time_limit_s: float) -> None:
        """Start :meth:`min_peak` of ``lm`` in a thread; :meth:`min_peak` then takes its result.

        [Note: a solve ahead] CP-SAT releases the GIL while it searches (one worker, a deterministic
        limit: the same cover whichever thread runs it), so a solve whose inputs are known early runs on
        the second core while this thread solves and simulates: the frontier's smallest-peak solve
        (solve/frontier.py) is known once the screen has picked the global choice. :meth:`close` waits
        for it if nobody asked."""
        key = (lm.choice, time_limit_s)
        if key not in self._ahead:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cp-sat-ahead")
            self._ahead[key] = self._threads.submit(cpsat.solve_min_peak, lm, time_limit_s=time_limit_s)

    def close(self) -> None:
        """Wait for the solves started ahead (see [Note: a solve ahead])."""
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
            self._threads = None

    def estimate(self, plan: Plan, timeline: bool = False) -> Estimate:
        """The simulators' verdict on ``plan`` (the memory timeline only when asked: the chosen plan's,
        for the report), memoised by the plan's decisions. See [Note: one call to the cost model]."""
        key = (plan.units, plan.prefetch, plan.mesh, plan.training, timeline)
        if key not in self._estimates:
            with self.clock.doing("simulate"):
                self._estimates[key] = self.cost_model.estimate(plan, timeline=timeline)
        return self._estimates[key]

    def device_fit(self, plan: Plan) -> FitVerdict | None:
        """``plan`` on a GPU of --mem, through the caching-allocator simulation (cost/fits.py; memoised by the
        cost model); None on a CPU profile, or when the request has no ``allocator_check``."""
        if not self.request.allocator_check:
            return None
        with self.clock.doing("simulate"):
            return device_fit(self.cost_model, plan)

    def shown_fits(self, c: Checked) -> bool:
        """Whether a plan the planner shows (the frontier, the recipes) fits --mem: its allocated
        peak within the search's budget at --mem and, on a GPU, its simulated steps surviving there
        (solve/survive.py [Note: Search by the allocated peak, judge by the allocator])."""
        if c.peak_bytes > self.shown_budget_bytes:
            return False
        fit = self.device_fit(c.plan)
        return fit is None or fit.survives

    def mem_needed(self, c: Checked) -> int:
        """The smallest --mem ``c`` fits: its peak within the search's budget (``profile.mem_for_tensor_budget``)
        and, on a GPU, its simulated steps surviving (cost/fits.py ``smallest_mem_bytes``)."""
        plan = replace(c.plan, cluster=replace(c.plan.cluster, mem_budget_bytes=self.profile.memory_bytes))
        fit = self.device_fit(plan)  # judged on the whole device: where it fits, if anywhere
        if fit is None:
            return self.profile.mem_for_tensor_budget(c.peak_bytes)
        with self.clock.doing("simulate"):
            return smallest_mem_bytes(self.cost_model, plan, fit, c.peak_bytes)

    @property
    def simulated_plans(self) -> int:
        return len(self._estimates)

    def check(self, lm: LinearModel, chosen: tuple[int, ...], status: str) -> Checked:
        units = cover_units(lm, chosen)
        return replace(self.check_units(units, lm.choice, status, evaluate(lm, chosen).peak_mib), cover=chosen)

    @property
    def prefetch_choices(self) -> tuple[Prefetch, ...]:
        """The prefetch depths the search tries (solve/choice.py)."""
        return prefetch_choices(self.engine)

    def check_units(self, units, choice: GlobalChoice, status: str, linear_peak_mib: int = -1,
                    method: str = "cp-sat") -> Checked:
        if self.engine == SINGLE:  # a unit is only a checkpointed region or not (plan/engine.py)
            units = single_device_units(self.space(choice.mesh), units)
        plan = make_plan(self.trace, units, choice, training=self.training, cluster=self.cluster,
                         model_path=self.request.model_path, tensor_parallel=self.request.tensor_parallel)
        est = self.estimate(plan)
        return Checked(choice=choice, units=units, peak_bytes=est.memory.peak_bytes,
                       step_time_s=est.time.step_time_s, samples_per_s=est.time.samples_per_s, status=status,
                       linear_peak_mib=linear_peak_mib, plan=plan, estimate=est, method=method)
