"""Medium (1-8B) transformers configs of each zoo architecture, planned on 8 GPUs at 40GB: how long
trace + plan take from a config.json (issue 13: under 10 s each).

    python benchmarks/bench_hf.py [--only NAME[,NAME]] [--profile h100-80gb]

Each architecture's config (published shapes, cited per entry in :data:`MEDIUM`) is written to a
temporary folder as a config.json (CLIP: a model file, its loss needs ``return_loss``) and given to the
same functions ``shard-planner plan config.json --gpus 8 --mem 40GB`` calls: ``load_model_file``,
``trace_model`` (bf16), ``plan_model``. Columns: ``params``; ``trace_s``, ``plan_s`` and ``total_s``
(wall clock); ``cpu_s`` (process CPU time of trace + plan, which a busy machine does not inflate);
``units``, ``ac`` (checkpointed units), ``peak`` (predicted per GPU), ``fits`` and ``under_10s``.

Writes reports/benchmarks/hf_plan.csv and hf_plan.md and prints the table. Wall times on the shared
2-core machine are noisy: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import OUT_DIR, load_text, print_table, quiet_logs, write_csv  # noqa: E402
from shard_planner.errors import InfeasibleError  # noqa: E402
from shard_planner.fileio import write_atomic  # noqa: E402
from shard_planner.model.modelfile import load_model_file  # noqa: E402
from shard_planner.hardware.profile import load_profile  # noqa: E402
from shard_planner.solve import PlanRequest, plan_model  # noqa: E402
from shard_planner.trace import trace_model  # noqa: E402
from shard_planner.units import format_bytes, parse_bytes  # noqa: E402

GPUS, BUDGET, TARGET_S = 8, "40GB", 10.0

# name -> (model_type, config fields): published shapes (the config.json of the named checkpoint)
MEDIUM = {
    # meta-llama/Meta-Llama-3-8B
    "llama-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=8192, rope_theta=500000.0,
                               architectures=["LlamaForCausalLM"])),
    # mistralai/Mistral-7B-v0.1 (sliding window 4096)
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                   max_position_embeddings=32768, sliding_window=4096,
                                   architectures=["MistralForCausalLM"])),
    # openai-community/gpt2-xl (1.5B)
    "gpt2-xl": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=50257,
                             architectures=["GPT2LMHeadModel"])),
    # tiiuae/falcon-7b (multi-query attention, parallel attention + MLP)
    "falcon-7b": ("falcon", dict(hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                                 multi_query=True, parallel_attn=True, new_decoder_architecture=False,
                                 vocab_size=65024, max_position_embeddings=2048,
                                 architectures=["FalconForCausalLM"])),
    # a Mixtral-style MoE of 8 experts, top 2, at ~6.6B (Mixtral-8x7B's layout, hidden 2048, 24 layers)
    "mixtral-6.6b": ("mixtral", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                                     num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096,
                                     architectures=["MixtralForCausalLM"])),
    # BERT at 1.3B (hidden 2048, 24 layers: the BERT-1.3B)
    "bert-1.3b": ("bert", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                               num_attention_heads=16, vocab_size=30522, max_position_embeddings=512,
                               architectures=["BertForMaskedLM"])),
    # google-t5/t5-3b
    "t5-3b": ("t5", dict(d_model=1024, d_ff=16384, d_kv=128, num_layers=24, num_heads=32, vocab_size=32128,
                         architectures=["T5ForConditionalGeneration"])),
    # a ViT at 1.8B (hidden 1664, 48 layers, MLP 8192: ViT-bigG's vision tower shape), 224 px, patch 14
    "vit-1.8b": ("vit", dict(hidden_size=1664, intermediate_size=8192, num_hidden_layers=48,
                             num_attention_heads=16, image_size=224, patch_size=14, num_labels=1000,
                             architectures=["ViTForImageClassification"])),
}

# CLIP at ~2.5B (laion/CLIP-ViT-bigG-14's vision tower, a 32-layer 1280 text tower): a model file
CLIP_MEDIUM = '''
import torch
from transformers import CLIPConfig, CLIPModel

TEXT = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
            vocab_size=49408, max_position_embeddings=77)
VISION = dict(hidden_size=1664, intermediate_size=8192, num_hidden_layers=48, num_attention_heads=16,
              image_size=224, patch_size=14)


def build_model():
    return CLIPModel(CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=1280))


def make_batch(batch_size):
    return {"input_ids": torch.randint(0, 49408, (batch_size, 77)),
            "pixel_values": torch.randn(batch_size, 3, 224, 224), "return_loss": True}, None


TRAINING = {"seq_len": 77}
'''


def write_models(folder: Path) -> dict[str, str]:
    """name -> the path given to shard-planner (a config.json, or CLIP's model file)."""
    import transformers

    paths = {}
    for name, (model_type, fields) in MEDIUM.items():
        config = transformers.CONFIG_MAPPING[model_type](**fields)
        config.save_pretrained(folder / name)
        paths[name] = str(folder / name / "config.json")
    (folder / "clip.py").write_text(CLIP_MEDIUM)
    paths["clip-2.5b"] = str(folder / "clip.py")
    return paths


def plan_once(name: str, path: str, profile_name: str) -> dict:
    """Trace and plan one model as ``shard-planner plan PATH --gpus 8 --mem 40GB`` does; its row."""
    profile = load_profile(profile_name)
    budget = parse_bytes(BUDGET)
    t0, c0 = time.perf_counter(), time.process_time()
    trace = trace_model(load_model_file(path), dtype="bfloat16")
    t1 = time.perf_counter()
    try:
        result = plan_model(trace, PlanRequest(gpus=GPUS, mem_budget_bytes=budget, profile=profile, model_path=path))
        plan, fits = result.plan, True
    except InfeasibleError as exc:
        plan, fits = None, f"no: {exc}"[:60]
    t2, c2 = time.perf_counter(), time.process_time()
    return {
        "model": name, "class": trace.model_class, "params": f"{trace.param_count / 1e9:.2f}B",
        "trace_s": round(t1 - t0, 2), "plan_s": round(t2 - t1, 2), "total_s": round(t2 - t0, 2),
        "cpu_s": round(c2 - c0, 2), "units": len(plan.units) if plan else "-",
        "ac": sum(u.activation_checkpoint for u in plan.units) if plan else "-",
        "peak": format_bytes(plan.predicted.peak_bytes) if plan else "-", "fits": fits,
        "under_10s": (t2 - t0) < TARGET_S,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="comma-separated model names (default: all)")
    ap.add_argument("--profile", default="h100-80gb", help="hardware profile (--mem 40GB caps it)")
    args = ap.parse_args()
    quiet_logs()
    print(f"load at the start: {load_text()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_models(Path(tmp))
        wanted = args.only.split(",") if args.only else list(paths)
        for name in wanted:
            rows.append(plan_once(name, paths[name], args.profile))
            print(json.dumps(rows[-1]), flush=True)
    load = load_text()
    print_table(rows, title=f"{GPUS} GPUs, --mem {BUDGET}, profile {args.profile} (load {load})")
    write_csv(rows, "hf_plan")
    cols = list(rows[0])
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    write_atomic(OUT_DIR / "hf_plan.md", f"# transformers configs (1-8B): trace + plan on {GPUS} GPUs at {BUDGET}\n\n"
                 f"`python benchmarks/bench_hf.py --profile {args.profile}`; shared 2-core CPU, load {load} at the "
                 "end (wall times noisy; cpu_s is not). Target: total under 10 s.\n\n" + "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
