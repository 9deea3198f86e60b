"""The GPU step-time model against 164 published training runs (MosaicML llm-foundry, A100 40/80 GB).

    python benchmarks/bench_published.py [--csv PATH] [--out NAME] [--trace-cache DIR] [--worst 12] [--rows N]
    python benchmarks/bench_published.py --csv benchmarks/data/llm_foundry_2023_h100_a100.csv --out published_2023

The second: llm-foundry's later tables, never used to build the model (benchmarks/data/README.md): 70 H100
80GB runs and 59 A100 80GB runs re-measured with the same newer software, the same schema.

For every row of ../shared/data/published_fsdp_runs.csv: examples/shape.py at that row's shape and
sequence length (traced once per (shape, sequence length), at micro-batches 1 and 2; every traced
quantity is affine in the micro-batch, so the row's micro-batch costs nothing more), a plan that mirrors
the run, and the cost model's tokens/s/GPU beside the published figure. Writes
reports/benchmarks/published.csv (one line per row) and published.md (the summary: median |error|, 90th
percentile, median signed error, Spearman's rank correlation, by model size, sequence length and
activation checkpointing, and the worst rows with their breakdown). Error = predicted / published - 1:
positive means the model predicts the run faster than it was.

The plan that mirrors a row ([Note: mirroring an llm-foundry run]):
- one FSDP unit per block, resharded after forward (FULL_SHARD); the root (embeddings, final norm,
  tied head) its own unit, not resharded after forward: FSDP1 keeps the root's parameters for backward
  (torch/distributed/fsdp/_runtime_utils.py, ``_post_forward_reshard``: ``free_unsharded_flat_param =
  not state._is_root and ...``);
- activation checkpointing of every block when the row says ``full``, recomputing the whole forward: the
  runs' torch (1.13.1 and 2.0.1, the CSV's notes) predates the early stop of non-reentrant checkpointing
  (pytorch/pytorch #96866, March 2023, in 2.1), and Composer checkpoints reentrantly by default
  (llm-foundry's train.py reads ``fsdp_config.get('activation_checkpointing_reentrant', True)``), which
  never stops early (trace/capture.py [Note: Early stop of the recomputation]);
- the row's micro-batch, on the row's GPU count, 8 per node, the a100-80gb or a100-40gb profile;
- param dtype bf16 and reduce dtype bf16: the rows say Composer ``mixed_precision=PURE``, which sets
  param, reduce and buffer dtype all to the autocast precision (composer/trainer/mosaic_fsdp.py,
  ``get_mixed_precision``: ``elif mixed_precision == 'PURE': ... reduce_dtype =
  get_torch_dtype(precision)``);
- prefetch: FSDP2's defaults (none explicit forward, one unit backward), as Composer's FSDP1 defaults
  (``backward_prefetch`` BACKWARD_POST, ``forward_prefetch`` False: composer/trainer/dist_strategy.py).

Gradient accumulation (the ``grad_accum`` column; global batch = micro-batch x GPUs x grad_accum):
Composer skips gradient synchronisation only for DistributedDataParallel models
(composer/trainer/dist_strategy.py, ``ddp_sync_context``: ``if not isinstance(state.model,
DistributedDataParallel): yield; return``), so under FSDP every micro-batch all-gathers and
reduce-scatters as a full step does; only the optimizer step runs once per global batch. Time of one
global batch per GPU = grad_accum x (step - optimizer) + optimizer, and tokens/s/GPU = micro-batch x
seq_len x grad_accum / that time.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import OUT_DIR, print_table, write_csv  # noqa: E402
from published_classes import by_gpu, class_shares  # noqa: E402

from shard_planner.cost import simulate_time  # noqa: E402
from shard_planner.fileio import write_atomic  # noqa: E402
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit  # noqa: E402
from shard_planner.hardware.profile import HardwareProfile, load_profile  # noqa: E402
from shard_planner.trace import ModelTrace, trace_model  # noqa: E402

logger = logging.getLogger(__name__)

# ../shared beside the checkout (the project's layout); also one level up, for a git worktree in a subfolder
_SHARED_CSVS = [base / "shared" / "data" / "published_fsdp_runs.csv" for base in (ROOT.parent, ROOT.parent.parent)]
DEFAULT_CSV = next((p for p in _SHARED_CSVS if p.is_file()), _SHARED_CSVS[0])
SHAPE_FILE = ROOT / "examples" / "shape.py"
PROFILE_OF_GPU = {"A100-80GB": "a100-80gb", "A100-40GB": "a100-40gb", "H100-80GB": "h100-80gb"}
GPUS_PER_NODE = 8  # the CSV's README: 8 A100s per node
# Composer mixed_precision=PURE (module docstring); the later tables' DEFAULT reduces in the precision too
# ([Note: Composer's DEFAULT mixed precision]).
REDUCE_DTYPE = "bfloat16"
# Model-size buckets (parameters, billions): the issue's <0.5B / 2-40B split, finer in between.
SIZE_BUCKETS = ((0.5, "<0.5B"), (2.0, "0.5-2B"), (10.0, "2-10B"), (40.0, "10-40B"), (float("inf"), ">40B"))


@dataclass(frozen=True)
class Run:
    """One published row: the shape, the run's settings and its published throughput."""

    index: int
    model: str
    gpu: str
    n_gpus: int
    shape: dict  # examples/shape.py's SHARD_PLANNER_SHAPE keys
    micro_batch: int
    grad_accum: int
    checkpoint: bool
    published_tokens_per_s_per_gpu: float
    reshard: bool = True  # FULL_SHARD; SHARD_GRAD_OP keeps the blocks' parameters from forward to backward

    @property
    def seq_len(self) -> int:
        return self.shape["seq_len"]


