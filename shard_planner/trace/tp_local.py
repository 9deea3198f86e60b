"""One tensor-parallel rank, traced as a local model: split parameters, emulated collectives.

[Note: A tensor-parallel rank traced locally]
A trace at degree ``tp_size`` > 1 (``trace_model(..., tensor_parallel=, tp_size=)``) traces what one rank of
``parallelize_module(model, mesh["tp"], torch_tp_plan(tp))`` (execute/tensor_parallel.py) runs, with plain fake
tensors instead of DTensors:

- parameters (:func:`shard_parameters`): a styled module's parameters become fake parameters of the local
  shard's shape, dtype and ``requires_grad`` kept (``p.data`` replaced, so tied weights stay tied). As torch
  2.13 places them (torch/distributed/tensor/parallel/style.py): colwise and head ``nn.Linear`` weight and bias
  Shard(0) (style.py:121-132), rowwise weight Shard(1), bias Replicate (style.py:250-279), embedding
  ``nn.Embedding`` weight Shard(0) (style.py:281-289), norm parameters replicated (style.py:390-399).
- activations: each styled module's inputs and outputs go through :class:`_Emulated`, an autograd Function
  that returns a new tensor of the rank's local shape (a new storage, as the functional collectives allocate
  their outputs), and whose backward does the same for the gradient; both record the collective they stand
  for into the call of the module that issues it (``Call.tp_collectives``). They dispatch only ``empty``: no
  FLOPs, no kernel (trace/kernel_ops.py NO_KERNEL_OPS), one op each. Which collective, in which phase, is
  [Note: The collectives torch 2.13 issues per style].
- the loss: with loss parallelism, ``loss_fn`` runs on the local (b, s, vocab / t) logits, and each
  ``_log_softmax`` / ``nll_loss_forward`` it dispatches records the all-reduces torch's loss_parallel handlers
  add (:meth:`RankEmulation.note_loss_op`).

[Note: Staging copies of the sequence-dim collectives]
  torch 2.13's functional collectives gather and scatter on dim 0 (torch/distributed/_functional_collectives.py
  ``all_gather_single``, ``reduce_scatter_single``). A reduce-scatter on another dim first copies its input
  into dim-0 chunks (``_chunk_or_narrow_cat``: ``torch.cat(torch.chunk(...))``, a full-size copy, always); an
  all-gather on another dim gathers into a (t x b, ...) buffer and re-cats it on the gather dim
  (``_maybe_view_chunk_cat``), a second full-size tensor, unless every dim before the gather dim has size 1
  after the first (b = 1 for the sequence dim): then a view. The emulation allocates that staging tensor
  beside each output and drops it after, at every micro-batch: at b = 1 a sequence all-gather's transient is
  one (s, h) activation above the real one (an over-estimate; the trace's two batch sizes must fit one line).
  This is the source's account, not yet a measurement's: the 2 x 2 plans measured (tests/execute/
  test_tp_predicted.py) peak at the loss, outside the blocks, with and without it.

[Note: Loss parallelism's decomposed log-softmax]
  Under loss parallelism torch computes the log-softmax of the vocabulary-split logits op by op
  (torch/distributed/tensor/parallel/loss.py ``_log_softmax``, after torch._decomp's: ``shifted = x - max``,
  ``exp(shifted)``, ``result = shifted - logsumexp``) where the trace runs the local fused kernel: at its peak
  the logits' input, ``shifted`` and ``exp`` (or ``result``) live, one logits-sized tensor more than the
  fused op's input and output. Its backward (``_nll_loss_and_log_softmax_backward``: ``grad_input =
  zeros_like(x)``, ``(grad_input + exp(x)) * grad_output``) holds three at once where the fused
  nll_loss / log-softmax backward holds two. The trace allocates that one tensor beside each of the two
  fused ops' outputs and drops it (:meth:`RankEmulation.loss_op`): what the real step measured at
  2 x 2 (examples/llama.py tiny, micro-batch 4, fp32) was 7-8% above the trace without it, with or without
  sequence parallelism, and equal without loss parallelism.

What it does not reproduce (measured on the tiny TP Llama at t=2, micro-batch 2, bf16, against the real
DTensor step with the tracer's StorageLog over its local ops): the bytes saved for backward match per module
exactly; the forward's peak rise is 1 KiB higher for real without sequence parallelism (the embedding's
(b, s) int64 index mask ``_MaskPartial`` keeps until the reduction). The loss under loss parallelism runs torch's decomposed log-softmax (amax, sub, exp, sum, log,
sub: loss.py:197-221) where the trace runs the local fused kernel: the same saves, a larger transient.

Refused (UserError): a quantised (NF4) parameter in a styled module, a split dimension the degree does not
divide (DTensor would pad uneven shards), a style on a module class torch's style does not split.

[Note: The collectives torch 2.13 issues per style]
Counted with torch.distributed.tensor.debug.CommDebugMode on the real DTensor step (tests/trace/test_tp_trace.py);
"full" is the whole tensor, (b, s, h) the activation:

  style         sequence parallel                           no sequence parallelism
  embedding     fwd reduce-scatter, bwd all-gather (b,s,h)   fwd all-reduce (b,s,h)
  gather_input  fwd all-gather, bwd reduce-scatter (b,s,h)    (not used)
  colwise       none (its input: the gathered DTensor)       bwd all-reduce of its input's gradient
  rowwise       fwd reduce-scatter, bwd all-gather (b,s,h)   fwd all-reduce (b,s,h)
  head input    fwd all-gather, bwd reduce-scatter (b,s,h)   bwd all-reduce (b,s,h)
  head output   loss parallel: none; else fwd all-gather of the logits (b,s,vocab), bwd none
  norm          bwd all-reduce of each trainable parameter's gradient (FSDP2), none for activations
  loss          loss parallel: fwd three all-reduces of (b*s) statistics; bwd none

Why: gather_input hands the module the gathered Replicate DTensor (execute/tensor_parallel.py [Note:
gather_input hands on a DTensor]); the colwise projections take it as it is, their Partial input gradients
sum on it, and the gather's backward reduce-scatters the sum once. Without sequence parallelism a colwise
projection's input is a plain tensor wrapped as ``DTensor.from_local(x, Replicate)``; its gradient comes
back Partial and ``_FromTorchTensor.backward`` redistributes it to the forward's placement, an all-reduce
(torch/distributed/tensor/_api.py:239-275), once per projection (q, k and v each). A Partial output (rowwise, embedding)
reduced to Shard(1) or Replicate gets a Replicate gradient back: all-gathered, or nothing. The logits'
all-gather's backward is a chunk too. Loss parallelism (torch/distributed/tensor/parallel/loss.py): the
log-softmax all-reduces the max and the sum of exponentials (loss.py:209-216), in the computation dtype
(float32 for 16-bit logits), and the NLL's masked gather one (loss.py:313-316), each of the (b*s) rows; the
fused backward (loss.py:451-518) communicates nothing. A norm's replicated parameters get Partial gradients
(SequenceParallel keeps them ``from_local(param, Replicate)``, style.py:390-399, and the norm runs on a
sequence slice); nothing reduces them in the step, but FSDP2's post-backward redistributes every DTensor
gradient to its parameter's placement before its reduce-scatter (torch/distributed/fsdp/_fully_shard/
_fsdp_param.py:934-966): an all-reduce of the gradient (param dtype) per norm parameter, recorded on the norm
once per step. The embedding's gradient comes back Replicate, the whole (vocab, dim) table (CommDebugMode's
run: ``tok_embeddings.weight.grad`` is Replicate), which that same redistribution chunks locally.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from shard_planner.plan.comm import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from shard_planner.errors import UserError
from shard_planner.trace.tp_adapters import refuse_quantised
from shard_planner.parallel.tensor_parallel import SEQUENCE_DIM, ModuleStyle, Style, TensorParallel
from shard_planner.trace.types import Affine, TPCollective

aten = torch.ops.aten

CHUNK = "chunk"  # a local slice copied out: a new storage, no collective


class Collective(NamedTuple):
    """One collective as it ran at one batch size (fitted into a :class:`TPCollective`)."""

    kind: str
    phase: str
    full_bytes: int


class Op(NamedTuple):
    """What :class:`_Emulated` does to a tensor in one phase: ``kind`` (a collective, ``CHUNK``, or None for
    the tensor itself) on dimension ``dim``."""

    kind: str | None
    dim: int = SEQUENCE_DIM


IDENTITY = Op(None)


# ---- parameters ----

def shard_parameters(model: nn.Module, tp: TensorParallel, tp_size: int, fake_mode: FakeTensorMode) -> None:
    """Each styled module's parameters as the local shard of one of ``tp_size`` ranks (see [Note: A
    tensor-parallel rank traced locally]); UserError for a module or parameter that cannot be split so."""
    modules = dict(model.named_modules())
    for fqn, style in tp.styles_by_fqn.items():
        module = modules.get(fqn)
        if module is None:
            raise UserError(f"tensor_parallel.styles names {fqn!r}, which is not a module of the model")
        _check_module_class(module, fqn, style)
        refuse_quantised(fqn, module)
        for name, p in module.named_parameters(recurse=False):
            dim = _split_dim(module, style, name, p)
            if dim is None:
                continue
            if p.shape[dim] % tp_size:
                raise UserError(f"{fqn}.{name}: dimension {dim} of shape {tuple(p.shape)} does not divide into "
                                f"{tp_size} tensor-parallel shards")
            local = list(p.shape)
            local[dim] //= tp_size
            p.data = FakeTensor(fake_mode, torch.empty(local, dtype=p.dtype, device="meta"), p.device)


_SPLITS = {Style.COLWISE: (nn.Linear, nn.Embedding), Style.ROWWISE: (nn.Linear,), Style.HEAD: (nn.Linear,),
           Style.EMBEDDING: (nn.Embedding,)}  # what torch splits (style.py:154-160, 303-313) and these styles mean


def _check_module_class(module: nn.Module, fqn: str, style: ModuleStyle) -> None:
    classes = _SPLITS.get(style.style)
    if classes is not None and not isinstance(module, classes):
        raise UserError(f"tensor_parallel.styles[{fqn!r}]: style {style.style.value} splits "
                        f"{' or '.join(c.__name__ for c in classes)}, not {type(module).__name__}")


def _split_dim(module: nn.Module, style: ModuleStyle, name: str, p: torch.Tensor) -> int | None:
    """The dimension torch's style splits parameter ``name`` on (None: replicated); style.py cited above."""
    s = style.style
    if s in (Style.NORM, Style.GATHER_INPUT, Style.GRAD_ALL_REDUCE):
        return None
    if s is Style.ROWWISE:
        return 1 if name == "weight" else None  # bias Replicate
    if s is Style.COLWISE and isinstance(module, nn.Embedding):
        return 1  # ColwiseParallel of an nn.Embedding: Shard(1), style.py:134-140
    return 0 if p.dim() >= 1 else None


