"""The loss a step computes over the output layer: the model file's own, chunked, or fused with the layer.

``--loss`` (or a model file's ``TRAINING["loss"]``) picks one of shard_planner/plan/loss.py's ``LOSSES``:

- ``model``: the model file's ``loss_fn`` (for a transformers config, the loss the model computes from its
  ``labels``: ``ForCausalLMLoss``, the whole (batch, sequence, vocabulary) logits upcast to fp32 at once).
- ``chunked``: torchtune's ``CEWithChunkedOutputLoss`` with its model's ``num_output_chunks``
  (torchtune/modules/loss/ce_chunked_output_loss.py, torchtune/modules/transformer.py
  ``TransformerDecoder.chunked_output``): the output layer runs on :data:`CHUNKS` chunks of the hidden
  states along the sequence and returns the list of their logits; the loss upcasts one chunk at a time
  (``F.cross_entropy(chunk.float(), labels, reduction="sum")``) and divides the sum by the number of targets
  not ignored. In eager PyTorch each chunk's fp32 log-softmax is still saved for backward (what
  ``log_softmax`` saves); what chunking removes is the fp32 copy of the whole logits beside it.
- ``fused``: Liger Kernel's fused linear cross-entropy (liger_kernel/ops/fused_linear_cross_entropy.py,
  ``fused_linear_cross_entropy_forward``): the output layer and the loss in one autograd function whose
  forward walks the tokens in chunks of ``next_power_of_2(ceil(tokens / ceil(vocab / hidden)))`` rows, computes
  each chunk's logits, its loss and the gradient of the logits, and from it the gradients of the hidden
  states (tokens x hidden, allocated once) and of the weight (accumulated into a tensor like the weight, the
  unsharded one under FSDP2); it saves those two for backward, which only scales them by the incoming
  gradient. The whole logits never exist. Liger computes the softmax of a chunk in a Triton kernel, in
  registers; here it is PyTorch on the chunk's fp32 copy (two chunk x vocabulary fp32
  tensors at once), so a GPU running Liger holds up to that much less than what is traced here, at most
  2 x 4 x 256 x 128256 B = 0.25 GiB for Llama 3 8B at 8,192 tokens per rank; the same ops are what the time
  model prices (about seven fp32 passes over each chunk's logits where Liger's kernel makes about two in bf16:
  about 8 ms more than Liger per 8,192 tokens of Llama 3 8B at 3 TB/s). Backward scales in place, always
  (Liger skips the scaling when the gradient is exactly 1: a data-dependent test the tracer's fake tensors
  cannot take).

Both need the output layer (:func:`output_layer`): a transformers model's ``get_output_embeddings()``, else
the one ``nn.Linear`` named ``output`` or ``lm_head``; the model must return the layer's result unchanged
(as its output or its ``.logits``): a model that scales or soft-caps its logits after the layer (Gemma 2)
is refused in one line. A transformers causal LM's ``labels`` become targets shifted by one token as
``ForCausalLMLoss`` shifts them (``labels[..., 1:]``, the last position ignored). Tensor parallelism is not
combined with them yet (its vocabulary-split logits would need the loss's collectives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shard_planner.errors import ModelFileError
from shard_planner.plan.loss import CHUNKED, CHUNKS, IGNORE_INDEX

HEAD_NAMES = ("output", "lm_head")


def output_layer(model) -> tuple[str, Any]:
    """(FQN, module) of the model's output layer, or a one-line ModelFileError saying why there is none."""
    import torch.nn as nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    named = [(n, m) for n, m in model.named_modules() if m is head or n.rpartition(".")[2] in HEAD_NAMES]
    found = [(n, m) for n, m in named if isinstance(m, nn.Linear)]
    if head is not None:
        found = [(n, m) for n, m in found if m is head]
    if len(found) != 1:
        names = ", ".join(n for n, _ in found) or "none"
        raise ModelFileError(f"the chunked and fused losses need one output layer (an nn.Linear named "
                             f"{' or '.join(HEAD_NAMES)}, or a transformers model's get_output_embeddings()); "
                             f"found {names}: use --loss model")
    return found[0]


HEAD_LOSS = "_shard_planner_head_loss"  # the attribute of a built model that holds its HeadLoss


@dataclass
class HeadLoss:
    """A chunked or fused loss installed on one built model: its output layer's forward replaced, and the
    targets the fused layer reads while the model runs (:meth:`run`)."""

    name: str
    targets: Any = None  # the fused layer's, for the forward running now
    returned: Any = None  # what the output layer returned in it

    @classmethod
    def install(cls, model, name: str) -> None:
        """Replace the output layer's forward of ``model`` (an instance attribute: the class is untouched) and
        keep the HeadLoss on the model (:data:`HEAD_LOSS`)."""
        _, head = output_layer(model)
        loss = cls(name)
        plain = head.forward

        def forward(h):
            if name == CHUNKED:
                loss.returned = [plain(c) for c in h.chunk(CHUNKS, dim=1)]
            else:
                loss.returned = fused_linear_cross_entropy(h, head.weight, head.bias, loss.targets)
            return loss.returned

        head.forward = forward
        setattr(model, HEAD_LOSS, loss)

    @staticmethod
    def of(model) -> "HeadLoss":
        """The HeadLoss :meth:`install` kept on ``model``."""
        loss = getattr(model, HEAD_LOSS, None)
        if loss is None:
            raise RuntimeError("the model was not built by its ModelFile: no chunked or fused loss installed")
        return loss

    def run(self, call, targets):
        """``call()`` (the model on a batch) with ``targets`` where the fused layer reads them."""
        if targets is None:
            raise ModelFileError(f"--loss {self.name} needs targets: make_batch gave none (nor labels to shift)")
        self.targets, self.returned = targets, None
        try:
            out = call()
        finally:
            self.targets = None
        logits, returned = getattr(out, "logits", out), self.returned
        self.returned = None  # held no longer than the step holds the output
        same = (logits is returned if not isinstance(returned, list) else isinstance(logits, (list, tuple))
                and len(logits) == len(returned) and all(a is b for a, b in zip(logits, returned)))
        if not same:
            raise ModelFileError(f"--loss {self.name}: the model does not return what its output layer returns "
                                 "(it changes the logits after the layer): use --loss model")
        return out


