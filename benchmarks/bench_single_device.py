"""One GPU is not FSDP (issue 39 item 4): the single-device step against FSDP2 on one rank, measured and published.

    python benchmarks/bench_single_device.py [--skip-runs]

1. Measured on this CPU (one rank, storage tracker; ``shard-planner plan --gpus 1 --profile cpu-gloo`` with
   ``--engine single`` and ``--engine fsdp2``, each answer run by ``shard-planner run``'s launcher for 5 steps after
   2 of warm-up): examples/llama.py and examples/gpt2.py (built in fp32: the single-device plan casts them to
   bf16, FSDP2 keeps fp32 master weights), and a tiny transformers Llama config in bf16 with LoRA r=8 on q_proj
   and v_proj (hidden 256, 4 layers, sequence 256, micro-batch 4), where the planner picks the single-device
   step by itself; and examples/vit.py at micro-batch 1, whose peak is the optimizer step, also with
   ``--optimizer-in-backward``. Columns: the predicted and measured peak and their error, the same for the step
   time.
2. Published: torchtune's README "Optimization flags" table (pytorch/torchtune README.md, PR #2003, Nov 2024),
   its "+ Packed Dataset" row: Llama 3.2 3B full fine-tune with ``full_finetune_single_device`` on one A100,
   batch 2, every sample packed to 4096 tokens, bf16 (weights, gradients, AdamW states), no activation
   checkpointing, no compile, plain cross-entropy: 60.0 GiB "peak memory active"
   (``torch.cuda.memory_stats()["active_bytes.all.peak"]``) and 7,075 tokens/s. Predicted here from the
   Llama-3.2-3B config (benchmarks/data/llama-3.2-3b/config.json, meta-llama/Llama-3.2-3B's, ``use_cache``
   false) on a100-80gb at --mem 80GB, micro-batch 2, sequence 4096, the planner's answer (which checkpoints
   nothing there); the predicted allocated peak less the profile's ``reserved_bytes`` (CUDA context and
   communicator buffers, outside what the allocator's statistics count). What differs from torchtune's step
   and is not modelled: its own Llama modules (the planner traces transformers'), the loss on bf16 logits
   (transformers upcasts them to fp32 first), flex attention over the packed samples (transformers' SDPA here).

Writes reports/benchmarks/single_device.csv and single_device.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import EXAMPLES, OUT_DIR, error_pct, print_table, quiet_logs, write_csv  # noqa: E402
from shard_planner.cli.main import main as cli  # noqa: E402
from shard_planner.execute import launch_plans  # noqa: E402
from shard_planner.fileio import write_atomic  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from shard_planner.plan import load_plan  # noqa: E402
from shard_planner.units import format_bytes  # noqa: E402

LLAMA_32_3B = ROOT / "benchmarks" / "data" / "llama-3.2-3b" / "config.json"
TORCHTUNE_PACKED = dict(peak_gib=60.0, tokens_per_s=7075, source="pytorch/torchtune README.md, Optimization flags, "
                        "'+ Packed Dataset' (PR #2003)")
TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=256, intermediate_size=688,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
                  max_position_embeddings=512, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
                  torch_dtype="bfloat16", use_cache=False)
CPU_CASES = {  # name: (model, extra plan arguments)
    "examples/llama.py": (str(EXAMPLES / "llama.py"), []),
    "examples/gpt2.py": (str(EXAMPLES / "gpt2.py"), []),
    "tiny Llama config, LoRA r=8": (None, ["--lora", "8", "--seq-len", "256", "--batch-size", "4"]),
    "examples/vit.py, micro-batch 1": (str(EXAMPLES / "vit.py"), ["--batch-size", "1"]),
}
# the engines each case is planned for: (the row's label, plan arguments); the last only for the ViT case, whose
# peak is the optimizer step (cost/engines/single.py [Note: Optimizer in backward])
ENGINES = (("single", ["--engine", "single"]), ("fsdp2", ["--engine", "fsdp2"]),
           ("single, optimizer in backward", ["--engine", "single", "--optimizer-in-backward"]))


def _plan(model: str, engine: list[str], extra: list[str], out: Path, *more: str) -> object:
    with contextlib.redirect_stdout(io.StringIO()):  # the summaries: the tables below say what matters here
        assert cli(["plan", model, "--gpus", "1", *engine, "--no-report", "-o", str(out), *extra, *more]) == 0
    return load_plan(out)


def cpu_rows(folder: Path) -> list[dict]:
    """Part 1: each CPU case planned for both engines and run on one rank."""
    (folder / "tiny").mkdir()
    (folder / "tiny" / "config.json").write_text(json.dumps(TINY_LLAMA))
    plans = []
    for name, (model, extra) in CPU_CASES.items():
        model = model or str(folder / "tiny" / "config.json")
        for engine, args in ENGINES if name.startswith("examples/vit") else ENGINES[:2]:
            out = folder / f"{len(plans)}.json"
            plans.append((name, engine, _plan(model, args, extra, out, "--mem", "2GB", "--profile", "cpu-gloo")))
    measured = launch_plans([p for _, _, p in plans], steps=5, warmup=2, device="cpu", timeout_s=600).measurements
    rows = []
    for (name, engine, plan), m in zip(plans, measured):
        pr = plan.predicted
        rows.append({"model": name, "engine": engine, "units": len(plan.units),
                     "checkpointed": sum(1 for u in plan.units if u.activation_checkpoint),
                     "predicted_peak": format_bytes(pr.peak_bytes), "measured_peak": format_bytes(m.peak_bytes),
                     "peak_error_pct": round(error_pct(pr.peak_bytes, m.peak_bytes), 1) + 0.0,
                     "predicted_step_ms": round(pr.step_time_s * 1e3, 1),
                     "measured_step_ms": round(m.step_time_median_s * 1e3, 1),
                     "step_error_pct": round(error_pct(pr.step_time_s, m.step_time_median_s), 1) + 0.0})
    return rows


def published_rows(folder: Path) -> list[dict]:
    """Part 2: torchtune's packed Llama 3.2 3B row, predicted for both engines."""
    reserved = load_profile("a100-80gb").reserved_bytes
    rows = []
    for engine, args in ENGINES[:2]:
        plan = _plan(str(LLAMA_32_3B), args, ["--seq-len", "4096", "--batch-size", "2"], folder / f"3b-{engine}.json",
                     "--mem", "80GB", "--profile", "a100-80gb")
        pr = plan.predicted
        allocated_gib = (pr.peak_bytes - reserved) / 2**30
        rows.append({"case": "Llama 3.2 3B full fine-tune, 1 x A100, batch 2 x 4096 packed, bf16, AdamW, no AC",
                     "engine": engine, "checkpointed": sum(1 for u in plan.units if u.activation_checkpoint),
                     "predicted_gib": round(allocated_gib, 2), "published_gib": TORCHTUNE_PACKED["peak_gib"],
                     "peak_error_pct": round(error_pct(allocated_gib, TORCHTUNE_PACKED["peak_gib"]), 1) + 0.0,
                     "predicted_tokens_per_s": round(pr.tokens_per_s),
                     "published_tokens_per_s": TORCHTUNE_PACKED["tokens_per_s"],
                     "tokens_error_pct": round(error_pct(pr.tokens_per_s, TORCHTUNE_PACKED["tokens_per_s"]), 1) + 0.0})
    return rows


