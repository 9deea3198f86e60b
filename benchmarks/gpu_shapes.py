"""Step time of published model shapes on one GPU: measured there, predicted here (issue 12).

Two modes, so the device machine only measures:

    python benchmarks/gpu_shapes.py measure --out OUT/shapes        # on the GPU (benchmarks/gpu_check.sh)
    python benchmarks/gpu_shapes.py report OUT/shapes [--profile h200]   # anywhere, no GPU

``measure`` trains each shape of SHAPES (MPT shapes of ../shared/data/published_fsdp_runs.csv, built by
examples/shape.py) with real FSDP2 at world size 1 (one unit per block, the root holding the
embeddings, final norm and head; bf16 parameters, fp32 reduce; AdamW), with and without full activation
checkpointing, through ``shard_planner.execute.run_plans`` (one launch per shape), and writes each
plan and its measurement (median step time from CUDA events after warm-up, peak memory).

``report`` predicts every measured plan with the cost model (``estimate`` on the profile, under both
compute models: "flops", traced FLOPs at the profile's one efficiency, and "roofline", the kernel model
of cost/kernels.py) and prints predicted vs measured step time and peak memory, writing
reports/benchmarks/gpu_shapes.{csv,md}. At world size 1 no collective crosses a link: these runs test
the compute, FSDP2-copy, optimizer and host-overhead terms of the time model alone.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit, load_plan, save_plan  # noqa: E402

SHAPE_FILE = ROOT / "examples" / "shape.py"
MPT = dict(ffn_type="gelu", norm="layernorm", pos="learned", bias=True, tied_embeddings=True, vocab=50368)
# name: (n_layers, d_model, n_heads, seq_len, micro_batch) -- the published rows' shapes and micro-batches
SHAPES = {
    "MPT-125m s2048": (12, 768, 12, 2048, 32),
    "MPT-125m s8192": (12, 768, 12, 8192, 8),
    "MPT-350m s2048": (24, 1024, 16, 2048, 32),
    "MPT-760m s2048": (24, 1536, 12, 2048, 24),
    "MPT-1b s2048": (24, 2048, 16, 2048, 14),
    "MPT-1b s16384": (24, 2048, 16, 16384, 2),
    "MPT-3b s2048": (32, 2560, 20, 2048, 10),
}
DRY_RUN = {"tiny s64": (2, 64, 4, 64, 8)}  # --device cpu: the script's rehearsal without a GPU
MEM_BYTES = 139 * 2**30


def shape_of(name: str) -> dict:
    layers, d, heads, seq, _ = {**SHAPES, **DRY_RUN}[name]
    return dict(MPT, n_layers=layers, d_model=d, d_ffn=4 * d, n_heads=heads, n_kv_heads=heads, seq_len=seq)


def plans_for(name: str, profile: str) -> list[Plan]:
    """Per-block FSDP2 units at world size 1, without and with full activation checkpointing."""
    import torch

    from shard_planner.model.modelfile import load_model_file
    from shard_planner.trace.structure import model_fingerprint

    mf = load_model_file(str(SHAPE_FILE))
    with torch.device("meta"):
        model = mf.build()
    layers, *_, micro_batch = {**SHAPES, **DRY_RUN}[name]
    ref = ModelRef(str(SHAPE_FILE), model_fingerprint(model), seq_len=shape_of(name)["seq_len"])
    cluster = Cluster(gpus=1, gpus_per_node=1, profile=profile, mem_budget_bytes=MEM_BYTES)
    training = Training(micro_batch, "adamw", "bfloat16", "float32")
    blocks = [f"blocks.{i}" for i in range(layers)]
    return [Plan(ref, cluster, Mesh(shard=1), training,
                 (Unit(("",), False), *(Unit((b,), True, ac) for b in blocks)), Prefetch(0, 1))
            for ac in (False, True)]


def measure(out: Path, steps: int, warmup: int, timeout_s: float, only: list[str] | None, device: str) -> None:
    from shard_planner.execute import run_plans
    from shard_planner.plan.measurement import save_measurement

    out.mkdir(parents=True, exist_ok=True)
    shapes = SHAPES if device == "cuda" else DRY_RUN
    for i, name in enumerate(n for n in shapes if not only or n in only):
        os.environ["SHARD_PLANNER_SHAPE"] = json.dumps(shape_of(name))  # the ranks inherit it
        t0 = time.perf_counter()
        try:
            plans = plans_for(name, "h200")
            measurements = run_plans(plans, world_size=1, steps=steps, warmup=warmup, timeout_s=timeout_s, device=device)
        except Exception as exc:  # keep the other shapes
            print(f"!! {name}: {type(exc).__name__}: {str(exc)[:400]}")
            continue
        for j, (plan, m) in enumerate(zip(plans, measurements)):
            stem = f"shape{i}-{'ac' if j else 'noac'}"
            save_plan(plan, out / f"{stem}-plan.json")
            save_measurement(m, out / f"{stem}-measurement.json")
            (out / f"{stem}-shape.json").write_text(json.dumps(dict(name=name, shape=shape_of(name))) + "\n")
            print(f"{name:16} AC {'full' if j else 'none':4} mb {plan.training.micro_batch:3} step "
                  f"{m.step_time_median_s * 1e3:9.2f} ms  peak {m.peak_bytes / 2**30:6.2f} GiB")
        print(f"   ({time.perf_counter() - t0:.1f} s)")


@functools.lru_cache(maxsize=None)
def _trace(shape_json: str):
    """The trace of examples/shape.py at one shape (each shape has an AC and a no-AC run: traced once)."""
    from shard_planner.trace import trace_model

    os.environ["SHARD_PLANNER_SHAPE"] = shape_json
    return trace_model(str(SHAPE_FILE), dtype="bfloat16")


def predictions(plan: Plan, shape: dict, profile_name: str) -> dict:
    from shard_planner.cost import estimate
    from shard_planner.hardware.profile import load_profile

    trace = _trace(json.dumps(shape, sort_keys=True))
    plan = replace(plan, model=replace(plan.model, fingerprint=trace.fingerprint))
    base = load_profile(profile_name)
    out = {}
    for model in ("flops", "roofline"):
        est = estimate(trace, plan, replace(base, compute_model=model))
        out[model] = est.prediction()
    return out


def _measured_on(folder: Path) -> str:
    """The device and torch of the first measurement in ``folder``."""
    from shard_planner.plan.measurement import load_measurement

    first = next(iter(sorted(folder.glob("*-measurement.json"))), None)
    if first is None:
        return "no measurement"
    m = load_measurement(first)
    return f"{m.device_name}, torch {m.torch_version}"


def report(folder: Path, profile_name: str) -> None:
    from common import OUT_DIR, print_table, write_csv

    from shard_planner.fileio import write_atomic

    from shard_planner.plan.measurement import load_measurement

    rows = []
    for mpath in sorted(folder.glob("*-measurement.json")):
        stem = mpath.name[: -len("-measurement.json")]
        plan = load_plan(folder / f"{stem}-plan.json")
        meta = json.loads((folder / f"{stem}-shape.json").read_text())
        m = load_measurement(mpath)
        pred = predictions(plan, meta["shape"], profile_name)
        row = dict(shape=meta["name"], ac="full" if plan.units[1].activation_checkpoint else "none",
                   micro_batch=plan.training.micro_batch, measured_ms=round(m.step_time_median_s * 1e3, 2))
        for model in ("flops", "roofline"):
            p = pred[model]
            row[f"{model}_ms"] = round(p.step_time_s * 1e3, 2)
            row[f"{model}_err_pct"] = round((p.step_time_s / m.step_time_median_s - 1) * 100, 1)
        p = pred["roofline"]
        alloc = p.peak_bytes - p.memory_at_peak.get("overhead", 0)
        row.update(measured_peak_gib=round(m.peak_bytes / 2**30, 3), predicted_peak_gib=round(alloc / 2**30, 3),
                   peak_err_pct=round((alloc / m.peak_bytes - 1) * 100, 2))
        rows.append(row)
    out = io.StringIO()
    print(f"# Step time on one GPU: predicted ({profile_name}) vs measured\n\nCommand: `python benchmarks/gpu_shapes.py "
          f"report {folder}`; measured by `benchmarks/gpu_check.sh` ({_measured_on(folder)}). Error = predicted / "
          "measured - 1 (positive: predicted too slow). Peak memory: predicted without the CUDA context and NCCL "
          "buffers, against torch.cuda.max_memory_allocated.", file=out)
    print_table(rows, title="FSDP2 at world size 1, one unit per block", stream=out)
    print("", file=out)
    for model in ("flops", "roofline"):
        errs = [r[f"{model}_err_pct"] for r in rows]
        print(f"- {model}: median |error| {statistics.median(abs(e) for e in errs):.1f}%, "
              f"median signed {statistics.median(errs):+.1f}%, worst {max(errs, key=abs):+.1f}%", file=out)
    peak = [abs(r["peak_err_pct"]) for r in rows]
    print(f"- peak memory: median |error| {statistics.median(peak):.2f}%, worst {max(peak):.2f}%", file=out)
    print(out.getvalue())
    write_csv(rows, f"gpu_shapes_{profile_name}")
    write_atomic(OUT_DIR / f"gpu_shapes_{profile_name}.md", out.getvalue())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("measure", help="train the shapes on this machine's GPU")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--steps", type=int, default=5)
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument("--timeout", type=float, default=120.0)
    m.add_argument("--only", nargs="*", help="shape names (default: all)")
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a tiny shape, to rehearse")
    r = sub.add_parser("report", help="predict a measure's plans with a profile")
    r.add_argument("folder", type=Path)
    r.add_argument("--profile", default="h200")
    args = parser.parse_args(argv)
    if args.mode == "measure":
        measure(args.out, args.steps, args.warmup, args.timeout, args.only, args.device)
    else:
        report(args.folder, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
