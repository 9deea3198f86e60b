"""Plan quality: how good is the planner's choice, measured, against every plan of a small space?

For the tiny GPT-2 and Llama examples on CPU (gloo, world size 2): build a small exhaustive space —
layout (one unit per block, pairs of blocks, all blocks one unit) x reshard after forward (all True /
all False) x prefetch (forward 0 / backward 1, forward 1 / backward 2) x activation checkpointing (none /
every unit), and the root alone (kept, or resharded after forward) — plus the usual hand-written policies, and the planner's plan at two
budgets: a loose one (everything fits) and a tight one (5% above the 40th percentile of the space's
predicted peaks: no-checkpointing plans mostly do not fit).

Measurement, in two stages, each ONE launch in which every plan runs once per round, in a freshly
shuffled order each round (``run_plans`` runs the jobs in turn in one process group), so that drifts of
the shared machine hit every plan alike:

1. screen: every distinct plan, ``--screen-rounds`` rounds of ``--screen-steps`` timed steps. A plan's
   time is the median of all its timed steps; its interval a two-level bootstrap over rounds, then steps;
   plans are compared on times divided by their round's typical plan time, with paired resamples
   (benchmarks/timing_stats.py says why). The measured peak (storage tracker, exact and repeatable)
   decides what fits a budget.
2. confirmation: for each budget the planner's choice and the ``--confirm-top`` fastest plans of the
   screen that fit, plus a second copy of one chosen plan (the A/A pair: what identical plans measure
   apart), ``--confirm-rounds`` rounds of ``--confirm-steps`` steps. The gap "chosen vs best" comes from
   this stage, with a paired bootstrap interval that re-picks the best in every resample.

Verdict per budget: met when the chosen plan's gap to the best is <= 5% or its interval includes 0
(cannot be told from the best), and its measured peak is within the budget (a hard check).

    python benchmarks/bench_plan_quality.py                 # gpt2 and llama (~10 min here at load 3-4)
    python benchmarks/bench_plan_quality.py --models llama --confirm-rounds 4

Writes reports/benchmarks/plan_quality.csv (every plan), plan_quality_summary.csv, plan_quality.png and
plan_quality_steps.csv (every timed step of both stages, for re-analysis).
Target: the chosen plan within 5% of the measured best of the space, never over budget.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import timing_stats as ts  # noqa: E402

logger = logging.getLogger(__name__)

MODELS = ("gpt2", "llama")
WORLD_SIZE = 2
TARGET_PCT = 5.0
TIGHT_QUANTILE = 0.4
BUDGETS = ("loose", "tight")
AA_COPY = "A/A copy"  # job id suffix of the second copy of a chosen plan in the confirmation


# ---- the plans ----
def exhaustive_space(trace, base) -> list[tuple[str, object]]:
    from shard_planner.plan import ROOT, Prefetch, Unit

    layouts = {}
    for kind in ("per-block", "pairs", "one-group"):
        groups = common.layout(trace, kind)
        if groups not in layouts.values():  # two layers: pairs == one group
            layouts[kind] = groups
    out = []
    for kind, groups in layouts.items():
        for reshard in (True, False):
            for pf in (Prefetch(0, 1), Prefetch(1, 2)):
                for ac in (False, True):
                    name = (f"{kind} {'reshard' if reshard else 'keep'} pf{pf.forward}/{pf.backward}"
                            f"{' AC' if ac else ''}")
                    out.append((name, replace(base, units=common.make_units(groups, reshard=reshard, ac=ac),
                                              prefetch=pf)))
    for pf in (Prefetch(0, 1), Prefetch(1, 2)):
        out.append((f"root only pf{pf.forward}/{pf.backward}", replace(base, prefetch=pf)))
    out.append(("root only, root reshard", replace(base, units=(Unit((ROOT,), reshard_after_forward=True),))))
    return out


def hand_written(trace, base) -> list[tuple[str, object]]:
    """The policies people write by hand, as the solver defines them for its report
    (shard_planner/plan/recipes.py: torchtitan, torchtune, Accelerate TRANSFORMER_BASED_WRAP and
    SIZE_BASED_WRAP, ZeRO-2-like, full activation checkpointing; those that offload left out), plus the
    whole model as one unit."""
    from shard_planner.plan.recipes import RECIPES
    from shard_planner.solve.space import build_space

    space = build_space(trace, shard_group=base.mesh.shard, gpus_per_node=base.cluster.gpus_per_node)
    out = [(f"policy: {r.title}", replace(base, units=r.units(space))) for r in RECIPES if not r.cpu_offload]
    out.append(("policy: root only (no wrapping)", base))
    return out


@dataclass
class Case:
    """One model: its plans (by fingerprint), the names they go by, the budgets and the planner's choices."""

    model: str
    trace: object
    base: object
    plans: dict = field(default_factory=dict)  # key -> plan as run
    entries: list = field(default_factory=list)  # (name, kind, key), kind: "space" | "policy" | "planner"
    budgets: dict = field(default_factory=dict)  # label -> bytes
    chosen: dict = field(default_factory=dict)  # label -> (key, solve_s)
    no_plan: dict = field(default_factory=dict)  # label -> why the planner gave none, or why it failed to run

    def name(self, key) -> str:
        return next(n for n, _, k in self.entries if k == key)


