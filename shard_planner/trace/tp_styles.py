"""``derive_tensor_parallel``: a model's tensor-parallel styles, found from its structure or a transformers plan.

    tp = derive_tensor_parallel(model, inputs)                             # from the structure
    tp = derive_tensor_parallel(model, inputs, hf_tp_plan=hf.tp_plan(model))  # transformers' own plan
    check_divisible(model, tp, degree=4, seq_len=2048)                     # every split dimension

``inputs`` are a batch's inputs (a tuple, passed positionally, or a dict of keyword inputs, as
``ModelFile.batch`` gives them); one forward runs on them under FakeTensorMode (or on the meta device
for a meta model), with hooks recording how each module is called: no real compute, no weights read (a
repeated block's records are copied from its first twin's: trace/tp_call_twins.py [Note: Twin blocks in the styles'
forward]).
The styles are those of shard_planner/parallel/tensor_parallel.py [Note: The tensor-parallel styles].

[Note: What tensor parallelism recognises]
  torchtitan's Llama plan (torchtitan 0.3: models/common/decoder_sharding.py:70-98 colwise/rowwise configs,
  :160-220 attention, :265-298 feed-forward, :301-336 embedding, final norm and output; models/llama3/
  sharding.py:44-74 the per-layer norms; torchtitan <= 0.2: models/llama3/infra/parallelize.py ``apply_tp``)
  is found in a model by what one forward does, names only cross-checking it:
  - the token embedding: the first ``nn.Embedding`` called -> ``embedding``;
  - the output layer: the last ``nn.Linear`` called, reading the same (B, T, dim) shape the embedding
    returned (a per-token head, not a classifier of one token) -> ``head``; its weight must not be the
    embedding's (tied: the two styles would distribute one parameter twice, untying it);
  - each attention: a module that calls ``F.scaled_dot_product_attention``; its ``nn.Linear`` children
    called before that call are the q, k, v projections (exactly three: a fused q/k/v projection packs
    [q | k | v] one after another, and a colwise split would hand rank 0 only query columns) ->
    ``colwise``; the one called after it, the output projection -> ``rowwise``. The projections' sizes
    must match the heads SDPA is handed, (B, H, T, head_dim), and the module must say its ``head_dim``
    (an attribute, as llama.py's, torchtitan's and transformers' attention modules do) so that
    :func:`check_divisible` can count heads;
  - each feed-forward: the one other child of the attention's parent (the block) holding called
    ``nn.Linear`` children: those reading dim (gate/up: w1, w3, fc1, up_proj, gate_proj, c_fc) -> ``colwise``,
    the one returning dim and reading their hidden size, called after them (down: w2, fc2, down_proj,
    c_proj) -> ``rowwise``: a pair of Linears feeding each other, dim -> hidden -> dim;
  - names cross-check the roles: a Linear whose name says the other role (``wo`` found as a q/k/v
    projection, ``up_proj`` as the down projection) refuses the model rather than guessing.
  With sequence parallelism (SEQUENCE_PARALLEL below) the norms and the ``gather_input`` modules are added.
  A LoRA layer (peft's, or one laid out as it) stands for the Linear it wraps, and its style is then given to
  its base layer and adapters (trace/tp_adapters.py [Note: LoRA adapters under tensor parallelism]).
  Anything else refuses with a :class:`UserError` saying what was not found (a U-Net has no attention, a
  ViT fuses q/k/v and classifies one token). A transformers plan (``hf_tp_plan``) replaces the first four
  items: :func:`_hf_styles`. A transformers model (its ``config`` has ``base_model_tp_plan``) is split by its
  own plan only: without ``hf_tp_plan`` it is refused.

[Note: Sequence parallelism's styles]
  torchtitan shards the activations between the split regions on the sequence (decoder_sharding.py:58-67,
  ``norm_config`` :101-116 ``SequenceParallel`` norms, the attention's and feed-forward's inputs gathered
  to Replicate :189-200 and :285-292); transformers' plans have no sequence parallelism (their rowwise and
  embedding styles all-reduce to Replicate: transformers/distributed/tensor_parallel.py:707-734), so it
  is added here to the structural styles. Not to a transformers plan: transformers' decoders compute
  position ids and the causal mask from the embedding output's length (transformers/models/llama/
  modeling_llama.py:379-388, the same in qwen2 and mistral), the local slice under sequence parallelism,
  and the attention then fails on mismatched rotary tables (tests/trace/test_tp_styles.py shows it), so
  ``derive_tensor_parallel`` refuses ``hf_tp_plan`` with ``sequence_parallel``. The styles added:
  - ``gather_input`` on every module whose ``colwise`` children read its input (the attention and the
    feed-forward), of the first positional argument, or of the keyword argument that carried the
    hidden states when the module was called by keyword (transformers' decoder layers call
    ``self_attn(hidden_states=...)``): ``gather_input:hidden_states``;
  - ``norm`` on every module called between the embedding and the output layer, outside those gathered
    modules, that holds parameters of its own: each must be norm-like (only 1-D parameters of size dim, output
    shaped as its input). Any other parameter there (a learned position table, a gate) would see a
    sequence slice with a plain, unreduced gradient: the model is refused.
"""

