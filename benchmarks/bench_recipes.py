"""Never worse than a recipe (issue 38): per case, the planner's answer beside every recipe people run
(shard_planner/plan/recipes.py), each recipe priced here apart from the planner by the same cost model.

    python benchmarks/bench_recipes.py [--only SUBSTR] [--max-cases N] [--max-s S]

Per case (a model, a GPU count, a profile, a budget; the micro-batch fixed per model, tensor parallelism
not searched: ``plan_model`` at degree 1): ``plan_model`` gives the answer (its predicted step time, the
caching allocator's retries priced); then every recipe is built on the answer's mesh, micro-batch and
accumulation, with its own units, reshard, checkpointing and offload, FSDP2's default prefetch where its
stack exposes none and each of the planner's prefetch depths where it leaves prefetch to the planner, and
judged as the planner judges a plan: its allocated peak within the usable budget and, on a GPU profile, its
first two steps surviving --mem in the simulated caching allocator (cost/fits.py), its retries priced.
Columns: the answer's step time and peak, the best recipe that fits and its step time, ``ratio`` = best
recipe's step time / the answer's (above 1: the answer is faster), ``loss`` when the recipe is faster by more
than the solver's tolerance (shard_planner/solve/never_worse.py ``RECIPE_TOLERANCE``, 0.1%), and the same
against torchtitan's recipes alone (the fastest of its AC modes that fits).

``--compare CSV`` sets the answers beside another run's recipes.csv (the committed recipes_main.csv: main at
a9e1fe7, before the recipes joined the search, run with this script on a tree that adds recipes.py and
never_worse.py to it).

Budgets: the device's whole memory, 60% and 35% of it (a budget no plan fits is a row marked infeasible, not
counted). The grid is :data:`CASES` (the issue's two cases first); ``--max-s`` stops starting cases after
that many seconds, the rows done so far written. Writes reports/benchmarks/recipes.csv and recipes.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import EXAMPLES, OUT_DIR, print_table, quiet_logs, write_csv  # noqa: E402
from shard_planner.cost import CostModel  # noqa: E402
from shard_planner.cost.fits import device_fit  # noqa: E402
from shard_planner.errors import InfeasibleError  # noqa: E402
from shard_planner.fileio import write_atomic  # noqa: E402
from shard_planner.plan.finetune import FineTune  # noqa: E402
from shard_planner.model.hf import HfOptions  # noqa: E402
from shard_planner.model.modelfile import load_model_file  # noqa: E402
from shard_planner.plan import Prefetch  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from shard_planner.plan.recipes import RECIPES  # noqa: E402
from shard_planner.solve import PlanRequest, plan_model  # noqa: E402
from shard_planner.solve.never_worse import RECIPE_TOLERANCE  # noqa: E402
from shard_planner.solve.choice import PREFETCH_CHOICES  # noqa: E402
from shard_planner.solve.space import build_space  # noqa: E402
from shard_planner.trace import trace_model  # noqa: E402

BUDGET_SHARES = (1.0, 0.6, 0.35)  # of the device's memory
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
# transformers configs (published shapes): meta-llama/Meta-Llama-3-8B with fp32 weights (torchtitan's setup in
# the issue), mistralai/Mistral-7B-v0.1
HF_CONFIGS = {
    "llama3-8b-hf": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=8192, rope_theta=500000.0, torch_dtype="float32",
                                   use_cache=False, architectures=["LlamaForCausalLM"])),
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                   max_position_embeddings=32768, sliding_window=4096, use_cache=False,
                                   architectures=["MistralForCausalLM"])),
}


@dataclass(frozen=True)
class Model:
    label: str
    path: str  # an example (examples/NAME.py) or a key of HF_CONFIGS
    size: str | None = None  # SHARD_PLANNER_SIZE of an example
    seq_len: int | None = None
    finetune: FineTune | None = None
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class Case:
    model: Model
    gpus: int
    profile: str
    budget_share: float
    micro_batch: int


LLAMA8, LLAMA70, LLAMA405 = (Model(f"Llama 3 {s.upper()}", "llama", s) for s in ("8b", "70b", "405b"))
MISTRAL = Model("Mistral 7B", "mistral-7b", seq_len=4096)
MISTRAL_LORA = replace(MISTRAL, label="Mistral 7B LoRA r16", finetune=FineTune(16, QKVO))
MISTRAL_QLORA = replace(MISTRAL, label="Mistral 7B QLoRA r16", finetune=FineTune(16, QKVO, qlora=True), dtype="float16")
GPT2, VIT, UNET, ENCDEC = (Model("GPT-2 XL", "gpt2", "xl"), Model("ViT-L", "vit", "large"),
                           Model("U-Net base", "unet", "base"), Model("enc-dec base", "encdec", "base"))

ISSUE_CASES = [  # issue 38's two cases, at --mem = the whole device
    Case(Model("Llama 3 8B (HF, fp32 weights, seq 8192)", "llama3-8b-hf", seq_len=8192), 8, "h100-80gb", 1.0, 2),
    Case(MISTRAL_QLORA, 2, "a100-80gb", 1.0, 2),
]


def _grid() -> list[Case]:
    grid = []
    for model, gpu_counts, profiles, mb in [
        (LLAMA8, (8, 64), ("h100-80gb", "a100-80gb", "l4"), 2),
        (LLAMA70, (64, 256), ("h100-80gb", "a100-80gb"), 1),
        (LLAMA405, (512,), ("h100-80gb",), 1),
        (MISTRAL_LORA, (1, 8), ("a100-80gb", "l4"), 2),
        (MISTRAL_QLORA, (1, 2), ("a100-80gb", "l4"), 2),
        (MISTRAL, (8,), ("h100-80gb",), 2),
        (GPT2, (1, 8), ("a100-80gb", "l4"), 8),
        (VIT, (8,), ("a100-80gb", "l4"), 32),
        (UNET, (8,), ("h100-80gb",), 8),
        (ENCDEC, (8,), ("a100-80gb",), 8),
    ]:
        grid += [Case(model, g, p, share, mb) for g in gpu_counts for p in profiles for share in BUDGET_SHARES]
    return grid


CASES = ISSUE_CASES + _grid()


def _trace(model: Model, folder: Path, cache: dict):
    if model in cache:
        return cache[model]
    if model.path in HF_CONFIGS:
        import transformers

        model_type, fields = HF_CONFIGS[model.path]
        transformers.CONFIG_MAPPING[model_type](**fields).save_pretrained(folder / model.path)
        mf = load_model_file(str(folder / model.path / "config.json"),
                             HfOptions(seq_len=model.seq_len, finetune=model.finetune))
    else:
        os.environ["SHARD_PLANNER_SIZE"] = model.size
        mf = load_model_file(str(EXAMPLES / f"{model.path}.py"))
    cache[model] = trace_model(mf, dtype=model.dtype)
    return cache[model]


def _recipe_times(trace, plan, profile) -> dict[str, float]:
    """Recipe title -> its fastest step time (retries priced) that fits, at ``plan``'s global choices."""
    cm = CostModel(trace, profile)
    space = build_space(trace, shard_group=plan.mesh.shard_group_size,
                        gpus_per_node=plan.mesh.shard_ranks_per_node(plan.cluster.gpus_per_node))
    budget = profile.tensor_budget_bytes(plan.cluster.mem_budget_bytes)
    out: dict[str, float] = {}
    for r in RECIPES:
        if r.cpu_offload and profile.device == "cpu":
            continue
        for pf in (Prefetch(),) if r.fixes_prefetch else PREFETCH_CHOICES:
            p = replace(plan, units=r.units(space), prefetch=pf, predicted=None,
                        training=replace(plan.training, cpu_offload=r.cpu_offload))
            est = cm.estimate(p)
            fit = device_fit(cm, p)
            if est.memory.peak_bytes > budget or (fit is not None and not fit.survives):
                continue
            step_s = est.time.step_time_s + (fit.retry_s if fit is not None else 0.0)
            out[r.title] = min(out.get(r.title, step_s), step_s)
    return out


