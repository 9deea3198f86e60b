"""CostModel: the cost model of one trace on one hardware profile, with everything it can reuse.

``CostModel(trace, profile)`` owns, for its trace and profile only (no module-level caches keyed by
``id()``):

- the cost tables per segmentation (cost/tables.py), an LRU dict keyed by the units' modules;
- subtree sums of the trace's per-module fields, shared by every segmentation;
- the measured per-block times per segmentation, when the profile has module timings; the timings'
  fingerprint/dtype check runs once per param dtype (a failing check raises every time);
- the step schedule per ``(units, prefetch)`` (cost/schedule.py) and the unit bytes per
  ``(units, shard, dtypes)``; what selectively checkpointed blocks store and skip recomputing per
  ``(units, micro-batch, dtype)`` (cost/selective.py);
- a memo of memory and time estimates keyed by the plan's decisions (units, prefetch, mesh,
  training), so a cover already simulated is not simulated again.

Every memo is keyed by the frozen query its function takes and reads nothing else (cost/queries.py
[Note: A memo is keyed by its function's query]): the keys listed above are those queries' fields;

Per world size, the CostModel that prices time on the profile as that many CPU ranks sharing the
  host's cores see it (``for_world``; cost/host_share.py [Note: CPU ranks sharing cores]): itself
  unless they share, always on a GPU profile. Time goes through it; memory does not depend on it.

Everything it returns is frozen or must be treated as read-only (estimates are shared by the memo).

The module-level functions of :mod:`shard_planner.cost` (``estimate``, ``simulate_memory``, ...) are
thin wrappers that build a CostModel per call (no module-level state): code that judges many plans of
one trace holds its own CostModel (the planner's PlanContext does).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import replace

from shard_planner.cost.engines import engine_named
from shard_planner.cost.kernels import (
    block_kernel_s, cpu_loss_memory_bound_s, cpu_memory_bound_s, device_of, has_kernel_records, loss_kernel_s,
    module_kernel_s, records_time_s,
)
from shard_planner.cost.schedule import Schedule
from shard_planner.cost.selective import (SelectiveBlocks, early_stop_share, flops_price, selective_blocks,
                                         subtree_selective)
from shard_planner.cost.queries import (BatchQuery, BlockQuery, PlanQuery, ReservedQuery, ScheduleQuery,
                                        SelectiveQuery, SubtreeQuery, UnitBytesQuery, UnitCostsQuery,
                                        segmentation_of)
from shard_planner.cost.tables import CostTables, segment_tables, subtree_summer, unit_params_of
from shard_planner.cost.host_share import shared_profile
from shard_planner.cost.tp_comm import block_tp_s, subtree_tp_s
from shard_planner.cost.time import BlockCompute, measured_block_times
from shard_planner.cost.activations import BlockActivations, block_activations
from shard_planner.cost.quantized import dequantisation_s, subtree_dequantisation_s
from shard_planner.cost.reserved import (ReservedEstimate, ReservedTimeline, simulate_reserved, simulate_reserved_timeline,
                                         simulated_events, unlimited_run)
from shard_planner.cost.types import Estimate, MemoryEstimate, TimeEstimate
from shard_planner.cost.unit_bytes import UnitBytes
from shard_planner.cost.unit_cost import UnitCost
from shard_planner.plan import Plan, Unit
from shard_planner.plan.engine import FSDP2
from shard_planner.plan.numerics import Numerics
from shard_planner.hardware.profile import HardwareProfile
from shard_planner.trace.types import Affine, ModelTrace

logger = logging.getLogger(__name__)

TABLES_CACHE_SIZE = 256  # segmentations kept (the solver's screen visits a few dozen per global choice)
MEMO_SIZE = 4096  # estimates kept per kind (memory with timeline, without, time)
# unlimited allocator runs kept (cost/reserved.py ``unlimited_run``): each holds its allocator's blocks, and
# it is asked again right after (cost/fits.py ``device_fit``: without a limit, then under the device's)
UNLIMITED_RUNS_KEPT = 4


class _LRU(OrderedDict):
    """A dict that keeps its ``size`` most recently used entries (None: all)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, query, price):
        """``price(query)``, computed once per ``query`` while it is kept. See [Note: A memo is keyed by
        its function's query] in cost/queries.py: ``price`` reads nothing but ``query``."""
        try:
            self.move_to_end(query)
            return self[query]
        except KeyError:
            value = price(query)
            if self.size is None or self.size > 0:
                self[query] = value
                if self.size is not None and len(self) > self.size:
                    self.popitem(last=False)
            return value


