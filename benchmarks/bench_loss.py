"""The loss over the output layer (issue 39 item 3): what chunked and fused cross-entropy change in a plan.

    python benchmarks/bench_loss.py

Llama 3 8B (examples/llama.py, SHARD_PLANNER_SIZE=8b: vocabulary 128,256, sequence 4096) on 8 H100s
(h100-80gb), FSDP2 without tensor parallelism (the chunked and fused losses are not combined with it yet), for
each loss of shard_planner/plan/loss.py, and measured on this CPU:

0. measured: the tiny Llama example (examples/llama.py, bf16, 2 gloo ranks, the storage tracker) planned for
   each loss on cpu-gloo (``plan --gpus 2 --mem 2GB``: one unit, the whole model), and the same plan with each of
   its two blocks a unit of its own (predicted by ``estimate``), each run for 2 steps after 1 of warm-up;
1. one fixed plan, ``estimate --recipe fsdp2-per-block`` at micro-batch 2: the same units for every loss, so
   the peak and step time differ by the loss alone; beside them what the loss holds by construction at its
   peak, in bytes per logit of the (micro-batch x sequence x vocabulary) logits: the model file's loss holds
   the bf16 logits (2 B), their fp32 copy (4 B) and the fp32 log-softmax it saves (4 B); the chunked loss the
   bf16 logits, every chunk's fp32 log-softmax and one chunk's fp32 copy (2 + 4 + 4/8 B); the fused loss no
   logits (the weight's and the hidden states' gradients instead, held from the forward);
2. the planner's answer at --mem 40GB (``plan --tp 1``): what the memory the loss frees buys (micro-batch,
   checkpointing).

Writes reports/benchmarks/loss.csv and loss.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import EXAMPLES, OUT_DIR, print_table, quiet_logs, write_csv  # noqa: E402
from shard_planner.cli.main import main as cli  # noqa: E402
from shard_planner.fileio import write_atomic  # noqa: E402
from shard_planner.plan import load_plan  # noqa: E402
from shard_planner.plan.loss import CHUNKS, LOSSES  # noqa: E402

VOCAB, SEQ, MICRO_BATCH = 128256, 4096, 2  # examples/llama.py at size 8b
LOSS_BYTES_PER_LOGIT = {"model": 2 + 4 + 4, "chunked": 2 + 4 + 4 / CHUNKS, "fused": 0}


def _quiet_cli(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli(list(args))
    if code:
        raise SystemExit(f"shard-planner {' '.join(args)} exited {code}:\n{out.getvalue()}")
    return out.getvalue()


def measured_rows(folder: Path) -> list[dict]:
    """Part 0: predicted against measured peaks on 2 CPU ranks (tests/model/test_loss_variants.py checks the same)."""
    from dataclasses import replace

    from shard_planner.cost import estimate
    from shard_planner.execute import run_plans
    from shard_planner.hardware.profile import load_priced_profile
    from shard_planner.model.hf import model_options
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.plan import Unit
    from shard_planner.trace import trace_for_plan

    plans = {}
    for loss in LOSSES:
        path = folder / f"cpu-{loss}.json"
        _quiet_cli("plan", str(EXAMPLES / "llama.py"), "--loss", loss, "--gpus", "2", "--mem", "2GB", "--profile",
                   "cpu-gloo", "-o", str(path), "--no-report")
        one = load_plan(path)
        blocks = replace(one, units=(Unit(("layers.0",), True), Unit(("layers.1",), True), one.units[-1]),
                         predicted=None)
        trace = trace_for_plan(load_model_file(one.model.path, model_options(one.model)), blocks)
        plans[loss, "one unit"] = one
        plans[loss, "a unit per block"] = replace(blocks, predicted=estimate(
            trace, blocks, load_priced_profile("cpu-gloo")).prediction())
    runs = run_plans(list(plans.values()), world_size=2, steps=2, warmup=1, device="cpu", timeout_s=600)
    return [{"setup": f"tiny Llama, 2 CPU ranks, {units}", "loss": loss,
             "predicted_mib": round(plan.predicted.peak_bytes / 2**20, 2), "measured_mib": round(run.peak_bytes / 2**20, 2),
             "peak_error_pct": round(100 * (plan.predicted.peak_bytes / run.peak_bytes - 1), 1),
             "measured_phase": max(run.memory, key=lambda m: m.peak_bytes).peak_phase, "final_loss": round(run.losses[-1], 4)}
            for ((loss, units), plan), run in zip(plans.items(), runs)]


def recipe_row(loss: str) -> dict:
    """The fixed plan's prediction, priced as ``estimate --recipe`` prices it (cli/estimate_recipe.py)."""
    from shard_planner.cli.estimate_recipe import recipe_plan_for
    from shard_planner.cli.main import build_parser
    from shard_planner.cost import estimate

    argv = ["estimate", str(EXAMPLES / "llama.py"), "--recipe", "fsdp2-per-block", "--gpus", "8", "--mem", "80GB",
            "--profile", "h100-80gb", "--micro-batch", str(MICRO_BATCH), "--loss", loss]
    plan, trace, profile = recipe_plan_for(build_parser(argv).parse_args(argv))
    p = estimate(trace, plan, profile).prediction()
    logits_gib = MICRO_BATCH * SEQ * VOCAB * LOSS_BYTES_PER_LOGIT[loss] / 2**30
    return {"setup": f"fsdp2-per-block, micro-batch {MICRO_BATCH}", "loss": loss,
            "peak_gib": round(p.peak_bytes / 2**30, 2),
            "activations_at_peak_gib": round(p.memory_at_peak.get("activations", 0) / 2**30, 2),
            "temporaries_at_peak_gib": round(p.memory_at_peak.get("temporaries", 0) / 2**30, 2),
            "loss_logits_gib": round(logits_gib, 2), "step_ms": round(p.step_time_s * 1e3, 1),
            "tokens_per_s": round(p.tokens_per_s)}