def markdown(cpu: list[dict], published: list[dict]) -> str:
    def table(rows):
        cols = list(rows[0])
        return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                         + ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows])

    parts = ["# One GPU: the single-device step against FSDP2 on one rank (benchmarks/bench_single_device.py)", "",
             "The single-device step (plan/engine.py `single`: plain PyTorch, every parameter cast to bf16, nothing "
             "gathered) and FSDP2 on one rank (`fully_shard` over a mesh of one still gathers each unit into a flat "
             "buffer and copies it out), each the planner's answer for the engine. See the script's docstring for "
             "the setups.", ""]
    if cpu:
        parts += ["## Measured on this CPU (one rank, storage tracker; step time by wall clock)", "", table(cpu), ""]
    parts += ["## Published: torchtune, one A100", "", f"Source: {TORCHTUNE_PACKED['source']}. Predicted: allocated "
              "peak less the profile's reserved_bytes; torchtune's own modules, loss on bf16 logits and flex "
              "attention are not what the planner traces (transformers' Llama, fp32 logits, SDPA).", "",
              table(published), ""]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-runs", action="store_true", help="the published rows only (no CPU runs)")
    args = ap.parse_args()
    quiet_logs()
    with tempfile.TemporaryDirectory() as tmp:
        cpu = [] if args.skip_runs else cpu_rows(Path(tmp))
        published = published_rows(Path(tmp))
    if cpu:
        print_table(cpu, title="measured on this CPU")
    print_table(published, title="published (torchtune)")
    write_csv(cpu + published, "single_device")
    path = OUT_DIR / "single_device.md"
    write_atomic(path, markdown(cpu, published))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