class CostModel:
    """Memory and time of FSDP2 plans for one trace on one profile (see the module docstring).

    ``memo_size=0`` turns the estimate memo off (every call simulates; for benchmarks)."""

    def __init__(self, trace: ModelTrace, profile: HardwareProfile, *, tables_cache_size: int = TABLES_CACHE_SIZE,
                 memo_size: int = MEMO_SIZE):
        self.trace = trace
        self.profile = profile
        self._subtree_sum = subtree_summer(trace)
        self._params_of = unit_params_of(trace)
        self._tables = _LRU(tables_cache_size)
        self._measured = _LRU(tables_cache_size)
        self._schedules = _LRU(tables_cache_size)
        self._unit_bytes = _LRU(tables_cache_size)
        self._activations = _LRU(tables_cache_size)
        self._compute = _LRU(tables_cache_size)
        self._unit_time = _LRU(tables_cache_size)  # per unit: collectives' and FSDP2 copies' seconds
        self._unit_costs = _LRU(tables_cache_size)  # per setting: each unit's cost (unit_costs_of)
        self._selective = _LRU(tables_cache_size)
        self._subtrees = _LRU(None)  # bounded: modules x options x micro-batches x dtypes
        self._memory = _LRU(memo_size)  # with its timeline
        self._memory_totals = _LRU(memo_size)  # without
        self._time = _LRU(memo_size)
        self._reserved = _LRU(memo_size)
        self._unlimited_runs = _LRU(min(memo_size, UNLIMITED_RUNS_KEPT))
        self._timings_checked: set[str] = set()
        self._kernel_modules = _LRU(tables_cache_size)  # per-module and loss kernel seconds
        self._dequant = _LRU(tables_cache_size)  # per module, seconds FLOPs do not see (_unseen_s)
        self._kernel_records = has_kernel_records(trace)
        self._worlds: dict[int, CostModel] = {}

    def for_world(self, world_size: int) -> "CostModel":
        """The CostModel of this trace on the profile as ``world_size`` ranks see it when they share the
        host's cores (cost/host_share.py ``shared_profile``): ``self`` when they do not. It shares this
        model's tables, schedules and unit bytes (they do not depend on the profile's rates)."""
        hit = self._worlds.get(world_size)
        if hit is None:
            shared = shared_profile(self.profile, world_size)
            if shared is self.profile:
                hit = self
            else:
                hit = CostModel(self.trace, shared, tables_cache_size=self._tables.size, memo_size=self._time.size)
                hit._subtree_sum, hit._params_of, hit._tables, hit._schedules, hit._unit_bytes = (
                    self._subtree_sum, self._params_of, self._tables, self._schedules, self._unit_bytes)
            self._worlds[world_size] = hit
        return hit

    # ---- per trace and segmentation ----
    def subtree_sum(self, fqn: str, attr: str) -> Affine:
        """Sum of the Affine field ``attr`` (e.g. ``"fwd_flops_self"``) over ``fqn``'s subtree, memoised
        (cost/tables.py ``subtree_summer``)."""
        return self._subtree_sum(fqn, attr)

    def tables(self, units: tuple[Unit, ...]) -> CostTables:
        """The cost tables of the trace segmented into ``units`` (only their modules matter)."""
        return self.segment_tables(segmentation_of(units))

    def segment_tables(self, segmentation: tuple[tuple[str, ...], ...]) -> CostTables:
        """The cost tables of the trace segmented into units of these modules (cost/tables.py)."""
        return self._tables.get_or(segmentation, lambda seg: segment_tables(self.trace, seg, self._subtree_sum,
                                                                            self._params_of))

    def schedule(self, units: tuple[Unit, ...], prefetch, engine: str = FSDP2) -> Schedule:
        """The step's event sequence (``engine``'s: FSDP2's is cost/schedule.py) for ``units`` and ``prefetch``."""
        return self._schedule(ScheduleQuery(units, prefetch, engine))

    def _schedule(self, q: ScheduleQuery) -> Schedule:
        return self._schedules.get_or(q, lambda q: engine_named(q.engine).schedule(self.tables(q.units), q.units,
                                                                                   q.prefetch))

    def unit_bytes(self, plan: Plan) -> tuple[UnitBytes, ...]:
        """Every unit's byte sizes under ``plan`` (cost/unit_bytes.py)."""
        return self._unit_bytes_of(UnitBytesQuery.of(plan))

    def _unit_bytes_of(self, q: UnitBytesQuery) -> tuple[UnitBytes, ...]:
        return self._unit_bytes.get_or(q, lambda q: engine_named(q.engine).unit_bytes(self.tables(q.units), q))

    def unit_costs_of(self, q: UnitCostsQuery) -> tuple[UnitCost, ...]:
        """What each unit of ``q`` costs on this model's profile (cost/unit_cost.py): the per-unit query
        the time walk reads here and the solver's linear model asks per candidate unit."""
        setting = q.setting
        price = engine_named(setting.engine).unit_cost
        # per unit (its parameters and reshard_after_forward) under this setting: the plans the solver judges
        # share most of their units (Llama 3 70B on 64 GPUs: ~21,000 unit costs asked, ~500 distinct)
        known = self._unit_costs.get_or(setting, lambda _: {})
        costs = []
        for p, u in zip(self.tables(q.units).unit_params, q.units):
            r = u.reshard_after_forward
            key = (p, r, type(r))  # True and 1 are equal keys, different policies (cost/reshard.py)
            cost = known.get(key)
            if cost is None:
                cost = known[key] = price(p, r, setting, self.profile)
            costs.append(cost)
        return tuple(costs)

    def block_activations(self, plan: Plan) -> BlockActivations:
        """Every block's activation bytes at the plan's micro-batch and param dtype (cost/memory.py)."""
        return self._block_activations(BlockQuery.of(plan))

    def _block_activations(self, q: BlockQuery) -> BlockActivations:
        return self._activations.get_or(q, lambda q: block_activations(
            self.trace, self.segment_tables(q.segmentation), q.batch.micro_batch, q.batch.numerics))

    def selective_blocks(self, plan: Plan) -> SelectiveBlocks | None:
        """Per block, what selective checkpointing keeps and the share of the forward a checkpointed
        block does not recompute (cost/selective.py); None when no unit of ``plan`` is checkpointed."""
        return self._selective_blocks(SelectiveQuery.of(plan))

    def _selective_blocks(self, q: SelectiveQuery) -> SelectiveBlocks | None:
        def price(q: SelectiveQuery) -> SelectiveBlocks | None:
            b = q.batch
            return selective_blocks(self.trace, self.tables(q.units), q.units, b.numerics,
                                    lambda fqn, ops: self._subtree(SubtreeQuery(fqn, ops, b)),
                                    lambda fqn: self._subtree(SubtreeQuery(fqn, None, b)))
        return self._selective.get_or(q, price)

    def early_stop_share(self, fqn: str, micro_batch: int, numerics: Numerics) -> float:
        """cost/selective.py's :func:`~shard_planner.cost.selective.early_stop_share` of ``fqn``, priced by
        :meth:`forward_price`; computed once per subtree. 0 where the profile's stack reruns the whole
        forward (``HardwareProfile.checkpoint_early_stop``)."""
        return self._subtree(SubtreeQuery(fqn, None, BatchQuery(micro_batch, numerics)))

    def subtree_selective(self, fqn: str, save_ops: tuple[str, ...], micro_batch: int,
                          numerics: Numerics) -> tuple[float, float, float]:
        """cost/selective.py's :func:`~shard_planner.cost.selective.subtree_selective` of ``fqn``, priced
        by :meth:`forward_price`; computed once per subtree (the plans the solver checks share blocks)."""
        return self._subtree(SubtreeQuery(fqn, save_ops, BatchQuery(micro_batch, numerics)))

    def _subtree(self, q: SubtreeQuery):
        """:meth:`early_stop_share` (``q.save_ops`` None) or :meth:`subtree_selective` of ``q``."""
        def price(q: SubtreeQuery):
            forward = self.forward_price(q.batch.micro_batch, q.batch.numerics)
            if q.save_ops is not None:
                return subtree_selective(self.trace, q.fqn, q.save_ops, q.batch.micro_batch, forward)
            if not self.profile.checkpoint_early_stop:
                return 0.0
            return early_stop_share(self.trace, q.fqn, q.batch.micro_batch, forward)
        return self._subtrees.get_or(q, price)

    def forward_price(self, micro_batch: int, numerics: Numerics):
        """``price(module, records)``: forward device seconds of a module's kernel records (None: its
        whole forward) by the roofline kernel model whenever the profile has a ``[kernels]`` table and the
        trace has kernel records, whatever its ``compute_model``; else by traced FLOPs. cost/selective.py
        reads only the ratio of two prices (the share of a block's forward that selective checkpointing
        does not recompute), and the ops it recomputes — norms, activations, rotary embeddings, residual
        adds — have next to no FLOPs but are bound by memory bandwidth: priced by FLOPs, recomputing them
        would cost nothing (Llama 3 8B, 8 H100s, seq 8192: selective 6,705 tokens/s/GPU against 6,742
        without checkpointing, where torchtitan measured 5,762 with selective)."""
        modules = self._roofline_s(micro_batch, numerics)
        if modules is None:
            return flops_price(micro_batch)
        dev = device_of(self.profile, numerics.compute_dtype)

        def price(m, records) -> float:
            return modules[0][m.fqn][0] if records is None else records_time_s(records, micro_batch, dev)
        return price

    # ---- compute times: the one place that prices a block's compute ----
    def _check_timings(self, numerics: Numerics) -> None:
        timings = self.profile.module_timings
        dtype = numerics.compute_dtype  # module timings are measured with the parameters cast to it
        if timings is not None and dtype not in self._timings_checked:
            timings.check(self.trace.fingerprint, dtype, f"the trace of {self.trace.model_path}")
            self._timings_checked.add(dtype)

    def block_compute_s(self, t: CostTables, micro_batch: int, numerics: Numerics) -> BlockCompute:
        """Device and host seconds of every block of ``t`` and of the loss at ``micro_batch``:
        measured when the profile's module timings have the block's module, else traced FLOPs at
        the profile's achievable FLOP/s and aten ops x per-op overhead (cost/time.py's docstring).
        The time simulator reads compute only from here."""
        profile, b = self.profile, micro_batch
        # each block's FLOPs at the rate of its module's GEMM dtype (plan/numerics.py; the whole subtree at one rate,
        # as every module has one dtype today: docs/extending.md, float8), the loss's at its own
        rates = [profile.flops_per_s(numerics.gemm_dtype(blk.fqn)) for blk in t.blocks]
        loss_rate = profile.flops_per_s(numerics.gemm_dtype(None))
        op_s = profile.per_op_overhead_s
        timings = profile.module_timings
        if timings is not None:
            self._check_timings(numerics)
            measured = self._measured.get_or(t.segmentation, lambda seg: measured_block_times(
                self.trace, self.segment_tables(seg), timings))
        else:
            measured = (None,) * len(t.blocks)
        blocks = t.blocks
        # A measured block's time already holds its kernels and its per-op framework time: no op overhead.
        kernels = self.kernel_module_s(b, numerics)
        if kernels is not None:  # GPU kernel model (cost/kernels.py) from the trace's kernel records
            priced_fwd, priced_bwd = block_kernel_s(self.trace, blocks, kernels[0])
            loss_priced = kernels[1]
        else:  # FLOPs, and the kernels they do not see (:meth:`_unseen_s`)
            unseen = self._unseen_s(b, numerics)
            extra = [subtree_dequantisation_s(self.trace, blk.fqn, unseen, blk.self_only) for blk in blocks]
            priced_fwd = tuple(blk.fwd_flops.at(b) / r + x[0] for blk, x, r in zip(blocks, extra, rates))
            priced_bwd = tuple(blk.bwd_flops.at(b) / r + x[1] for blk, x, r in zip(blocks, extra, rates))
            loss_priced = self.trace.loss_flops.at(b) / loss_rate + cpu_loss_memory_bound_s(self.trace, b, profile)
        if timings is not None:
            loss_dev, loss_host = timings.loss_fwd_s.at(b) + timings.loss_bwd_s.at(b), 0.0
        else:
            loss_dev, loss_host = loss_priced, self.trace.loss_ops * op_s
        tp_fwd_s, tp_bwd_s, loss_tp_s = block_tp_s(t, self.trace, b, profile)
        return BlockCompute(
            device_fwd_s=tuple(m.fwd_s.at(b) if m is not None else priced_fwd[i] for i, m in enumerate(measured)),
            device_bwd_s=tuple(m.bwd_s.at(b) if m is not None else priced_bwd[i] for i, m in enumerate(measured)),
            ops_fwd_s=tuple(0.0 if m is not None else blk.fwd_ops * op_s for blk, m in zip(blocks, measured)),
            ops_bwd_s=tuple(0.0 if m is not None else blk.bwd_ops * op_s for blk, m in zip(blocks, measured)),
            loss_device_s=loss_dev, loss_host_s=loss_host,
            tp_fwd_s=tp_fwd_s, tp_bwd_s=tp_bwd_s, loss_tp_s=loss_tp_s,
        )

    def kernel_module_s(self, micro_batch: int, numerics: Numerics) -> tuple[dict, float] | None:
        """Per module its own forward and backward device seconds, and the loss's, from the trace's
        kernel records priced by the profile's ``[kernels]`` table (cost/kernels.py), once per
        (micro-batch, dtype); None unless the profile's ``compute_model`` is "roofline" and the trace has
        records (then compute is traced FLOPs x the profile's efficiency)."""
        if self.profile.compute_model != "roofline":
            return None
        return self._roofline_s(micro_batch, numerics)

    def _roofline_s(self, micro_batch: int, numerics: Numerics) -> tuple[dict, float] | None:
        """:meth:`kernel_module_s`'s figures whenever they can be priced (a ``[kernels]`` table and kernel
        records), whatever the profile's ``compute_model``."""
        dev = device_of(self.profile, numerics.compute_dtype) if self._kernel_records else None
        if dev is None:
            return None

        def price(q: BatchQuery):
            rate = self.profile.flops_per_s(q.numerics.compute_dtype)  # for modules whose records did not pair
            dev = device_of(self.profile, q.numerics.compute_dtype)
            return (module_kernel_s(self.trace, q.micro_batch, dev, rate),
                    loss_kernel_s(self.trace, q.micro_batch, dev, rate))
        return self._kernel_modules.get_or(BatchQuery(micro_batch, numerics), price)

    def _unseen_s(self, micro_batch: int, numerics: Numerics) -> dict[str, tuple[float, float]]:
        """Per module, the forward and backward seconds of its own kernels that FLOPs do not see: the
        dequantisation of quantised weights on a GPU (cost/quantized.py) and, on a CPU, every memory-bound
        kernel (cost/kernels.py [Note: memory-bound kernels on a CPU priced from FLOPs])."""
        def unseen(q: BatchQuery) -> dict[str, tuple[float, float]]:
            out = dict(dequantisation_s(self.trace, q.micro_batch, self.profile))
            for fqn, (f, b) in cpu_memory_bound_s(self.trace, q.micro_batch, self.profile).items():
                f0, b0 = out.get(fqn, (0.0, 0.0))
                out[fqn] = (f0 + f, b0 + b)
            return out
        return self._dequant.get_or(BatchQuery(micro_batch, numerics), unseen)

    def module_compute_s(self, fqn: str | None, micro_batch: int, numerics: Numerics) -> tuple[float, float]:
        """Forward and backward seconds of ``fqn``'s subtree at ``micro_batch``, compute only (no FSDP2 or
        per-op overhead): measured when the profile's module timings have the module, else FLOPs /
        throughput; plus its tensor-parallel collectives, which hold up the compute stream as long
        (cost/tp_comm.py). For models of the step time outside the simulator (the solver's linear
        model); the loss is ``fqn=None``."""
        f, b = self._module_device_s(fqn, micro_batch, numerics)
        if self.trace.tp_size <= 1:
            return f, b
        tp_f, tp_b = subtree_tp_s(self.trace, fqn, micro_batch, self.profile)
        return f + tp_f, b + tp_b

    def _module_device_s(self, fqn: str | None, micro_batch: int, numerics: Numerics) -> tuple[float, float]:
        """:meth:`module_compute_s` without the tensor-parallel collectives."""
        timings = self.profile.module_timings
        if timings is not None:
            self._check_timings(numerics)
            if fqn is None:
                return timings.loss_fwd_s.at(micro_batch), timings.loss_bwd_s.at(micro_batch)
            m = timings.modules.get(fqn)
            if m is not None:
                return m.fwd_s.at(micro_batch), m.bwd_s.at(micro_batch)
        kernels = self.kernel_module_s(micro_batch, numerics)
        if kernels is not None:
            if fqn is None:
                return kernels[1], 0.0
            return tuple(sum(kernels[0][m.fqn][i] for m in self.trace.subtree(fqn)) for i in (0, 1))
        rate = self.profile.flops_per_s(numerics.gemm_dtype(fqn))  # its GEMM dtype, the subtree's (as above)
        if fqn is None:  # the trace does not split the loss's FLOPs into forward and backward
            return (self.trace.loss_flops.at(micro_batch) / rate
                    + cpu_loss_memory_bound_s(self.trace, micro_batch, self.profile), 0.0)
        deq_f, deq_b = subtree_dequantisation_s(self.trace, fqn, self._unseen_s(micro_batch, numerics))
        return (self.subtree_sum(fqn, "fwd_flops_self").at(micro_batch) / rate + deq_f,
                self.subtree_sum(fqn, "bwd_flops_self").at(micro_batch) / rate + deq_b)

    # ---- estimates ----
    def memory(self, plan: Plan, *, timeline: bool = True) -> MemoryEstimate:
        """Peak live bytes of one rank over one step, its breakdown, and (``timeline``) every event."""
        return self._memory_of(PlanQuery.of(plan), timeline)

    def time(self, plan: Plan) -> TimeEstimate:
        """Step time of one rank and what it is made of (cost/time.py)."""
        return self.for_world(plan.mesh.world_size)._time_of(PlanQuery.of(plan))

    def estimate(self, plan: Plan, *, timeline: bool = True) -> Estimate:
        """Memory and time of ``plan``; ``.prediction()`` gives the plan's ``predicted`` section.
        ``timeline=False`` skips the memory timeline (faster; the solver's checks)."""
        q = PlanQuery.of(plan)
        return Estimate(memory=self._memory_of(q, timeline), time=self.for_world(plan.mesh.world_size)._time_of(q))

    def _memory_of(self, q: PlanQuery, timeline: bool) -> MemoryEstimate:
        if timeline:
            return self._memory.get_or(q, lambda q: self._simulate_memory(q, True))
        with_timeline = self._memory.get(q)
        if with_timeline is not None:  # the same walk, its timeline dropped
            return self._memory_totals.get_or(q, lambda q: replace(with_timeline, timeline=()))
        return self._memory_totals.get_or(q, lambda q: self._simulate_memory(q, False))

    def _simulate_memory(self, q: PlanQuery, timeline: bool, accountants: tuple = ()) -> MemoryEstimate:
        """The memory walk of ``q`` (cost/memory.py; several micro-steps per optimizer step:
        cost/accumulation.py), its events also to ``accountants``. ``q`` is the ``plan`` the walk reads."""
        engine = engine_named(q.engine)
        walk = engine.memory_walk if q.training.accumulation_steps == 1 else engine.accumulated_memory_walk
        return walk(self.trace, self.tables(q.units), q, self.profile, self._unit_bytes_of(UnitBytesQuery.of(q)),
                    self._schedule(ScheduleQuery.of(q)), self._block_activations(BlockQuery.of(q)),
                    timeline=timeline, selective=self._selective_blocks(SelectiveQuery.of(q)), accountants=accountants)

    def reserved(self, plan, expandable_segments: bool = True, device_bytes: int | None = None) -> ReservedEstimate:
        """What the CUDA caching allocator reserves to run ``plan``'s first two steps (cost/reserved.py),
        in either allocator mode; under ``device_bytes`` (the memory the allocator can get) its retries and
        OOM too."""
        return self._reserved.get_or(ReservedQuery(PlanQuery.of(plan), expandable_segments, device_bytes),
                                     self._simulate_reserved)

    def _simulate_reserved(self, q: ReservedQuery) -> ReservedEstimate:
        unlimited = self._unlimited_runs.get_or(replace(q, device_bytes=None), lambda u: unlimited_run(
            lambda accountants: self._simulate_memory(u.plan, False, accountants), u.expandable_segments))
        return simulate_reserved(lambda accountants: self._simulate_memory(q.plan, False, accountants),
                                 q.expandable_segments, q.device_bytes, unlimited=unlimited)

    def reserved_timeline(self, plan, expandable_segments: bool = True,
                          device_bytes: int | None = None) -> ReservedTimeline:
        """The allocator's allocated and reserved bytes at every mark of ``plan``'s second step, for the
        report's timeline (cost/reserved.py; not memoised: one call per report)."""
        q = PlanQuery.of(plan)
        return simulate_reserved_timeline(lambda accountants: self._simulate_memory(q, False, accountants),
                                          expandable_segments, device_bytes)

    def walk_memory(self, plan: Plan, accountants: tuple) -> MemoryEstimate:
        """The memory walk of ``plan`` with its events also sent to ``accountants`` (cost/allocations.py), e.g.
        cost/alloc_sequence.py's, which compares them with a real step's. Not memoised."""
        return self._simulate_memory(PlanQuery.of(plan), False, tuple(accountants))

    def reserved_events(self, plan, expandable_segments: bool = True) -> list:
        """The simulated allocator's calls over ``plan``'s two steps (cost/reserved.py ``simulated_events``),
        to replay under another limit (cost/allocator_replay.py). Not memoised."""
        q = PlanQuery.of(plan)
        return simulated_events(lambda accountants: self._simulate_memory(q, False, accountants), expandable_segments)

    def _time_of(self, q: PlanQuery) -> TimeEstimate:
        return self._time.get_or(q, self._simulate_time)

    def _simulate_time(self, q: PlanQuery) -> TimeEstimate:
        """The two-stream time walk of ``q`` (cost/time.py; accumulation: cost/accumulation.py)."""
        t = self.tables(q.units)
        block = BlockQuery.of(q)
        compute = self._compute.get_or(block, lambda b: self.block_compute_s(
            self.segment_tables(b.segmentation), b.batch.micro_batch, b.batch.numerics))
        comm, copies = self._unit_time.get_or(UnitCostsQuery.of(q), self._unit_time_s)
        schedule = self._schedule(ScheduleQuery.of(q))
        selective = self._selective_blocks(SelectiveQuery.of(q))

        engine = engine_named(q.engine)

        def walk(collectives):
            return engine.time_walk(self.trace, t, q, self.profile, schedule, compute, collectives,
                                    selective=selective, copies=copies)
        if q.training.accumulation_steps == 1:
            return walk(comm)
        return engine.accumulated_time(q.training, walk, comm, self.trace.tokens_per_sample, q.mesh.dp_size)

    def _unit_time_s(self, q: UnitCostsQuery):
        """Per unit its collectives' and its copies' seconds, the two-stream walk's inputs, from every unit's
        cost (the engine's: FSDP2's are cost/time.py ``unit_collectives_s`` and ``unit_copies_s``)."""
        return engine_named(q.setting.engine).time_inputs(self.unit_costs_of(q))
