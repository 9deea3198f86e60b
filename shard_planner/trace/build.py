"""Building the model under FakeTensorMode, and casting its parameters, with as few fake ops as possible.

Every op on a fake tensor goes through FakeTensorMode's Python dispatch (about a millisecond each on
this machine), so building a 1.8B ViT (289 Linear layers) spends a third of its ops initialising
values that fake tensors do not have: ``reset_parameters``' ``uniform_``, transformers'
``_init_weights``' ``normal_``/``fill_``/``zero_``. :func:`build_fake` skips those in-place
initialisers (:class:`_SkipInitialisers`); shapes, strides, dtypes and devices are untouched, so the
trace is the same. ``nn.init.trunc_normal_`` (ViT, DeiT, Swin, DINOv2 under transformers) is skipped whole
for a fake tensor (:func:`_skip_trunc_normal`): its rejection loop asks ``mask.any()``, a value a fake
tensor does not have (DataDependentOutputException). A fake tensor that holds a constant (one made from Python data, e.g.
``torch.tensor(0.5)``, whose value fake mode tracks and ``.item()`` can read) is initialised as usual.
A ``build_model()`` that casts or moves its model (``.to(torch.bfloat16)``, ``.half()``) works under fake
tensors too (:func:`_swappable_fakes`, [Note: Casting a fake model]).
:func:`cast_parameters` makes the compute-dtype copies as fresh fake tensors directly, without an op.

[Note: NF4 weights under fake tensors]
torchao's ``to_nf4`` quantises a weight with real arithmetic: block absmax, double quantisation of the
scalers, and the nearest of 16 code values for every element, in chunks of 2^20 elements
(``convert_to_norm_float_weight``). Under FakeTensorMode every one of those ops is dispatched without
values: 0.45 s for one 8192 x 28672 weight on this machine, minutes for a 70B model's 560 linears. The
values are never read in a trace, only the inner tensors' sizes and dtypes, which ``from_tensor`` fixes
from the weight's: n/2 uint8 codes, n/64 int8 scalers, n/16384 factors and a 0-d mean in the weight's
dtype, the 16-value table (model/param_storage.py, [Note: NF4 parameters as stored]). So while a fake model is
built, ``NF4Tensor.from_tensor`` of a fake weight builds the NF4Tensor from empty fake tensors of those sizes
(:func:`_nf4_by_shape`); tests/trace/test_finetune_trace.py checks them against the real ``to_nf4``'s.

[Note: Casting a fake model] ``nn.Module._apply`` (``.to``, ``.half``, ``.bfloat16``) replaces a
FakeTensor parameter with ``torch.utils.swap_tensors`` (torch 2.13, module.py: ``or isinstance(param,
FakeTensor)``), and ``swap_tensors`` refuses a tensor that any weak reference points to. FakeTensorMode
memoises the fake tensors it makes (``FakeTensorConverter.tensor_memo``, a WeakValueDictionary keyed by
the fresh meta tensor each was made from), and ``nn.Parameter(fake)`` detaches, which is such a fake
tensor: so every fake parameter carries a ``KeyedRef`` and ``model.to(torch.bfloat16)`` fails with
"_apply(): Couldn't swap Embedding.weight" (pytorch#184976, #178584: the same diagnosis, unreleased
fixes). The memo entry only serves a later lookup of the same fresh meta tensor, which nothing makes
again for a parameter, so while the model is built the swap first drops the two tensors' own memo
entries; any other weak reference still refuses the swap, as torch does.
"""

from __future__ import annotations

from contextlib import contextmanager

import weakref

import torch
import torch.nn as nn
import torch.nn.init
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from shard_planner.model.modelfile import ModelFile

aten = torch.ops.aten

# In-place ops that only write values into their first argument (no shape, stride or dtype change).
_INITIALISERS = frozenset({
    aten.uniform_.default, aten.normal_.default, aten.fill_.Scalar, aten.zero_.default,
})


class _SkipInitialisers(TorchDispatchMode):
    """Inside FakeTensorMode, while the model is built: an initialiser of a fake tensor without a
    constant returns its argument unchanged instead of being dispatched to the fake mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _INITIALISERS and isinstance(args[0], FakeTensor) and args[0].constant is None:
            return args[0]
        return func(*args, **(kwargs or {}))


def build_fake(model_file: ModelFile, fake_mode: FakeTensorMode) -> nn.Module:
    """``model_file.build()`` under ``fake_mode``, without running weight initialisers (nor NF4's
    quantisation: [Note: NF4 weights under fake tensors])."""
    with fake_mode, _SkipInitialisers(), _skip_trunc_normal(), _swappable_fakes(), _shaped_nf4(model_file):
        return model_file.build()


@contextmanager
def _shaped_nf4(model_file: ModelFile):
    """While the model is built: torchao's ``NF4Tensor.from_tensor`` (what ``to_nf4`` calls) of a fake tensor
    makes the NF4 weight's inner tensors by their shapes alone. See [Note: NF4 weights under fake tensors].
    Only where torchao's NF4 is in use: a QLoRA fine-tune, or a model file that imported it."""
    qlora = bool(getattr(model_file.finetune, "qlora", False))
    module = _nf4_module(qlora)
    if module is None:
        yield
        return
    cls = module.NF4Tensor
    original = cls.__dict__["from_tensor"]

    def from_tensor(klass, tensor, block_size, scaler_block_size):
        if not (isinstance(tensor, FakeTensor) and tensor.constant is None):
            return original.__func__(klass, tensor, block_size, scaler_block_size)
        return _nf4_by_shape(module, klass, tensor, block_size, scaler_block_size)

    cls.from_tensor = classmethod(from_tensor)
    try:
        yield
    finally:
        cls.from_tensor = original