def run_case(case: Case, folder: Path, cache: dict) -> dict:
    profile = load_profile(case.profile)
    mem = int(profile.memory_bytes * case.budget_share)
    row = dict(model=case.model.label, gpus=case.gpus, profile=case.profile, mem_gib=round(mem / 2**30, 1),
               micro_batch=case.micro_batch)
    trace = _trace(case.model, folder, cache)
    t0 = time.perf_counter()
    try:
        result = plan_model(trace, PlanRequest(gpus=case.gpus, mem_budget_bytes=mem, profile=profile,
                                               gpus_per_node=profile.interconnect.gpus_per_node,
                                               micro_batch=case.micro_batch, param_dtype=case.model.dtype))
    except InfeasibleError:
        return dict(row, status="infeasible", plan_s=round(time.perf_counter() - t0, 1))
    plan = result.plan
    answer_s = plan.predicted.step_time_s
    recipes = _recipe_times(trace, plan, profile)
    row.update(status="planned", plan_s=round(time.perf_counter() - t0, 1), answer_ms=round(answer_s * 1e3, 1),
               answer_gib=round(plan.predicted.peak_bytes / 2**30, 2), method=plan.solver.method)
    if recipes:
        best = min(recipes, key=recipes.get)
        row.update(best_recipe=best, recipe_ms=round(recipes[best] * 1e3, 1), ratio=round(recipes[best] / answer_s, 4),
                   loss=answer_s > recipes[best] * (1 + RECIPE_TOLERANCE))
    titan = {k: v for k, v in recipes.items() if k.startswith("torchtitan")}
    if titan:
        row.update(titan_ratio=round(min(titan.values()) / answer_s, 4))
    return row


