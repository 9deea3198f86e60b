"""The zoo: tiny transformers configurations of nine architectures, each as a user gives it to
shard-planner (a config.json, a folder holding one, or a model file for CLIP, whose contrastive loss needs
``return_loss``), and the helpers that plan them at a roomy and a tight budget. Every architecture with a
decoder is in it twice: as transformers builds it (``use_cache=True``: its forward returns a KV cache, so
no plan checkpoints it) and built with ``use_cache=False`` (:data:`NO_CACHE`, named ``<name>-nocache``).

Tiny (hidden 64, two layers, 32 tokens or 32 x 32 pixels), so that every trace takes a second or two
and all plans run in one 2-rank world (``launch_plans``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

SEQ_LEN = 32
ROOMY_BYTES = 4 * 2**30
PROFILE = "cpu-gloo"

_TEXT = dict(vocab_size=256, max_position_embeddings=64)
_DECODER = dict(_TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


@dataclass(frozen=True)
class Arch:
    """One architecture of the zoo: its transformers config and how it is given to shard-planner."""

    name: str
    config_class: str
    kwargs: dict
    given_as: str  # "config.json", "folder" (the folder holding config.json) or "model file"
    text: bool = True  # token inputs (--seq-len applies)
    extra: dict | None = None  # written into config.json after save_pretrained (keys it leaves out)


ZOO = (
    Arch("llama", "LlamaConfig", dict(_DECODER, num_key_value_heads=2, architectures=["LlamaForCausalLM"]),
         "config.json"),
    Arch("mistral", "MistralConfig", dict(_DECODER, num_key_value_heads=2, sliding_window=16,
                                          architectures=["MistralForCausalLM"]), "folder"),
    Arch("gpt2", "GPT2Config", dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                    architectures=["GPT2LMHeadModel"]), "config.json"),
    Arch("mixtral", "MixtralConfig", dict(_DECODER, intermediate_size=64, num_key_value_heads=2,
                                          num_local_experts=4, num_experts_per_tok=2,
                                          architectures=["MixtralForCausalLM"]),
         "config.json", extra={"experts_implementation": "eager"}),
    Arch("falcon", "FalconConfig", dict(_TEXT, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_kv_heads=2, new_decoder_architecture=True,
                                        architectures=["FalconForCausalLM"]), "config.json"),
    Arch("bert", "BertConfig", dict(_DECODER, architectures=["BertForMaskedLM"]), "folder"),
    Arch("t5", "T5Config", dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                architectures=["T5ForConditionalGeneration"]), "config.json"),
    Arch("vit", "ViTConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=32, patch_size=8, num_labels=10,
                                  architectures=["ViTForImageClassification"]),
         "folder", text=False),
    Arch("clip", "CLIPConfig", {}, "model file", text=False),
)

# The architectures whose forward returns a cache by default (a decoder; T5's too)
CACHED = ("llama", "mistral", "gpt2", "mixtral", "falcon", "t5")
NO_CACHE = tuple(replace(arch, name=f"{arch.name}-nocache", kwargs={**arch.kwargs, "use_cache": False})
                 for arch in ZOO if arch.name in CACHED)
ALL = ZOO + NO_CACHE

CLIP_MODEL_FILE = '''"""CLIP (a text and a vision tower, a 0-d logit_scale): the contrastive loss of a batch."""
import torch
from transformers import CLIPConfig, CLIPModel

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32)
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=8)
SEQ = 16


def build_model():
    return CLIPModel(CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=32))


def make_batch(batch_size):
    return {"input_ids": torch.randint(0, 256, (batch_size, SEQ)),
            "pixel_values": torch.randn(batch_size, 3, 32, 32), "return_loss": True}, None


TRAINING = {"seq_len": SEQ}
'''


def write_arch(arch: Arch, folder: Path) -> str:
    """Write ``arch`` under ``folder`` as it is given to shard-planner; the path to give."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    if arch.given_as == "model file":
        path = folder / f"{arch.name}.py"
        path.write_text(CLIP_MODEL_FILE)
        return str(path)
    getattr(transformers, arch.config_class)(**arch.kwargs).save_pretrained(folder)
    if arch.extra:
        data = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**data, **arch.extra}))
    return str(folder / "config.json") if arch.given_as == "config.json" else str(folder)


def load_arch(arch: Arch, path: str):
    """The ModelFile of ``arch`` written at ``path``."""
    from shard_planner.model.hf import HfOptions
    from shard_planner.model.modelfile import load_model_file

    return load_model_file(path, HfOptions(seq_len=SEQ_LEN) if arch.text and arch.given_as != "model file" else None)


def reference_param_count(arch: Arch, model_file) -> int:
    """Parameters of the model built for real by transformers (not through the tracer)."""
    return sum(p.numel() for p in model_file.build().parameters())


def tight_budget_bytes(result, profile) -> int:
    """A --mem a quarter of the way from the smallest peak on the roomy plan's frontier to the roomy plan's
    peak: the planner must checkpoint, reshard or split units to fit."""
    smallest = min(p.peak_bytes for p in result.plan.frontier)
    usable = smallest + (result.plan.predicted.peak_bytes - smallest) // 4
    return int(usable / profile.usable_fraction) + 1


def located(plan, path: str):
    """``plan`` with its model path the one given (a config, folder or model file)."""
    return replace(plan, model=replace(plan.model, path=path))


# Plans that checkpoint a block with a unit nested inside it ([Note: Nested units' gradients] in
# shard_planner/cost/memory.py): (architecture, block, nested module). Built without a cache: a model whose
# forward returns one is never checkpointed ([Note: No checkpointing of a forward that builds a cache]).
NESTED_AC = (("gpt2-nocache", "transformer.h.{}", "mlp"), ("llama-nocache", "model.layers.{}", "mlp"))


def nested_ac_plan(plan, trace, profile, block: str, nested: str):
    """``plan`` re-segmented: the root, every block checkpointed, the first block's ``nested`` a unit of
    its own; predicted by the cost model."""
    from shard_planner.cost import estimate
    from shard_planner.plan import Unit

    units = [Unit(("",), False)]
    for i in range(2):
        units.append(Unit((block.format(i),), True, activation_checkpoint=True))
        if i == 0:
            units.append(Unit((f"{block.format(i)}.{nested}",), True))
    plan = replace(plan, units=tuple(units), frontier=(), baselines=())
    return replace(plan, predicted=estimate(trace, plan, profile, timeline=False).prediction())
