"""The parallel layout of a plan (the role of torchtitan's ``ParallelDims``): one type owns the degrees,
checks them once, and derives every size and group placement the other stages need.

    Mesh(shard=8, replicate=2)        # HSDP: 2 replicas x 8-way sharding, 16 ranks
    mesh.dp_size                      # 16: ranks that each take their own micro-batch
    mesh.shard_group_size             # 8: what sharded state divides by
    mesh.shard_group_spans_nodes(8)   # False: the shard group fits in one node of 8 GPUs
    Mesh.fsdp(16, tp=2)               # plain FSDP over every tp group of 16 ranks: shard 8 x tp 2

The layout is built here and then passed: a request's GPUs at the trace's tensor-parallel degree become
the layouts the solver searches, once per request (:meth:`Mesh.fsdp`, :meth:`Mesh.per_node_hsdp`;
solve/context.py ``PlanContext.layouts``), another world size's layout is :meth:`Mesh.at_world_size`,
the plan carries the chosen one (its ``mesh`` section), cost asks it for group sizes and placements
(cost/collectives.py takes the layout, not integers), and execute builds the torch device mesh from
:attr:`Mesh.device_mesh_shape` and :attr:`Mesh.device_mesh_dim_names` (``execute.apply.build_mesh``), as
the FSDP2 export writes it. Nothing outside this module multiplies,
divides or takes the remainder of a raw degree, and no other dataclass stores one:
tests/test_layout_owns_degrees.py searches the package for it, with its allow-list (a trace's own degree,
``ModelTrace.tp_size``: a trace is one rank's numbers at the degree it was traced at, a fact of the data as
its dtype is; cost and report check it against the plan's layout; the planner builds its layouts for it).

[Note: The layout's name and its pipeline degree]
The class keeps the name ``Mesh``: it is the plan file's ``mesh`` section, and every stage and test already
names it (a rename would touch every file that imports it for no change in meaning). It holds every
dimension a plan may have: data-parallel replicate (HSDP) and shard (FSDP), tensor (``tp``), and pipeline
stages (``pp``). ``pp`` is validated but not yet planned: only ``pp == 1`` is priced, solved, run and
exported, so a layout with ``pp > 1`` is refused on construction, in one PlanError line — one place, so that
no stage can silently treat stages as ranks; the pipeline issue lifts that line and adds the stages'
sizes here. ``pp`` is written to the plan file only when it is not 1 (as ``tp``), so plan files read and
write as before it. Context and expert parallelism will be fields beside these, their sizes derived here.

[Note: which size means what]
- ``world_size``: every rank of the job (pp x replicate x shard x tp). Ranks that share a host's cores and
  memory (cost.host_share), the number of processes to launch, "over N GPUs" in reports.
- ``dp_size``: the data-parallel ranks, replicate x shard. Each takes its own micro-batch, so samples per
  step and the global batch multiply by it. Tensor-parallel ranks share one micro-batch, so ``dp_size``
  is ``world_size / non_data_parallel_size``; a size of samples must read ``dp_size``.
- ``non_data_parallel_size``: the ranks that share one micro-batch (tp x pp; torchtitan's name).
- ``shard_group_size``: the ranks one parameter is sharded over (FSDP2's shard mesh dimension). Sharded
  parameters, gradients and optimizer states divide by it (ZeRO-3: 16 bytes/param / N); all-gathers and
  reduce-scatters run over it; an int ``reshard_after_forward`` must be a non-trivial divisor of it.
- ``replicate_group_size``: HSDP replicas (1 = plain FSDP); the all-reduce of the reduce-scattered
  gradients runs over it.
- ``tp_size``: the tensor-parallel degree: the ranks one micro-batch's activations and each split weight
  are divided over (shard_planner/parallel/tensor_parallel.py), adjacent ranks inside a node. FSDP2 then shards what
  each tp rank holds over the shard group: a parameter's bytes per rank divide by ``tp_size`` (the split:
  :meth:`Mesh.tp_share`) and by ``shard_group_size`` (FSDP); the shard and replicate groups are the
  data-parallel sub-mesh.

Rank layout (placement on nodes): ranks are numbered node by node (torchrun's default) and the device
mesh is ("replicate", "shard"[, "tp"]) with the last dimension fastest, as ``init_device_mesh`` lays it
out. A group's ranks are then ``stride`` apart: tp ranks are adjacent, a shard group strides by tp and a
replicate group by shard x tp. A group of g > 1 ranks ``stride`` apart spans nodes when g x stride
exceeds the GPUs of a node (:func:`group_spans_nodes`, the one placement rule; the collectives ask the
layout's ``*_group_spans_nodes`` methods).
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.errors import PlanError


def group_spans_nodes(group_size: int, stride_ranks: int, gpus_per_node: int) -> bool:
    """Whether a group of ``group_size`` ranks, ``stride_ranks`` apart in a node-by-node numbering,
    leaves its node: it covers ``group_size x stride_ranks`` consecutive ranks (sizes divide nodes)."""
    return group_size > 1 and group_size * stride_ranks > gpus_per_node


def degree_divides(degree: int, *rank_counts: int) -> bool:
    """Whether a degree divides every one of ``rank_counts`` (a tensor-parallel degree must divide the GPUs
    per node and the GPUs: it stays inside a node; tp_degrees [Note: Which degrees are searched])."""
    return all(count % degree == 0 for count in rank_counts)


@dataclass(frozen=True, order=True)
class ModelSplit:
    """How one model replica is split over ranks: the layout's dimensions that change what one rank traces and
    computes, tensor parallelism ``tp`` and pipeline stages ``pp`` (1; refused above it as :class:`Mesh`
    refuses it), as opposed to the data-parallel ones (shard, replicate), which the solver searches on one
    rank's trace. The layout search's candidates and the key of its outcomes (solve/layout_search.py,
    ``Plan.layouts``); :attr:`Mesh.split` is a layout's. Ordered as its fields: the search's outcomes are
    listed by it. Pipeline stages become the second dimension searched here (their stages' sizes and labels
    beside tp's), the search itself unchanged."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        Mesh(shard=1, tp=self.tp, pp=self.pp)  # the same checks, in the same words

    @property
    def label(self) -> str:
        """For people: ``TP 2``; ``no tensor parallelism`` for a replica on one rank (pipeline stages, when
        planned, add `` x PP n``)."""
        parts = [f"{name} {n}" for name, n in (("TP", self.tp), ("PP", self.pp)) if n > 1]
        return " x ".join(parts) if parts else "no tensor parallelism"

    @property
    def comm_label(self) -> str:
        """What the split's own collectives are called in the summary (``LayoutOutcome.split_comm_s``): ``TP``
        (the pipeline's sends and receives will join them)."""
        return "TP"

    @property
    def key(self) -> str:
        """A short name for files and figure ids: ``tp2``; ``tp1`` for a replica on one rank."""
        return f"tp{self.tp}" + (f"-pp{self.pp}" if self.pp > 1 else "")


@dataclass(frozen=True)
class Mesh:
    """The parallel layout: ``shard`` ranks one parameter is sharded over, ``replicate`` HSDP replicas
    (1 = plain FSDP), ``tp`` the tensor-parallel degree (1: none; the plan's ``tensor_parallel`` section says
    how each module is split, shard_planner/parallel/tensor_parallel.py), ``pp`` pipeline stages (1; not yet planned:
    [Note: The layout's name and its pipeline degree]). The plan file's ``mesh`` section; ``tp`` and ``pp``
    are written only when they are not 1, so plans read and write as before them."""

    shard: int
    replicate: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for name in ("shard", "replicate", "tp", "pp"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise PlanError(f"mesh.{name} must be a positive int, got {v!r}")
        if self.pp > 1:  # See [Note: The layout's name and its pipeline degree]
            raise PlanError(f"mesh.pp is {self.pp}: pipeline stages are not planned yet (only pp = 1 is priced, "
                            "solved, run and exported)")

    # ---- the layouts a world of ranks is planned on ----
    @classmethod
    def fsdp(cls, world_size: int, tp: int = 1) -> "Mesh":
        """Plain FSDP over every tp group of ``world_size`` ranks (``tp`` adjacent ranks each); a PlanError
        when ``tp`` does not divide ``world_size``."""
        if not degree_divides(tp, world_size):
            raise PlanError(f"mesh.tp {tp} does not divide the {world_size} ranks")
        return cls(shard=world_size // tp, tp=tp)

    @classmethod
    def per_node_hsdp(cls, world_size: int, gpus_per_node: int, tp: int = 1) -> "Mesh | None":
        """HSDP with one node per shard group (its tp groups sharded inside the node, one replica per node):
        None unless ``world_size`` is several whole nodes, each holding whole tp groups."""
        if world_size <= gpus_per_node or not degree_divides(gpus_per_node, world_size) \
                or not degree_divides(tp, gpus_per_node):
            return None
        return cls(shard=gpus_per_node // tp, replicate=world_size // gpus_per_node, tp=tp)

    @classmethod
    def tp_group(cls, tp: int) -> "Mesh":
        """The layout of one tensor-parallel group alone: for the tp collectives of a trace at degree ``tp``
        (cost/tp_comm.py), which depend on the tp group's placement and on nothing else of the plan."""
        return cls(shard=1, tp=tp)

    def at_world_size(self, world_size: int) -> "Mesh":
        """The layout of the same decisions on ``world_size`` ranks: plain FSDP, keeping the tensor-parallel
        degree when it divides ``world_size`` (dropping it otherwise; Plan.with_world_size)."""
        return Mesh.fsdp(world_size, self.tp if degree_divides(self.tp, world_size) else 1)

    # ---- sizes: see [Note: which size means what] ----
    @property
    def world_size(self) -> int:
        """Every rank of the job."""
        return self.dp_size * self.non_data_parallel_size

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each takes its own micro-batch."""
        return self.replicate * self.shard

    @property
    def non_data_parallel_size(self) -> int:
        """The ranks that share one micro-batch: tp x pp (torchtitan's ``non_data_parallel_size``)."""
        return self.tp * self.pp

    @property
    def shard_group_size(self) -> int:
        return self.shard

    @property
    def replicate_group_size(self) -> int:
        return self.replicate

    @property
    def tp_size(self) -> int:
        return self.tp

    @property
    def pp_size(self) -> int:
        """Pipeline stages (1: all that is planned; [Note: The layout's name and its pipeline degree])."""
        return self.pp

    @property
    def split(self) -> ModelSplit:
        """How this layout splits one model replica over ranks (its tp and pp): the layout search's key."""
        return ModelSplit(tp=self.tp, pp=self.pp)

    @property
    def is_hsdp(self) -> bool:
        """Replicas whose reduced gradients are all-reduced across them (HSDP)."""
        return self.replicate > 1

    def is_reshard_size(self, ranks: int) -> bool:
        """Whether an int ``reshard_after_forward`` of ``ranks`` is allowed: a divisor of the shard group
        smaller than it (FSDP2; equal to it, it would silently mean True)."""
        return ranks < self.shard_group_size and self.shard_group_size % ranks == 0

    def tp_share(self, count: int) -> int:
        """One tp rank's part of a dimension of ``count`` split over the tp group (``count`` itself at tp 1)."""
        return count // self.tp

    # ---- placement on nodes: rank layout in the module docstring ----
    def shard_group_spans_nodes(self, gpus_per_node: int, group_size: int | None = None) -> bool:
        """Whether the shard group (or a reshard group of its first ``group_size`` ranks) leaves a node: its
        ranks are ``tp`` apart."""
        size = self.shard_group_size if group_size is None else group_size
        return group_spans_nodes(size, self.tp, gpus_per_node)

    def shard_ranks_per_node(self, gpus_per_node: int) -> int:
        """The ranks of one shard group on one node: all of them when the group fits in a node."""
        return min(self.shard_group_size, max(1, gpus_per_node // self.tp))

    def replicate_group_spans_nodes(self, gpus_per_node: int) -> bool:
        """Whether the replicas of one shard (``shard x tp`` ranks apart) are on more than one node."""
        return group_spans_nodes(self.replicate_group_size, self.shard * self.tp, gpus_per_node)

    def tp_group_spans_nodes(self, gpus_per_node: int) -> bool:
        """Whether the tp group (adjacent ranks) leaves a node: only when the degree exceeds a node's GPUs."""
        return group_spans_nodes(self.tp, 1, gpus_per_node)

    # ---- the torch device mesh (built in execute) ----
    @property
    def device_mesh_shape(self) -> tuple[int, ...]:
        """``init_device_mesh``'s shape: (shard,) for FSDP, (replicate, shard) for HSDP, then (..., tp) with
        tensor parallelism (the last dimension is the fastest: tp ranks are adjacent, inside a node)."""
        return tuple(size for size, _ in self._mesh_dims)

    @property
    def device_mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(name for _, name in self._mesh_dims)

    @property
    def dp_mesh_dim_names(self) -> tuple[str, ...]:
        """The data-parallel sub-mesh FSDP2 shards over (``fully_shard(mesh=device_mesh[names])``)."""
        return tuple(name for name in self.device_mesh_dim_names if name != "tp")

    @property
    def _mesh_dims(self) -> tuple[tuple[int, str], ...]:
        dims = ((self.replicate, "replicate"),) if self.is_hsdp else ()  # pp > 1 is refused: no "pp" dimension yet
        dims += ((self.shard, "shard"),)
        return dims + (((self.tp, "tp"),) if self.is_tp else ())

    @property
    def is_tp(self) -> bool:
        """Tensor parallelism over ``tp_size`` > 1 ranks."""
        return self.tp > 1

    # ---- for people ----
    @property
    def description(self) -> str:
        """For people: ``FSDP over 8 GPUs``, ``HSDP 2 replicas x 8 GPUs`` (replicate x shard), then `` x TP 4``."""
        return self.describe()

    def describe(self, rank: str = "GPU") -> str:
        """:attr:`description` with ``rank`` the word for one rank (``"CPU rank"`` on a CPU profile:
        profile.rank_word)."""
        if not self.is_hsdp:
            dp = f"FSDP over {self.shard} {rank}{'s' if self.shard > 1 else ''}"
        else:
            dp = f"HSDP {self.replicate} replicas x {self.shard} {rank}s"
        return dp + (f" x TP {self.tp}" if self.is_tp else "")

    @property
    def shape_text(self) -> str:
        """``2x8``: replicate x shard; ``2x8x4`` with tensor parallelism (replicate x shard x tp)."""
        return f"{self.replicate}x{self.shard}" + (f"x{self.tp}" if self.is_tp else "")
