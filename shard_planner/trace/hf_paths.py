"""transformers' "am I being traced?" branches, answered as a real run of the same batch answers them.

[Note: transformers under fake tensors] transformers (5.x) decides from the attention mask's values
whether SDPA may use its own causal (or no) mask: ``masking_utils._ignore_causal_mask_sdpa`` and
``_ignore_bidirectional_mask_sdpa`` skip the 4-D mask when the 2-D padding mask is all ones, and
``find_packed_sequence_indices`` (called only without a cache and without a 2-D mask: ``use_cache=False``
training) finds no packed sequences when position ids count up. A fake tensor has no values, so each of
them first asks ``is_tracing(mask)`` (true for a ``FakeTensor``) and takes the conservative path: the
(B, 1, T, T) mask is materialised and, because SDPA then gets a mask, ``sdpa_attention_forward`` repeats
K/V heads for grouped-query attention (``use_gqa_in_sdpa``) instead of SDPA's ``enable_gqa``. A real
step on an unpadded batch does neither (measured on a tiny Llama: the attention's saved bytes +59%, its
forward peak +42% under fake tensors).

:func:`real_run_paths` makes the batch once for real (small: token ids and masks), reads whether it is
padded or packed, and while the model is traced answers those helpers as a real run does, exactly when
the real batch's masks hold no padding (and its position ids no packing):

- the padding helpers get ``None`` for a fake padding mask (what "no padding" means to them);
- the packing helper is called on real position ids 0..T-1 of the fake ones' shape (outside every
  dispatch mode), and its answer is returned where it is "no packing" (``None`` in transformers 5.x);
  any other answer is what the fake path computes anyway, so the fake call stands.

A padded (or packed) batch is left alone: both paths then materialise the mask. Only transformers' own
helpers are wrapped, for the trace's duration, and only when transformers is loaded.

[Note: transformers internals may change] The helpers are private: a transformers release may rename
an argument or change what a helper does with it. A helper whose signature no longer has the argument
where it is expected is not wrapped, and a wrapped call that raises is made again as transformers would
make it (the conservative path: the trace can only over-count attention memory); either is logged in one
warning line per trace, never an error.
"""

from __future__ import annotations

import inspect
import logging
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from shard_planner.model.modelfile import ModelFile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Helper:
    """A masking_utils helper: the argument that carries the padding mask or the position ids (by position
    and name), and whether it answers about padding (else packing)."""

    index: int
    arg: str
    padding: bool


_HELPERS = {
    "_ignore_causal_mask_sdpa": _Helper(0, "padding_mask", padding=True),
    "_ignore_bidirectional_mask_sdpa": _Helper(0, "padding_mask", padding=True),
    "find_packed_sequence_indices": _Helper(0, "position_ids", padding=False),
}


class _Fallback:
    """The one warning of a trace whose transformers helpers could not be adapted ([Note: transformers
    internals may change])."""

    def __init__(self):
        self.warned = False

    def warn(self, helper: str, why: str) -> None:
        if self.warned:
            return
        self.warned = True
        import transformers

        logger.warning("transformers %s: masking_utils.%s %s; tracing transformers' own (conservative) mask path "
                       "instead: attention memory may read high", transformers.__version__, helper, why)


