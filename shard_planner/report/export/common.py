"""What every exporter shares: the result type, the plan's uniform settings, and config emitters."""

from __future__ import annotations

import math
import re
import textwrap
from collections import Counter
from dataclasses import dataclass

from shard_planner.hardware.allocator_conf import launch_env
from shard_planner.plan import OPTIMIZER_TORCH, Plan, Training, Unit
from shard_planner.plan.loss import CHUNKED, CHUNKS, DESCRIPTIONS, FUSED

# The plan's dtype names as torch spells them in generated code and notes.
TORCH_DTYPES = {"float32": "torch.float32", "bfloat16": "torch.bfloat16", "float16": "torch.float16"}


@dataclass(frozen=True)
class Export:
    """One exported file, and what in the plan it could not say exactly (also written in the file)."""

    target: str  # "fsdp2" | "accelerate" | "torchtitan" | "deepspeed"
    text: str
    suffix: str  # ".py", ".yaml", ".json"
    notes: tuple[str, ...] = ()  # "what the plan says -> the nearest setting used"


# Module names folded into f-string templates (f"blocks.{i}"): characters that stand as themselves there.
TEMPLATE_SAFE = re.compile(r"[A-Za-z0-9_.\-]+")


def py_str(text: str) -> str:
    """``text`` as a Python string literal that compiles back to it, whatever it holds (backslashes such as
    ``\\N``, quotes, line breaks, non-BMP or surrogate-escaped characters): repr, not json.dumps, whose
    surrogate pairs would read back as two characters."""
    literal = repr(text)
    if literal[0] == "'" and "'" not in text and '"' not in text:
        return f'"{literal[1:-1]}"'  # the generated file's quotes (nothing inside changes)
    return literal


def allocator_env(plan: Plan) -> str:
    """'PYTORCH_ALLOC_CONF=expandable_segments:True': the CUDA caching allocator's setting ``plan`` was judged to
    fit --mem with (``cluster.expandable_segments``; shard_planner/hardware/allocator_conf.py), as an assignment in the
    environment of a launch."""
    return launch_env(plan.cluster.expandable_segments)


def allocator_line(plan: Plan, launch: str) -> str:
    """What every export says of the allocator's setting: the plan's memory on --mem was judged with it, and
    ``launch`` (the stack's launch command) with it in the environment."""
    env = allocator_env(plan)
    return (f"CUDA caching allocator: the plan was judged to fit --mem with {env}; set it in every rank's "
            f"environment before CUDA starts: {env} {launch}")


def finetune_recipe(plan: Plan) -> str | None:
    """How the plan's fine-tune is built (shard_planner/model/hf_finetune.py does the same), as code a user can
    paste before wrapping the model; None without a fine-tune."""
    ft = plan.model.finetune
    if ft is None:
        return None
    if ft.lora_rank is None:
        return (f"for name, module in model.named_modules(): freeze the parameters of the modules whose names match "
                f"{list(ft.freeze)} (fnmatch; module.requires_grad_(False))")
    nf4 = ("replace every nn.Linear weight but the output layer's with torchao's to_nf4(weight) first, then "
           if ft.qlora else "")
    targets = list(ft.lora_targets) if ft.lora_targets and ft.lora_targets != ("all-linear",) else "all-linear"
    return (f"{nf4}model = peft.get_peft_model(model, peft.LoraConfig(r={ft.lora_rank}, lora_alpha={ft.lora_alpha}, "
            f"lora_dropout=0.0, target_modules={targets!r}))")


def finetune_notes(plan: Plan, stack: str, expressible: bool) -> list[str]:
    """What a stack's export says of the plan's fine-tune (issue 28): how to build it, or that the stack
    cannot and the export trains every parameter, which is not the plan the prediction is for."""
    recipe = finetune_recipe(plan)
    if recipe is None:
        return []
    what = plan.model.finetune.text
    if expressible:
        return [f"the plan is a fine-tune ({what}): {stack} has no setting for it; build the model as the plan "
                f"did before {stack} wraps it: {recipe}; the optimizer then steps the trainable parameters only"]
    return [f"the plan is a fine-tune ({what}): {stack} cannot express it, so this export trains every parameter "
            f"(not the plan the prediction is for); the fsdp2 export builds it"]


