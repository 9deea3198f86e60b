"""A tiny Llama config fine-tuned as people do it (--lora, --qlora, --freeze), for tests/hf/test_finetune.py,
tests/trace/test_finetune_trace.py and tests/cli/test_finetune_cli.py.

Hidden 256, MLP 512, 2 layers, 4 heads (2 KV heads), 256 tokens, 32 a sample, no KV cache, built in bf16
(the dtype a base is loaded in): every Linear of its layers holds a multiple of 64 x 256 x 2 elements, as
NF4 at 2 ranks needs (blocks of 64, scaler blocks of 256, each inner tensor split in 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SEQ_LEN = 32
CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=256,
              intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, use_cache=False, dtype="bfloat16")
LAYERS = tuple(f"base_model.model.model.layers.{i}" for i in range(2))  # the decoder layers under peft's wrapper


def write_config(folder: Path, **overrides) -> str:
    """config.json of the tiny Llama (``overrides`` replace its keys) in ``folder``; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**CONFIG, **overrides}))
    return str(path)


def need_finetune_extra(qlora: bool = False) -> None:
    """Skip unless peft (and for QLoRA torchao's to_nf4) is installed: the finetune extra."""
    reason = "the finetune extra is not installed (pip install 'shard-planner[finetune]')"
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'shard-planner[hf]')")
    pytest.importorskip("peft", reason=reason)
    if qlora:
        from shard_planner.model.hf_finetune import quiet_imports

        with quiet_imports():
            torchao = pytest.importorskip("torchao.quantization", reason=reason)
        if not hasattr(torchao, "to_nf4"):
            pytest.skip(f"this torchao has no torchao.quantization.to_nf4: {reason}")


def load(path: str, finetune):
    """The ModelFile of the config at ``path``, fine-tuned as ``finetune`` (a FineTune) says."""
    from shard_planner.model.hf import HfOptions
    from shard_planner.model.modelfile import load_model_file

    return load_model_file(path, HfOptions(seq_len=SEQ_LEN, finetune=finetune))
