"""The sharded model state and the optimizer step: where the state lives, the optimizer's states,
temporaries and traffic per sharded parameter element — one table each and one function per rule,
called by the memory simulator (cost/memory.py), the time simulator (cost/time.py), the model-state
summary (cost/api.py) and the solver's linear model (solve/linear.py), so that none of them re-derives a
rule (issue 27; tests/solve/test_linear_follows_cost_rules.py changes a rule here and sees all follow).

[Note: Optimizer step]
  Optimizer states are created at the first step and live from then on (the simulated step is a
  steady-state one). On GPU torch.optim defaults to the foreach implementation: AdamW/Adam allocate
  one temporary the size of all sharded parameters (``torch._foreach_sqrt(exp_avg_sqs)`` in
  torch/optim/adamw.py ``_multi_tensor_adamw``). On CPU tensors it takes the single-tensor path
  (``_default_to_fused_or_foreach`` picks foreach for CUDA only), whose temporaries are per parameter:
  measured with the storage tracker, AdamW's step peaks 2x one parameter above its states with one
  parameter and 3x the parameter size with 2 to 8 equal ones (``sqrt`` and ``div`` of this one, the
  previous ``denom`` not yet released) — modelled as 3x the largest module's parameter shard. SGD
  (with or without momentum, no weight decay) allocates none either way. Gradients are freed by
  ``zero_grad(set_to_none=True)`` before the next forward. Not counted: Adam's ``step`` counter, a 4-byte
  tensor per parameter that lives on the host unless ``capturable``/``fused`` (on a CPU rank, 188 B for
  the zoo's T5: 47 parameters).

[Note: CPU offload]
  With ``CPUOffloadPolicy`` the sharded parameters, gradients and optimizer states live on the host,
  and the optimizer steps there. On a GPU profile they leave the device, but every all-gather first
  copies the unit's fp32 shard to the device (1/N, transient). On a CPU profile (``device == "cpu"``)
  the host is the device: nothing moves and offloaded state still counts.
"""

from __future__ import annotations

from shard_planner.cost.unit_params import UnitParams, built_dtype
from shard_planner.dtypes import dtype_bytes
from shard_planner.plan.numerics import Numerics
from shard_planner.hardware.profile import HardwareProfile

# Optimizer states per parameter element, in the sharded (built) dtype (torch/optim: AdamW and Adam
# keep exp_avg and exp_avg_sq; SGD with momentum keeps momentum_buffer; plain SGD nothing; ZeRO §5
# counts them in K).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}

# Temporaries of the step. See [Note: Optimizer step]. GPU (foreach): in sizes of all
# sharded parameters together (torch/optim/adamw.py _multi_tensor_adamw: torch._foreach_sqrt(exp_avg_sqs));
# CPU (single-tensor): in sizes of the largest one parameter shard (measured, tests/test_cost_model.py).
OPTIMIZER_TEMPORARIES = {"adamw": 1, "adam": 1, "sgd_momentum": 0, "sgd": 0}
OPTIMIZER_TEMPORARIES_SINGLE_TENSOR = {"adamw": 3, "adam": 3, "sgd_momentum": 0, "sgd": 0}

# Reads + writes per sharded parameter element of one foreach step, in state-dtype elements.
# torch/optim/adamw.py _multi_tensor_adamw: mul_(params) 2, lerp_(exp_avgs, grads) 3, mul_(exp_avg_sqs)
# 2, addcmul_(exp_avg_sqs, grads, grads) 3, sqrt(exp_avg_sqs) 2, div_ 2, add_(eps) 2,
# addcdiv_(params, exp_avgs, denom) 4 = 20; Adam without weight decay skips the first: 18.
# torch/optim/sgd.py _multi_tensor_sgd: momentum mul_ 2 + add_ 3, then add_(params, bufs) 3 = 8;
# plain SGD: add_(params, grads) 3.
OPTIMIZER_ACCESSES_PER_ELEMENT = {"adamw": 20, "adam": 18, "sgd_momentum": 8, "sgd": 3}


def optimizer_state_count(optimizer: str) -> int:
    return OPTIMIZER_STATES[optimizer]


def optimizer_step_bytes(optimizer: str, sharded_elements: float, state_elem_bytes: int) -> float:
    """Bytes the step reads and writes on one rank (memory-bound: time = bytes / bandwidth)."""
    return OPTIMIZER_ACCESSES_PER_ELEMENT[optimizer] * sharded_elements * state_elem_bytes


def state_on_device(cpu_offload: bool, device: str) -> bool:
    """Whether the sharded parameters, gradients and optimizer states are in device memory: not under
    ``CPUOffloadPolicy`` on a GPU (they live on the host, and the step runs there); on a CPU profile the
    host is the device and they still count ([Note: CPU offload])."""
    return not (cpu_offload and device != "cpu")


def optimizer_state_bytes(optimizer: str, sharded_grad_bytes: float) -> float:
    """The optimizer's states on one rank: ``OPTIMIZER_STATES`` per sharded gradient element, in the
    gradient's (built) dtype (ZeRO §5's K; cost/memory.py [Note: FSDP2 model state])."""
    return OPTIMIZER_STATES[optimizer] * sharded_grad_bytes


def optimizer_temporaries_bytes(optimizer: str, device: str, sharded_float_bytes: float,
                                largest_module_float_bytes: float, shard: int) -> float:
    """The step's temporaries on one rank when it steps on the device ([Note: Optimizer
    step]): foreach on a GPU, in sizes of all ``sharded_float_bytes`` together; the single-tensor path on
    a CPU, in sizes of the largest module's floating parameters' shard."""
    if device == "cpu":
        return OPTIMIZER_TEMPORARIES_SINGLE_TENSOR[optimizer] * largest_module_float_bytes / shard
    return OPTIMIZER_TEMPORARIES[optimizer] * sharded_float_bytes


def optimizer_step_s(optimizer: str, sharded_elements: float, state_elem_bytes: float, profile: HardwareProfile,
                     cpu_offload: bool) -> float:
    """Seconds of the step's memory traffic on one rank (memory-bound: :func:`optimizer_step_bytes` /
    bandwidth): the host's bandwidth under CPU offload, where the step runs on the host (the device's when
    the profile has none), else the device's. Framework overhead per tensor is cost/time.py's."""
    bw = ((profile.host_memory_bandwidth_bytes_per_s or profile.memory_bandwidth_bytes_per_s) if cpu_offload
          else profile.memory_bandwidth_bytes_per_s)
    return optimizer_step_bytes(optimizer, sharded_elements, state_elem_bytes) / bw


def model_step_s(optimizer: str, params: UnitParams, shard_group_size: int, profile: HardwareProfile,
                 cpu_offload: bool, numerics: Numerics) -> float:
    """Seconds of the step's memory traffic on one rank for a model whose parameters are ``params``
    (cost/unit_params.py): :func:`optimizer_step_s` of its trainable floating elements' 1/N shards (the
    optimizer steps only parameters with a gradient), its states in the sharded dtype (``numerics``,
    plan/numerics.py) of the dtype most of their bytes were built in. The time walk and the linear model both
    call it."""
    return optimizer_step_s(optimizer, params.trainable_float_numel / shard_group_size,
                            dtype_bytes(numerics.sharded_dtype(built_dtype(params))), profile, cpu_offload)
