"""transformers' "am I being traced?" branches, answered as a real run of the same batch answers them.

[Note: transformers under fake tensors] transformers (5.x) decides from the attention mask's values
whether SDPA may use its own causal (or no) mask: ``masking_utils._ignore_causal_mask_sdpa`` and
``_ignore_bidirectional_mask_sdpa`` skip the 4-D mask when the 2-D padding mask is all ones, and
``find_packed_sequence_indices`` finds no packed sequences when position ids count up. A fake tensor has
no values, so each of them first asks ``is_tracing(mask)`` (true for a ``FakeTensor``) and takes the
conservative path: the (B, 1, T, T) mask is materialised and, because SDPA then gets a mask,
``sdpa_attention_forward`` repeats K/V heads for grouped-query attention (``use_gqa_in_sdpa``) instead
of SDPA's ``enable_gqa``. A real step on an unpadded batch does neither (measured on a tiny Llama: the
attention's saved bytes +59%, its forward peak +42% under fake tensors).

:func:`real_run_paths` makes the batch once for real (small: token ids and masks), reads whether it is
padded or packed, and while the model is traced hands those helpers ``None`` for a fake mask exactly
when the real batch's masks hold no padding (and no packing), which is what they conclude from the
values in a real run. A padded batch is left alone: both paths then materialise the mask. Only
transformers' own helpers are wrapped, for the trace's duration, and only when transformers is loaded.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from functools import wraps

import torch
from torch._subclasses.fake_tensor import FakeTensor

from shard_planner.modelfile import ModelFile

logger = logging.getLogger(__name__)

# masking_utils helper -> the argument that carries the padding mask (or position ids), by position and name
_PADDING_HELPERS = {
    "_ignore_causal_mask_sdpa": (0, "padding_mask"),
    "_ignore_bidirectional_mask_sdpa": (0, "padding_mask"),
}
_PACKING_HELPERS = {"find_packed_sequence_indices": (0, "position_ids")}


@contextmanager
def real_run_paths(model_file: ModelFile, batch_size: int):
    """While tracing ``model_file``'s transformers model: its mask helpers see an unpadded fake mask as
    a real run sees the real one (see [Note: transformers under fake tensors])."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    unpadded, unpacked = _batch_facts(model_file, batch_size)
    helpers = {**(_PADDING_HELPERS if unpadded else {}), **(_PACKING_HELPERS if unpacked else {})}
    originals = {name: getattr(masking, name) for name in helpers if hasattr(masking, name)}
    if originals:
        logger.info("transformers masks: the batch is %s, so the trace takes a real run's path (%s: "
                    "SDPA's own mask, no materialised mask or repeated K/V heads)",
                    "unpadded and unpacked" if unpadded and unpacked else "unpadded" if unpadded else "unpacked",
                    ", ".join(sorted(originals)))
    for name, fn in originals.items():
        setattr(masking, name, _none_for_fake(fn, *helpers[name]))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(masking, name, fn)


def _none_for_fake(fn, index: int, name: str):
    """``fn`` with its mask argument (``index``/``name``) replaced by None when it is a fake tensor."""
    @wraps(fn)
    def wrapper(*args, **kwargs):
        if name in kwargs and isinstance(kwargs[name], FakeTensor):
            kwargs[name] = None
        elif len(args) > index and isinstance(args[index], FakeTensor):
            args = args[:index] + (None,) + args[index + 1:]
        return fn(*args, **kwargs)

    return wrapper


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
