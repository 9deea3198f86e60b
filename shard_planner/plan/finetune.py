"""How a transformers config's model is fine-tuned: the ``finetune`` record of a plan's model section.

``--lora R`` (with ``--lora-targets``), ``--qlora`` and ``--freeze PATTERN`` (cli/args.py, the options of a
MODEL that is a transformers config) become one :class:`FineTune`; the plan records it in
``model.finetune`` so that ``run``, ``export`` and ``report`` rebuild the same model
(shard_planner/model/hf_finetune.py builds it with peft and torchao). A model file that freezes parameters
itself needs none: its ``build_model()`` is the fine-tune, and the fingerprint already records which
parameters train.

The three kinds, as the libraries do them:

- LoRA (Hu et al. 2021, arXiv:2106.09685) through peft: ``get_peft_model(model, LoraConfig(r=R,
  lora_alpha=2R, target_modules=targets, lora_dropout=0))``. peft freezes every base parameter and keeps
  the adapters in fp32 whatever the base's dtype (``get_peft_model(autocast_adapter_dtype=True)``, its
  default, casts bf16/fp16 adapters up); the base keeps the dtype the config builds it in (its
  ``dtype``/``torch_dtype``). Targets are peft's names: ``("q_proj", "v_proj")``, or ``("all-linear",)``
  (every Linear but the output layer). None given: peft's default for the architecture (what
  ``LoraConfig(target_modules=None)`` picks: q_proj and v_proj for Llama), else all-linear for an
  architecture peft has no default for; the plan records the names chosen. alpha = 2R: it scales the
  update, not memory or time.
- QLoRA (Dettmers et al. 2023, arXiv:2305.14314): the same LoRA on a base whose Linear weights are NF4
  (torchao's ``to_nf4``, block 64, scaler block 256, as bitsandbytes' ``load_in_4bit``: every Linear but
  the output layer), the LoRA adapters on top.
- ``freeze``: fnmatch patterns over the model's module names as transformers builds it
  (``model.embed_tokens``, ``*.vision_tower*``); every parameter of a matching module's subtree stops
  training (``requires_grad_(False)``), the rest train: a full fine-tune with frozen parts.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.errors import PlanError

ALL_LINEAR = "all-linear"  # peft's name for every Linear but the output layer
ADAPTERS = ("lora_A", "lora_B")  # peft's names of a LoRA layer's two adapter Linears (or ModuleDicts of them)
NF4_BLOCK = 64  # torchao to_nf4's block_size: elements per absmax scaler (QLoRA's)
NF4_SCALER_BLOCK = 256  # to_nf4's scaler_block_size: scalers per quantization factor (QLoRA's double quantisation)


def is_adapter(fqn: str) -> bool:
    """Whether module ``fqn`` is (inside) one of peft's LoRA adapters (``...q_proj.lora_A.default``)."""
    return any(part in ADAPTERS for part in fqn.split("."))


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise PlanError(message)


@dataclass(frozen=True)
class FineTune:
    """What is frozen and how (see the module docstring). ``lora_targets`` empty: peft's default for the
    architecture, resolved when the model is built (``hf_finetune.resolved``)."""

    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ()
    qlora: bool = False
    freeze: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        object.__setattr__(self, "freeze", tuple(self.freeze))
        r = self.lora_rank
        _require(r is None or (isinstance(r, int) and not isinstance(r, bool) and r >= 1),
                 f"--lora must be a positive rank, got {r!r}")
        _require(r is not None or not self.lora_targets, "--lora-targets names where --lora R puts adapters: give --lora R")
        _require(r is not None or not self.qlora, "--qlora puts LoRA adapters on an NF4 base: give --lora R too")
        _require(r is None or not self.freeze,
                 "--freeze with --lora: peft already freezes every base parameter (only the adapters train); "
                 "--freeze chooses what a full fine-tune freezes")
        _require(ALL_LINEAR not in self.lora_targets or len(self.lora_targets) == 1,
                 f"--lora-targets {ALL_LINEAR} stands alone, got {','.join(self.lora_targets)}")
        _require(all(t for t in self.lora_targets + self.freeze), "--lora-targets and --freeze take non-empty names")

    @property
    def lora_alpha(self) -> int | None:
        """peft's ``lora_alpha``: 2 x the rank (the scale of the update, alpha / r = 2)."""
        return None if self.lora_rank is None else 2 * self.lora_rank

    @property
    def text(self) -> str:
        """For people: ``QLoRA r=16 on all-linear (NF4 base)``, ``LoRA r=8 on q_proj, v_proj``, ``frozen:
        model.embed_tokens``."""
        if self.lora_rank is None:
            return f"frozen: {', '.join(self.freeze)}"
        targets = ", ".join(self.lora_targets) or "peft's default targets"
        return f"{'QLoRA' if self.qlora else 'LoRA'} r={self.lora_rank} on {targets}" + (
            " (NF4 base)" if self.qlora else "")


def parse_targets(text: str) -> tuple[str, ...]:
    """``--lora-targets``: comma-separated module names (``q_proj,v_proj``), or ``all-linear``."""
    return tuple(t.strip() for t in text.split(",") if t.strip())
