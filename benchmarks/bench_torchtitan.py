"""The step-time model against torchtitan's published FSDP2 runs: another stack than llm-foundry (FSDP2,
not FSDP1), other models (Llama, not MPT), PyTorch SDPA, and, for the H100 rows, other hardware than
the profile describes. Nothing here was fitted to these rows except where a row says so.

    python benchmarks/bench_torchtitan.py [--trace-cache DIR]

Rows (tokens/s/GPU as published):
- 64 x A100 80GB (pytorch/torchtitan docs/performance.md): Llama 3 8B (seq 8192, local batch 1,
  selective op / selective layer), Llama 3 70B (full AC), Llama 2 13B (seq 4096, local batch 2: none /
  selective layer / selective op), Llama 2 70B (local batch 1 selective op, 2 full).
- 8 and 128 x H100 (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 1 and 3,
  "FSDP" without torch.compile or Float8): Llama 3.1 8B, seq 8192, local batch 2, selective AC (the
  llama3_8b.toml default, selective_ac_option "op"). That page says its hardware: Grand Teton hosts,
  H100s with 96 GB HBM2e at 2.4 TB/s, the default 500 W power limit (the SXM part's TDP is 700 W), "the
  actual peak TFLOPs number is between SXM and NVL".

Mirrored plans (examples/llama.py at the row's shape, bf16): one unit per transformer block, resharded
after forward, the root (embeddings, final norm, output) not resharded (torchtitan's parallelize);
bf16 parameters, fp32 gradient reduction (torchtitan's mixed_precision_reduce default), AdamW, the
row's local batch, no gradient accumulation. FSDP2's copies on the compute stream are priced (the
model's default: shard_planner/cost/fsdp_copies.py). Activation checkpointing as torchtitan applies it:
"op" = selective on every block with torchtitan's own rule (``ac_save_ops = ["alternate_matmul",
"attention_fwd"]``: SDPA outputs and every other mm kept, shard_planner/plan/checkpointing.py [Note:
torchtitan's op-level policy]); "layer" = selective_ac_option "2": full AC on every second block
(torchtitan counts blocks from 1 and checkpoints block i when i % 2 == 0); "full"; "none".

Columns: the profile as shipped (a100-80gb: roofline; h100-80gb: flops, whose compute_efficiency was
fitted to the 8-GPU H100 row, so that row is not a check of it), the other compute model, and for the
H100 rows the roofline on the hardware the page describes: HBM 2.4 TB/s and the GEMM clock bracketed
between the NVL part's peak (835 of 989 TFLOP/s dense bf16, H100 NVL datasheet) and the SXM part's.
Writes reports/benchmarks/torchtitan.csv and .md.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import EXAMPLES, OUT_DIR, print_table, write_csv  # noqa: E402
from shard_planner.plan.checkpointing import TORCHTITAN_OP_SAVE_OPS  # noqa: E402
from shard_planner.cost import CostModel  # noqa: E402
from shard_planner.fileio import write_atomic  # noqa: E402
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit  # noqa: E402
from shard_planner.hardware.profile import HardwareProfile, load_profile  # noqa: E402
from shard_planner.trace.types import ModelTrace  # noqa: E402

LLAMA = EXAMPLES / "llama.py"
A100_PAGE = "torchtitan docs/performance.md (64 x A100 80GB)"
H100_PAGE = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 96GB HBM2e, 500 W)"
H100_NVL_PEAK_FRACTION = 835 / 989  # dense bf16: H100 NVL datasheet 1,671 TFLOP/s with sparsity, SXM 1,979
GRAND_TETON_HBM_BYTES_PER_S = 2.4e12  # the H100 page: "96GB HBM2e with 2.4 TB/sec peak memory bandwidth"


@dataclass(frozen=True)
class Row:
    model: str
    size: str  # examples/llama.py SHARD_PLANNER_SIZE
    seq_len: int
    gpus: int
    local_batch: int
    ac: str  # "op", "layer", "full", "none"
    published: float  # tokens/s/GPU
    source: str

    @property
    def gpu(self) -> str:
        return "A100 80GB" if self.source == A100_PAGE else "H100 (500 W)"


ROWS = (
    Row("Llama 3 8B", "8b", 8192, 64, 1, "layer", 2904, A100_PAGE),
    Row("Llama 3 8B", "8b", 8192, 64, 1, "op", 2973, A100_PAGE),
    Row("Llama 3 70B", "70b", 8192, 64, 1, "full", 331, A100_PAGE),
    Row("Llama 2 13B", "2-13b", 4096, 64, 2, "none", 2162, A100_PAGE),
    Row("Llama 2 13B", "2-13b", 4096, 64, 2, "layer", 1914, A100_PAGE),
    Row("Llama 2 13B", "2-13b", 4096, 64, 2, "op", 1904, A100_PAGE),
    Row("Llama 2 70B", "2-70b", 4096, 64, 1, "op", 355, A100_PAGE),
    Row("Llama 2 70B", "2-70b", 4096, 64, 2, "full", 353, A100_PAGE),
    Row("Llama 3.1 8B", "8b", 8192, 8, 2, "op", 5762, H100_PAGE),
    Row("Llama 3.1 8B", "8b", 8192, 128, 2, "op", 5605, H100_PAGE),
)


def trace_for(size: str, seq_len: int, cache_dir: Path | None) -> ModelTrace:
    """examples/llama.py at ``size`` and ``seq_len`` (bf16), from the disk cache or traced now."""
    from shard_planner.trace import trace_model

    key = hashlib.sha256(f"{size}:{seq_len}".encode() + LLAMA.read_bytes()).hexdigest()[:20]
    path = cache_dir / f"llama-{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        return ModelTrace.from_json(path.read_text())
    os.environ.update(SHARD_PLANNER_SIZE=size, SHARD_PLANNER_SEQ=str(seq_len))
    trace = trace_model(str(LLAMA), dtype="bfloat16")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, trace.to_json())
    return trace


def _checkpoint(ac: str, i: int) -> dict:
    """Unit fields for block ``i`` (from 0) under torchtitan's AC mode ``ac`` (module docstring)."""
    if ac == "op":
        return dict(activation_checkpoint="selective", ac_save_ops=TORCHTITAN_OP_SAVE_OPS)
    return dict(activation_checkpoint=ac == "full" or (ac == "layer" and (i + 1) % 2 == 0))