def prepare(model: str, profile, planners=()) -> Case:
    """The space, the budgets (from ``profile``'s predicted peaks) and the planner's plan per budget with
    ``profile``; and with each of ``planners`` ((suffix, profile) pairs) too, as budget "label suffix"."""
    from shard_planner.cost import estimate
    from shard_planner.errors import InfeasibleError
    from shard_planner.plan.measurement import plan_fingerprint
    from shard_planner.solve import PlanRequest, plan_model
    from shard_planner.trace import trace_model

    path = str(common.EXAMPLES / f"{model}.py")
    trace = trace_model(path)
    base = common.base_plan(path, trace, world_size=WORLD_SIZE)
    case = Case(model, trace, base)
    space = exhaustive_space(trace, base)
    peaks = sorted(estimate(trace, p, profile).memory.peak_bytes for _, p in space)
    # tight: 5% above the quantile's peak, so that the budget is not exactly some plan's peak
    case.budgets = {"loose": int(peaks[-1] * 1.5),
                    "tight": int(peaks[int(TIGHT_QUANTILE * (len(peaks) - 1))] * 1.05)}
    named = [(n, "space", p) for n, p in space] + [(n, "policy", p) for n, p in hand_written(trace, base)]
    planned = {}  # label -> (plan, solve_s)
    case.budgets = {label + suffix: budget for suffix, _ in (("", profile), *planners)
                    for label, budget in case.budgets.items()}
    by_label = {label + suffix: prof for suffix, prof in (("", profile), *planners) for label in BUDGETS}
    for label, budget in case.budgets.items():
        profile = by_label[label]
        t0 = time.perf_counter()
        try:
            # the budget is what a plan may fill; the planner keeps the profile's fragmentation share of --mem
            # free (profile.tensor_budget_bytes), so it is given the --mem whose usable part is the budget
            mem = profile.mem_for_tensor_budget(budget)
            plan = plan_model(trace, PlanRequest(gpus=WORLD_SIZE, mem_budget_bytes=mem, profile=profile,
                                                 micro_batch=base.training.micro_batch,
                                                 optimizer=base.training.optimizer, model_path=path)).plan
        except InfeasibleError as exc:  # reported as a miss: the space has plans that fit
            case.no_plan[label] = f"NO PLAN: {exc}"
            print(f"  {model}, {label} budget: the planner found no plan ({exc})", flush=True)
            continue
        planned[label] = (plan, time.perf_counter() - t0)

    def add(name, kind, plan):
        run = replace(plan, cluster=base.cluster)  # the planner's own cluster differs in gpus_per_node only
        key = plan_fingerprint(replace(run, predicted=None))
        case.plans.setdefault(key, run)
        case.entries.append((name, kind, key))
        return key

    for name, kind, plan in named:
        add(name, kind, plan)
    case.chosen = {label: (add(f"planner ({label} budget)", "planner", plan), solve_s)
                   for label, (plan, solve_s) in planned.items()}
    return case


