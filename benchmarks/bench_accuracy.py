"""Accuracy of the cost model: predicted vs measured peak memory and step time on real runs, and
agreement with FSDPMemTracker on 7-8B / 70B Llama shapes.

Part 1 (real runs): every example model at its tiny size x 12 diverse plans (reshard True / False /
mixed, prefetch 0-2, grouped units, activation checkpointing, fp32 vs bf16 compute, CPU offload, root
only), run with real FSDP2 on CPU/gloo at world size 2 (one launch per model), plus int-reshard plans at
world size 4 for the models named by --ws4 (default gpt2). Peak memory is measured by the storage tracker (exact on
CPU, see DESIGN.md), step time by wall clock (median of the timed steps; noisy on a shared 2-core
machine). Predictions use the profile given (default cpu-gloo).

Step-time errors are given twice: with the profile as shipped, and with the profile fitted the way
``shard-planner tune`` fits it (compute efficiency, collective bandwidth and latency), leave one model out:
each model predicted with the profile fitted to the other models' runs. With ``--timings``, a third time:
compute priced from the model's module times measured on this machine just before
(``shard-planner calibrate --model``, at the run's world size and dtype), the rest from the profile.

Part 2 (fake process group): our prediction vs FSDPMemTracker under FakeTensorMode for Llama 8B and
70B shapes at world size 8 and 64, with both wall times: the plans and the tracker's harness of
benchmarks/bench_vs_memtracker.py (the cost model's benchmark, 8B), imported, not duplicated; 70B added.

    python benchmarks/bench_accuracy.py                  # everything (~15-20 min here)
    python benchmarks/bench_accuracy.py --models gpt2 --ws4    # one model, world size 2 only
    python benchmarks/bench_accuracy.py --skip-memtracker

Writes reports/benchmarks/accuracy_runs.csv, accuracy_runs.png, accuracy_summary.csv,
accuracy_memtracker.csv. Targets: peak memory error under 3% median and 5% max; FSDPMemTracker
agreement within 5%.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

MODELS = ("gpt2", "llama", "vit", "encdec", "unet")
PEAK_TARGET_MEDIAN_PCT, PEAK_TARGET_MAX_PCT = 3.0, 5.0
MEMTRACKER_TARGET_PCT = 5.0


def _run_all(plans, *, world_size: int, steps: int, warmup: int, timeout_s: float):
    """Measurements of ``plans`` in one launch; when the launch fails, each plan alone, so one failing
    plan costs only its own row. Returns a list of (Measurement | None, error | None)."""
    from shard_planner.errors import RunError
    from shard_planner.execute import run_plans

    try:
        return [(m, None) for m in run_plans(plans, world_size=world_size, steps=steps, warmup=warmup,
                                             timeout_s=timeout_s, device="cpu")]
    except RunError as exc:
        print(f"  one launch failed ({exc}); running the plans one by one", flush=True)
    out = []
    for p in plans:
        try:
            out.append((run_plans([p], world_size=world_size, steps=steps, warmup=warmup, timeout_s=timeout_s,
                                  device="cpu")[0], None))
        except RunError as exc:
            out.append((None, str(exc)))
    return out


def measure_model(model: str, *, world_size: int, profile, steps: int, warmup: int, int_reshard: int | None,
                  timeout_s: float, only_int: bool = False, timings: bool = False, also=()) -> list[dict]:
    from shard_planner.cost import estimate
    from shard_planner.trace import trace_model

    path = str(common.EXAMPLES / f"{model}.py")
    traces, timed = {}, {}

    def timed_profile(dtype: str, micro_batch: int):
        """``profile`` pricing compute from this model's module times, measured once per dtype and micro-batch."""
        if (dtype, micro_batch) not in timed:
            timed[dtype, micro_batch] = common.timed_profile(model, profile, world_size=world_size, dtype=dtype,
                                                             micro_batch=micro_batch)
        return timed[dtype, micro_batch]

    def trace_for(dtype: str):
        if dtype not in traces:
            traces[dtype] = trace_model(path, dtype=dtype)
        return traces[dtype]

    base = common.base_plan(path, trace_for("bfloat16"), world_size=world_size)
    variants = common.plan_variants(trace_for("bfloat16"), base, int_reshard=int_reshard)
    if only_int:
        variants = [(n, p) for n, p in variants if any(not isinstance(u.reshard_after_forward, bool) for u in p.units)]
    predictions = []
    for _, plan in variants:
        t0 = time.perf_counter()
        est = estimate(trace_for(plan.training.param_dtype), plan, profile)
        predictions.append((est, time.perf_counter() - t0))
    t0 = time.perf_counter()
    results = _run_all([p for _, p in variants], world_size=world_size, steps=steps, warmup=warmup,
                       timeout_s=timeout_s)
    launch_s = time.perf_counter() - t0
    # measured after the runs, so that the runs' numbers do not depend on whether timings were asked for
    timed_steps = [estimate(trace_for(plan.training.param_dtype), plan,
                            timed_profile(plan.training.param_dtype, plan.training.micro_batch),
                            timeline=False).time.step_time_s if timings else float("nan")
                   for _, plan in variants]
    rows = []
    for (name, plan), (est, est_s), (m, err), timed_s in zip(variants, predictions, results, timed_steps):
        row = dict(model=model, world_size=world_size, plan=name, _trace=trace_for(plan.training.param_dtype),
                   _plan=plan, step_err_fitted_pct=float("nan"), pred_step_timed_s=timed_s,
                   step_err_timed_pct=float("nan"),
                   pred_peak_mib=est.memory.peak_bytes / 2**20, pred_step_s=est.time.step_time_s,
                   meas_peak_mib=float("nan"), meas_step_s=float("nan"), peak_err_pct=float("nan"),
                   step_err_pct=float("nan"), step_spread_s=float("nan"), estimate_ms=est_s * 1e3, error=err or "")
        if m is not None:
            row.update(meas_peak_mib=m.peak_bytes / 2**20, meas_step_s=m.step_time_median_s,
                       peak_err_pct=common.error_pct(est.memory.peak_bytes, m.peak_bytes),
                       step_err_pct=common.error_pct(est.time.step_time_s, m.step_time_median_s),
                       step_err_timed_pct=common.error_pct(timed_s, m.step_time_median_s),
                       step_spread_s=m.step_time_spread_s)
        for other in also:  # the same runs, predicted with another profile (--also-profile)
            t = estimate(trace_for(plan.training.param_dtype), plan, other, timeline=False).time.step_time_s
            row[f"pred_step_{other.name}_s"] = t
            row[f"step_err_{other.name}_pct"] = (common.error_pct(t, m.step_time_median_s) if m is not None
                                                 else float("nan"))
        rows.append(row)
    print(f"  {model} at world size {world_size}: {len(variants)} plans, launch {launch_s:.0f} s", flush=True)
    return rows