# How each loss of plan/loss.py is had in code a user runs (what shard_planner/model/loss.py computes the same way)
LOSS_CODE = {
    CHUNKED: (f"torchtune's CEWithChunkedOutputLoss (torchtune.modules.loss): the output layer applied to "
              f"h.chunk({CHUNKS}, dim=1) (torchtune's TransformerDecoder num_output_chunks={CHUNKS}) and the loss "
              f"over that list of logits"),
    FUSED: ("Liger Kernel's fused linear cross-entropy in place of the output layer and the loss "
            "(liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss()(output_layer.weight, h, targets); "
            "transformers' Trainer: use_liger_kernel=True)"),
}


def loss_text(plan: Plan) -> str | None:
    """The plan's loss over the output layer as code a user runs (plan/loss.py); None for the model file's own."""
    return LOSS_CODE.get(plan.model.loss)


def loss_paragraph(plan: Plan) -> str:
    """The generated code's paragraph on the plan's loss (the fsdp2 exports' docstring): "" for the model file's own."""
    code = loss_text(plan)
    return "" if code is None else f"\nThe plan's loss is {DESCRIPTIONS[plan.model.loss]}: compute it as {code}."


def loss_notes(plan: Plan, stack: str) -> list[str]:
    """What a config-driven stack's export says of the plan's loss: it has no setting for it, the training
    script computes it (or, for a stack whose step is its own, the prediction assumes what it cannot set)."""
    code = loss_text(plan)
    if code is None:
        return []
    return [f"the plan's loss is {DESCRIPTIONS[plan.model.loss]}: {stack} has no setting for it; compute it in the "
            f"training step as {code}, or the step holds the whole logits and peaks above the prediction"]


def optimizer_call(t: Training, trainable_only: bool = False) -> str:
    """The plan's optimizer as the torch call that builds it (what the executor builds: over the
    parameters that train when some are frozen, ``trainable_only``)."""
    cls, kwargs = OPTIMIZER_TORCH[t.optimizer]
    extra = "".join(f", {k}={v!r}" for k, v in kwargs.items())
    params = "[p for p in model.parameters() if p.requires_grad]" if trainable_only else "model.parameters()"
    return f"torch.optim.{cls}({params}, lr={t.lr!r}{extra})"


def uniform_reshard(plan: Plan) -> tuple[bool, list[str]]:
    """One reshard_after_forward for all units (what config-driven stacks take), and notes.

    Nearest choice when the plan mixes settings: True, the setting that needs the least memory, so a
    plan that fits still fits (at the cost of the all-gathers the plan avoided)."""
    values = Counter(u.reshard_after_forward for u in plan.inner_units)
    notes = []
    ints = sorted({v for v in values if not isinstance(v, bool)})
    if ints:
        notes.append(f"{sum(values[v] for v in ints)} unit(s) reshard to {', '.join(map(str, ints))} ranks after forward "
                     "(a partial reshard): not expressible here; using reshard after forward = true")
    bools = {v for v in values if isinstance(v, bool)}
    if len(bools) == 2 or (ints and False in bools):
        notes.append(f"the plan reshards {values[True]} unit(s) and keeps {values[False]} unit(s) gathered after "
                     "forward: one setting for all here; using true (less memory, more all-gathers than the plan)")
        return True, notes
    if ints:
        return True, notes
    return (bools.pop() if bools else True), notes


def split_number(fqn: str) -> tuple[str, int, str] | None:
    """``"enc.layers.3.attn"`` -> ("enc.layers.", 3, ".attn"): around the last all-digit path segment."""
    parts = fqn.split(".")
    for k in range(len(parts) - 1, -1, -1):
        if parts[k].isdigit():
            prefix = ".".join(parts[:k]) + ("." if k else "")
            suffix = ("." if k < len(parts) - 1 else "") + ".".join(parts[k + 1:])
            return prefix, int(parts[k]), suffix
    return None


def block_units(plan: Plan) -> list[Unit]:
    """The units of the repeated blocks (``layers.0``, ``layers.1``, ...): the largest set of units whose
    first module is numbered under the same parent. All inner units when nothing is numbered."""
    by_prefix: dict[tuple[str, str], list[Unit]] = {}
    for u in plan.inner_units:
        parsed = split_number(u.modules[0])
        if parsed is not None:
            by_prefix.setdefault((parsed[0], parsed[2]), []).append(u)
    return max(by_prefix.values(), key=len) if by_prefix else list(plan.inner_units)


