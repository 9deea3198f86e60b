"""Predicted vs measured for a few plans of a Llama-style model at world size 1 (benchmarks/gpu_check.sh).

Builds hand-written plans for examples/llama.py (per-block units with and without activation
checkpointing, grouped pairs that stay unsharded, a doubled micro-batch), predicts each with the cost
model when it is available (``shard_planner.trace.trace_model`` + ``shard_planner.cost.estimate`` with
the profile given), runs them all in one launch with ``shard_planner.execute.run_plans`` and prints a
table: predicted and measured peak memory (``torch.cuda.max_memory_allocated``; reserved beside it)
and step time (median of CUDA-event timings after warm-up), with the error in percent. The predicted
peak is shown without its "overhead" category (CUDA context, NCCL buffers), which the allocator does
not see.

    SHARD_PLANNER_SIZE=1b python benchmarks/gpu_plans.py --device cuda --out OUT/plans
    SHARD_PLANNER_SIZE=tiny python benchmarks/gpu_plans.py --device cpu --out /tmp/p   # CPU rehearsal
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shard_planner.plan.measurement import save_measurement  # noqa: E402
from shard_planner.model.modelfile import load_model_file  # noqa: E402
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit, save_plan  # noqa: E402
from shard_planner.trace.structure import model_fingerprint  # noqa: E402
from shard_planner.units import format_bytes  # noqa: E402

MODEL = str(ROOT / "examples" / "llama.py")
PLAN_NAMES = ("per-block", "per-block, full AC", "pairs, no reshard, AC every other pair",
              "per-block, full AC, 2x micro-batch")


def make_plans(model_path: str, profile: str, mem_budget_bytes: int) -> dict[str, Plan]:
    import torch

    mf = load_model_file(model_path)
    with torch.device("meta"):  # the structure only: no memory, no time
        model = mf.build()
    layers = [name for name, _ in model.layers.named_children()]
    layers = [f"layers.{name}" for name in layers]
    ref = ModelRef(model_path, model_fingerprint(model), seq_len=mf.training.get("seq_len"))
    cluster = Cluster(gpus=1, gpus_per_node=1, profile=profile, mem_budget_bytes=mem_budget_bytes)
    mb = mf.training.get("micro_batch", 1)
    training = Training(micro_batch=mb, optimizer=mf.training.get("optimizer", "adamw"),
                        lr=float(mf.training.get("lr", 1e-4)), param_dtype="bfloat16", reduce_dtype="float32")
    root = Unit(("",), reshard_after_forward=False)

    def plan(units, training=training, prefetch=Prefetch()):
        return Plan(ref, cluster, Mesh(shard=1), training, (root, *units), prefetch)

    pairs = [tuple(layers[i:i + 2]) for i in range(0, len(layers), 2)]
    return dict(zip(PLAN_NAMES, (
        plan([Unit((name,)) for name in layers]),
        plan([Unit((name,), True, True) for name in layers]),
        plan([Unit(p, False, i % 2 == 0) for i, p in enumerate(pairs)], prefetch=Prefetch(1, 1)),
        plan([Unit((name,), True, True) for name in layers], training=replace(training, micro_batch=2 * mb)),
    )))


def predict(plans: dict[str, Plan], model_path: str, profile: str) -> dict[str, Plan]:
    """Fill ``predicted`` with the cost model; on any failure say why and leave the plans bare."""
    try:
        from shard_planner.cost import estimate
        from shard_planner.hardware.profile import load_profile
        from shard_planner.trace import trace_model
    except ImportError as exc:
        print(f"no prediction: the cost model is not available here ({exc})")
        return plans
    try:
        t0 = time.perf_counter()
        trace = trace_model(model_path)
        prof = load_profile(profile)
        out = {name: replace(p, predicted=estimate(trace, p, prof).prediction()) for name, p in plans.items()}
        print(f"traced and estimated in {time.perf_counter() - t0:.1f} s (profile {profile})")
        return out
    except Exception as exc:  # report, and still measure
        print(f"no prediction: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return plans


def table(names: list[str], plans: dict[str, Plan], measurements) -> list[dict]:
    """Print predicted vs measured per plan; the rows of summary.json."""
    rows = []
    head = (f"{'plan':40} {'mb':>3} {'pred alloc':>11} {'meas peak':>11} {'err':>7} {'reserved':>11} "
            f"{'pred step':>10} {'meas step':>10} {'spread':>8} {'err':>7}")
    print(head)
    for name, m in zip(names, measurements):
        p = plans[name].predicted
        # Compared without the predicted overhead (CUDA context, NCCL), which max_memory_allocated does not see.
        p_alloc = p.peak_bytes - p.memory_at_peak.get("overhead", 0) if p else None
        peak_err = f"{(p_alloc - m.peak_bytes) / m.peak_bytes * 100:+.1f}%" if p else "-"
        step_err = (f"{(p.step_time_s - m.step_time_median_s) / m.step_time_median_s * 100:+.1f}%" if p else "-")
        print(f"{name:40} {plans[name].training.micro_batch:>3} "
              f"{format_bytes(p_alloc) if p else '-':>11} {format_bytes(m.peak_bytes):>11} {peak_err:>7} "
              f"{format_bytes(m.reserved_bytes) if m.reserved_bytes else '-':>11} "
              f"{f'{p.step_time_s:.4g}' if p else '-':>10} {m.step_time_median_s:>10.4g} "
              f"{m.step_time_spread_s:>8.2g} {step_err:>7}")
        rows.append({"plan": name, "micro_batch": plans[name].training.micro_batch,
                     "predicted_peak_bytes": p.peak_bytes if p else None,
                     "predicted_overhead_bytes": p.memory_at_peak.get("overhead", 0) if p else None,
                     "peak_bytes": m.peak_bytes,
                     "reserved_bytes": m.reserved_bytes,
                     "predicted_step_time_s": p.step_time_s if p else None,
                     "step_time_median_s": m.step_time_median_s, "step_time_s": list(m.step_time_s),
                     "losses": list(m.losses)})
    return rows


def report(folder: Path, profile: str) -> None:
    """Predict the plans a measure left in ``folder`` (plan-i.json, measurement-i.json) with this code."""
    from shard_planner.plan.measurement import load_measurement
    from shard_planner.plan import load_plan

    paths = sorted(folder.glob("plan-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    loaded = [load_plan(p) for p in paths]
    names = [PLAN_NAMES[i] if i < len(PLAN_NAMES) else p.stem for i, p in enumerate(paths)]
    plans = predict(dict(zip(names, (replace(p, model=replace(p.model, path=MODEL), predicted=None) for p in loaded))),
                    MODEL, profile)
    measurements = [load_measurement(folder / f"measurement-{p.stem.split('-')[1]}.json") for p in paths]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print(f"# Llama example plans on one GPU: predicted ({profile}) vs measured\n\nCommand: `SHARD_PLANNER_SIZE="
              f"{os.environ.get('SHARD_PLANNER_SIZE', 'tiny')} python benchmarks/gpu_plans.py --report {folder}`; measured "
              f"on {measurements[0].device_name}, torch {measurements[0].torch_version}. Peak: predicted without the CUDA "
              "context and NCCL buffers, against torch.cuda.max_memory_allocated.\n\n```")
        table(names, plans, measurements)
        print("```")
    print(out.getvalue())
    from common import OUT_DIR

    from shard_planner.fileio import write_atomic
    write_atomic(OUT_DIR / f"gpu_plans_{profile}.md", out.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--profile", default="h200")
    parser.add_argument("--mem", default=str(139 * 2**30), help="budget in bytes recorded in the plans")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--out", help="folder for the plans and measurements (required unless --report)")
    parser.add_argument("--only", type=int, help="run only the first N plans")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="predict the plans a measure left in DIR (no run; no GPU needed)")
    args = parser.parse_args()
    if args.report:
        report(args.report, args.profile)
        return 0
    if not args.out:
        parser.error("--out is required to measure")

    from shard_planner.execute import run_plans

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"model {MODEL} SHARD_PLANNER_SIZE={os.environ.get('SHARD_PLANNER_SIZE', 'tiny')}, device {args.device}")
    plans = predict(make_plans(MODEL, args.profile, int(args.mem)), MODEL, args.profile)
    names = list(plans)[: args.only]
    for i, name in enumerate(names):
        save_plan(plans[name], out / f"plan-{i}.json")
    t0 = time.perf_counter()
    measurements = run_plans([plans[n] for n in names], world_size=1, steps=args.steps, warmup=args.warmup,
                             timeout_s=args.timeout, device=args.device)
    print(f"ran {len(names)} plans in one launch in {time.perf_counter() - t0:.1f} s "
          f"({measurements[0].device_name}, torch {measurements[0].torch_version})")
    rows = table(names, plans, measurements)
    for i, m in enumerate(measurements):
        save_measurement(m, out / f"measurement-{i}.json")
    (out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
