"""The single-device engine: one GPU, plain PyTorch, no sharding (plan/engine.py ``SINGLE``; issue 39 item 4).

What torchtune's single-device recipes run (recipes/full_finetune_single_device.py,
lora_finetune_single_device.py): the model on one device in the training dtype, no wrapper, activation
checkpointing per module, ``optimizer.step()`` then ``zero_grad(set_to_none=True)``. Against FSDP2 on one
rank (``fully_shard`` over a mesh of one still all-gathers into a flat buffer and copies out: each unit's
parameters live twice while it computes, the root's through the whole step) the step differs in:

[Note: The single-device step]
  - parameters: every floating parameter in the compute dtype, stored once (the executor casts the model to
    it, LoRA adapters too, which peft would otherwise keep in fp32: torchtune's LoRA recipes build them in
    the model's dtype); non-floating ones (NF4 weights) as built. No all-gather output, no unsharded copy,
    no mixed-precision cast copy, no post-forward clone;
  - gradients: autograd's ``AccumulateGrad`` stores each parameter's gradient in ``.grad`` (the parameter's
    dtype) during its block's backward, and it stays there through the rest of the backward and the
    optimizer step until ``zero_grad(set_to_none=True)`` frees it: no reduce-scatter, no sharded gradient.
    Over micro-steps of accumulation the later micro-steps add into ``.grad`` in place, so a new gradient is
    live only during its block's backward (cost/accumulation.py [Note: Deferred gradient sync] describes
    the same in-place case of FSDP2 without gradient sync);
  - optimizer states: the optimizer's over the trainable parameters, in their (compute) dtype;
  - no collectives, no copies on the compute stream, no per-unit hooks (the profile's
    ``per_unit_overhead_s`` prices FSDP2's pre- and post-forward hooks: none run here);
  - no process groups beyond the default one. The profile's ``reserved_bytes`` still counts NCCL's
    buffers (about 0.5 GiB on a GPU profile), which one device without a communicator does not create:
    the profile has no separate figure for them, so the prediction is that much high on a GPU.

The walks are FSDP2's where the step has the same shape: the schedule is FSDP2's without its all-gathers,
their waits and its reshards; the memory walk is cost/accumulation.py's, every micro-step without gradient
sync and the gradients never converted (held in ``.grad``), ``zero_grad`` freeing them; the time walk is
FSDP2's with zero collectives and copies, no per-unit overhead, and the optimizer's per-tensor overhead of a
plain tensor (the profile's ``plain_tensor_optimizer_overhead_s``): on CPU, where AdamW steps one tensor at a
time (torch/optim/adamw.py: foreach only for CUDA tensors, optimizer.py ``_default_to_fused_or_foreach``), each
op on a DTensor adds DTensor's sharding propagation; the profile's ``per_param_tensor_optimizer_overhead_s`` was
measured on FSDP2's DTensors, about 10x a plain tensor's on cpu-gloo.

[Note: Optimizer in backward]
  ``training.optimizer_in_backward`` (torchtune's ``optimizer_in_bwd``; PyTorch's tutorial "How to save memory
  by fusing the optimizer step into the backward pass"): one optimizer per parameter, stepped by a
  ``register_post_accumulate_grad_hook`` that then sets the gradient to None (execute/stepper.py). So a block's
  gradients live one at a time: each is stepped (the single-tensor path's temporaries) and freed as autograd
  accumulates it, the walk counting one parameter's gradient (at most the largest module's parameters, as
  stored) on top of the block's backward, and at the step's end nothing is left to step. The step's time is the
  same traffic at the same per-tensor overhead (cost/optimizer.py), run inside the backward on the same
  stream. Without accumulation only: a later micro-step's gradients would find the parameters stepped.
"""

from __future__ import annotations

from dataclasses import replace

from shard_planner.cost import optimizer as optimizer_rules
from shard_planner.cost.accumulation import _AccumulationWalk
from shard_planner.cost.allocations import GRADS, ON_DEFAULT
from shard_planner.cost.engines.fsdp2 import FSDP2_ENGINE
from shard_planner.cost.memory import _MemoryWalk
from shard_planner.cost.schedule import EventKind, Phase
from shard_planner.cost.unit_bytes import UnitBytes
from shard_planner.cost.unit_collectives import UnitCollectives
from shard_planner.cost.unit_cost import UnitCost
from shard_planner.cost.unit_params import UnitParams, built_dtype
from shard_planner.dtypes import FLOAT_DTYPES, dtype_bytes
from shard_planner.plan.engine import SINGLE
from shard_planner.plan.numerics import Numerics

