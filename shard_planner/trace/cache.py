"""Whether a model's forward builds a cache for a later call: a fact of the forward's output.

[Note: A forward that builds a cache] A transformers decoder built with ``use_cache=True`` (the default
of most decoder configs) returns, beside its logits and loss, the keys and values of every attention layer
in a cache object (``CausalLMOutputWithPast.past_key_values``; ``cache`` from transformers 5.2x on, a
``DynamicCache``) that each attention layer extends in place (``DynamicLayer.update``: ``torch.cat``
onto what it holds). Activation checkpointing recomputes the forward in backward, so a checkpointed
attention extends the cache a second time (measured, transformers 5.25 Llama: 16 cached positions after
forward, 32 after backward): full checkpointing still computes the right gradients there, but the cache
holds what no plan priced, and torch's selective checkpointing fails in backward ("aten.slice.Tensor
invocation index 4 encountered during backward but not found in storage"), as the recomputation's ops no
longer match the forward's. Training never reads the cache. :func:`output_cache` finds one in the output
generically: a field named like a cache (``past_key_values``, ``cache``, ``*_cache``) holding something,
or an object whose class is named ``*Cache``; the trace records it (``ModelTrace.forward_cache``) and
shard_planner/plan/checkpointing.py holds the rule that follows from it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shard_planner.model.modelfile import ModelFile
from shard_planner.trace.routing import KnownValues

# Output fields that carry a cache for the next call (transformers' names; "*_cache" too)
CACHE_FIELDS = frozenset({"past_key_values", "past_key_value", "cache", "cache_params", "mems"})
_MAX_DEPTH = 3  # the output, a tuple or dict in it, and one more level


def output_cache(output, depth: int = 0) -> str | None:
    """What in a forward's ``output`` is a cache for a later call ("output field 'cache': DynamicCache"), or None.
    See [Note: A forward that builds a cache]."""
    if output is None or isinstance(output, torch.Tensor) or depth > _MAX_DEPTH:
        return None
    if type(output).__name__.endswith("Cache"):
        return f"a {type(output).__name__}"
    if isinstance(output, dict):  # transformers' ModelOutput is an OrderedDict of its non-None fields
        items = list(output.items())
    elif isinstance(output, (tuple, list)):
        items = [(None, v) for v in output]
    else:
        return None
    for key, value in items:
        if isinstance(key, str) and _is_cache_field(key) and _holds_something(value):
            return f"output field {key!r}: {type(value).__name__}"
        found = output_cache(value, depth + 1)
        if found is not None:
            return found
    return None


def _is_cache_field(key: str) -> bool:
    return key in CACHE_FIELDS or key.endswith("_cache")


def _holds_something(value) -> bool:
    if value is None:
        return False
    if isinstance(value, (tuple, list, dict)):
        return len(value) > 0
    return not isinstance(value, (bool, int, float, str))


def probe_forward_cache(model_file: ModelFile) -> str | None:
    """:func:`output_cache` of one forward of ``model_file``'s model at micro-batch 1, without real
    memory: built and run under FakeTensorMode as a trace runs it (MoE routing under [Note: balanced
    routing]), without backward or recording."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shard_planner.trace.build import build_fake
    from shard_planner.trace.dynamo_deferred import dynamo_deferred

    with dynamo_deferred():  # [Note: torch._dynamo during a trace]
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = build_fake(model_file, fake_mode)
        with fake_mode, torch.no_grad():
            inputs, targets = model_file.batch(1)
            with _Routed():
                return output_cache(model_file.forward(model, inputs, targets))


class _Routed(TorchDispatchMode):
    """Data-dependent routing answered as a trace answers it ([Note: balanced routing])."""

    def __init__(self):
        super().__init__()
        self.known = KnownValues()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.known.dispatch(func, args, kwargs or {})