# ---- measuring ----
@dataclass(frozen=True)
class Timed:
    """One plan of an interleaved launch: step times (rounds x steps), in seconds and relative to the
    typical plan of their round (benchmarks/timing_stats.py, [Note: normalising per round]; every
    comparison uses these), and the measured peak."""

    times_s: object  # numpy array (rounds, steps)
    rel: object  # the same, divided by the round's level: unitless
    peak_bytes: int


def measure_interleaved(jobs: dict, *, rounds: int, steps: int, warmup: int, timeout_s: float,
                        seed: int) -> tuple[dict, float]:
    """Run every plan of ``jobs`` (job id -> plan) once per round, in a shuffled order per round, all in
    ONE launch; returns ({job id: Timed}, wall seconds)."""
    from shard_planner.execute import run_plans

    ids = list(jobs)
    orders = ts.round_orders(len(ids), rounds, seed=seed)
    flat = [ids[i] for order in orders for i in order]
    t0 = time.perf_counter()
    ms = run_plans([jobs[j] for j in flat], world_size=WORLD_SIZE, steps=steps, warmup=warmup,
                   timeout_s=timeout_s, device="cpu")
    wall_s = time.perf_counter() - t0
    by_id = {j: [] for j in ids}
    for j, m in zip(flat, ms):  # in run order, so each plan's list is in round order
        by_id[j].append(m)
    times = {j: ts.as_matrix([x.step_time_s for x in m]) for j, m in by_id.items()}
    rel = ts.normalise_by_round(times)
    out = {}
    for j, m in by_id.items():
        peaks = {x.peak_bytes for x in m}
        if len(peaks) > 1:  # the storage tracker is exact: this would be news
            logger.warning("%s: measured peak differs between rounds: %s", j, sorted(peaks))
        out[j] = Timed(times[j], rel[j], max(peaks))
    return out, wall_s


def find_failing(case: Case, keys: list) -> dict:
    """Run each of ``keys`` alone for one step: {key: error} for those that fail."""
    from shard_planner.errors import RunError
    from shard_planner.execute import run_plans

    failed = {}
    for k in keys:
        try:
            run_plans([case.plans[k]], world_size=WORLD_SIZE, steps=1, warmup=1, timeout_s=600, device="cpu")
        except RunError as exc:
            failed[k] = str(exc)
    return failed


def screen(case: Case, args) -> tuple[dict, float]:
    """Every distinct plan, interleaved. A planner plan that FSDP2 rejects would take the launch down:
    then each planner plan runs alone to find it, it is reported as the planner's failure, and the
    screen runs again without it."""
    from shard_planner.errors import RunError

    jobs = dict(case.plans)
    try:
        return measure_interleaved(jobs, rounds=args.screen_rounds, steps=args.screen_steps, warmup=args.warmup,
                                   timeout_s=args.timeout, seed=args.seed)
    except RunError as exc:
        failed = find_failing(case, list(dict.fromkeys(k for k, _ in case.chosen.values())))
        if not failed:
            raise  # a plan of the space or a policy failed: a bug to look at, not a verdict
        print(f"  {case.model}: the screen failed ({exc}); planner plans that fail alone: {len(failed)}", flush=True)
        for label, (k, _) in list(case.chosen.items()):
            if k in failed:
                case.no_plan[label] = f"FAILED TO RUN: {failed[k][-160:]}"
                del case.chosen[label]
        for k in failed:
            del jobs[k]
        return measure_interleaved(jobs, rounds=args.screen_rounds, steps=args.screen_steps, warmup=args.warmup,
                                   timeout_s=args.timeout, seed=args.seed)


def fitting(case: Case, timed: dict, budget: int) -> list:
    return [k for k in case.plans if k in timed and timed[k].peak_bytes <= budget]


