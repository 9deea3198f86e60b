"""A golden dump of the cost model's estimates and the planner's choices, to prove that a refactoring
changes no number (issue 27: "behaviour does not change").

    python benchmarks/golden_estimates.py --out /tmp/golden_before.json     # on the commit before
    python benchmarks/golden_estimates.py --check /tmp/golden_before.json   # after every commit
    python benchmarks/golden_estimates.py --tiny --out FILE                 # hand-written traces only

What it records, as one canonical JSON document (keys sorted, floats as ``repr`` writes them, so two
dumps are equal byte for byte exactly when every number is):

- estimates: for every trace of a fixed corpus, on one or more profiles, a fixed list of plans
  (:func:`plans_for`: hand-written layouts x reshard True / False / int x prefetch depths x full and
  selective checkpointing x grouped units x CPU offload x gradient accumulation x HSDP x dtypes x
  optimizers), each priced by ONE CostModel per (trace, profile) in that order — so a memo keyed on too
  few fields shows as a stale number — with every field of the Estimate, the memory timeline included;
  beside it the peak without the timeline, whether a fresh CostModel (``shard_planner.cost.estimate``)
  agrees, ``model_state_bytes`` and a few ``module_compute_s``. A plan the cost model rejects records
  its error (that is behaviour too).
- plans: the plan ``plan_model`` chooses for the cases of benchmarks/bench_plan.py (``SPEEDUP`` and the
  8B timing row; not 70B, for the runtime), without the solver's wall-clock text.

The corpus: the hand-written traces of tests/models (solve_traces.py, cost_synth.py, report_fixtures.py,
cost_mlp.py), the examples at their tiny size traced in bf16 and fp32, and examples/llama.py at 8b.
``--tiny`` keeps only the small hand-written traces and no planner cases (seconds; the test's corpus).
``--check`` recomputes and exits 1 naming the first path where the documents differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "models"))

from common import layout, make_units, plan_variants  # noqa: E402
from shard_planner.cost import CostModel, estimate, model_state_bytes  # noqa: E402
from shard_planner.plan import ROOT as ROOT_MODULE  # noqa: E402
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit  # noqa: E402
from shard_planner.plan.numerics import Numerics  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402

EXAMPLES = ("gpt2", "llama", "vit", "encdec", "unet", "shape")
WORLD = 8  # ranks of every corpus plan but the HSDP and 2-rank ones


# ---- canonical JSON ----
def canonical(value):
    """``value`` as plain JSON data: dataclasses and named tuples as dicts of their fields, enums as their
    values, tuples as lists, dict keys as strings. Floats stay floats (json writes them with ``repr``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return canonical(value.value)
    if hasattr(value, "_asdict"):
        return canonical(value._asdict())
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"no canonical form for {type(value).__name__}")


def dumps(doc) -> str:
    return json.dumps(canonical(doc), sort_keys=True, allow_nan=True) + "\n"


