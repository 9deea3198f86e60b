"""Llama 3.1 70B fine-tuned on 8 GPUs (issue 28's "must show"): full fine-tuning, LoRA and QLoRA side by side on
8 x 80GB and 8 x 24GB, and the LoRA plan's sharded state against the formula.

    python benchmarks/bench_finetune.py [--cases full,lora,qlora] [--skip-cli]

The model: benchmarks/data/llama-3.1-70b/config.json (meta-llama/Llama-3.1-70B's config.json, with
``use_cache: false``; hidden 8192, MLP 28672, 80 layers, 64 heads, 8 KV heads, vocabulary 128256, llama3 RoPE,
``torch_dtype`` bfloat16), sequence 2048, micro-batch 2 (``--batch-size 2``), AdamW, bf16 compute:

- ``full``: every parameter trains, the config with ``torch_dtype`` float32 (fp32 master weights, bf16
  compute: FSDP2's MixedPrecisionPolicy; ZeRO's 16 bytes a parameter);
- ``lora``: ``--lora 16 --lora-targets all-linear`` (peft): the base frozen in bf16 as the config loads it,
  fp32 adapters on every Linear of the layers;
- ``qlora``: the same adapters on an NF4 base (``--qlora``: torchao's to_nf4 on every Linear but the output
  layer).

Each case is traced once (timed: the 10 s target of the issue) and planned (timed, the same functions
``shard-planner plan`` calls) for 8 x 80GB (profile h100-80gb) and 8 x 24GB (profile l4). Columns: trace_s and
plan_s (wall clock), units, checkpointed units, whether the plan offloads to the CPU, the predicted peak per
GPU and tokens/s. For LoRA on 8 x 80GB the estimate's sharded parameters + optimizer states are compared with
(2 x frozen + 4 x trainable) / 8 + 8 x trainable / 8 bytes (bf16 base, fp32 adapters, AdamW's two fp32 states)
and must agree within 1%; the plan must not offload. Unless ``--skip-cli``, ``shard-planner plan`` itself runs
once for LoRA (a fresh process, --no-report): its wall time end to end.

Writes reports/benchmarks/finetune.csv and finetune.md and prints the tables. Wall times on the shared 2-core
machine are noisy: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import OUT_DIR, load_text, print_table, quiet_logs, write_csv  # noqa: E402
from shard_planner.cost import estimate  # noqa: E402
from shard_planner.cost.kernels import MATMUL  # noqa: E402
from shard_planner.errors import InfeasibleError  # noqa: E402
from shard_planner.fileio import write_atomic  # noqa: E402
from shard_planner.plan.finetune import ALL_LINEAR, FineTune  # noqa: E402
from shard_planner.model.hf import HfOptions  # noqa: E402
from shard_planner.model.modelfile import load_model_file  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from shard_planner.solve import PlanRequest, plan_model  # noqa: E402
from shard_planner.trace import trace_model  # noqa: E402
from shard_planner.units import format_bytes, parse_bytes  # noqa: E402

CONFIG = ROOT / "benchmarks" / "data" / "llama-3.1-70b" / "config.json"
GPUS, SEQ_LEN, MICRO_BATCH, RANK, TARGET_S, FORMULA_TOLERANCE = 8, 2048, 2, 16, 10.0, 0.01
CLUSTERS = (("8 x 80GB", "h100-80gb", "80GB"), ("8 x 24GB", "l4", "24GB"))
CASES = {
    "full": None,
    "lora": FineTune(lora_rank=RANK, lora_targets=(ALL_LINEAR,)),
    "qlora": FineTune(lora_rank=RANK, lora_targets=(ALL_LINEAR,), qlora=True),
}


def config_for(case: str, folder: Path) -> str:
    """The config to give: the 70B config itself, or for full fine-tuning a copy built in fp32."""
    if case != "full":
        return str(CONFIG)
    data = json.loads(CONFIG.read_text())
    (folder / "full").mkdir(exist_ok=True)
    (folder / "full" / "config.json").write_text(json.dumps({**data, "torch_dtype": "float32"}))
    return str(folder / "full" / "config.json")


def trace_case(case: str, path: str):
    """(trace, seconds): the config traced as ``shard-planner plan`` traces it (bf16 compute)."""
    t0 = time.perf_counter()
    model_file = load_model_file(path, HfOptions(seq_len=SEQ_LEN, finetune=CASES[case]))
    trace = trace_model(model_file, dtype="bfloat16")
    return trace, model_file, time.perf_counter() - t0


def plan_row(case: str, path: str, trace, cluster: tuple[str, str, str], trace_s: float) -> tuple[dict, object]:
    """One (case, cluster) planned: its row and the plan (None when nothing fits)."""
    label, profile_name, mem = cluster
    profile = load_profile(profile_name)
    budget = min(parse_bytes(mem), profile.memory_bytes)
    t0 = time.perf_counter()
    try:
        plan = plan_model(trace, PlanRequest(gpus=GPUS, mem_budget_bytes=budget, profile=profile, model_path=path,
                                             micro_batch=MICRO_BATCH, profile_name=profile_name)).plan
    except InfeasibleError as exc:
        plan, why = None, str(exc)
    plan_s = time.perf_counter() - t0
    row = {"case": case, "cluster": label, "profile": profile_name, "params": f"{trace.param_count / 1e9:.2f}B",
           "trainable": f"{trace.trainable_param_count / 1e6:,.1f}M", "trace_s": round(trace_s, 2),
           "plan_s": round(plan_s, 2)}
    if plan is None:
        return {**row, "fits": f"no: {why}"[:90]}, None
    p = plan.predicted
    return {**row, "fits": True, "units": len(plan.units), "ac": sum(bool(u.activation_checkpoint) for u in plan.units),
            "offload": plan.training.cpu_offload, "peak": format_bytes(p.peak_bytes),
            "tokens_per_s": round(p.tokens_per_s or 0), "alloc_retries": p.alloc_retries_per_step, "mfu": round(p.mfu or 0, 3),
            "step_s": round(p.step_time_s, 2), "dequant_s": round(dequant_seconds(trace, profile), 2)}, plan


def dequant_seconds(trace, profile) -> float:
    """Seconds of one step's NF4 dequantisation at HBM bandwidth, which the profile's "flops" compute model
    alone does not price (cost/quantized.py adds it to the step): the memory-bound kernels (all but matmuls) of the modules holding NF4 weights (stored as
    uint8 codes), forward and backward once at the micro-batch (a checkpointed unit dequantises again in its
    recomputation: not counted). 0 without NF4."""
    moved = sum(k.bytes.at(MICRO_BATCH) for m in trace.modules if "uint8" in m.frozen_param_bytes_by_dtype
                for k in m.fwd_kernels + m.bwd_kernels if k.op_class != MATMUL)
    return moved / profile.memory_bandwidth_bytes_per_s


def formula_check(trace, plan, profile_name: str) -> dict:
    """The estimate's sharded parameters + optimizer states at the peak against (2 F + 4 T) / 8 + 8 T / 8."""
    frozen = trace.param_count - trace.trainable_param_count
    trainable = trace.trainable_param_count
    formula = (2 * frozen + 4 * trainable) / GPUS + 8 * trainable / GPUS
    at_peak = estimate(trace, plan, load_profile(profile_name), timeline=False).prediction().memory_at_peak
    estimated = at_peak["sharded_params"] + at_peak["optimizer_states"]
    return {"frozen_params": frozen, "trainable_params": trainable, "sharded_params": at_peak["sharded_params"],
            "optimizer_states": at_peak["optimizer_states"], "estimate_bytes": estimated, "formula_bytes": round(formula),
            "error_pct": round(100 * (estimated / formula - 1), 3), "within_1pct": abs(estimated / formula - 1) <= FORMULA_TOLERANCE,
            "offload": plan.training.cpu_offload}