# FSDP2's events that have no counterpart on one device: the all-gathers, their waits and the reshards
_SHARDING_EVENTS = frozenset({EventKind.ALL_GATHER, EventKind.ALL_GATHER_WAIT, EventKind.RESHARD})
_NO_COLLECTIVES = UnitCollectives(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def single_unit_bytes(p: UnitParams, numerics: Numerics) -> UnitBytes:
    """The bytes of the parameters ``p`` on one device ([Note: The single-device step]): each floating one in the
    dtype it is stored in (``numerics.sharded_dtype``: the compute dtype once the model is cast), the others as
    built, and the gradients of the trainable floating ones in their parameter's dtype (``AccumulateGrad``).
    ``sharded`` is what the device holds (nothing is sharded); ``sharded_grad`` and ``unsharded_grads`` both the
    gradients ``.grad`` holds (the optimizer's states are sized on them)."""
    def stored_bytes(numel_by_dtype) -> float:
        return sum(k * dtype_bytes(numerics.sharded_dtype(dt)) for dt, k in numel_by_dtype if dt in FLOAT_DTYPES)

    grads = stored_bytes(p.trainable_numel_by_dtype) + p.replicated_float_bytes
    return UnitBytes(sharded=stored_bytes(p.numel_by_dtype) + p.other_bytes + p.replicated_bytes, unsharded=0.0,
                     all_gather_output=0.0, rs_input=0.0, rs_output=0.0, sharded_grad=grads, cast_input=0.0,
                     post_forward=0.0, reshard=False, grad_cast=False, last_grad=0.0, mp=False,
                     unsharded_grads=grads)


class _SingleDeviceWalk(_AccumulationWalk):
    """cost/accumulation.py's walk with every micro-step holding its gradients (``.grad``): no gathers (the
    schedule has none), no reduce-scatter; ``zero_grad`` frees what was held ([Note: The single-device step])."""

    def __init__(self, *args):
        super().__init__(*args)
        # the optimizer's temporaries come in sizes of the largest module's parameters: as stored here
        built = built_dtype(self.t.model_params)
        stored = self.t.largest_module_float_bytes * dtype_bytes(self.plan.training.numerics.sharded_dtype(built))
        self.t = replace(self.t, largest_module_float_bytes=stored / dtype_bytes(built))
        if self.plan.training.optimizer_in_backward:  # one parameter's gradient at a time: [Note: Optimizer in backward]
            one = self.t.largest_module_float_bytes
            self.acts = replace(self.acts, own_grads=tuple(min(g, one) for g in self.acts.own_grads))
        self.converts = False  # the gradients stay as autograd stored them, later ones added in place
        self.steps = tuple(replace(s, sync=False, gathered=False, keep=False) for s in self.steps)

    def backward(self, ev) -> None:
        """With the optimizer in backward ([Note: Optimizer in backward]): the block's new gradients are stepped
        and freed as soon as autograd has accumulated them."""
        super().backward(ev)
        if not self.plan.training.optimizer_in_backward:
            return
        blk = self.t.blocks[ev.block]
        owners = (blk.unit, *blk.nested)
        stepped = sum(self.units[u].grad_bytes for u in owners)
        if not stepped:
            return
        self.record("optimizer step", self.acts.names[ev.block], Phase.BACKWARD, extra_temp=self.step_temporaries)
        for u in owners:
            if self.units[u].grad_bytes:
                self.out.on_free(GRADS, self.units[u].grad_bytes, self.t.unit_names[u], ON_DEFAULT)
                self.units[u].grad_bytes = 0.0

    @property
    def step_temporaries(self) -> float:
        """One parameter's step on the single-tensor path (one optimizer per parameter): cost/optimizer.py's
        temporaries in sizes of the largest module's floating parameters, as stored (``__init__``)."""
        return optimizer_rules.optimizer_temporaries_bytes(self.plan.training.optimizer, "cpu", 0.0,
                                                           self.t.largest_module_float_bytes, 1)

    def optimizer(self, ev) -> None:
        if not self.plan.training.optimizer_in_backward:
            return super().optimizer(ev)
        self.record("optimizer step (done in backward)", "", Phase.OPTIMIZER)  # nothing left to step or free

    def zero_grad(self) -> None:
        names = self.t.unit_names
        for u, st in enumerate(self.units):
            held = self.acc[u] + st.grad_bytes
            if held:
                self.out.on_free(GRADS, held, names[u], ON_DEFAULT)
            self.acc[u], st.grad_bytes = 0.0, 0.0

    def result(self):
        # one step: no micro-step labels (cost/memory.py's result)
        return _MemoryWalk.result(self) if self.n == 1 else super().result()


class _SingleDeviceEngine:
    """See the module docstring."""

    name = SINGLE

    def schedule(self, t, units, prefetch):
        sched = FSDP2_ENGINE.schedule(t, units, prefetch)
        return replace(sched, events=tuple(e for e in sched.events if e.kind not in _SHARDING_EVENTS),
                       prefetched_in_backward=frozenset())

    def unit_bytes(self, t, q):
        return tuple(single_unit_bytes(p, q.numerics) for p in t.unit_params)

    def unit_cost(self, params, reshard_after_forward, setting, profile):
        x = single_unit_bytes(params, setting.numerics)
        return UnitCost(bytes=x, collectives=_NO_COLLECTIVES, copy_out_s=0.0, copy_in_s=0.0, state_on_device=True,
                        optimizer_state_bytes=optimizer_rules.optimizer_state_bytes(setting.optimizer,
                                                                                    x.sharded_grad))

    def memory_walk(self, trace, t, plan, profile, ub, sched, acts, *, timeline, selective, accountants):
        walk = _SingleDeviceWalk(trace, t, plan, profile, ub, sched, acts, timeline, accountants)
        if selective is not None:
            walk.stash = selective.stash
        return walk.run()

    accumulated_memory_walk = memory_walk  # the walk above runs every micro-step

    def time_inputs(self, costs):
        return FSDP2_ENGINE.time_inputs(costs)  # every collective and copy 0 s (unit_cost above)

    def time_walk(self, trace, t, plan, profile, sched, compute, collectives, *, selective, copies):
        # no FSDP2 hooks, and the optimizer steps plain tensors, not DTensors
        one_device = replace(profile, per_unit_overhead_s=0.0,
                             per_param_tensor_optimizer_overhead_s=profile.plain_tensor_optimizer_s)
        return FSDP2_ENGINE.time_walk(trace, t, plan, one_device, sched, compute, collectives, selective=selective,
                                      copies=copies)

    def accumulated_time(self, training, walk, collectives, tokens_per_sample, dp_size):
        return FSDP2_ENGINE.accumulated_time(training, walk, collectives, tokens_per_sample, dp_size)


SINGLE_ENGINE = _SingleDeviceEngine()