def plan_for(row: Row, trace: ModelTrace) -> Plan:
    """The plan that mirrors ``row`` (module docstring)."""
    n_layers = sum(1 for m in trace.modules if m.fqn.count(".") == 1 and m.fqn.startswith("layers."))
    units = (Unit(("",), False),) + tuple(Unit((f"layers.{i}",), True, **_checkpoint(row.ac, i))
                                          for i in range(n_layers))
    return Plan(ModelRef(str(LLAMA), trace.fingerprint), Cluster(row.gpus, 8, "h100-80gb", 80 << 30),
                Mesh(row.gpus), Training(row.local_batch, "adamw", "bfloat16", "float32"), units, Prefetch(0, 1))


def profiles_for(row: Row) -> dict[str, HardwareProfile]:
    """The profiles each row is priced with, by column name (module docstring)."""
    if row.source == A100_PAGE:
        p = load_profile("a100-80gb")
        return {"shipped": p, "other": replace(p, compute_model="flops")}
    p = load_profile("h100-80gb")
    out = {"shipped": p, "other": replace(p, compute_model="roofline")}
    hw = replace(p, compute_model="roofline", memory_bandwidth_bytes_per_s=GRAND_TETON_HBM_BYTES_PER_S)
    out["500W_sxm_clock"] = hw
    out["500W_nvl_clock"] = replace(hw, kernels={**hw.kernels, "sustained_clock_fraction": H100_NVL_PEAK_FRACTION})
    return out