def _nf4_module(load: bool):
    """torchao's NF4 module when it is imported (or ``load``: import it), else None."""
    import importlib
    import sys

    from shard_planner.model.param_storage import NF4_MODULE

    if NF4_MODULE not in sys.modules and not load:
        return None
    try:
        return importlib.import_module(NF4_MODULE)
    except ImportError:
        return None  # an older torchao elsewhere: its own to_nf4 runs (slowly) on the fake weights


def _nf4_by_shape(module, cls, tensor: FakeTensor, block_size: int, scaler_block_size: int):
    """The NF4Tensor ``to_nf4(tensor)`` makes, its inner tensors empty fakes of the sizes it gives them
    (nf4_tensor.py ``from_tensor``, ``double_quantize_scalers``, ``convert_to_norm_float_weight``), its
    checks kept. See [Note: NF4 weights under fake tensors]."""
    n = tensor.numel()
    n_blocks = n // block_size
    if tensor.dim() > 2 or n % block_size or n_blocks % scaler_block_size or n % 2:
        raise ValueError(f"to_nf4: a weight of shape {tuple(tensor.shape)} does not split into blocks of {block_size} "
                         f"and scaler blocks of {scaler_block_size}")
    with tensor.fake_mode:
        inner = dict(
            quantized_scalers=torch.empty(n_blocks, dtype=torch.int8, device=tensor.device),
            quantization_factor=torch.empty(n_blocks // scaler_block_size, dtype=tensor.dtype, device=tensor.device),
            scaler_mean=torch.empty((), dtype=tensor.dtype, device=tensor.device),
            quantized_data=torch.empty(n // 2, dtype=torch.uint8, device=tensor.device),
            nf4=torch.empty(16, dtype=tensor.dtype, device=tensor.device),
        )
        meta = module.SubclassTensorArgs(tensor.size(), tensor.stride(), tensor.storage_offset(), tensor.dtype,
                                         tensor.device, tensor.requires_grad)
        return cls(meta, block_size, n_blocks, scaler_block_size, inner["quantized_scalers"],
                   inner["quantization_factor"], inner["scaler_mean"], inner["quantized_data"], inner["nf4"])


@contextmanager
def _swappable_fakes():
    """While the model is built: ``torch.utils.swap_tensors`` of fake tensors first drops their fake
    mode's memo entries, whose weak references refuse the swap. See [Note: Casting a fake model]."""
    original = torch.utils.swap_tensors

    def swapping(t1, t2):
        for t in (t1, t2):
            if isinstance(t, FakeTensor):
                _forget_memo(t)
        return original(t1, t2)

    torch.utils.swap_tensors = swapping
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


def _forget_memo(t: FakeTensor) -> None:
    """Drop ``t`` from its fake mode's tensor memo (the memo's weak references to it, and only those)."""
    memo = t.fake_mode.fake_tensor_converter.tensor_memo
    for ref in weakref.getweakrefs(t):
        if isinstance(ref, weakref.KeyedRef) and memo.data.get(ref.key) is ref:
            del memo[ref.key]


@contextmanager
def _skip_trunc_normal():
    """While the model is built: ``nn.init.trunc_normal_`` of a fake tensor without a constant returns it
    unchanged (``trunc_normal_`` looks its ``_no_grad_trunc_normal_`` up in torch.nn.init when called,
    so wrappers that hold ``trunc_normal_`` itself, as transformers' initialization does, see this too)."""
    original = getattr(torch.nn.init, "_no_grad_trunc_normal_", None)
    if original is None:  # another torch: nothing to skip
        yield
        return

    def skipping(tensor, *args, **kwargs):
        if isinstance(tensor, FakeTensor) and tensor.constant is None:
            return tensor
        return original(tensor, *args, **kwargs)

    torch.nn.init._no_grad_trunc_normal_ = skipping
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = original


def cast_parameters(model: nn.Module, compute: torch.dtype, fake_mode: FakeTensorMode) -> None:
    """Floating parameters to ``compute``, as FSDP2's MixedPrecisionPolicy(param_dtype=...) gathers them.

    A contiguous fake parameter gets a fresh fake tensor of the same shape in ``compute`` (what
    ``.to(compute)`` returns, made without dispatching an op); anything else is cast with ``.to``.
    """
    for p in model.parameters():
        if not p.is_floating_point() or p.dtype == compute or hasattr(type(p), "fsdp_pre_all_gather"):
            continue  # a subclass FSDP2 gathers its own way (an NF4 weight) is not cast: its extension decides
        if isinstance(p, FakeTensor) and p.fake_mode is fake_mode and p.is_contiguous():
            meta = torch.empty(p.shape, dtype=compute, device="meta")
            p.data = FakeTensor(fake_mode, meta, p.device)
        else:
            with fake_mode:
                p.data = p.data.to(compute)
