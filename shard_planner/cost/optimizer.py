"""The optimizer's memory and traffic per sharded parameter element: one table each, read by the
memory simulator (cost/memory.py), the time simulator (cost/time.py) and the solver's linear model
(solve/linear.py).
"""

from __future__ import annotations

# Optimizer states per parameter element, in the sharded (built) dtype (torch/optim: AdamW and Adam
# keep exp_avg and exp_avg_sq; SGD with momentum keeps momentum_buffer; plain SGD nothing; ZeRO §5
# counts them in K).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}

# Temporaries of the step. See cost/memory.py [Note: Optimizer step]. GPU (foreach): in sizes of all
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