def predict(row: Row, trace: ModelTrace) -> dict:
    plan = plan_for(row, trace)
    out = {"model": row.model, "gpu": row.gpu, "gpus": row.gpus, "seq_len": row.seq_len,
           "local_batch": row.local_batch, "ac": row.ac, "published": row.published}
    for name, profile in profiles_for(row).items():
        t = CostModel(trace, profile).time(plan)
        tps = t.tokens_per_s / row.gpus
        label = name if name.startswith("500W") else f"{name}_{profile.compute_model}"
        out[f"{label}_tps"] = round(tps)
        out[f"{label}_err_pct"] = round(100 * (tps / row.published - 1), 2)
    return out


def summarise(rows: list[dict], column: str, where) -> dict:
    errs = [r[column] for r in rows if where(r) and r.get(column) is not None]
    return {"column": column, "rows": len(errs), "median_abs_pct": round(statistics.median(abs(e) for e in errs), 2),
            "median_signed_pct": round(statistics.median(errs), 2), "max_abs_pct": round(max(abs(e) for e in errs), 2)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace-cache", type=Path, default=Path(tempfile.gettempdir()) / "shard_planner_torchtitan_traces",
                    help="directory of cached traces (keyed by size, sequence and the model file); '' for none")
    args = ap.parse_args(argv)
    cache = args.trace_cache if str(args.trace_cache) else None
    start = time.perf_counter()
    traces: dict = {}
    rows = []
    for row in ROWS:
        key = (row.size, row.seq_len)
        if key not in traces:
            traces[key] = trace_for(row.size, row.seq_len, cache)
        rows.append(predict(row, traces[key]))
    a100 = lambda r: r["gpu"] == "A100 80GB"  # noqa: E731
    h100 = lambda r: r["gpu"] != "A100 80GB"  # noqa: E731
    summary = [dict(summarise(rows, "shipped_roofline_err_pct", a100), gpu="A100"),
               dict(summarise(rows, "other_flops_err_pct", a100), gpu="A100"),
               dict(summarise(rows, "shipped_flops_err_pct", h100), gpu="H100 (500 W)"),
               dict(summarise(rows, "other_roofline_err_pct", h100), gpu="H100 (500 W)"),
               dict(summarise(rows, "500W_sxm_clock_err_pct", h100), gpu="H100 (500 W)"),
               dict(summarise(rows, "500W_nvl_clock_err_pct", h100), gpu="H100 (500 W)")]
    columns = list(dict.fromkeys(c for r in rows for c in r))
    write_csv(rows, "torchtitan", columns=columns)
    text = report(rows, summary, time.perf_counter() - start)
    print(text)
    path = OUT_DIR / "torchtitan.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    print(f"wrote {path}")


def report(rows: list[dict], summary: list[dict], seconds: float) -> str:
    """The Markdown report: one table per GPU and the summary."""
    buf = io.StringIO()
    buf.write("# Step-time model vs torchtitan's published FSDP2 runs\n\n")
    buf.write(f"Command: `python benchmarks/bench_torchtitan.py` ({seconds:.0f} s). Error = predicted / published "
              "tokens/s/GPU - 1. How the rows are mirrored and which columns are which: the script's docstring.\n")
    a100_cols = ["model", "gpus", "seq_len", "local_batch", "ac", "published", "shipped_roofline_tps",
                 "shipped_roofline_err_pct", "other_flops_tps", "other_flops_err_pct"]
    h100_cols = ["model", "gpus", "seq_len", "local_batch", "ac", "published", "shipped_flops_tps",
                 "shipped_flops_err_pct", "other_roofline_tps", "other_roofline_err_pct", "500W_sxm_clock_tps",
                 "500W_sxm_clock_err_pct", "500W_nvl_clock_tps", "500W_nvl_clock_err_pct"]
    print_table([r for r in rows if r["gpu"] == "A100 80GB"], title="64 x A100 80GB (profile a100-80gb)",
                columns=a100_cols, stream=buf)
    print_table([r for r in rows if r["gpu"] != "A100 80GB"], title="H100 96GB HBM2e at 500 W (profile h100-80gb)",
                columns=h100_cols, stream=buf)
    print_table(summary, title="summary (error = predicted / published - 1)", stream=buf)
    return buf.getvalue()


if __name__ == "__main__":
    main()