def confirmation_jobs(case: Case, timed: dict, top: int) -> dict:
    """Per budget the chosen plan and the ``top`` fastest of the screen that fit; one A/A copy."""
    jobs = {}
    for label, (chosen, _) in case.chosen.items():
        fits = sorted((k for k in fitting(case, timed, case.budgets[label]) if k != chosen),
                      key=lambda k: ts.pooled_median(timed[k].rel))
        for k in [chosen, *fits[:top]]:
            jobs.setdefault(k, case.plans[k])
    if case.chosen:
        first = next(iter(case.chosen.values()))[0]
        jobs[(first, AA_COPY)] = case.plans[first]
    return jobs


# ---- judging ----
@dataclass(frozen=True)
class Boot:
    """Bootstrap distributions of one launch: of each plan's median in seconds (its own interval) and
    of its round-normalised median (every comparison)."""

    s: dict
    rel: dict


def bootstrap(launch: dict, args) -> Boot:
    if not launch:
        return Boot({}, {})
    return Boot(*(ts.joint_bootstrap({k: getattr(t, attr) for k, t in launch.items()}, n_boot=args.boot,
                                     seed=args.seed) for attr in ("times_s", "rel")))


def verdict_of(over_budget: bool, gap: ts.Estimate) -> str:
    """Met when the chosen plan is within the target of the best, or cannot be told from it; never
    over budget."""
    if over_budget:
        return "MISSED: over budget"
    if gap.point <= TARGET_PCT:
        return f"met: gap <= {TARGET_PCT:g}%"
    if gap.lo <= 0.0:
        return "met: indistinguishable from the best"
    return "MISSED: slower than the best"


def plan_rows(case: Case, timed: dict, confirmed: dict, sboot: Boot, cboot: Boot, profile) -> list[dict]:
    from shard_planner.cost import estimate

    rows = []
    for name, kind, key in case.entries:
        if key not in timed:
            continue  # a planner plan that failed to run
        est = estimate(case.trace, case.plans[key], profile)
        s = ts.median_estimate(timed[key].times_s, sboot.s[key])
        c = ts.median_estimate(confirmed[key].times_s, cboot.s[key]) if key in confirmed else None
        rows.append(dict(model=case.model, kind=kind, plan=name, pred_peak_mib=est.memory.peak_bytes / 2**20,
                         meas_peak_mib=timed[key].peak_bytes / 2**20, pred_step_s=est.time.step_time_s,
                         screen_step_s=s.point, screen_lo_s=s.lo, screen_hi_s=s.hi,
                         screen_rel=ts.pooled_median(timed[key].rel),
                         confirm_step_s=c.point if c else None, confirm_lo_s=c.lo if c else None,
                         confirm_hi_s=c.hi if c else None,
                         confirm_rel=ts.pooled_median(confirmed[key].rel) if c else None, key=key))
    return rows


def aa_gap(confirmed: dict, cboot: Boot) -> ts.Estimate | None:
    """The A/A pair: how far apart two copies of one plan measured (the noise floor of the run)."""
    copies = [j for j in confirmed if isinstance(j, tuple) and j[1] == AA_COPY]
    if not copies:
        return None
    copy, orig = copies[0], copies[0][0]
    return ts.paired_gap_pct(confirmed[copy].rel, confirmed[orig].rel, cboot.rel[copy], cboot.rel[orig])