from __future__ import annotations

import logging
import re
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shard_planner.errors import UserError
from shard_planner.model.hf import is_transformers_model
from shard_planner.parallel.mesh import degree_divides
from shard_planner.parallel.tensor_parallel import GATHER_KWARG_SEPARATOR, Style, TensorParallel
from shard_planner.trace.tp_adapters import (check_not_quantised, inside_lora_layer, layer_of, linear_of, lora_layers,
                                             transformers_prefix, with_adapters)

logger = logging.getLogger(__name__)

# Names cross-checking the roles structure finds ([Note: What tensor parallelism recognises]): a Linear
# named for the other role refuses the model. Names outside both sets are taken on structure alone.
QKV_NAMES = frozenset({"wq", "wk", "wv", "q_proj", "k_proj", "v_proj", "query", "key", "value", "q", "k", "v"})
ATTENTION_OUT_NAMES = frozenset({"wo", "o_proj", "out_proj", "c_proj", "proj", "dense", "o"})
MLP_IN_NAMES = frozenset({"w1", "w3", "fc1", "up_proj", "gate_proj", "c_fc", "up", "gate", "fc_in", "wi"})
MLP_OUT_NAMES = frozenset({"w2", "fc2", "down_proj", "c_proj", "down", "fc_out", "wo"})


@dataclass
class ModuleCall:
    """How a module was first called in the traced forward: its place in the call order, the keyword that
    carried its hidden states (None: the first positional argument), their shape and the output's."""

    order: int
    kwarg: str | None
    input_shape: tuple[int, ...] | None
    output_shape: tuple[int, ...] | None = None


@dataclass
class AttentionCall:
    """One ``F.scaled_dot_product_attention`` call: its place in the call order and the (B, H, T, head_dim)
    query and key shapes' head counts and head size."""

    order: int
    q_heads: int
    kv_heads: int
    head_dim: int


@dataclass
class CallTrace:
    calls: dict[str, ModuleCall] = field(default_factory=dict)  # fqn -> first call, forward order
    attention: dict[str, AttentionCall] = field(default_factory=dict)  # innermost calling module -> first SDPA
    counter: int = 0
    stack: list[str] = field(default_factory=list)
    called: dict[type, list[str]] = field(default_factory=dict)  # _called's answers, per module kind

    def tick(self) -> int:
        self.counter += 1
        return self.counter