def cross_fitted_errors(rows: list[dict], prior) -> dict | None:
    """Step-time errors with a profile fitted the way ``shard-planner tune`` fits one, leave one model
    out: each model's runs are predicted with the profile fitted to every *other* model's runs. Fills
    ``step_err_fitted_pct``; returns the profile fitted to all runs' factors (None with one model)."""
    from shard_planner.cost import estimate
    from shard_planner.tune.fit import fit_profile

    ok = [r for r in rows if r["meas_step_s"] == r["meas_step_s"]]
    models = sorted({r["model"] for r in ok})
    if len(models) < 2:
        return None

    def fit_on(sel):
        return fit_profile(prior, lambda prof: [estimate(r["_trace"], r["_plan"], prof, timeline=False).time.step_time_s
                                                for r in sel], [r["meas_step_s"] for r in sel])

    for model in models:
        fitted = fit_on([r for r in ok if r["model"] != model]).profile
        for r in ok:
            if r["model"] == model:
                t = estimate(r["_trace"], r["_plan"], fitted, timeline=False).time.step_time_s
                r["step_err_fitted_pct"] = common.error_pct(t, r["meas_step_s"])
    return fit_on(ok).factors


def plot_runs(rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for ax, (pred, meas, label) in zip(axes, (("pred_peak_mib", "meas_peak_mib", "peak memory per rank (MiB)"),
                                             ("pred_step_s", "meas_step_s", "step time (s)"))):
        pts = [(r[meas], r[pred], r["model"]) for r in rows if r[meas] == r[meas]]
        for model in dict.fromkeys(p[2] for p in pts):
            xs = [p[0] for p in pts if p[2] == model]
            ys = [p[1] for p in pts if p[2] == model]
            ax.scatter(xs, ys, label=model, s=22)
        if pts:
            lo = min(min(p[0], p[1]) for p in pts) * 0.9
            hi = max(max(p[0], p[1]) for p in pts) * 1.1
            ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--", label="predicted = measured")
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.set_title(f"Predicted vs measured {label.split(' (')[0]}")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Cost model vs real FSDP2 runs (CPU, gloo; storage tracker, wall clock)")
    return fig


def summary_rows(rows: list[dict], also=()) -> list[dict]:
    out = []
    groups = sorted({(r["model"], r["world_size"]) for r in rows}) + [("all", None)]
    for model, ws in groups:
        sel = [r for r in rows if model == "all" or (r["model"] == model and r["world_size"] == ws)]
        pk_med, pk_max = common.summarize([r["peak_err_pct"] for r in sel])
        st_med, st_max = common.summarize([r["step_err_pct"] for r in sel])
        sf_med, sf_max = common.summarize([r["step_err_fitted_pct"] for r in sel])
        tm_med, tm_max = common.summarize([r["step_err_timed_pct"] for r in sel])
        out.append(dict(model=model, world_size=ws if ws is not None else "-",
                        plans=sum(1 for r in sel if r["meas_peak_mib"] == r["meas_peak_mib"]),
                        failed=sum(1 for r in sel if r["error"]),
                        peak_err_median_pct=pk_med, peak_err_max_pct=pk_max,
                        step_err_median_pct=st_med, step_err_max_pct=st_max,
                        fitted_step_err_median_pct=sf_med, fitted_step_err_max_pct=sf_max,
                        timed_step_err_median_pct=tm_med, timed_step_err_max_pct=tm_max))
        for other in also:
            med, mx = common.summarize([r[f"step_err_{other.name}_pct"] for r in sel])
            out[-1].update({f"{other.name}_step_err_median_pct": med, f"{other.name}_step_err_max_pct": mx})
    return out


# (size, world sizes, how many of bench_vs_memtracker's plans): 8B its first three (ungrouped; the rest are in
# bench_vs_memtracker itself), 70B only the first, torchtitan's (each
# FSDPMemTracker estimate of 70B takes minutes here).
MEMTRACKER_CASES = (("8b", (8, 64), 3), ("70b", (8, 64), 1))


def run_memtracker_part(cases=MEMTRACKER_CASES) -> list[dict]:
    """Our prediction vs FSDPMemTracker (fake process group, FakeTensorMode) for Llama 8B and 70B shapes
    at world size 8 and 64, with both wall times. The plans, the profile without fixed overhead and the
    tracker's harness are bench_vs_memtracker's (the cost model's benchmark), imported; this adds 70B."""
    import dataclasses

    import bench_vs_memtracker as peer
    from cost_memtracker import memtracker_peaks  # tests/models/, put on the path by bench_vs_memtracker

    from shard_planner.cost import simulate_memory
    from shard_planner.hardware.profile import load_profile
    from shard_planner.trace import trace_model

    profile = dataclasses.replace(load_profile("h100-80gb"), reserved_bytes=0, per_process_group_bytes=0)
    rows = []
    for size, world_sizes, count in cases:
        env = {"SHARD_PLANNER_SIZE": size}
        common.set_model_size(size)
        t0 = time.perf_counter()
        trace = trace_model(peer.MODEL)
        trace_s = time.perf_counter() - t0
        for ws in world_sizes:
            named = list(peer.plans(trace, ws).items())[:count]
            for name, (plan, held) in named:
                t0 = time.perf_counter()
                theirs = memtracker_peaks(peer.MODEL, [plan], env=env)[0]
                theirs_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                ours = simulate_memory(trace, plan, profile).peak_bytes
                ours_s = time.perf_counter() - t0
                rows.append(dict(model=f"llama {size}", world_size=ws, plan=name, ours_gib=ours / 2**30,
                                 memtracker_gib=theirs / 2**30, diff_pct=common.error_pct(ours, theirs),
                                 held_to_target=held, ours_trace_s=trace_s, ours_estimate_ms=ours_s * 1e3,
                                 memtracker_s=theirs_s))
                print(f"  llama {size}, world size {ws}, {name}: ours {ours / 2**30:.2f} GiB, FSDPMemTracker "
                      f"{theirs / 2**30:.2f} GiB ({theirs_s:.0f} s)", flush=True)
    common.set_model_size(None)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--ws4", nargs="*", default=["gpt2"], choices=MODELS,
                    help="models also run at world size 4, int-reshard plans included (default gpt2)")
    # 15 timed steps: on the shared 2-core VM one plan's steps spread by ~40% of its median; the median of
    # 5 moved by 10-20% between runs of the same plan (2026-12-04: 12.6% median error with 5, 10.1% with 15)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", default="cpu-gloo")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--timings", action="store_true",
                    help="also predict step time from module times measured here first (shard-planner calibrate "
                         "--model; ~30 s per model and dtype)")
    ap.add_argument("--also-profile", nargs="*", default=[], metavar="PROFILE",
                    help="also predict the same runs' step time with these profiles (name or path): columns "
                         "pred_step_NAME_s, step_err_NAME_pct (e.g. a profile `shard-planner calibrate` wrote)")
    ap.add_argument("--skip-runs", action="store_true", help="only the FSDPMemTracker part")
    ap.add_argument("--skip-memtracker", action="store_true", help="only the real runs")
    args = ap.parse_args(argv)
    common.quiet_logs()
    common.set_model_size(None)
    from shard_planner.hardware.profile import load_profile

    profile = load_profile(args.profile)
    also = [load_profile(p) for p in args.also_profile]
    print(f"machine load at start: {common.load_text()}", flush=True)
    start = time.perf_counter()
    if not args.skip_runs:
        rows = []
        for model in args.models:
            rows += measure_model(model, world_size=2, profile=profile, steps=args.steps, warmup=args.warmup,
                                  int_reshard=None, timeout_s=args.timeout, timings=args.timings, also=also)
            if model in args.ws4:
                rows += measure_model(model, world_size=4, profile=profile, steps=args.steps, warmup=args.warmup,
                                      int_reshard=2, timeout_s=args.timeout, timings=args.timings, also=also)
        factors = cross_fitted_errors(rows, profile)
        columns = ["model", "world_size", "plan", "pred_peak_mib", "meas_peak_mib", "peak_err_pct", "pred_step_s",
                   "meas_step_s", "step_err_pct", "step_err_fitted_pct", "pred_step_timed_s", "step_err_timed_pct",
                   "step_spread_s", "estimate_ms", "error"]
        columns += [c for o in also for c in (f"pred_step_{o.name}_s", f"step_err_{o.name}_pct")]
        common.print_table(rows, title="Predicted vs measured, real FSDP2 runs (CPU, gloo)", columns=columns)
        common.write_csv(rows, "accuracy_runs", columns=columns)
        summary = summary_rows(rows, also)
        common.print_table(summary, title="Errors |predicted - measured| / measured (%)")
        common.write_csv(summary, "accuracy_summary")
        common.save_figure(plot_runs(rows), "accuracy_runs")
        if factors is not None:
            print("step time with a profile fitted as tune fits it (leave one model out); factors fitted to all "
                  "runs: " + ", ".join(f"{k} x{v:.3g}" for k, v in factors.items()))
        overall = summary[-1]
        ok = (overall["peak_err_median_pct"] < PEAK_TARGET_MEDIAN_PCT and overall["peak_err_max_pct"] < PEAK_TARGET_MAX_PCT)
        print(f"peak-memory target (median < {PEAK_TARGET_MEDIAN_PCT}%, max < {PEAK_TARGET_MAX_PCT}%): "
              f"{'met' if ok else 'MISSED'} (median {overall['peak_err_median_pct']:.2f}%, "
              f"max {overall['peak_err_max_pct']:.2f}%)")
    if not args.skip_memtracker:
        mt_rows = run_memtracker_part()
        common.print_table(mt_rows, title="Our prediction vs FSDPMemTracker (fake process group)")
        common.write_csv(mt_rows, "accuracy_memtracker")
        held = [abs(r["diff_pct"]) for r in mt_rows if r["held_to_target"]]
        print(f"FSDPMemTracker agreement target (within {MEMTRACKER_TARGET_PCT}% on ungrouped plans): "
              f"{'met' if held and max(held) <= MEMTRACKER_TARGET_PCT else 'MISSED'} (max {max(held, default=float('nan')):.2f}%; "
              "grouped plans are reported, not held: the tracker reads low on them, DESIGN.md)")
    print(f"machine load at end: {common.load_text()}")
    print(f"\nbench_accuracy: {time.perf_counter() - start:.0f} s; outputs in {common.OUT_DIR}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CI", "1")  # no progress lines inside the benchmark's output
    sys.exit(main())