def judge_budget(case: Case, label: str, timed: dict, confirmed: dict, sboot: Boot, cboot: Boot,
                 aa: ts.Estimate | None) -> dict:
    from shard_planner.tune import describe_plan

    budget = case.budgets[label]
    fits = fitting(case, timed, budget)
    row = dict(model=case.model, budget=label, budget_mib=budget / 2**20, plans_that_fit=len(fits))
    if label in case.no_plan:
        return dict(row, chosen=case.no_plan[label][:160], verdict="MISSED: no runnable plan")
    key, solve_s = case.chosen[label]
    over = timed[key].peak_bytes > budget
    pool = fits if key in fits else [*fits, key]
    chosen_rel = ts.pooled_median(timed[key].rel)
    screen_rank = 1 + sum(1 for k in pool if k != key and ts.pooled_median(timed[k].rel) < chosen_rel)
    candidates = [k for k in confirmed if not isinstance(k, tuple) and (k in fits or k == key)]
    best, gap = ts.gap_to_best_pct(key, candidates, {k: confirmed[k].rel for k in candidates}, cboot.rel)
    row.update(chosen=describe_plan(case.plans[key]), chosen_meas_peak_mib=timed[key].peak_bytes / 2**20,
               chosen_over_budget=over, screen_rank=f"{screen_rank}/{len(pool)}",
               confirmed_plans=len(candidates), best=case.name(best),
               chosen_step_s=ts.pooled_median(confirmed[key].times_s),
               best_step_s=ts.pooled_median(confirmed[best].times_s),
               gap_pct=gap.point, gap_lo_pct=gap.lo, gap_hi_pct=gap.hi,
               aa_gap_pct=aa.point if aa else None, aa_lo_pct=aa.lo if aa else None,
               aa_hi_pct=aa.hi if aa else None, aa_includes_zero=aa.includes_zero() if aa else None,
               resolves_5pct=gap.half_width <= TARGET_PCT, verdict=verdict_of(over, gap), solve_s=solve_s)
    for name, kind, k in case.entries:  # the hand-written policies, from the screen (paired)
        if kind == "policy":
            row[f"vs {name.removeprefix('policy: ')} % (screen)"] = (
                "over budget" if timed[k].peak_bytes > budget else
                ts.paired_gap_pct(timed[key].rel, timed[k].rel, sboot.rel[key], sboot.rel[k]).fmt())
    return row


def judge(case: Case, timed: dict, confirmed: dict, profile, args) -> tuple[list[dict], list[dict]]:
    sboot, cboot = bootstrap(timed, args), bootstrap(confirmed, args)
    aa = aa_gap(confirmed, cboot)
    summary = [judge_budget(case, label, timed, confirmed, sboot, cboot, aa) for label in case.budgets]
    return plan_rows(case, timed, confirmed, sboot, cboot, profile), summary


def evaluate_model(model: str, profile, args, also=()) -> tuple[list[dict], list[dict], list[dict]]:
    """``also``: more profiles the planner plans with (--also-profile), judged on the same measurements;
    with --timings the profile without its module times is planned with too."""
    t0 = time.perf_counter()
    planners = [(f" [{p.name}]", p) for p in also]
    if args.timings:
        planners.insert(0, (f" [{profile.name}, no timings]", profile))
        profile = common.timed_profile(model, profile, world_size=WORLD_SIZE)
    case = prepare(model, profile, planners)
    print(f"  {model}: {len(case.plans)} distinct plans; traced and planned in {time.perf_counter() - t0:.0f} s",
          flush=True)
    timed, wall_s = screen(case, args)
    print(f"  {model}: screen, {len(timed)} plans x {args.screen_rounds} rounds x {args.screen_steps} steps: "
          f"{wall_s:.0f} s (load {common.load_text()})", flush=True)
    jobs = confirmation_jobs(case, timed, args.confirm_top)
    confirmed = {}
    if jobs:  # else the planner gave no runnable plan at any budget: nothing to confirm
        confirmed, wall_s = measure_interleaved(jobs, rounds=args.confirm_rounds, steps=args.confirm_steps,
                                                warmup=args.warmup, timeout_s=args.timeout, seed=args.seed + 1)
        print(f"  {model}: confirmation, {len(jobs)} jobs x {args.confirm_rounds} rounds x {args.confirm_steps} "
              f"steps: {wall_s:.0f} s (load {common.load_text()})", flush=True)
    rows, summary = judge(case, timed, confirmed, profile, args)
    steps = step_rows(case, "screen", timed) + step_rows(case, "confirmation", confirmed)
    return rows, summary, steps


def step_rows(case: Case, stage: str, timed: dict) -> list[dict]:
    """Every timed step, for re-analysis (plan_quality_steps.csv)."""
    out = []
    for job, t in timed.items():
        key, copy = job if isinstance(job, tuple) else (job, "")
        for r, times in enumerate(t.times_s):
            out += [dict(model=case.model, stage=stage, plan=case.name(key) + (f" ({copy})" if copy else ""),
                         round=r, step=i, step_s=float(v)) for i, v in enumerate(times)]
    return out