def planner_row(loss: str, folder: Path) -> dict:
    plan_path = folder / f"plan-{loss}.json"
    _quiet_cli("plan", str(EXAMPLES / "llama.py"), "--gpus", "8", "--mem", "40GB", "--tp", "1", "--loss", loss,
               "-o", str(plan_path), "--no-report")
    plan = load_plan(plan_path)
    p = plan.predicted
    return {"setup": "plan --mem 40GB --tp 1", "loss": loss, "peak_gib": round(p.peak_bytes / 2**30, 2),
            "micro_batch": plan.training.micro_batch,
            "checkpointed": sum(1 for u in plan.units if u.activation_checkpoint),
            "step_ms": round(p.step_time_s * 1e3, 1), "tokens_per_s": round(p.tokens_per_s)}


def main() -> int:
    quiet_logs()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["SHARD_PLANNER_SIZE"] = "tiny"
        measured = measured_rows(folder)
        os.environ["SHARD_PLANNER_SIZE"] = "8b"
        fixed = [recipe_row(loss) for loss in LOSSES]
        planned = [planner_row(loss, folder) for loss in LOSSES]
    print_table(measured, title="measured on this CPU")
    print_table(fixed, title="one plan (fsdp2-per-block), each loss")
    print_table(planned, title="the planner's answer, each loss")
    write_csv(measured + fixed + planned, "loss")
    md = ["# The loss over the output layer (benchmarks/bench_loss.py)", "",
          "See the script's docstring for the setups.", "", "## Measured on this CPU", "", _table(measured), "",
          "## Llama 3 8B on 8 H100s, predicted", "",
          "`loss_logits_gib`: what the loss holds of the logits by construction at its peak (bytes per logit x "
          "micro-batch x sequence x vocabulary).", "", _table(fixed), "", _table(planned), ""]
    write_atomic(OUT_DIR / "loss.md", "\n".join(md).encode())
    print(json.dumps({"wrote": [str(OUT_DIR / "loss.csv"), str(OUT_DIR / "loss.md")]}))
    return 0


def _table(rows: list[dict]) -> str:
    cols = list(rows[0])
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows])


if __name__ == "__main__":
    sys.exit(main())