def grouped_note(plan: Plan) -> list[str]:
    grouped = [u for u in plan.inner_units if len(u.modules) > 1]
    if not grouped:
        return []
    return [f"{len(grouped)} unit(s) group several modules into one fully_shard call (e.g. {grouped[0].name}): "
            "not expressible here; each module becomes its own unit (smaller, more all-gathers: peak memory "
            "the same or lower, step time may be longer than predicted)"]


def prefetch_notes(plan: Plan, *, where: str) -> list[str]:
    notes = []
    if plan.prefetch.forward > 0:
        notes.append(f"forward prefetch of {plan.prefetch.forward} unit(s): {where} does not expose it; nearest: "
                     "FSDP2's default (no explicit forward prefetch). The fsdp2 export sets it with "
                     "set_modules_to_forward_prefetch")
    if plan.prefetch.backward > 1:
        notes.append(f"backward prefetch of {plan.prefetch.backward} units: {where} does not expose it; nearest: "
                     "FSDP2's default of 1 unit")
    return notes


# ---- YAML (block style, the subset accelerate writes: nested mappings of scalars) ----
# [Note: YAML 1.1 scalars] Accelerate reads its config with PyYAML (accelerate 1.16,
# commands/config/config_args.py: yaml.safe_load), which resolves plain scalars by YAML 1.1's rules
# (PyYAML 6, yaml/resolver.py): a float needs a "." (`1e+20` is a string, `1.0e+20` a float), yes/no/on/off
# are booleans, and a line break inside a plain or single-quoted scalar folds to a space. So strings that
# are not plain identifiers are written double-quoted with every line break and non-printable character
# escaped, and floats always with a "." (or .inf/.nan).

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.,/-]*")
_YAML_WORDS = {"y", "n", "yes", "no", "true", "false", "on", "off", "null", "~"}


def _yaml_printable(ch: str) -> bool:
    """Characters YAML 1.1 lets stand unescaped inside a double-quoted scalar (its c-printable set,
    without the line breaks NEL, LS and PS, which it would fold)."""
    c = ord(ch)
    return 0x20 <= c <= 0x7E or 0xA0 <= c <= 0xD7FF and c not in (0x2028, 0x2029) or 0xE000 <= c <= 0xFFFD \
        or c >= 0x10000


def _escaped(ch: str) -> str:
    """``ch`` as it stands in a YAML double-quoted scalar (the escapes Python writes too)."""
    if _yaml_printable(ch):
        return "\\" + ch if ch in '"\\' else ch
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _yaml_quoted(text: str) -> str:
    return '"' + "".join(map(_escaped, text)) + '"'


def _yaml_float(value: float) -> str:
    """See [Note: YAML 1.1 scalars]."""
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    text = repr(value)
    mantissa, e, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    return mantissa + (e + (exponent if exponent[0] in "+-" else "+" + exponent) if e else "")


def yaml_scalar(value) -> str:
    """``value`` (bool, int, float or str) as a YAML scalar that ``yaml.safe_load`` reads back as itself."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, float):
        return _yaml_float(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and text.lower() not in _YAML_WORDS:
        return text
    return _yaml_quoted(text)


def emit_yaml(mapping: dict, indent: int = 0) -> list[str]:
    lines = []
    for key, value in mapping.items():
        pad = "  " * indent
        if isinstance(value, dict):
            lines.append(f"{pad}{yaml_scalar(key)}:")
            lines.extend(emit_yaml(value, indent + 1))
        else:
            lines.append(f"{pad}{yaml_scalar(key)}: {yaml_scalar(value)}")
    return lines


def comment_block(lines: list[str], prefix: str = "# ", width: int = 100) -> list[str]:
    """Comment lines wrapped at ``width``; a "- " bullet's continuation lines are indented under it."""
    out = []
    for line in lines:
        # PyYAML refuses non-printable characters even in comments and reads NEL, LS and PS as line
        # breaks; Python ends a comment at \n or \r: all escaped (see _yaml_printable)
        line = "".join(ch if _yaml_printable(ch) else _escaped(ch) for ch in line)
        if not line:
            out.append(prefix.rstrip())
            continue
        indent = "  " if line.startswith("- ") else ""
        out += [f"{prefix}{part}" for part in textwrap.wrap(line, width - len(prefix), subsequent_indent=indent,
                                                           break_on_hyphens=False, break_long_words=False)]
    return out