def plot(rows: list[dict], summary: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8.4), squeeze=False,
                             gridspec_kw={"height_ratios": [1.6, 1]})
    for ax, model in zip(axes[1], models):
        plot_gaps(ax, model, [s for s in summary if s["model"] == model and "gap_pct" in s])
    for ax, model in zip(axes[0], models):
        sel = [r for r in rows if r["model"] == model]
        for kind, marker, color in (("space", "o", "tab:blue"), ("policy", "s", "tab:orange"),
                                    ("planner", "*", "tab:red")):
            pts = [r for r in sel if r["kind"] == kind]
            ax.errorbar([r["meas_peak_mib"] for r in pts], [r["screen_step_s"] for r in pts],
                        yerr=[[r["screen_step_s"] - r["screen_lo_s"] for r in pts],
                              [r["screen_hi_s"] - r["screen_step_s"] for r in pts]],
                        fmt=marker, ms=11 if kind == "planner" else 5, color=color, elinewidth=0.8, capsize=2,
                        label=f"{kind} (screen)", zorder=3 if kind == "planner" else 2)
        conf = [r for r in sel if r["confirm_step_s"] is not None]
        ax.scatter([r["meas_peak_mib"] for r in conf], [r["confirm_step_s"] for r in conf], s=90,
                   facecolors="none", edgecolors="black", label="confirmation median", zorder=4)
        for s in summary:
            if s["model"] == model and "[" not in s["budget"]:  # a budget once, not per planning profile
                ax.axvline(s["budget_mib"], ls="--", color="grey", lw=1)
                ax.text(s["budget_mib"], ax.get_ylim()[1], f" {s['budget']} budget", va="top", fontsize=8)
        ax.set_xlabel("measured peak memory per rank (MiB)")
        ax.set_ylabel("step time, median of all steps (s; 95% interval)")
        ax.set_title(f"{model} (tiny): every plan of the space, measured")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Plan quality on CPU/gloo, world size {WORLD_SIZE}, plans interleaved in rounds")
    fig.tight_layout()
    return fig


