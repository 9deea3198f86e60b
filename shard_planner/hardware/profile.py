"""HardwareProfile: what the cost model needs to know about a device and its interconnect.

Profiles are TOML files (profiles/NAME.toml, read with the standard library's tomllib); every number
in them cites its source in a comment. ``load_profile`` takes a name from profiles/ or a path.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from shard_planner.errors import ProfileError
from shard_planner.plan.paths import is_profile_path
from shard_planner.hardware.timings import ModuleTimings, load_timings
from shard_planner.units import DTYPE_NAMES, format_bytes

PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"  # the repository's profiles/
DEFAULT_PROFILE = "h100-80gb"


@dataclass(frozen=True)
class Interconnect:
    """Ring collectives: time = latency_s * (p - 1) + (p - 1) / p * bytes / busbw(bytes) (nccl-tests' busbw),
    busbw(bytes) = busbw_bytes_per_s * bytes / (bytes + busbw_half_bytes) per link (cost/collectives.py)."""

    gpus_per_node: int
    intra_node_latency_s: float
    intra_node_busbw_bytes_per_s: float  # the plateau: large messages
    inter_node_latency_s: float
    inter_node_busbw_bytes_per_s: float  # the plateau, per rank as nccl-tests define busbw
    # Half-bandwidth message size n_1/2 of each link (Hockney): the message size at which the bandwidth
    # term runs at half the plateau (small messages are protocol-bound: NCCL's LL/LL128 before Simple).
    # 0: busbw is the plateau at every size (profiles written before the curve was modelled, cpu-gloo).
    intra_node_busbw_half_bytes: float = 0.0
    inter_node_busbw_half_bytes: float = 0.0

    def __post_init__(self):
        for name in ("intra_node_busbw_half_bytes", "inter_node_busbw_half_bytes"):
            if not getattr(self, name) >= 0:
                raise ProfileError(f"[interconnect] {name} must be >= 0, got {getattr(self, name)!r}")


COMPUTE_MODELS = ("flops", "roofline")


# [Note: --mem at a device's nominal size]
# What a GPU reports (nvidia-smi, profiles/*.toml memory_bytes) is below the size its datasheet names: 81559 of
# 81920 MiB on an H100 SXM 80GB (0.4% below), 40536 of 40960 MiB on an A100 SXM 40GB (1.0%), 143771 MiB on an
# H200 "141 GB" (0.4%), 23034 of 24576 MiB on an L4 24GB, 23028 MiB on an A10G 24GB and 46068 of 49152 MiB on an
# L40S 48GB (6.3% each). `--mem 80GB` on h100-80gb therefore means the device, not a budget above it: a --mem
# whose device reports at most NOMINAL_SIZE_SLACK less (--mem <= memory_bytes / (1 - slack)) is taken as the
# device without a warning; it is capped at memory_bytes as any --mem above it is (tensor_budget_bytes).
NOMINAL_SIZE_SLACK = 0.07


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device: str  # "cuda" or "cpu"
    memory_bytes: int  # per device
    # of --mem (at most memory_bytes): CPU, what the planner may fill by the allocated peak, the rest kept free for
    # the OS and the ranks' processes; GPU, the margin of the caching-allocator simulation, which must survive
    # usable_fraction x (--mem less the memory outside the allocator) (cost/fits.py [Note: The margin on a GPU])
    usable_fraction: float
    reserved_bytes: int  # fixed per process: CUDA context, NCCL, allocator reserve
    per_process_group_bytes: int  # each extra process group (int reshard) costs this (pytorch#153302)
    peak_flops_per_s: dict[str, float]  # by compute dtype name ("bfloat16", "float32")
    compute_efficiency: float  # achievable fraction of peak for training matmuls
    memory_bandwidth_bytes_per_s: float  # HBM (optimizer step, elementwise)
    host_to_device_bytes_per_s: float  # PCIe, for CPU offload
    interconnect: Interconnect
    # Extra bytes a backend allocates inside one collective, as a fraction of the collective's input
    # (reduce-scatter) or output (all-gather). NCCL: 0. gloo on CPU copies the flat reduce-scatter input
    # (measured with the storage tracker: one input-size storage more during reduce_scatter_single).
    reduce_scatter_temp_fraction: float = 0.0
    all_gather_temp_fraction: float = 0.0
    # Host memory bandwidth, for the optimizer step under CPU offload (None: memory_bandwidth_bytes_per_s).
    host_memory_bandwidth_bytes_per_s: float | None = None
    # Framework overheads (shard_planner/cost/time.py; 0 in profiles written before they were modelled):
    # per aten op of forward/backward (CPU: Python + dispatcher + autograd; GPU: kernel launch), per FSDP
    # unit per training step (pre/post-forward and -backward hooks, all-gather copy-in/copy-out,
    # reduce-scatter copies), and per parameter tensor of the optimizer step.
    per_op_overhead_s: float = 0.0
    per_unit_overhead_s: float = 0.0
    per_param_tensor_optimizer_overhead_s: float = 0.0
    # the same for a plain (not DTensor) parameter tensor: the single-device step (cost/engines/single.py).
    # On CPU, where AdamW runs one tensor at a time, every op of a DTensor's step goes through DTensor's
    # sharding propagation and costs several times a plain tensor's; None: as a sharded tensor's
    plain_tensor_optimizer_overhead_s: float | None = None
    source: str = ""  # where the numbers come from (file path)
    notes: dict[str, str] = field(default_factory=dict)
    # Per-module compute times measured on this device (`shard-planner calibrate --model`); blocks they
    # cover are priced from them instead of FLOPs and per-op overhead (shard_planner/cost/time.py).
    module_timings: ModuleTimings | None = None
    # The profile's [kernels] table: per-device constants of the roofline kernel model, each with its
    # source (shard_planner/cost/kernels.py, KernelConstants). None: compute priced as traced FLOPs x
    # compute_efficiency (CPU profiles, profiles written before the kernel model).
    kernels: dict | None = None
    # How unmeasured compute is priced: "flops" (traced FLOPs x compute_efficiency) or "roofline" (the
    # trace's kernel records priced by the [kernels] table, cost/kernels.py). The A100 profiles say
    # "roofline": on the published A100 runs it is closer than flops in the median (4.3% |error| against
    # 10.6%), the 90th percentile (10.1% against 20.8%) and every size bucket, though biased +3.7% too fast
    # (flops -0.5%); on torchtitan's FSDP2 runs on 64 A100s 1.7% (reports/benchmarks/torchtitan.md). The
    # other GPU profiles say "flops": torchtitan's only H100 figures ran on 500 W HBM2e parts, where the
    # H100 roofline is 11-20% fast, and no public sustained-clock figure for the 700 W H100 is known.
    # `calibrate` writes a measured [kernels] table with compute_model = "roofline"
    # (profiles/cpu-gloo-roofline.toml).
    compute_model: str = "flops"
    # How much slower compute runs while a collective runs beside it on the communication stream (0.189:
    # 18.9% slower); shard_planner/cost/overlap.py [Note: Compute slowdown under overlapped collectives].
    # 0 (CPU profiles, profiles written before the term): overlapped compute runs as fast as alone.
    overlap_compute_slowdown: float = 0.0
    # Relative standard deviation of the sustained compute speed of GPUs of this SKU (persistent per-GPU
    # differences); a job runs at the pace of its slowest GPU: shard_planner/cost/stragglers.py [Note:
    # Stragglers: the slowest of N GPUs]. 0 (CPU profiles, profiles without the key): no slowdown.
    gpu_speed_spread: float = 0.0
    # Whether FSDP2's copy-out after each all-gather and copy-in before each reduce-scatter are priced on
    # the compute stream (shard_planner/cost/fsdp_copies.py [Note: FSDP2's copies on the compute stream]);
    # False prices FSDP1's flat parameters, which have neither (benchmarks/bench_published.py mirrors
    # FSDP1 runs). Not read from profile files: what shard-planner runs is FSDP2.
    fsdp_copies: bool = True
    # Whether a checkpointed recomputation stops after the last tensor its forward saved (non-reentrant
    # torch.utils.checkpoint from torch 2.1 on, what shard-planner runs: trace/capture.py [Note: Early stop
    # of the recomputation]); False reruns the whole forward (reentrant checkpointing, or torch < 2.1:
    # benchmarks/bench_published.py mirrors such runs). Not read from profile files.
    checkpoint_early_stop: bool = True
    # CPU profiles: the cores the ranks of one host share, and how many ranks ran at once when the
    # collectives and the per-unit and optimizer overheads were measured (``calibrate --world-size``).
    # A plan whose ranks outnumber the cores runs every rank slower by the share of a core each gets
    # (shard_planner/cost/host_share.py [Note: CPU ranks sharing cores]). 0: unknown, no sharing (GPU
    # profiles: each rank has its device).
    host_cores: int = 0
    measured_ranks: int = 0
    # GPU profiles: the driver calls of the CUDA caching allocator's retries, each in seconds: a cudaMalloc or
    # cudaFree of one segment, a page of an expandable segment mapped (cuMemCreate + cuMemMap) or unmapped
    # (cuMemUnmap + cuMemRelease); the device synchronisation is priced apart. shard_planner/cost/retries.py
    # [Note: How retries are priced]. 0 (CPU profiles: no caching allocator): free.
    cuda_malloc_s: float = 0.0
    cuda_free_s: float = 0.0
    page_map_s: float = 0.0
    page_unmap_s: float = 0.0

    def __post_init__(self):
        for key in ("overlap_compute_slowdown", "gpu_speed_spread", "cuda_malloc_s", "cuda_free_s", "page_map_s",
                    "page_unmap_s"):
            value = getattr(self, key)
            if not (value >= 0.0 and math.isfinite(value)):
                raise ProfileError(f"profile {self.name}: {key} must be a finite number >= 0, got {value!r}")
        for key in ("host_cores", "measured_ranks"):
            value = getattr(self, key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ProfileError(f"profile {self.name}: {key} must be a whole number >= 0, got {value!r}")
        plain = self.plain_tensor_optimizer_overhead_s
        if plain is not None and not (plain >= 0.0 and math.isfinite(plain)):
            raise ProfileError(f"profile {self.name}: plain_tensor_optimizer_overhead_s must be a finite number >= 0, "
                               f"got {plain!r}")
        if self.compute_model not in COMPUTE_MODELS:
            raise ProfileError(f"profile {self.name}: compute_model must be one of {', '.join(COMPUTE_MODELS)}, "
                               f"got {self.compute_model!r}")
        if self.compute_model == "roofline" and not self.kernels:
            raise ProfileError(f"profile {self.name}: compute_model = \"roofline\" needs a [kernels] table "
                               "(see profiles/h100-80gb.toml)")

    @property
    def plain_tensor_optimizer_s(self) -> float:
        """The optimizer's overhead per plain (not DTensor) parameter tensor: ``plain_tensor_optimizer_overhead_s``,
        else the sharded tensor's."""
        plain = self.plain_tensor_optimizer_overhead_s
        return self.per_param_tensor_optimizer_overhead_s if plain is None else plain

    def with_timings(self, timings: ModuleTimings | None) -> "HardwareProfile":
        """A copy of this profile that prices compute from ``timings`` (None: from FLOPs again)."""
        if timings is not None and timings.device != self.device:
            raise ProfileError(f"module timings were measured on {timings.device} ({timings.device_name}), "
                               f"profile {self.name} is for {self.device}; use a {timings.device} profile")
        return replace(self, module_timings=timings)

    @property
    def usable_bytes(self) -> int:
        """What the planner may fill of the whole device: ``tensor_budget_bytes(memory_bytes)``."""
        return self.tensor_budget_bytes(self.memory_bytes)

    def tensor_budget_bytes(self, mem_budget_bytes: int) -> int:
        """The allocated peak the planner may fill under a per-device budget of ``mem_budget_bytes``
        (``--mem``): the budget (at most the device's memory) x ``usable_fraction``, the profile's overhead
        (CUDA context, NCCL: ``reserved_bytes``) counted inside the peak. On a CPU profile that is what fits.
        On a GPU profile it is the search's filter, about the most a plan can allocate and still fit: what
        fits is decided by the caching-allocator simulation (cost/fits.py, solve/survive.py)."""
        return int(min(mem_budget_bytes, self.memory_bytes) * self.usable_fraction)

    @property
    def rank_word(self) -> str:
        """What one rank is called in what people read (:func:`rank_word`)."""
        return rank_word(self.device)

    def is_nominal_size(self, mem_budget_bytes: int) -> bool:
        """Whether ``mem_budget_bytes`` (--mem) above the device's memory is the size its datasheet names, which
        means the whole device (see [Note: --mem at a device's nominal size])."""
        return self.memory_bytes < mem_budget_bytes <= self.memory_bytes / (1 - NOMINAL_SIZE_SLACK)

    def mem_for_tensor_budget(self, tensor_bytes: int) -> int:
        """The smallest ``--mem`` whose ``tensor_budget_bytes`` holds ``tensor_bytes``: tensor_bytes /
        usable_fraction, rounded up (beyond the device's memory when no budget on this device holds it)."""
        need = math.ceil(tensor_bytes / self.usable_fraction)
        while self.tensor_budget_bytes(need) < tensor_bytes and need <= self.memory_bytes:
            need += 1  # int() of the product can land one byte short
        return need

    def usable_reason(self, mem_budget_bytes: int) -> str:
        """How ``tensor_budget_bytes(mem_budget_bytes)`` follows from --mem, in words (:func:`usable_reason`)."""
        return usable_reason(mem_budget_bytes, self.memory_bytes, self.usable_fraction, self.device)

    def check_compute_dtype(self, dtype: str) -> None:
        """One ProfileError line when this profile gives no rate for compute dtype ``dtype``.

        [Note: A compute dtype the device lacks] A profile lists a peak rate for each dtype its device's
        GEMMs run in, and none for one it lacks: a V100 (Volta) has FP16 tensor cores and no bfloat16 ones,
        where PyTorch's bfloat16 matmuls run emulated, far below the fp16 rate (profiles/v100-32gb.toml).
        A plan in such a dtype is refused before anything is traced, naming the dtypes the profile has, rather
        than priced at another dtype's rate or switched silently to fp16 (whose training needs a loss scaler
        that a bfloat16 plan does not)."""
        if dtype in self.peak_flops_per_s:
            return
        typed = {v: k for k, v in DTYPE_NAMES.items() if len(k) == 4}  # "float16" -> "fp16", as --dtype takes it
        usable = [typed[d] for d in self.peak_flops_per_s if d in typed]
        instead = f"plan with --dtype {' or '.join(usable)}" if usable else "add a rate it has"
        raise ProfileError(f"profile {self.name} gives no {dtype} compute rate (its [peak_flops_per_s] has "
                           f"{', '.join(self.peak_flops_per_s)}): {instead}, or, if the device has {dtype} "
                           f"arithmetic, add its rate to {self.source or 'the profile'}")

    def flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s in ``dtype``: peak x efficiency."""
        self.check_compute_dtype(dtype)  # See [Note: A compute dtype the device lacks]
        return self.peak_flops_per_s[dtype] * self.compute_efficiency


def rank_word(device: str) -> str:
    """What one rank on ``device`` is called in what people read: ``"GPU"``, or ``"CPU rank"`` on the CPU."""
    return "CPU rank" if device == "cpu" else "GPU"


def ranks_text(device: str, count: int) -> str:
    """``count`` ranks on ``device`` in words: "8 GPUs", "1 CPU rank", "2 CPU ranks"."""
    return f"{count} {rank_word(device)}{'' if count == 1 else 's'}"


def usable_reason(mem_budget_bytes: int, memory_bytes: int | None, usable_fraction: float, device: str, *,
                  name_mem: bool = True) -> str:
    """'--mem 40.00 GiB less the 5.3% margin of the allocator simulation' (a GPU profile), '--mem 2.00 GiB less
    20% kept free for the OS and the ranks' processes' (a CPU one), or 'the device's 79.65 GiB less ...' when
    --mem is above the device's memory, which caps it (``tensor_budget_bytes``). ``name_mem`` False: '--mem
    less ...' (for text that states --mem beside it)."""
    if memory_bytes is not None and mem_budget_bytes > memory_bytes:
        of = f"the device's {format_bytes(memory_bytes)}"
    else:
        of = f"--mem {format_bytes(mem_budget_bytes)}" if name_mem else "--mem"
    percent = f"{(1 - usable_fraction) * 100:.3g}%"
    if device == "cuda":
        return f"{of} less the {percent} margin of the allocator simulation"
    return f"{of} less {percent} kept free for the OS and the ranks' processes"


def load_profile(name_or_path: str) -> HardwareProfile:
    """A profile by name (profiles/NAME.toml) or by path to a TOML file."""
    path = Path(name_or_path) if is_profile_path(name_or_path) else PROFILES_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))) or "none"
        raise ProfileError(f"no profile {name_or_path!r}: give a path to a TOML file or one of: {known}")
    try:
        d = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML ({exc})") from None
    try:
        ic = d.pop("interconnect")
        return HardwareProfile(interconnect=Interconnect(**ic), source=str(path), **d)
    except (KeyError, TypeError) as exc:
        raise ProfileError(f"{path}: malformed profile ({exc}); see profiles/h100-80gb.toml for the fields") from None


def load_priced_profile(profile: str, timings: str | None = None) -> HardwareProfile:
    """The hardware profile ``profile`` (a name in profiles/ or a TOML path) that prices compute from the
    module times in the file ``timings`` (None: from FLOPs). A plan records both (``cluster.profile``,
    ``cluster.timings``), so ``estimate``, ``run`` and ``report`` price it as ``plan`` did."""
    hw = load_profile(profile)
    return hw if timings is None else hw.with_timings(load_timings(timings))