def load_runs(path: Path) -> list[Run]:
    """The CSV's rows as :class:`Run` (MPT shapes: gelu MLP, LayerNorm, learned positions, biases)."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    runs = []
    for i, r in enumerate(rows):
        ffn = "gelu" if r["ffn_type"].startswith("gelu") else "swiglu"
        shape = dict(n_layers=int(r["n_layers"]), d_model=int(r["d_model"]), d_ffn=int(r["d_ffn"]),
                     n_heads=int(r["n_heads"]), n_kv_heads=int(r["n_kv_heads"]), vocab=int(r["vocab"]),
                     seq_len=int(r["seq_len"]), tied_embeddings=r["tied_embeddings"] == "yes", ffn_type=ffn,
                     norm="layernorm", pos="learned", bias=True)
        runs.append(Run(i, r["model"], r["gpu"], int(r["n_gpus"]), shape, int(r["micro_batch"]),
                        int(r["grad_accum"] or 1), r["activation_checkpoint"] == "full",
                        float(r["tokens_per_s_per_gpu"]), reshard=r["sharding"] != "SHARD_GRAD_OP"))
    return runs


def _code_key() -> str:
    """Changes when the tracer, the shape model file or torch change: a cached trace is then stale."""
    h = hashlib.sha256(torch.__version__.encode())
    for p in sorted((ROOT / "shard_planner" / "trace").rglob("*.py")) + [SHAPE_FILE]:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def trace_for(shape: dict, cache_dir: Path | None) -> tuple[ModelTrace, bool]:
    """The trace of examples/shape.py at ``shape`` (bf16), from the disk cache or the tracer; True when
    it was traced now."""
    text = json.dumps(shape, sort_keys=True)
    path = None
    if cache_dir is not None:
        path = cache_dir / f"{hashlib.sha256((text + _code_key()).encode()).hexdigest()[:24]}.json"
        if path.is_file():
            return ModelTrace.from_json(path.read_text()), False
    os.environ["SHARD_PLANNER_SHAPE"] = text
    trace = trace_model(str(SHAPE_FILE), dtype="bfloat16")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, trace.to_json())
    return trace, True


def plan_for(run: Run, trace: ModelTrace, profile_name: str, memory_bytes: int) -> Plan:
    """The plan that mirrors ``run`` (module docstring, [Note: mirroring an llm-foundry run])."""
    blocks = [f"blocks.{i}" for i in range(run.shape["n_layers"])]
    units = (Unit(("",), False),) + tuple(Unit((b,), run.reshard, run.checkpoint) for b in blocks)
    training = Training(run.micro_batch, "adamw", "bfloat16", REDUCE_DTYPE)
    return Plan(ModelRef(str(SHAPE_FILE), trace.fingerprint),
                Cluster(run.n_gpus, GPUS_PER_NODE, profile_name, memory_bytes), Mesh(run.n_gpus),
                training, units, Prefetch(0, 1))


# [Note: the attention kernel of the published runs] The rows ran llm-foundry's default attn_impl
# "triton" (the CSV's notes), i.e. flash_attn's Triton FlashAttention (flash_attn/flash_attn_triton.py,
# after Tillet's Triton tutorial), not the FlashAttention-2 CUDA kernel the profiles' [kernels] tables
# describe (what PyTorch SDPA runs today). Measured speed of that kernel family on A100, causal, head
# dim 64, 16k tokens, triton-lang/triton PR #1917 ("Before" table, 2023-07-09; causal FLOPs halved as
# the Triton tutorial counts them): forward 122 TFLOP/s, backward 81 TFLOP/s, i.e. 0.39 and 0.26 of 312.
# The kernel model quotes attention at head dim 128 (cost/kernels.py: 1/eff(d) = 1/eff(128) +
# r (1/d - 1/128), r = 32 on A100, /2.5 backward), so eff(128) = 1 / (1/0.39 - 32/128) = 0.432 forward,
# 1 / (1/0.26 - 12.8/128) = 0.267 backward. Only the attention efficiencies change; every device
# constant stays the profile's. No measurement of that kernel on an H100 was found: the H100 rows keep the
# h100-80gb profile's FlashAttention-2 figures (35% forward, FlashAttention-3 paper), so their attention is
# priced as FlashAttention-2's, a kernel at least as fast as Triton's on A100 (FlashAttention-2 paper, Fig. 4).
TRITON_FLASH_ATTENTION = {"attention_fwd_efficiency": 0.432, "attention_bwd_efficiency": 0.267}
ATTENTION_OF_PROFILE = {"a100-80gb": TRITON_FLASH_ATTENTION, "a100-40gb": TRITON_FLASH_ATTENTION}

# [Note: Composer's DEFAULT mixed precision] The later tables (benchmarks/data) say amp_bf16 with FSDP
# mixed_precision DEFAULT. Composer of that time (torch 2.0.1, the runs' image; composer/trainer/
# mosaic_fsdp_utils.py, get_mixed_precision) sets param_dtype and buffer_dtype to the precision for DEFAULT
# and leaves reduce_dtype None, and FSDP1 then reduces in param_dtype (torch/distributed/fsdp/api.py,
# MixedPrecision.reduce_dtype: None with param_dtype set takes param_dtype). So DEFAULT prices as PURE:
# bf16 all-gathers and reduce-scatters, bf16 compute.


def stack_profile(name: str, compute_model: str) -> HardwareProfile:
    """The GPU's profile pricing compute by ``compute_model`` ("roofline": the kernel model, with the
    attention kernel the published runs used, [Note: the attention kernel of the published runs];
    "flops": the shipped profile as it is), without FSDP2's copies: the runs used FSDP1, whose flat
    parameters all-gather and reduce-scatter in place (shard_planner/cost/fsdp_copies.py); checkpointed
    blocks recompute their whole forward (module docstring)."""
    # FSDP1: flat parameters, no copies; torch < 2.1 or reentrant checkpointing: no early stop (docstring)
    profile = replace(load_profile(name), fsdp_copies=False, checkpoint_early_stop=False)
    if compute_model == "flops" or not profile.kernels:
        return replace(profile, compute_model="flops")
    return replace(profile, compute_model="roofline", kernels={**profile.kernels, **ATTENTION_OF_PROFILE.get(name, {})})


def predict(run: Run, trace: ModelTrace, profiles: dict, compute_model: str) -> dict:
    """Predicted tokens/s/GPU of ``run`` and its breakdown per global batch (module docstring)."""
    name = PROFILE_OF_GPU[run.gpu]
    profile = profiles.get(name) or profiles.setdefault(name, stack_profile(name, compute_model))
    est = simulate_time(trace, plan_for(run, trace, name, profile.memory_bytes), profile)
    accum = run.grad_accum
    per_micro_s = est.step_time_s - est.optimizer_s
    batch_s = accum * per_micro_s + est.optimizer_s
    predicted = run.micro_batch * run.seq_len * accum / batch_s
    n_params = trace.param_count
    return dict(
        row=run.index, model=run.model, params_b=round(n_params / 1e9, 3), gpu=run.gpu, n_gpus=run.n_gpus,
        seq_len=run.seq_len, micro_batch=run.micro_batch, grad_accum=accum,
        ac="full" if run.checkpoint else "none", size_bucket=size_bucket(n_params),
        published=run.published_tokens_per_s_per_gpu, predicted=round(predicted, 1),
        error_pct=round((predicted / run.published_tokens_per_s_per_gpu - 1) * 100, 2),
        batch_s=batch_s, compute_s=accum * est.compute_s, exposed_comm_s=accum * est.exposed_comm_s,
        comm_s=accum * est.comm_s, optimizer_s=est.optimizer_s, mfu_pred=round(est.mfu * 100, 2),
        **(class_shares(trace, run.micro_batch, profile, "blocks." if run.checkpoint else None)
           if compute_model == "roofline" else {}),
    )


def size_bucket(n_params: int) -> str:
    return next(label for limit, label in SIZE_BUCKETS if n_params / 1e9 < limit)


def _rank(values: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their mean rank (for Spearman's rho)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's r of the ranks."""
    rx, ry = _rank(x), _rank(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between order statistics (numpy's default)."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(rows: list[dict], label: str) -> dict:
    """Median |error|, 90th percentile |error|, median signed error, Spearman, for ``rows``."""
    errs = [r["error_pct"] for r in rows]
    absolute = [abs(e) for e in errs]
    return dict(group=label, rows=len(rows), median_abs_pct=round(statistics.median(absolute), 2),
                p90_abs_pct=round(percentile(absolute, 90), 2), median_signed_pct=round(statistics.median(errs), 2),
                max_abs_pct=round(max(absolute), 2),
                spearman=round(spearman([r["predicted"] for r in rows], [r["published"] for r in rows]), 4)
                if len(rows) > 2 else float("nan"))


def grouped(rows: list[dict], key: str, order=None) -> list[dict]:
    groups: dict = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    keys = order or sorted(groups)
    return [summary(groups[k], f"{key}={k}") for k in keys if k in groups]


TARGETS = "median |err| <= 8%, p90 <= 20%, |median signed| <= 3%, Spearman >= 0.98, no size bucket biased > 10%"


def write_markdown(rows: list[dict], tables: dict, meta: dict, name: str) -> Path:
    """reports/benchmarks/<name>.md: how it was run, the summary tables, the worst rows."""
    import io

    buf = io.StringIO()
    gpus = " / ".join(sorted({r["gpu"] for r in rows}))
    buf.write(f"# Step-time model ({meta['compute_model']} compute) vs {len(rows)} published llm-foundry runs "
              f"({gpus})\n\n")
    buf.write(f"Command: `{meta['command']}`; {meta['rows']} rows, {meta['traces']} traces "
              f"({meta['traced']} traced now), {meta['seconds']:.0f} s at load {meta['load']}.\n")
    buf.write(f"Error = predicted / published tokens/s/GPU - 1 (positive: predicted too fast). Targets (issue 12): "
              f"{TARGETS}.\n")
    for title, table in tables.items():
        print_table(table, title=title, stream=buf)
    buf.write("\n" + NOTES)
    return write_atomic_text(buf.getvalue(), f"{name}.md")


NOTES = """## How the rows are priced

(The later tables, `--csv benchmarks/data/llm_foundry_2023_h100_a100.csv`: as below, except that the H100
rows are priced with the h100-80gb profile and its FlashAttention-2 attention figures (no H100 measurement
of the runs' Triton kernel was found), six large-scale rows are SHARD_GRAD_OP (blocks not resharded after
forward), and Composer's DEFAULT mixed precision reduces in bf16 as PURE does: [Note: Composer's DEFAULT
mixed precision] in benchmarks/bench_published.py; benchmarks/data/README.md.)

- Compute (`--compute-model roofline`, published.md): the roofline kernel model (shard_planner/cost/kernels.py) over the trace's kernel records,
  with the a100-80gb / a100-40gb profiles' [kernels] tables (datasheet, CUTLASS tiles, maximum achievable
  matmul FLOPS, FlashAttention-2 paper), except attention: these runs used llm-foundry's Triton
  FlashAttention (the CSV's notes: attn_impl triton), priced at its measured A100 speed (triton-lang/triton
  PR #1917) instead of FlashAttention-2's ([Note: the attention kernel of the published runs] in
  benchmarks/bench_published.py).
- Inter-node collectives: the A100 profiles' busbw per rank is the node's aggregate NIC bandwidth (8 x 200
  Gb/s, one NCCL ring per NIC) x 0.9 = 180 GB/s. The runs' fabric is 1600 Gbps RoCE per node (the CSV), the
  same aggregate: on Oracle's BM.GPU4.8 (8 A100, 16 x 100 Gb/s RoCE ports) NCCL reaches "above 185 GB per
  second" per node (blogs.oracle.com/cloud-infrastructure, "Scaling with OCI cluster networking"), so the
  plateau stands; the per-unit messages here (14 MB at 125M to 1.6 GB at 70B per all-gather) are priced
  latency-bound where small (127 ring steps x 2.5 us at 128 GPUs).
- Collectives by message size (shard_planner/cost/collectives.py): intra-node NVLink busbw(n) = plateau x n /
  (n + n_1/2), n_1/2 = 2.4 MB and 1.3 us per ring step on the A100 profiles (an nccl-tests curve, cited
  there); inter-node the ring with 2.5 us per step (NVIDIA/nccl-tests #119's curve). Without the slowdown below, exposed communication is at most 0.4% of a row's time here
  (median 0.13%; column exposed_comm_s); against the alpha-beta ring of before (6 us / 12 us per step, one
  busbw) rows move by at most 2 points (median 0.01): the lower latencies expose less.
- Baseline (`--compute-model flops`, published_flops.md, what the shipped profiles use): traced FLOPs at
  one efficiency per profile (compute_efficiency), the same collectives and schedule.
- GEMMs at the sustained clock (cost/kernels.py [Note: sustained clock]): the A100 profiles'
  maximum-achievable-matmul rate (a burst at the 1410 MHz boost clock) x 1305/1410, the clock an A100
  holds at its 400 W limit under dense matrix work (NVIDIA's A100 HPL Rpeak clock). This alone took the
  roofline from 11.7% median |error| (+11.7% signed) to 6.1% (+6.1%); attention and memory-bound kernels
  are not scaled.
- Compute beside collectives (shard_planner/cost/overlap.py, [Note: Compute slowdown under overlapped
  collectives]): while the communication stream is busy the compute stream runs 1 / (1 + 0.189) as fast, the
  A100 profiles' overlap_compute_slowdown: NCCL's kernels hold SMs and HBM bandwidth, and compute beside them
  ran 18.9% slower on average (at most 40%) in GPT and LLaMA training on A100, H100, MI250 and MI210 (Lee et
  al., arXiv 2507.03114, 2025). A collective hidden for h seconds then costs h x 0.159. Against the same model
  without it (0 slowdown): median signed error +6.09% -> +5.63%, >40B bucket +15.05% -> +12.07%, by GPU count
  8: +4.1 -> +3.9, 16: +6.5 -> +6.3, 32: +10.8 -> +10.2, 64: +11.0 -> +10.1, 128: +11.2 -> +10.3; exposed_comm_s
  now holds that added time (at most 3.7% of a row's time, median 0.43%).
- The slowest GPU sets the pace (shard_planner/cost/stragglers.py, [Note: Stragglers: the slowest of N
  GPUs]): FSDP synchronises every rank at every collective, so a job runs at its slowest GPU's sustained
  speed; with per-GPU speeds spread normally with relative standard deviation sigma (the A100 profiles'
  gpu_speed_spread = 0.0176: the maximum achievable matmul FLOPS of one 8-GPU NVIDIA node's GPUs differ by
  "5% and higher" (stas00/ml-engineering, "Not all accelerators are created equal"), read as the expected
  range of 8 normal samples; the profiles' comment derives it and the cluster-wide readings of Sinha et al.,
  SC'22, 1.0-1.5%), compute takes 1 / (1 - sigma E[max of N normals]): +2.6% on 8 GPUs, +3.8% on 32, +4.8% on
  128. Against sigma = 0.01 (the lowest cluster-wide reading, used until 2026-12-04): median |error| 4.31% ->
  4.05%, p90 10.11 -> 8.63, median signed +3.74 -> +2.46, >40B bucket +9.53 -> +7.6, by GPU count 8: +2.47 ->
  +1.35, 16: +4.44 -> +3.02, 32: +7.94 -> +6.23, 64: +7.51 -> +5.58, 128: +7.47 -> +5.32; against no
  straggler term: 5.69%, 12.35, +5.63. The seq-2048 rows on 16 / 32 / 64 / 128 GPUs are +1.6 / +2.2 / +2.1 /
  +1.5 points (median) above the same model's 8-GPU row (without the term +2.4 / +3.5 / +3.9 / +4.6): the
  growth with N is gone, a step at leaving the node remains. Flops compute: median |error| 10.59 -> 10.63,
  p90 20.75 -> 20.1, signed -0.54 -> -1.73. On the sets this model was not built on: llm-foundry's later
  A100-80GB rows 4.15% -> 4.4% median, signed +0.37 -> -0.73 (published_2023.md); torchtitan's A100 rows
  (FSDP2, 64 GPUs) 4.18% -> 2.46%, signed +4.18 -> +2.39 (`python benchmarks/bench_torchtitan.py`).
- What is left: the error still grows with the share of communication. Binned by comm_s / compute_s
  (published.csv): -2.2% below 0.01 (46 rows), +1.7% at 0.01-0.02, +3.0% at 0.02-0.03, +6.1% at 0.03-0.05,
  +7.0% at 0.05-0.08, +8.3% at 0.08-0.12 (before the straggler term: -0.3, +4.6, +5.7, +9.0, +10.3, +12.3;
  before the overlap slowdown too: -0.2, +4.8, +6.1, +9.6, +11.2, +14.3). Part of that is the sequence
  length, not communication: the share falls as the sequence grows, and so does the error at one model and
  GPU count (MPT-125m on 8 A100-80GB: +6.1% at 512 tokens to -8.0% at 65536, with the share between 0.009
  and 0.001). At seq 2048 the rows on 16 / 32 / 64 / 128 GPUs were +2.4 / +3.5 / +3.9 / +4.6 points (median)
  above the same model's 8-GPU row before the straggler term. Communication time does not explain that within
  this schedule: with inter-node busbw cut to 1/4 (45 GB/s per rank) the medians by GPU count are still
  +5.5 / +6.0 / +7.8 / +8.5% at 16-128 GPUs, and with a slowdown of 1.0 +5.9 / +6.9 / +8.1 / +8.4% (both
  before the straggler term). Not modelled: per-step host work that grad_accum = 1 does not amortise (most
  multi-node rows), FSDP1's own device work (the bf16 cast of each shard before its all-gather, the
  gradient pre/post-divide: memory-bound, under 0.1% of a row's time here), and allocator pressure near
  the memory limit (MPT-13b on 8 A100-40GB at grad_accum 16: +15-20%, against +1% on A100-80GB at
  micro-batch 20-80).
- Where the error sits by kernel class (the table "error by kernel class", benchmarks/published_classes.py:
  ln(predicted / published) regressed on each row's shares of priced device time; a diagnosis, nothing is
  set from it). On the 8-GPU rows without AC, which communication and recomputation confound least, the
  rows read as GEMMs priced 9.4% (A100-80GB) and 12.5% (A100-40GB) too fast and attention 4-7% too slow,
  residual ~1%; llm-foundry's later A100-80GB rows, which this model was not built on, read the same (GEMMs
  +10.5%, attention -8.9%). So the +2.5% median is mostly the A100's GEMMs at these Linear shapes: their
  sustained clock (1305 of 1410 MHz, NVIDIA's HPL Rpeak clock, not a measurement) or the CUTLASS-tile shape
  factor, which only the H200 has checked (reports/benchmarks/gpu_kernels_h200.md: 2.8% on its FSDP2
  runs). `benchmarks/gpu_kernels.py measure` on one A100 decides it.
"""


def write_atomic_text(text: str, name: str) -> Path:
    path = OUT_DIR / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    return path


WORST_COLUMNS = ["row", "model", "gpu", "n_gpus", "seq_len", "micro_batch", "grad_accum", "ac", "published",
                 "predicted", "error_pct", "batch_s", "compute_s", "exposed_comm_s", "optimizer_s"]


def _baseline_rows(name: str) -> list[dict]:
    """The rows of reports/benchmarks/<name>_flops.csv (``--compute-model flops``: traced FLOPs at one
    efficiency, as the shipped profiles price compute), for comparison; [] when absent."""
    path = OUT_DIR / f"{name}_flops.csv"
    if not path.is_file():
        return []
    with path.open() as f:
        return [{**r, **{k: float(r[k]) for k in ("error_pct", "predicted", "published")}} for r in csv.DictReader(f)]


def run_all(runs: list[Run], cache_dir: Path | None, compute_model: str) -> tuple[list[dict], int]:
    """Predict every run; returns the rows and how many traces were made (not cached)."""
    memo: dict = {}
    profiles: dict = {}
    out = []
    traced = 0
    for run in runs:
        key = json.dumps(run.shape, sort_keys=True)
        if key not in memo:
            t0 = time.perf_counter()
            memo[key], made = trace_for(run.shape, cache_dir)
            traced += made
            logger.info("%s %s seq %d: %.1f s", "traced" if made else "cached trace", run.model, run.seq_len,
                        time.perf_counter() - t0)
        out.append(predict(run, memo[key], profiles, compute_model))
    return out, traced


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--out", default="published", metavar="NAME",
                    help="report name under reports/benchmarks (default published, or published_flops with "
                         "--compute-model flops; NAME_flops then)")
    ap.add_argument("--trace-cache", type=Path, default=Path(tempfile.gettempdir()) / "shard_planner_published_traces",
                    help="directory of cached traces (keyed by shape and the tracer's code); '' for none")
    ap.add_argument("--worst", type=int, default=12)
    ap.add_argument("--rows", type=int, default=None, help="only the first N rows (a quick look)")
    ap.add_argument("--compute-model", choices=("roofline", "flops"), default="roofline",
                    help="how compute is priced: the kernel model, or traced FLOPs at the profile's efficiency "
                         "(the shipped profiles' default); writes published.* or published_flops.*")
    args = ap.parse_args(argv)
    if not args.csv.is_file():
        ap.error(f"--csv {args.csv}: no such file (the development set is {DEFAULT_CSV})")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started = time.perf_counter()
    runs = load_runs(args.csv)[: args.rows]
    cache = args.trace_cache if str(args.trace_cache) else None
    rows, traced = run_all(runs, cache, args.compute_model)
    name = args.out if args.compute_model == "roofline" else f"{args.out}_flops"
    seconds = time.perf_counter() - started
    write_csv(rows, name)
    buckets = [label for _, label in SIZE_BUCKETS]
    baseline = _baseline_rows(name) if args.compute_model == "roofline" else []
    tables = {
        "all rows": [summary(rows, "all")] + ([summary(baseline, f"flops compute ({name}_flops.csv)")]
                                              if baseline else []),
        "by model size": grouped(rows, "size_bucket", buckets),
        "by sequence length": grouped(rows, "seq_len"),
        "by activation checkpointing": grouped(rows, "ac"),
        "by GPU": grouped(rows, "gpu"),
        "by GPU count (8 per node)": grouped(rows, "n_gpus", sorted({r["n_gpus"] for r in rows})),
        # the shares are of the kernel model's priced time
        **({"error by kernel class (a diagnosis: benchmarks/published_classes.py)": by_gpu(rows, GPUS_PER_NODE)}
           if args.compute_model == "roofline" else {}),
        f"worst {args.worst} rows (times per global batch, s)": [
            {k: (round(r[k], 4) if isinstance(r[k], float) else r[k]) for k in WORST_COLUMNS}
            for r in sorted(rows, key=lambda r: -abs(r["error_pct"]))[: args.worst]],
    }
    meta = dict(command="python benchmarks/bench_published.py " + " ".join(argv or sys.argv[1:]), rows=len(rows),
                traces=len({json.dumps(r.shape, sort_keys=True) for r in runs}), traced=traced, seconds=seconds,
                load=" ".join(f"{x:.1f}" for x in os.getloadavg()), compute_model=args.compute_model)
    for title, table in tables.items():
        print_table(table, title=title)
    path = write_markdown(rows, tables, meta, name)
    print(f"\n{len(rows)} rows in {seconds:.0f} s; wrote {OUT_DIR / (name + '.csv')} and {path}")


if __name__ == "__main__":
    main()