def plot_gaps(ax, model: str, cases: list[dict]) -> None:
    """The confirmation stage: chosen vs best per budget and the A/A pair, with 95% intervals."""
    labels, points, los, his = [], [], [], []
    for s in cases:
        labels.append(f"chosen vs best\n({s['budget']} budget)")
        points.append(s["gap_pct"]), los.append(s["gap_lo_pct"]), his.append(s["gap_hi_pct"])
    if cases and cases[0]["aa_gap_pct"] is not None:
        labels.append("A/A: same plan\ntwice (noise)")
        points.append(cases[0]["aa_gap_pct"]), los.append(cases[0]["aa_lo_pct"]), his.append(cases[0]["aa_hi_pct"])
    y = list(range(len(labels)))
    ax.errorbar(points, y, xerr=[[p - lo for p, lo in zip(points, los)], [hi - p for p, hi in zip(points, his)]],
                fmt="o", color="black", capsize=3)
    ax.axvline(0, color="grey", lw=1)
    ax.axvspan(-TARGET_PCT, TARGET_PCT, color="tab:green", alpha=0.12, label=f"within {TARGET_PCT:g}%")
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("slower than the reference (%), confirmation stage, 95% interval")
    ax.set_title(f"{model}: gap of the planner's choice", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def verdict_line(summary: list[dict]) -> str:
    cases = [s for s in summary if "gap_pct" in s]
    met = bool(summary) and all(s["verdict"].startswith("met") for s in summary)
    worst = max(cases, key=lambda s: s["gap_pct"]) if cases else None
    unresolved = sum(1 for s in cases if not s["resolves_5pct"])
    aa_failed = list(dict.fromkeys(s["model"] for s in cases if s["aa_includes_zero"] is False))
    return (f"target (within {TARGET_PCT:g}% of the measured best or indistinguishable from it, never over "
            f"budget): {'met' if met else 'MISSED'} (met in {sum(s['verdict'].startswith('met') for s in summary)}/"
            f"{len(summary)} case(s))"
            + (f"; largest gap {worst['gap_pct']:+.1f}% [{worst['gap_lo_pct']:+.1f}, {worst['gap_hi_pct']:+.1f}] "
               f"({worst['model']}, {worst['budget']})" if worst else "")
            + (f"; {unresolved} case(s) with an interval wider than +-{TARGET_PCT:g}%: this run cannot resolve "
               f"{TARGET_PCT:g}% there" if unresolved else "")
            + (f"; A/A check FAILED for {', '.join(aa_failed)}: two copies of one plan measured apart with an "
               "interval excluding 0, so the intervals there are too narrow and an 'indistinguishable' verdict "
               "there is not evidence" if aa_failed else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--screen-rounds", type=int, default=2, help="rounds of the screen (default 2)")
    ap.add_argument("--screen-steps", type=int, default=6, help="timed steps per plan per screen round (default 6)")
    ap.add_argument("--confirm-rounds", type=int, default=12, help="rounds of the confirmation (default 12)")
    ap.add_argument("--confirm-steps", type=int, default=5,
                    help="timed steps per plan per confirmation round (default 5: jobs of one plan differ more "
                         "than its steps, so rounds buy more than steps)")
    ap.add_argument("--confirm-top", type=int, default=3,
                    help="fastest plans of the screen that fit, confirmed beside the chosen one (default 3)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", default="cpu-gloo", help="the profile the planner plans with (name or path)")
    ap.add_argument("--also-profile", nargs="*", default=[], metavar="PROFILE",
                    help="the planner also plans with these profiles (name or path); their choices are confirmed "
                         "and judged on the same measurements, as budget 'loose [NAME]' / 'tight [NAME]'")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for one launch (default 1800)")
    ap.add_argument("--boot", type=int, default=ts.N_BOOT, help=f"bootstrap resamples (default {ts.N_BOOT})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the round orders and the bootstrap")
    ap.add_argument("--timings", action="store_true",
                    help="the planner prices compute from module times measured here first (shard-planner "
                         "calibrate --model), as the README recommends on a real machine; default: FLOPs")
    args = ap.parse_args(argv)
    if min(args.screen_rounds, args.confirm_rounds, args.screen_steps, args.confirm_steps) < 1:
        ap.error("rounds and steps must be at least 1")
    common.quiet_logs()
    common.set_model_size(None)
    from shard_planner.hardware.profile import load_profile

    profile = load_profile(args.profile)
    start = time.perf_counter()
    print(f"bench_plan_quality: load {common.load_text()} at the start", flush=True)
    rows, summary, steps = [], [], []
    for model in args.models:
        r, s, t = evaluate_model(model, profile, args, [load_profile(p) for p in args.also_profile])
        rows += r
        summary += s
        steps += t
    columns = ["model", "kind", "plan", "pred_peak_mib", "meas_peak_mib", "pred_step_s", "screen_step_s",
               "screen_lo_s", "screen_hi_s", "screen_rel", "confirm_step_s", "confirm_lo_s", "confirm_hi_s",
               "confirm_rel"]
    common.print_table(rows, title=f"Every plan, measured (CPU, gloo, world size {WORLD_SIZE}; median of all "
                                   "steps and its 95% interval; rel: relative to the typical plan of its round)",
                       columns=columns)
    common.write_csv(rows, "plan_quality", columns=columns)
    common.write_csv(steps, "plan_quality_steps")
    scols = list(dict.fromkeys(k for s in summary for k in s))
    short = [c for c in scols if not c.startswith("vs ")]
    common.print_table(summary, title="The planner's choice vs the measured best (confirmation stage)",
                       columns=short)
    common.print_table(summary, title="The planner's choice vs the hand-written policies (screen, paired, %)",
                       columns=["model", "budget"] + [c for c in scols if c.startswith("vs ")])
    common.write_csv(summary, "plan_quality_summary", columns=scols)
    common.save_figure(plot(rows, summary), "plan_quality")
    print(verdict_line(summary))
    print(f"\nbench_plan_quality: {time.perf_counter() - start:.0f} s (load {common.load_text()} at the end); "
          f"outputs in {common.OUT_DIR}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CI", "1")
    sys.exit(main())