def _quantiles(values: list[float]) -> str:
    if not values:
        return "none"
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
    return (f"median {100 * (statistics.median(values) - 1):+.1f}%, p90 {100 * (p90 - 1):+.1f}%, "
            f"max {100 * (values[-1] - 1):+.1f}%")


def summary(rows: list[dict], grid_size: int) -> list[str]:
    planned = [r for r in rows if r["status"] == "planned"]
    compared = [r for r in planned if "ratio" in r]
    losses = [r for r in compared if r["loss"]]
    return [
        f"- cases run: {len(rows)} of the grid's {grid_size}; planned: {len(planned)}; infeasible (no plan fits "
        f"the budget): {len(rows) - len(planned)}; with a recipe that fits: {len(compared)}",
        f"- cases where a recipe is faster than the answer by more than {100 * RECIPE_TOLERANCE:.1f}%: {len(losses)}"
        + "".join(f"\n  - {r['model']}, {r['gpus']} x {r['profile']}, {r['mem_gib']} GiB: {r['best_recipe']}"
                  for r in losses),
        f"- the answer's gain over the best recipe that fits (its step time / the answer's - 1): "
        f"{_quantiles([r['ratio'] for r in compared])}",
        f"- over torchtitan's recipes alone (the fastest of its AC modes that fits): "
        f"{_quantiles([r['titan_ratio'] for r in planned if 'titan_ratio' in r])}",
    ]


def compared_with(rows: list[dict], before_csv: str) -> list[str]:
    """Lines that set ``rows`` beside the rows of another run's recipes.csv (e.g. main's, before the recipes
    joined the search): its losses, and how many answers are the same, faster or slower here."""
    import csv

    with open(before_csv, newline="") as f:
        before = {(r["model"], r["gpus"], r["profile"], r["mem_gib"]): r for r in csv.DictReader(f)}
    same, faster, slower, lost = 0, [], [], 0
    for r in rows:
        b = before.get((r["model"], str(r["gpus"]), r["profile"], str(r["mem_gib"])))
        if r["status"] != "planned" or b is None or b["status"] != "planned":
            continue
        lost += b["loss"] == "True"
        ratio = r["answer_ms"] / float(b["answer_ms"])
        if abs(ratio - 1) < 1e-9:
            same += 1
        (faster if ratio < 1 else slower if ratio > 1 else []).append((r, ratio))
    worst = max(slower, key=lambda x: x[1], default=None)
    return [f"- against {before_csv}: its cases lost to a recipe (by more than {100 * RECIPE_TOLERANCE:.1f}%): {lost}; "
            f"answers here the same {same}, faster {len(faster)} (median "
            f"{100 * (statistics.median([x[1] for x in faster]) - 1) if faster else 0:+.1f}%), slower {len(slower)}"
            + (f" (worst {100 * (worst[1] - 1):+.2f}%: {worst[0]['model']}, {worst[0]['gpus']} x {worst[0]['profile']}, "
               f"{worst[0]['mem_gib']} GiB)" if worst else "")]


COLUMNS = ["model", "gpus", "profile", "mem_gib", "micro_batch", "status", "answer_ms", "answer_gib", "method",
           "best_recipe", "recipe_ms", "ratio", "loss", "titan_ratio", "plan_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="only cases whose model label contains this")
    ap.add_argument("--max-cases", type=int, default=None)
    ap.add_argument("--max-s", type=float, default=None, help="start no case after this many seconds")
    ap.add_argument("--compare", default=None, metavar="CSV", help="another run's recipes.csv to set the answers beside")
    args = ap.parse_args()
    quiet_logs()
    cases = [c for c in CASES if args.only is None or args.only.lower() in c.model.label.lower()][:args.max_cases]
    rows, cache, t0 = [], {}, time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            if args.max_s is not None and time.perf_counter() - t0 > args.max_s:
                break
            rows.append(run_case(case, Path(tmp), cache))
            print(rows[-1], flush=True)
            write_csv(rows, "recipes", columns=COLUMNS)  # after every case: a stopped run keeps its rows
    print_table(rows, columns=COLUMNS)
    lines = summary(rows, len(CASES)) + (compared_with(rows, args.compare) if args.compare else [])
    print("\n".join(lines))
    md = ["# Never worse than a recipe (benchmarks/bench_recipes.py)", "", *lines, "",
          f"Wall time {time.perf_counter() - t0:.0f} s on this machine (load average {os.getloadavg()[0]:.1f}).", "",
          "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
          *("| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows)]
    write_atomic(OUT_DIR / "recipes.md", "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