@contextmanager
def real_run_paths(model_file: ModelFile, batch_size: int):
    """While tracing ``model_file``'s transformers model: its mask helpers see an unpadded fake mask as
    a real run sees the real one (see [Note: transformers under fake tensors])."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    unpadded, unpacked = _batch_facts(model_file, batch_size)
    fallback = _Fallback()
    originals = {name: getattr(masking, name) for name, h in _HELPERS.items()
                 if hasattr(masking, name) and (unpadded if h.padding else unpacked)}
    wrapped = {name: _adapted(name, fn, _HELPERS[name], fallback) for name, fn in originals.items()}
    wrapped = {name: fn for name, fn in wrapped.items() if fn is not None}
    if wrapped:
        logger.info("transformers masks: the batch is %s, so the trace takes a real run's path (%s: "
                    "SDPA's own mask, no materialised mask or repeated K/V heads)",
                    "unpadded and unpacked" if unpadded and unpacked else "unpadded" if unpadded else "unpacked",
                    ", ".join(sorted(wrapped)))
    for name, fn in wrapped.items():
        setattr(masking, name, fn)
    try:
        yield
    finally:
        for name in wrapped:
            setattr(masking, name, originals[name])


def _adapted(name: str, fn: Callable, helper: _Helper, fallback: _Fallback) -> Callable | None:
    """``fn`` answering a fake argument as a real run of the batch does; None (and the trace's warning)
    where ``fn``'s signature no longer has ``helper``'s argument where expected."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    if len(params) <= helper.index or params[helper.index] != helper.arg:
        fallback.warn(name, f"no longer takes {helper.arg!r} as argument {helper.index}")
        return None
    answer = _unpadded_answer if helper.padding else _unpacked_answer

    @wraps(fn)
    def wrapper(*args, **kwargs):
        in_kwargs = helper.arg in kwargs
        value = kwargs[helper.arg] if in_kwargs else args[helper.index] if len(args) > helper.index else None
        if not isinstance(value, FakeTensor):
            return fn(*args, **kwargs)
        try:
            return answer(fn, helper, args, kwargs, in_kwargs)
        except Exception as exc:  # transformers changed: its own path, once warned. See [Note: transformers internals may change]
            fallback.warn(name, f"raised {type(exc).__name__} on the real run's answer ({exc})")
            return fn(*args, **kwargs)

    return wrapper


def _call_with(fn: Callable, helper: _Helper, args: tuple, kwargs: dict, in_kwargs: bool, value):
    """``fn`` called as given, with ``value`` in place of ``helper``'s argument (by name or by position)."""
    if in_kwargs:
        return fn(*args, **{**kwargs, helper.arg: value})
    return fn(*args[:helper.index], value, *args[helper.index + 1:], **kwargs)


def _unpadded_answer(fn: Callable, helper: _Helper, args: tuple, kwargs: dict, in_kwargs: bool):
    """A padding helper's answer for a mask of ones: the helper given no mask."""
    return _call_with(fn, helper, args, kwargs, in_kwargs, None)


def _unpacked_answer(fn: Callable, helper: _Helper, args: tuple, kwargs: dict, in_kwargs: bool):
    """The packing helper's answer for position ids 0..T-1 (real, outside every dispatch mode, so the
    trace records none of its ops) where it is "no packing" (None); else the fake call's own answer."""
    fake = kwargs[helper.arg] if in_kwargs else args[helper.index]
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        real = torch.arange(fake.shape[-1], dtype=fake.dtype).expand(fake.shape)
        answer = _call_with(fn, helper, args, kwargs, in_kwargs, real)
    return None if answer is None else fn(*args, **kwargs)


def _batch_facts(model_file: ModelFile, batch_size: int) -> tuple[bool, bool]:
    """(no input mask holds a zero, no position ids other than 0..T-1) of a real batch of ``model_file``.

    Masks: keyword inputs whose name holds ``mask``; for positional inputs, every bool tensor and every
    integer tensor with values in {0, 1} (a token-id tensor of such a vocabulary counts as a mask too,
    which can only make the answer "padded": the conservative path)."""
    inputs, _targets = model_file.batch(batch_size)
    named = inputs.items() if isinstance(inputs, dict) else ((None, t) for t in inputs)
    unpadded = unpacked = True
    for key, t in named:
        if not isinstance(t, torch.Tensor) or t.is_floating_point():
            continue
        if key is not None and "position_ids" in key:
            unpacked &= bool((t == torch.arange(t.shape[-1])).all())
        elif _is_mask(key, t):
            unpadded &= bool(t.all())
    return unpadded, unpacked


def _is_mask(key: str | None, t: torch.Tensor) -> bool:
    if key is not None:
        return "mask" in key
    return t.dtype == torch.bool or (t.numel() > 0 and int(t.min()) >= 0 and int(t.max()) <= 1)