def output_loss(name: str, output, targets):
    """The chunked or fused loss of the model's ``output``: what its output layer returned (:meth:`HeadLoss.run`
    checked it), or a ModelOutput whose ``.logits`` it is; the fused layer's is the loss itself."""
    logits = getattr(output, "logits", output)
    return chunked_cross_entropy(list(logits), targets) if name == CHUNKED else logits


def chunked_cross_entropy(logits: list, targets):
    """torchtune's CEWithChunkedOutputLoss: each chunk of logits upcast and summed, over the targets kept."""
    import torch.nn.functional as F

    chunks = targets.chunk(CHUNKS, dim=1)
    if [c.shape for c in chunks] != [lc.shape[:-1] for lc in logits]:
        raise ModelFileError(f"--loss {CHUNKED}: the targets {tuple(targets.shape)} are not one per logit of the "
                             f"output layer's chunks {[tuple(lc.shape) for lc in logits]}: use --loss model")
    total = sum(F.cross_entropy(lc.flatten(0, -2).float(), tc.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
                for lc, tc in zip(logits, chunks))
    return total / (targets != IGNORE_INDEX).sum().clamp_min(1)


def fused_chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """Liger's chunk of tokens: ``next_power_of_2(ceil(tokens / ceil(vocab / hidden)))``."""
    rows = math.ceil(tokens / math.ceil(vocab / hidden))
    return 1 << max(0, rows - 1).bit_length()


def fused_linear_cross_entropy(hidden, weight, bias, targets):
    """The mean cross-entropy of ``hidden @ weight.T + bias`` against ``targets``, by :class:`_FusedLinearCE`."""
    return _fused_function().apply(hidden, weight, bias, targets)


_FUSED = None


def _fused_function():
    """The autograd function (defined once torch is imported: this module is imported without it)."""
    global _FUSED
    if _FUSED is None:
        _FUSED = _define_fused()
    return _FUSED


def _define_fused():
    import torch

    class _FusedLinearCE(torch.autograd.Function):
        """Liger's algorithm (module docstring): gradients computed in forward, saved, scaled in backward."""

        @staticmethod
        def forward(ctx, hidden, weight, bias, targets):
            x, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
            rows = fused_chunk_rows(x.shape[0], weight.shape[0], x.shape[1])
            grad_x = torch.zeros_like(x)
            grad_w = torch.zeros_like(weight) if weight.requires_grad else None
            grad_b = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
            kept = (t != IGNORE_INDEX).sum().clamp_min(1)
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            for start in range(0, x.shape[0], rows):
                xc, tc = x[start:start + rows], t[start:start + rows]
                logits = torch.nn.functional.linear(xc, weight, bias)
                scores = logits.float()
                lse = torch.logsumexp(scores, dim=-1)
                valid, index = tc != IGNORE_INDEX, tc.clamp_min(0).unsqueeze(1)  # an ignored target's row: class 0
                picked = scores.gather(1, index).squeeze(1)
                total = total + ((lse - picked) * valid).sum()
                probs = scores.sub_(lse.unsqueeze(1)).exp_()  # the softmax, in place of the fp32 logits
                probs.scatter_add_(1, index, -valid.unsqueeze(1).to(probs.dtype))
                probs.mul_(valid.unsqueeze(1) / kept)
                grad_logits = logits.copy_(probs)  # d loss / d logits, in the logits' own buffer (as Liger)
                del probs, scores
                grad_x[start:start + rows] = grad_logits @ weight
                if grad_w is not None:
                    grad_w.addmm_(grad_logits.t(), xc)
                if grad_b is not None:
                    grad_b.add_(grad_logits.sum(0))
            ctx.shape = hidden.shape
            ctx.save_for_backward(grad_x, grad_w, grad_b)
            return total / kept

        @staticmethod
        def backward(ctx, grad_loss):
            grad_x, grad_w, grad_b = ctx.saved_tensors
            grads = [g.mul_(grad_loss.to(g.dtype)) if g is not None else None for g in (grad_x, grad_w, grad_b)]
            return grads[0].view(ctx.shape), grads[1], grads[2], None

    return _FusedLinearCE


def shifted_labels(labels):
    """A transformers causal LM's ``labels`` as next-token targets: ``ForCausalLMLoss``'s shift (pad with the
    ignore index, drop the first position)."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