# ---- the emulated collectives ----

class _Emulated(torch.autograd.Function):
    """A tensor-parallel redistribution on one rank: returns a new tensor of the local shape after ``fwd``,
    and in backward a new gradient after ``bwd``; records the collectives into ``calls``' list. See
    [Note: A tensor-parallel rank traced locally]."""

    @staticmethod
    def forward(ctx, x, fwd: Op, bwd: Op, tp_size: int, record: list):
        ctx.bwd, ctx.tp_size, ctx.record = bwd, tp_size, record
        return _apply(x, fwd, "fwd", tp_size, record)

    @staticmethod
    def backward(ctx, grad):
        return _apply(grad, ctx.bwd, "bwd", ctx.tp_size, ctx.record), None, None, None, None


def _apply(x: torch.Tensor, op: Op, phase: str, tp_size: int, record: list) -> torch.Tensor:
    if op.kind is None:
        return x.view_as(x)
    shape = list(x.shape)
    dim = op.dim % x.dim()
    if op.kind == ALL_GATHER:
        shape[dim] *= tp_size
    elif op.kind in (REDUCE_SCATTER, CHUNK):
        if shape[dim] % tp_size:
            raise UserError(f"tensor parallelism: dimension {dim} of an activation of shape {tuple(x.shape)} does "
                            f"not divide into {tp_size} shards (sequence parallelism needs the sequence length "
                            "to divide by the degree)")
        shape[dim] //= tp_size
    # funcol's all-gather and reduce-scatter run on dim 0: on another dim a full-size chunk+cat copy stages
    # them ([Note: Staging copies of the sequence-dim collectives]); allocated with the output, dropped after
    staging = x.new_empty(shape if op.kind == ALL_GATHER else x.shape) if op.kind in (ALL_GATHER, REDUCE_SCATTER) \
        and dim != 0 else None
    out = x.new_empty(shape)
    del staging
    if op.kind != CHUNK:
        full = out if op.kind == ALL_GATHER else x
        record.append(Collective(op.kind, phase, full.numel() * full.element_size()))
    return out