def derive_tensor_parallel(model: nn.Module, inputs, *, sequence_parallel: bool = True, loss_parallel: bool = True,
                           hf_tp_plan: dict[str, str] | None = None, fake_mode=None) -> TensorParallel:
    """The styles of ``model`` ([Note: What tensor parallelism recognises]), from its structure or from
    ``hf_tp_plan`` (a transformers model's ``tp_plan``: shard_planner.model.hf.tp_plan), with sequence
    parallelism's ([Note: Sequence parallelism's styles]). ``inputs``: one batch's inputs (tuple or dict);
    ``fake_mode``: the FakeTensorMode ``model`` was built in (trace/build.py build_fake), if it was."""
    is_transformers = is_transformers_model(model)
    if is_transformers and hf_tp_plan is None:
        raise UserError(f"tensor parallelism: {type(model).__name__} is a transformers model, split by its own plan "
                        "only: pass hf_tp_plan=shard_planner.model.hf.tp_plan(model) (None: it has no plan; plan it "
                        "without tp)")
    if hf_tp_plan is not None and sequence_parallel:
        raise UserError(f"sequence parallelism: {type(model).__name__} reads the sequence length off its embedding's "
                        "output (transformers' position ids and causal mask, e.g. modeling_llama.py:379), which is "
                        "a rank's slice under sequence parallelism; pass sequence_parallel=False")
    trace = trace_calls(model, inputs, fake_mode)
    styles = _hf_styles(model, hf_tp_plan) if hf_tp_plan is not None else _structural_styles(model, trace)
    if hf_tp_plan is not None:
        _check_untied(model, styles)  # the structure's path checks as it finds the two (_embedding_and_head)
    adapted = sorted(lora_layers(model) & set(styles))
    if sequence_parallel and adapted:
        raise UserError(f"sequence parallelism: {adapted[0]} is a LoRA layer, whose replicated lora_A cannot take the "
                        "gathered input sequence parallelism hands it (trace/tp_adapters.py); pass "
                        "sequence_parallel=False")
    if sequence_parallel:
        styles = _with_sequence_parallel(model, trace, styles)
    styles = with_adapters(model, styles)  # each LoRA layer's style to its base layer and adapters
    check_not_quantised(model, styles)
    if loss_parallel and Style.HEAD.value not in styles.values():
        raise UserError("loss parallelism needs an output layer (\"head\") and none was found; pass "
                        "loss_parallel=False")
    order = {fqn: call.order for fqn, call in trace.calls.items()}
    ordered = dict(sorted(styles.items(), key=lambda item: order.get(item[0], 0)))
    logger.info("%s: tensor-parallel styles for %d modules, from %s", type(model).__name__, len(ordered),
                "the transformers plan" if hf_tp_plan is not None else "its structure")
    return TensorParallel(styles=ordered, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


def trace_calls(model: nn.Module, inputs, fake_mode=None, reuse: bool = True) -> CallTrace:
    """Run one forward of ``model`` on ``inputs`` without real compute (FakeTensorMode: ``fake_mode``, the one
    the model was built in, or a new one; the meta device for a model on it), recording every module's first
    call and every SDPA call's innermost module; a repeated block's records copied from its first twin's
    (``reuse=False``: every block run; trace/tp_call_twins.py [Note: Twin blocks in the styles' forward])."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shard_planner.trace.tp_call_twins import call_twins

    trace = CallTrace()
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if on_meta:
        inputs = _map_tensors(inputs, lambda t: t.to("meta"))
    with ExitStack() as stack:
        for fqn, module in model.named_modules():
            stack.callback(module.register_forward_pre_hook(_pre_hook(trace, fqn), with_kwargs=True).remove)
            stack.callback(module.register_forward_hook(_post_hook(trace, fqn), always_call=True).remove)
        stack.enter_context(torch.no_grad())
        stack.enter_context(nullcontext() if on_meta else fake_mode or FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(_AttentionRecorder(trace))
        stack.enter_context(call_twins(model, trace) if reuse else nullcontext())
        try:
            model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        except Exception as exc:
            text = str(exc).strip().splitlines()
            raise UserError(f"tensor parallelism: the model's forward failed on the batch ({type(exc).__name__}: "
                            f"{text[0] if text else ''}); it must run to find the model's structure") from exc
    return trace


def _map_tensors(inputs, fn):
    if isinstance(inputs, dict):
        return {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return tuple(fn(v) if isinstance(v, torch.Tensor) else v for v in inputs)


def _pre_hook(trace: CallTrace, fqn: str):
    def hook(_module, args, kwargs):
        trace.stack.append(fqn)
        if fqn in trace.calls:
            return None
        kwarg, hidden = None, args[0] if args and isinstance(args[0], torch.Tensor) else None
        if hidden is None:
            kwarg = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
            hidden = kwargs.get(kwarg) if kwarg else None
        trace.calls[fqn] = ModuleCall(trace.tick(), kwarg, tuple(hidden.shape) if hidden is not None else None)
        return None

    return hook


def _post_hook(trace: CallTrace, fqn: str):
    def hook(_module, _args, output):
        trace.stack.pop()
        outputs = output if isinstance(output, (tuple, list)) else (output,)  # transformers: (hidden, weights)
        out = next((o for o in outputs if isinstance(o, torch.Tensor)), None)
        call = trace.calls[fqn]
        if call.output_shape is None and out is not None:
            call.output_shape = tuple(out.shape)
        return None

    return hook


class _AttentionRecorder(TorchFunctionMode):
    """Records each ``F.scaled_dot_product_attention`` call against the innermost module running it."""

    def __init__(self, trace: CallTrace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.trace.stack:
            q, k = (args + (None, None))[:2]
            q, k = kwargs.get("query", q), kwargs.get("key", k)
            owner = self.trace.stack[-1]
            if owner not in self.trace.attention and q is not None and q.dim() == 4:
                self.trace.attention[owner] = AttentionCall(self.trace.tick(), q.shape[1], k.shape[1], q.shape[-1])
        return func(*args, **kwargs)


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _leaf(fqn: str) -> str:
    return fqn.rpartition(".")[2]


def _called(model: nn.Module, trace: CallTrace, kind: type) -> list[str]:
    """The modules of ``kind`` the forward called, in call order (found once per kind: the styles ask for each
    block's Linears, 0.65 s at Llama 3.1 405B when every question walked the model again)."""
    if kind not in trace.called:
        modules = dict(model.named_modules())
        found = [f for f in trace.calls if isinstance(modules[f], kind)]
        if kind is nn.Linear:  # a LoRA layer stands for its Linear, its parts for nothing (trace/tp_adapters.py)
            layers = lora_layers(model) & set(trace.calls)
            found = [f for f in found if not inside_lora_layer(f, layers)] + sorted(layers)
        trace.called[kind] = sorted(found, key=lambda f: trace.calls[f].order)
    return trace.called[kind]


def _structural_styles(model: nn.Module, trace: CallTrace) -> dict[str, str]:
    """The embedding, attention, feed-forward and output-layer styles found from the structure: [Note: What
    tensor parallelism recognises]."""
    embedding, head = _embedding_and_head(model, trace)
    if not trace.attention:
        raise UserError(f"tensor parallelism: {type(model).__name__} has no module that calls "
                        "F.scaled_dot_product_attention, so no attention to split by heads; plan it without tp")
    styles = {embedding: Style.EMBEDDING.value}
    for attention in trace.attention:
        qkv, out = _attention_projections(model, trace, attention)
        styles.update(dict.fromkeys(qkv, Style.COLWISE.value))
        styles[out] = Style.ROWWISE.value
        up, down = _feed_forward(model, trace, attention, model.get_submodule(embedding).embedding_dim)
        styles.update(dict.fromkeys(up, Style.COLWISE.value))
        styles[down] = Style.ROWWISE.value
    styles[head] = Style.HEAD.value
    return styles


def _embedding_and_head(model: nn.Module, trace: CallTrace) -> tuple[str, str]:
    """(token embedding, output layer): the first nn.Embedding and the last nn.Linear called, the latter
    reading the (B, T, dim) shape the former returned."""
    embeddings, linears = _called(model, trace, nn.Embedding), _called(model, trace, nn.Linear)
    if not embeddings or not linears:
        raise UserError(f"tensor parallelism: {type(model).__name__} has no token embedding (nn.Embedding) and "
                        "output layer (nn.Linear) to split on the vocabulary; plan it without tp")
    embedding, head = embeddings[0], linears[-1]
    hidden = trace.calls[embedding].output_shape
    if trace.calls[head].input_shape != hidden:
        raise UserError(f"tensor parallelism: the last layer {head} reads {trace.calls[head].input_shape}, not the "
                        f"per-token hidden states {hidden} the embedding {embedding} returns (not a language-model "
                        "head); plan it without tp")
    _check_untied(model, {embedding: Style.EMBEDDING.value, head: Style.HEAD.value})
    return embedding, head


def _check_untied(model: nn.Module, styles: dict[str, str]) -> None:
    """Refuse an output layer whose weight is the embedding's (tied embeddings, Gemma's default), from the structure
    or a transformers plan: each style would split the one parameter on its own (the vocabulary twice)."""
    ends = [next((f for f, s in styles.items() if s == style.value), None) for style in (Style.EMBEDDING, Style.HEAD)]
    if None not in ends and linear_of(model, ends[1]).weight is model.get_submodule(ends[0]).weight:
        raise UserError(f"tensor parallelism: {ends[1]}.weight is {ends[0]}.weight (tied embeddings); each style "
                        "would distribute it on its own, untying them; untie them or plan without tp")


def _linear_children(model: nn.Module, trace: CallTrace, fqn: str) -> list[str]:
    """The called nn.Linear children of ``fqn``, in call order."""
    prefix = f"{fqn}." if fqn else ""
    return [f for f in _called(model, trace, nn.Linear) if f.startswith(prefix) and "." not in f[len(prefix):]]


def _attention_projections(model: nn.Module, trace: CallTrace, attention: str) -> tuple[list[str], str]:
    """(q/k/v projections, output projection) of the module calling SDPA, checked against its heads."""
    sdpa = trace.attention[attention]
    linears = _linear_children(model, trace, attention)
    before = [f for f in linears if trace.calls[f].order < sdpa.order]
    after = [f for f in linears if trace.calls[f].order > sdpa.order]
    packed = (sdpa.q_heads + 2 * sdpa.kv_heads) * sdpa.head_dim
    if len(before) == 1 and linear_of(model, before[0]).out_features == packed:
        raise UserError(f"tensor parallelism: {before[0]} projects q, k and v in one Linear ([q | k | v] packed), "
                        "which a colwise split would cut across q, k and v instead of by heads; use three "
                        "Linears (q, k, v) or plan without tp")
    if len(before) != 3 or len(after) != 1:
        raise UserError(f"tensor parallelism: attention {attention} calls {len(before)} Linear children before "
                        f"scaled_dot_product_attention and {len(after)} after; recognised are three (q, k, v) "
                        "and one (output); plan it without tp")
    mods = [linear_of(model, f) for f in before]
    head_dim = getattr(model.get_submodule(attention), "head_dim", None)
    expected = [sdpa.q_heads * sdpa.head_dim] + [sdpa.kv_heads * sdpa.head_dim] * 2
    if [m.out_features for m in mods] != expected or head_dim != sdpa.head_dim:
        raise UserError(f"tensor parallelism: attention {attention}'s projections {before} return "
                        f"{[m.out_features for m in mods]} features and its head_dim attribute is {head_dim!r}, "
                        f"but it hands SDPA {sdpa.q_heads} query and {sdpa.kv_heads} key/value heads of "
                        f"{sdpa.head_dim}: not recognised; plan it without tp")
    _check_names(before, ATTENTION_OUT_NAMES, "a q/k/v projection")
    _check_names(after, QKV_NAMES, "an attention output projection")
    return before, after[0]


def _feed_forward(model: nn.Module, trace: CallTrace, attention: str, dim: int) -> tuple[list[str], str]:
    """(gate/up projections, down projection) of the block's one other module holding called Linears."""
    block = _parent(attention)
    children = [f"{block}.{name}" if block else name for name, _ in model.get_submodule(block).named_children()]
    holders = [c for c in children if c != attention and _linear_children(model, trace, c)]
    if len(holders) != 1:
        raise UserError(f"tensor parallelism: block {block or '(root)'} has {len(holders)} modules with Linear "
                        f"children besides its attention ({holders}); recognised is one feed-forward; plan it "
                        "without tp")
    linears = _linear_children(model, trace, holders[0])
    mods = {f: linear_of(model, f) for f in linears}
    up = [f for f in linears if mods[f].in_features == dim]
    down = [f for f in linears if mods[f].out_features == dim and f not in up]
    hidden = {mods[f].out_features for f in up}
    if (not up or len(down) != 1 or len(up) + 1 != len(linears) or hidden != {mods[down[0]].in_features}
            or trace.calls[down[0]].order < max(trace.calls[f].order for f in up)):
        raise UserError(f"tensor parallelism: feed-forward {holders[0]} is not Linears dim -> hidden feeding one "
                        f"Linear hidden -> dim (dim {dim}; Linears {linears}); a packed gate/up projection is not "
                        "recognised; plan it without tp")
    _check_names(up, MLP_OUT_NAMES, "a gate/up projection")
    _check_names(down, MLP_IN_NAMES, "a down projection")
    return up, down[0]


def _check_names(fqns: list[str], other_role: frozenset[str], what: str) -> None:
    """Refuse a Linear that structure gives one role and whose name says the other."""
    for fqn in fqns:
        if _leaf(fqn) in other_role:
            raise UserError(f"tensor parallelism: {fqn} is {what} by structure but its name says otherwise; "
                            "the model is not recognised; plan it without tp")


def _hf_style(name: str, fqn: str) -> str:
    """Our style for one of transformers' style names (transformers/distributed/tensor_parallel.py:707-734)."""
    match name:
        case "colwise":  # ColwiseParallel(input Replicate, output Shard(-1)), local output: ours
            return Style.COLWISE.value
        case "rowwise":  # RowwiseParallel(input Shard(-1), output Replicate): ours (Shard(1) with sequence par.)
            return Style.ROWWISE.value
        case "embedding_rowwise":  # EmbeddingParallel(shard_dim=0): vocabulary split, Partial -> Replicate
            return Style.EMBEDDING.value
        case "colwise_gather_output" | "colwise_rep":  # the output layer, logits gathered (ours: kept split
            return Style.HEAD.value                    # with loss parallelism)
        case "sequence_parallel":  # SequenceParallel(use_local_output=True)
            return Style.NORM.value
        case "replicated_with_grad_allreduce":  # Qwen3's per-head norms: whole, gradients summed over tp
            return Style.GRAD_ALL_REDUCE.value
    raise UserError(f"tensor parallelism: the transformers plan gives {fqn} the style {name!r}, which has no "
                    "equivalent here (colwise, rowwise, embedding_rowwise, colwise_gather_output, colwise_rep, "
                    "sequence_parallel, replicated_with_grad_allreduce); plan it without tp")


def _hf_styles(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """A transformers ``tp_plan`` (patterns with ``*`` for layer numbers, as transformers' mixin.py:79-101
    ``init_parallel_plans`` merges the class's ``_tp_plan`` and the config's ``base_model_tp_plan``) expanded over
    the model's module names the way transformers matches them (distributed/parallel_utils.py:39-64: every
    ``.<digits>`` between dots is ``*``), each style mapped by :func:`_hf_style`. The plan names the transformers
    model's modules: under peft's wrapper (``PeftModel.get_base_model()``, ``base_model.model.``) they are matched
    below its prefix, and a LoRA layer where the plan names a Linear takes its style (trace/tp_adapters.py)."""
    prefix = transformers_prefix(model)
    styles, matched = {}, set()
    for fqn, _ in model.named_modules():
        if prefix and not fqn.startswith(prefix):
            continue
        name = fqn[len(prefix):]
        pattern = re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)
        if name and pattern in plan:
            styles[fqn] = _hf_style(plan[pattern], fqn)
            matched.add(pattern)
    unmatched = sorted(set(plan) - matched)
    if unmatched:
        raise UserError(f"tensor parallelism: the transformers plan's {unmatched[0]!r} names no module of "
                        f"{type(model).__name__} (a parameter's style, or a model wrapped under another prefix); "
                        "plan it without tp")
    if not styles:
        raise UserError(f"tensor parallelism: the transformers plan is empty for {type(model).__name__}")
    return styles


def _with_sequence_parallel(model: nn.Module, trace: CallTrace, styles: dict[str, str]) -> dict[str, str]:
    """``styles`` plus sequence parallelism's: [Note: Sequence parallelism's styles]."""
    ends = [next((f for f, s in styles.items() if s == style.value), None) for style in (Style.EMBEDDING, Style.HEAD)]
    if None in ends or any(f not in trace.calls for f in ends):
        raise UserError("sequence parallelism splits the sequence after the token embedding and gathers it before "
                        "the output layer, and this plan styles no (called) embedding and head; pass "
                        "sequence_parallel=False")
    embedding, head = ends
    hidden = trace.calls[embedding].output_shape
    gathered = sorted({_parent(f) for f, s in styles.items() if s == Style.COLWISE.value})
    out = dict(styles)
    for fqn in gathered:
        call = trace.calls.get(fqn)
        if call is None or call.input_shape != hidden:
            raise UserError(f"sequence parallelism: {fqn} (the module around colwise {fqn}.*) is not called with the "
                            f"hidden states {hidden} to gather; pass sequence_parallel=False")
        out[fqn] = Style.GATHER_INPUT.value + (GATHER_KWARG_SEPARATOR + call.kwarg if call.kwarg else "")
    modules = dict(model.named_modules())
    first, last = trace.calls[embedding].order, trace.calls[head].order
    for fqn, call in trace.calls.items():
        inside = any(fqn == g or fqn.startswith(g + ".") for g in gathered)
        own = list(modules[fqn].parameters(recurse=False))
        if not first < call.order < last or inside or fqn in out or not own:
            continue
        if not all(p.dim() == 1 and p.shape[0] == hidden[-1] for p in own) or call.output_shape != call.input_shape:
            raise UserError(f"sequence parallelism: {fqn} ({type(modules[fqn]).__name__}) holds parameters and runs on "
                            "the sequence slice between the split regions, but is not a norm (1-D parameters of size "
                            f"{hidden[-1]}); pass sequence_parallel=False")
        out[fqn] = Style.NORM.value
    return out


def check_divisible(model: nn.Module, tp: TensorParallel, degree: int, *, seq_len: int | None = None) -> None:
    """Raise a :class:`UserError` naming the first split dimension of ``tp``'s styles that ``degree`` does not
    divide: the attention heads of each colwise projection of a module with a ``head_dim`` (query and, in GQA,
    key/value heads: torchtitan requires both, models/common/decoder.py:144-158), every colwise Linear's
    output features and rowwise Linear's input features (the MLP hidden size), the embedding's and the
    output layer's vocabulary, and with sequence parallelism the sequence length (``seq_len`` where given).
    Every split is required even, so that every rank holds the same shapes."""
    if degree < 1:
        raise UserError(f"tensor parallelism: the degree must be positive, got {degree}")
    for fqn, style in tp.styles_by_fqn.items():
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            raise UserError(f"tensor parallelism: the plan styles {fqn}, which {type(model).__name__} has not; "
                            "derive the styles for this model") from None
        for what, size in _split_sizes(model, fqn, module, style.style):
            if not degree_divides(degree, size):
                raise UserError(f"tensor parallelism of degree {degree}: {fqn} {what} {size}, which {degree} does "
                                "not divide; choose a tp degree that divides it")
    tp.check_sequence(degree, seq_len)


def _split_sizes(model: nn.Module, fqn: str, module: nn.Module, style: Style) -> list[tuple[str, int]]:
    """(what, size) of each dimension ``style`` splits on ``module``."""
    match style:
        case Style.COLWISE:
            sizes = []
            head_dim = getattr(model.get_submodule(_parent(layer_of(fqn))), "head_dim", None)  # past a LoRA layer
            if isinstance(head_dim, int) and head_dim > 0 and module.out_features % head_dim == 0:
                sizes.append((f"holds attention heads of head_dim {head_dim}: heads", module.out_features // head_dim))
            return sizes + [("splits its output features", module.out_features)]
        case Style.ROWWISE:
            return [("splits its input features", module.in_features)]
        case Style.EMBEDDING:
            return [("splits its vocabulary", module.num_embeddings)]
        case Style.HEAD:
            return [("splits its output features (the vocabulary)", module.out_features)]
    return []
