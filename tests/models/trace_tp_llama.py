"""examples/llama.py with its tiny size at 8 heads and 4 kv heads, for the tensor-parallel trace tests: 4 ranks
then split whole heads (the example's 2 kv heads would cut one in half). examples/llama.py's attention views
its projections with ``-1`` heads, so it runs on a rank's local column shards. Every other size
(``SHARD_PLANNER_SIZE``), the batch, the loss and ``TRAINING`` are the example's; :func:`tp_styles` is
torchtitan's Llama plan as shard_planner/parallel/tensor_parallel.py styles, for these tests and the executor's
(tests/models/exec_llama_tp.py)."""

import importlib.util
from pathlib import Path

import torch.nn as nn

_spec = importlib.util.spec_from_file_location(
    "shard_planner_examples_llama", Path(__file__).resolve().parents[2] / "examples" / "llama.py")
llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama)

TINY_HEADS = dict(n_heads=8, n_kv_heads=4)
make_batch, loss_fn, TRAINING = llama.make_batch, llama.loss_fn, llama.TRAINING


def build_model() -> nn.Module:
    cfg = llama.config()
    if cfg["size"] == "tiny":
        cfg |= TINY_HEADS
    return llama.Transformer(cfg["dim"], cfg["n_layers"], cfg["n_heads"], cfg["n_kv_heads"], cfg["ffn_dim"],
                             cfg["vocab_size"])


def tp_styles(n_layers: int | None = None) -> dict[str, str]:
    """torchtitan's Llama tensor-parallel plan (models/llama3/infra/parallelize.py ``apply_tp``) as styles."""
    n = llama.config()["n_layers"] if n_layers is None else n_layers
    styles = {"tok_embeddings": "embedding", "norm": "norm", "output": "head"}
    for i in range(n):
        p = f"layers.{i}"
        styles |= {f"{p}.attention_norm": "norm", f"{p}.attention": "gather_input", f"{p}.attention.wq": "colwise",
                   f"{p}.attention.wk": "colwise", f"{p}.attention.wv": "colwise", f"{p}.attention.wo": "rowwise",
                   f"{p}.ffn_norm": "norm", f"{p}.feed_forward": "gather_input", f"{p}.feed_forward.w1": "colwise",
                   f"{p}.feed_forward.w3": "colwise", f"{p}.feed_forward.w2": "rowwise"}
    return styles
