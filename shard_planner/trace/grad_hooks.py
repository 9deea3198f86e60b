"""``register_all_grads_hook``: a call once every gradient of some tensors is computed, holding none of them
(the tracer's post-backward of a module call: trace/capture.py)."""

from __future__ import annotations

import torch
from torch.autograd.graph import _get_grad_fn_or_grad_acc


def register_all_grads_hook(tensors: list[torch.Tensor], fn) -> None:
    """Call ``fn()`` once the gradients of all ``tensors`` that this backward reaches are computed.

    ``register_multi_grad_hook(tensors, fn, mode="all")`` does this too, but holds each gradient until
    the last arrives, to pass them all to ``fn``: with an input shared by every block (T5's
    ``position_bias``, whose gradient is complete only after block 0) each block's input gradient would
    stay alive to the end of the backward, which a real step does not do. This is its counting, from
    torch/autograd/graph.py, without the buffer.
    """
    grad_fns = [_get_grad_fn_or_grad_acc(t) for t in tensors]
    count: dict[int, int] = {}
    expected: dict[int, int] = {}

    def inner_hook(_grad) -> None:
        task = torch._C._current_graph_task_id()
        seen = count.get(task, 0)
        if seen == 0:  # how many of the hooks this backward will run
            expected[task] = sum(map(torch._C._will_engine_execute_node, grad_fns))
        count[task] = seen + 1
        if count[task] == expected[task]:
            del count[task], expected[task]
            fn()

    for t in tensors:
        t.register_hook(inner_hook)