def emulate(x, fwd: Op, bwd: Op, tp_size: int, record: list):
    """``x`` through :class:`_Emulated` if a tensor (else as is)."""
    if not isinstance(x, torch.Tensor) or fwd == bwd == IDENTITY:
        return x
    return _Emulated.apply(x, fwd, bwd, tp_size, record)


# ---- per style ----

class RankEmulation:
    """One step's tensor-parallel emulation: :meth:`before` and :meth:`after` a styled module's forward (where
    torch's style hooks run), :meth:`note_loss_op` for the loss. See [Note: The collectives torch 2.13 issues
    per style]."""

    def __init__(self, tp: TensorParallel, tp_size: int):
        self.tp, self.tp_size = tp, tp_size
        self.styles = tp.styles_by_fqn
        self.norms_seen: set[str] = set()

    def before(self, call, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The module's inputs as its forward gets them (gathered, or marked for the gradient's all-reduce)."""
        style = self.styles.get(call.fqn)
        if style is None:
            return args, kwargs
        s, sp = style.style, self.tp.sequence_parallel
        if s is Style.NORM or s is Style.GRAD_ALL_REDUCE:
            self._norm_grads(call, module)
            return args, kwargs
        if (s is Style.COLWISE or s is Style.HEAD) and not sp:
            fwd, bwd = IDENTITY, Op(ALL_REDUCE)
        elif s is Style.HEAD or s is Style.GATHER_INPUT:
            fwd, bwd = Op(ALL_GATHER), Op(REDUCE_SCATTER)
        else:
            return args, kwargs
        return self._first_input(call, style, args, kwargs, fwd, bwd)

    def _first_input(self, call, style: ModuleStyle, args, kwargs, fwd: Op, bwd: Op):
        """The redistributed input: keyword ``style.kwarg``, else the first positional argument."""
        if style.kwarg is not None:
            if style.kwarg not in kwargs:
                raise UserError(f"gather_input:{style.kwarg}: {call.fqn} was called without that keyword argument")
            return args, {**kwargs, style.kwarg: emulate(kwargs[style.kwarg], fwd, bwd, self.tp_size,
                                                         call.tp_collectives)}
        if not args or not isinstance(args[0], torch.Tensor):
            raise UserError(f"tensor parallelism: {call.fqn} was called without a tensor as its first positional "
                            "argument; name the gathered keyword argument (gather_input:NAME)")
        return (emulate(args[0], fwd, bwd, self.tp_size, call.tp_collectives), *args[1:]), kwargs

    def after(self, call, out):
        """The module's output as its caller gets it (reduced, reduce-scattered or gathered)."""
        style = self.styles.get(call.fqn)
        if style is None:
            return out
        s, sp = style.style, self.tp.sequence_parallel
        if s in (Style.EMBEDDING, Style.ROWWISE):
            fwd, bwd = (Op(REDUCE_SCATTER), Op(ALL_GATHER)) if sp else (Op(ALL_REDUCE), IDENTITY)
        elif s is Style.HEAD and not self.tp.loss_parallel:
            fwd, bwd = Op(ALL_GATHER, -1), Op(CHUNK, -1)
        else:
            return out
        if not isinstance(out, torch.Tensor):
            raise UserError(f"tensor parallelism: {call.fqn} ({s.value}) returned {type(out).__name__}, not a tensor")
        return emulate(out, fwd, bwd, self.tp_size, call.tp_collectives)

    def _norm_grads(self, call, module: nn.Module) -> None:
        """The all-reduce of a replicated module's parameter gradients, once per step: a sequence-parallel norm's
        (DTensor's, of its Partial gradients), a ``grad_all_reduce`` module's (its post-accumulate-grad hook)."""
        if call.fqn in self.norms_seen:
            return
        self.norms_seen.add(call.fqn)
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                call.tp_collectives.append(Collective(ALL_REDUCE, "bwd", p.numel() * p.element_size()))

    def note_loss_op(self, func, args, record: list) -> None:
        """Loss parallelism's all-reduces for one op of the loss's forward (torch's loss.py handlers)."""
        if not self.tp.loss_parallel:
            return
        if func is aten._log_softmax.default:  # max and sum of exponentials, in the computation dtype
            x, dim = args[0], args[1]
            itemsize = 4 if x.dtype in (torch.float16, torch.bfloat16) else x.element_size()
            rows = x.numel() // max(1, x.shape[dim])
            record.extend([Collective(ALL_REDUCE, "fwd", rows * itemsize)] * 2)
        elif func in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default):  # the masked gather
            x = args[0]
            channels = x.shape[1] if x.dim() >= 2 else x.shape[0]
            record.append(Collective(ALL_REDUCE, "fwd", x.numel() // max(1, channels) * x.element_size()))


    def loss_op(self, func, args, out, phase: str, record: list, log) -> None:
        """One op of the loss (trace/capture.py ``Step.record_op``, its outputs logged): in forward its
        collectives (:meth:`note_loss_op`); a storage of the transient the real op makes beyond the local one
        (:meth:`loss_transient_bytes`) allocated beside its output in ``log`` and freed at once."""
        if phase == "fwd":
            self.note_loss_op(func, args, record)
        nbytes = self.loss_transient_bytes(func, args, out)
        if nbytes:
            transient = out.new_empty(nbytes, dtype=torch.uint8)  # fake, as the op's output
            log.track(transient)
            del transient

    def loss_transient_bytes(self, func, args, out) -> int:
        """The bytes one op of the loss allocates for a moment beyond what the local op does, under loss
        parallelism: [Note: Loss parallelism's decomposed log-softmax]; 0 for every other op."""
        if not self.tp.loss_parallel or not isinstance(out, torch.Tensor):
            return 0
        if func is aten._log_softmax.default:  # in the computation dtype (fp32 for 16-bit logits)
            return out.numel() * (4 if out.dtype in (torch.float16, torch.bfloat16) else out.element_size())
        if func is aten._log_softmax_backward_data.default:
            return out.numel() * out.element_size()
        return 0


def fit_collectives(seq1: list[Collective], seq2: list[Collective], b1: int, b2: int) -> tuple[TPCollective, ...]:
    """Pair one module's collectives at batch sizes b1 and b2 in order; each's bytes affine in the batch."""
    if [(c.kind, c.phase) for c in seq1] != [(c.kind, c.phase) for c in seq2]:
        raise UserError(f"tensor-parallel collectives differ between batch sizes {b1} and {b2}: "
                        f"{[c.kind for c in seq1]} vs {[c.kind for c in seq2]}")
    return tuple(TPCollective(x.kind, x.phase, Affine.fit(b1, float(x.full_bytes), b2, float(y.full_bytes)))
                 for x, y in zip(seq1, seq2))


def check_tensor_parallel(tp: TensorParallel | None, tp_size: int) -> TensorParallel | None:
    """The styles to trace with: None at degree 1 (nothing is split); UserError for a degree without styles."""
    if tp_size < 1:
        raise UserError(f"tp_size must be at least 1, got {tp_size}")
    if tp_size == 1:
        return None
    if tp is None:
        raise UserError(f"tp_size {tp_size} needs the tensor-parallel styles (tensor_parallel)")
    return tp