def plan_command(case: str, cluster: tuple[str, str, str], layouts: bool = False) -> list[str]:
    """The ``shard-planner plan`` command a (LoRA or QLoRA) row answers, as a user types it from the repository's
    root: the report lists these, and the docs quote them (tests/test_readme_figures.py checks that they agree).
    Full fine-tuning needs a copy of the config in fp32 (:func:`config_for`), so it has none. The rows plan FSDP
    alone (``--tp 1``: ``plan_model`` on the trace of the whole model); ``layouts``: the command without it, which
    also searches the tensor-parallel layouts (:func:`cli_plan`)."""
    _label, profile_name, mem = cluster
    finetune = CASES[case]
    argv = ["shard-planner", "plan", str(CONFIG.relative_to(ROOT)), "--lora", str(finetune.lora_rank), "--lora-targets",
            ALL_LINEAR]
    argv += ["--qlora"] if finetune.qlora else []
    return argv + ["--gpus", str(GPUS), "--mem", mem, "--profile", profile_name, "--batch-size", str(MICRO_BATCH),
                   "--seq-len", str(SEQ_LEN)] + ([] if layouts else ["--tp", "1"])


def cli_plan(folder: Path) -> tuple[float, str, list[str]]:
    """``shard-planner plan`` for LoRA on 8 x 80GB in a fresh process (--no-report), searching the tensor-parallel
    layouts as it does by default (LoRA splits with its base layers: trace/tp_adapters.py): wall seconds, its time
    line, and the chosen plan's layout lines from the summary."""
    out = folder / "plan.json"
    argv = [sys.executable, "-m", "shard_planner.cli.main", *plan_command("lora", CLUSTERS[0], layouts=True)[1:],
            "-o", str(out), "--no-report"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    seconds = time.perf_counter() - t0
    lines = done.stdout.splitlines()
    time_line = next((line for line in lines if line.startswith("time:")), done.stderr.strip()[-200:])
    searched = lines.index("layouts searched (the fastest plan of each):") if done.returncode == 0 else len(lines)
    layouts = [line.strip() for line in lines[searched + 1:] if line.startswith("  ")]
    summary = [line for line in lines if line.startswith(("predicted peak", "predicted step"))]
    return seconds, time_line, summary + layouts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: full, lora, qlora")
    ap.add_argument("--skip-cli", action="store_true", help="do not time shard-planner plan in a fresh process")
    args = ap.parse_args()
    quiet_logs()
    print(f"load at the start: {load_text()}", flush=True)
    rows, check = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            path = config_for(case, Path(tmp))
            trace, _mf, trace_s = trace_case(case, path)
            for cluster in CLUSTERS:
                row, plan = plan_row(case, path, trace, cluster, trace_s)
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
                if case == "lora" and cluster[1] == "h100-80gb" and plan is not None:
                    check = formula_check(trace, plan, cluster[1])
                    print(json.dumps(check), flush=True)
        cli = None if args.skip_cli else cli_plan(Path(tmp))
    write_report(rows, check, cli, load_text())
    return 0


def write_report(rows: list[dict], check: dict | None, cli: tuple[float, str, list[str]] | None, load: str) -> None:
    """Print the tables and write finetune.csv (the side-by-side rows) and finetune.md."""
    columns = ["case", "cluster", "profile", "params", "trainable", "trace_s", "plan_s", "fits", "units", "ac",
               "offload", "peak", "tokens_per_s", "alloc_retries", "mfu", "step_s", "dequant_s"]
    print_table(rows, title=f"Llama 3.1 70B on {GPUS} GPUs, seq {SEQ_LEN}, micro-batch {MICRO_BATCH} (load {load})",
                columns=columns)
    write_csv(rows, "finetune", columns=columns)
    md = [f"# Llama 3.1 70B fine-tuned on {GPUS} GPUs: full vs LoRA vs QLoRA", "",
          f"`python benchmarks/bench_finetune.py`; sequence {SEQ_LEN}, micro-batch {MICRO_BATCH}, AdamW, bf16 compute; "
          f"LoRA r={RANK} on all linear layers (peft, fp32 adapters, alpha {2 * RANK}); QLoRA the same on an NF4 base "
          "(torchao). Full fine-tuning keeps fp32 master weights. Shared 2-core CPU, load "
          f"{load} at the end (wall times noisy). Targets: trace and plan under {TARGET_S:g} s each.", "",
          _markdown(rows, columns), "", NOTES, "", "## The commands", "",
          "Each LoRA and QLoRA row is what this command answers, run from the repository's root (full fine-tuning "
          "gives `plan` a copy of the config with `torch_dtype` float32; `alloc_retries`: the CUDA caching "
          "allocator's cache releases per step the plan survives with, priced in its step time):", "",
          *(f"    {' '.join(plan_command(case, cluster))}" for case in CASES if case != "full" for cluster in CLUSTERS)]
    if check is not None:
        print_table([check], title="LoRA, 8 x 80GB: sharded parameters + optimizer states vs (2F + 4T)/8 + 8T/8")
        md += ["", "## LoRA on 8 x 80GB: sharded parameters + optimizer states against the formula", "",
               "(2 x frozen + 4 x trainable) / 8 + 8 x trainable / 8 bytes per GPU (bf16 base, fp32 adapters, AdamW); "
               "the estimate's `sharded_params` + `optimizer_states` at the peak. Must agree within 1%, and the plan "
               "must not offload.", "", _markdown([check], list(check))]
    if cli is not None:
        seconds, line, layouts = cli
        print(f"shard-planner plan (LoRA, 8 x 80GB, layouts searched, fresh process, --no-report): {seconds:.2f} s "
              f"wall; {line}", *layouts, sep="\n")
        md += ["", "## `shard-planner plan` end to end, the layouts searched", "",
               "LoRA on 8 x 80GB without `--tp 1`: the tensor-parallel layouts searched as well (the adapters split "
               "with their base layers: shard_planner/trace/tp_adapters.py), in a fresh process with `--no-report`:",
               "", f"    {' '.join(plan_command('lora', CLUSTERS[0], layouts=True))}", "",
               f"{seconds:.2f} s wall clock ({line}). What it printed of the chosen plan and each layout:", "",
               *(f"    {text}" for text in layouts)]
    write_atomic(OUT_DIR / "finetune.md", "\n".join(md) + "\n")


NOTES = """`dequant_s`: the NF4 dequantisation in QLoRA's step. torchao dequantises every NF4 weight to bf16 where
it is used (`LinearNF4`: forward, and again in backward for the input gradient), in eager elementwise ops (unpack
the 4-bit codes to int64, look them up, scale by the dequantised scalers, interleave) that move about 14 bytes per
element where the matmul reads 2. The trace records those kernels and their bytes, and their temporaries are in
the predicted peak (3.1 GiB for one 8192 x 28672 weight). These ops have no FLOPs, so the profiles' `flops`
compute model alone would price them at their launch overhead; cost/quantized.py adds their bytes at the
profile's HBM bandwidth ([Note: NF4 dequantisation time]), forward and backward, and again in a checkpointed
block's recomputation, so `step_s` holds them. `dequant_s` is that time forward and backward once (recomputation
not counted), computed here on its own: how much of QLoRA's step is dequantisation. Full fine-tuning and LoRA
have none.

Trace time: peft's `get_peft_model` builds 1,120 adapter Linears under FakeTensorMode (each made, then moved to
the base's dtype and cast back up to fp32: ~24,000 fake ops) - about 1.7 of LoRA's 3.8 s warm trace; the plain
70B config traces in 0.7 s warm. QLoRA's NF4 weights are built by shape under fake tensors (the real `to_nf4`
would take minutes: trace/build.py [Note: NF4 weights under fake tensors]). The first trace in a process also
pays FakeTensorMode's one-time set-up (~2 s)."""


def _markdown(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