def first_difference(a, b, path: str = "$") -> str | None:
    """The JSON path of the first place where ``a`` and ``b`` differ (None: equal)."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} {a!r:.200} != {type(b).__name__} {b!r:.200}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: only in the {'new' if k not in a else 'golden'} dump"
            hit = first_difference(a[k], b[k], f"{path}.{k}")
            if hit:
                return hit
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            hit = first_difference(x, y, f"{path}[{i}]")
            if hit:
                return hit
        return None if len(a) == len(b) else f"{path}: length {len(a)} != {len(b)}"
    return None if a == b or (a != a and b != b) else f"{path}: {a!r:.200} != {b!r:.200}"


# ---- the corpus ----
def hand_written(tiny: bool) -> list[tuple[str, object, list]]:
    """(name, trace, profiles) of the hand-written traces the cost and solver tests use (``tiny``: not the
    80-layer one)."""
    import cost_mlp
    import cost_synth
    import report_fixtures
    import solve_traces

    h100, test_gpu = load_profile("h100-80gb"), solve_traces.profile()
    gloo = load_profile("cpu-gloo")
    corpus = [
        ("solve_traces.stack_trace(4)", solve_traces.stack_trace(4), [test_gpu, h100]),
        ("solve_traces.stack_trace(6, unsplit)", solve_traces.stack_trace(6, split_block=False), [test_gpu]),
        ("cost_synth.synthetic_trace(8, 1024, 512)", cost_synth.synthetic_trace(8, 1024, 512), [h100, gloo]),
        ("report_fixtures.make_trace(8)", report_fixtures.make_trace(8), [h100]),
        ("cost_mlp.analytic_trace()", cost_mlp.analytic_trace(), [gloo]),
    ]
    if not tiny:
        corpus.append(("cost_synth.synthetic_trace(80)", cost_synth.synthetic_trace(80, 8192, 4096), [h100]))
    return corpus


def traced() -> list[tuple[str, object, list]]:
    """The examples at their tiny size in bf16 and fp32, and examples/llama.py at 8b (bf16)."""
    from shard_planner.trace import trace_model

    h100, gloo, roofline = (load_profile(n) for n in ("h100-80gb", "cpu-gloo", "cpu-gloo-roofline"))
    out = []
    for ex in EXAMPLES:
        for dtype in ("bfloat16", "float32"):
            set_size(None)
            out.append((f"examples/{ex}.py tiny {dtype}", trace_model(str(ROOT / "examples" / f"{ex}.py"), dtype=dtype),
                        [h100, gloo, roofline]))
    set_size("8b")
    out.append(("examples/llama.py 8b bfloat16", trace_model(str(ROOT / "examples" / "llama.py")), [h100]))
    set_size(None)
    return out


def set_size(size: str | None) -> None:
    os.environ.pop("SHARD_PLANNER_SEQ", None)
    if size is None:
        os.environ.pop("SHARD_PLANNER_SIZE", None)
    else:
        os.environ["SHARD_PLANNER_SIZE"] = size


def plans_for(trace) -> list[tuple[str, Plan]]:
    """The fixed plans of one trace: benchmarks/common.py's ``plan_variants`` (layouts x reshard x prefetch
    x full AC x fp32 x offload) and what they leave out: selective checkpointing, int reshard, HSDP,
    accumulation (each gradient sync, parameters kept gathered), SGD, micro-batch 2, 2 ranks."""
    base = Plan(ModelRef("golden", trace.fingerprint, seq_len=trace.tokens_per_sample),
                Cluster(WORLD, 8, "golden", 2**40), Mesh(WORLD), Training(1), (Unit((ROOT_MODULE,), False),))
    per_block, pairs = layout(trace, "per-block"), layout(trace, "pairs")
    blocks = make_units(per_block)
    tr = base.training

    def accumulate(sync: str, keep: bool) -> Training:
        return replace(tr, accumulation_steps=4, gradient_sync=sync, keep_params_gathered=keep)

    return plan_variants(trace, base, int_reshard=4) + [
        ("per-block selective", replace(base, units=make_units(per_block, ac="selective"))),
        ("pairs selective every other pf2/1", replace(base, units=make_units(pairs, ac=lambda i: "selective" if i % 2
                                                                              else False), prefetch=Prefetch(2, 1))),
        ("per-block pf0/3 reshard 2", replace(base, units=make_units(per_block, reshard=2), prefetch=Prefetch(0, 3))),
        ("per-block HSDP 2x4", replace(base, units=blocks, mesh=Mesh(4, 2))),
        ("per-block HSDP 2x4 offload AC", replace(base, units=make_units(per_block, ac=True), mesh=Mesh(4, 2),
                                                  training=replace(tr, cpu_offload=True))),
        ("per-block accumulate 4 every", replace(base, units=blocks, training=accumulate("every_micro_step", False))),
        ("per-block accumulate 4 last", replace(base, units=blocks, training=accumulate("last_micro_step", False))),
        ("per-block accumulate 4 last kept AC", replace(base, units=make_units(per_block, ac=True),
                                                        training=accumulate("last_micro_step", True))),
        ("per-block sgd mb 2", replace(base, units=blocks, training=replace(tr, optimizer="sgd", micro_batch=2))),
        ("per-block fp32 reduce bf16", replace(base, units=blocks, training=replace(tr, reduce_dtype="bfloat16"))),
        ("pairs root reshard", replace(base, units=(Unit((ROOT_MODULE,), True), *make_units(pairs)[1:]))),
        ("per-block 2 ranks", replace(base, units=blocks).with_world_size(2)),
    ]


# ---- what is recorded ----
def record_trace(trace, profiles) -> dict:
    """Every plan of :func:`plans_for` on every profile, priced by one CostModel per profile in order."""
    out = {}
    plans = plans_for(trace)
    for profile in profiles:
        model = CostModel(trace, profile)
        rows = {}
        for label, plan in plans:
            rows[label] = record_plan(model, trace, plan, profile)
        rows["module_compute_s"] = {str(fqn): record_call(lambda f=fqn: model.module_compute_s(f, 2, Numerics()))
                                    for fqn in (None, ROOT_MODULE, *(g[0] for g in layout(trace, "per-block")[:2]))}
        out[profile.name] = rows
    return out


def record_call(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a rejection is behaviour, recorded as such
        return {"error": f"{type(exc).__name__}: {exc}"}


def record_plan(model: CostModel, trace, plan: Plan, profile) -> dict:
    def run() -> dict:
        full = model.estimate(plan)
        lean = model.estimate(plan, timeline=False)
        fresh = estimate(trace, plan, profile)
        return {"estimate": full, "peak_without_timeline": lean.memory.peak_bytes,
                "time_without_timeline_equal": lean.time == full.time,
                "fresh_model_equal": canonical(fresh) == canonical(full),
                "model_state_bytes": model_state_bytes(trace, plan)}
    return record_call(run)


def record_plans() -> dict:
    """The plan ``plan_model`` chooses for bench_plan.py's cases (the 8B timing row and SPEEDUP)."""
    from bench_plan import SPEEDUP, TIMING
    from shard_planner.errors import InfeasibleError
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.solve import PlanRequest, plan_model
    from shard_planner.trace import trace_model
    from shard_planner.units import parse_bytes

    profile = load_profile("h100-80gb")
    cases = [(ex, size, gpus, budget) for _, ex, size, gpus, budget, _ in TIMING if size != "70b"]
    cases += [(ex, size, gpus, b) for ex, size, gpus, tight, roomy in SPEEDUP for b in (tight, roomy)]
    out, traces = {}, {}
    for ex, size, gpus, budget in cases:
        path = str(ROOT / "examples" / f"{ex}.py")
        set_size(size)
        if (ex, size) not in traces:
            traces[ex, size] = trace_model(path, dtype="bfloat16")
        micro_batch = int(load_model_file(path).training.get("micro_batch", 1))
        request = PlanRequest(gpus=gpus, mem_budget_bytes=parse_bytes(budget), profile=profile, gpus_per_node=8,
                              micro_batch=micro_batch, model_path=f"examples/{ex}.py", profile_name="h100-80gb")
        try:
            result = plan_model(traces[ex, size], request)
        except InfeasibleError as exc:
            out[f"{ex} {size} {gpus} {budget}"] = {"infeasible": str(exc)}
            continue
        plan = result.plan.to_dict()
        solver = plan.pop("solver")  # its status and seconds carry wall-clock text
        plan["solver"] = {"method": solver["method"], "objective": solver["objective"]}
        out[f"{ex} {size} {gpus} {budget}"] = {"plan": plan, "fastest_step_time_s": result.fastest_step_time_s,
                                               "estimate": result.estimate}
    set_size(None)
    return out


def build(tiny: bool) -> dict:
    from common import quiet_logs

    quiet_logs()
    corpus = hand_written(tiny) + ([] if tiny else traced())
    doc = {"estimates": {name: record_trace(trace, profiles) for name, trace, profiles in corpus}}
    if not tiny:
        doc["plans"] = record_plans()
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="write the dump to this file")
    what.add_argument("--check", help="recompute and compare with this dump; exit 1 at the first difference")
    ap.add_argument("--tiny", action="store_true", help="hand-written traces only, no planner cases")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    text = dumps(build(args.tiny))
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out} ({len(text) / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")
        return 0
    golden = Path(args.check).read_text()
    if text == golden:
        print(f"identical to {args.check} ({len(text) / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")
        return 0
    where = first_difference(json.loads(text), json.loads(golden)) or "the same data, other bytes"
    print(f"DIFFERS from {args.check}: {where}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
