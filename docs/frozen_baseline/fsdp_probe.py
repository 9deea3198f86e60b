"""What FSDP2 (torch 2.13) does with frozen parameters, seen on 2 gloo CPU ranks (docs/frozen_facts.md).

    python docs/frozen_baseline/fsdp_probe.py [CASE ...]     # output: docs/frozen_baseline/fsdp_probe.txt

A toy LoRA model: a frozen embedding (its own unit), two blocks (units) each a frozen base linear d x d plus a
trainable low-rank pair A (r x d), B (d x r), and a frozen head in the root. FSDP2's own functions are wrapped
to log, on rank 0, every all-gather (the group, its training state, the buffer's dtype and bytes, the
parameters and whether they require grad), every pre-backward, every post-backward and where it runs
(autograd or the root's final callback), every reduce-scatter and its parameters, and an all-gather that
``finalize_backward`` drops unused. Cases:

    lora_mp          fp32 parameters, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    mixed_dtype      bf16 frozen bases, fp32 adapters, no mixed precision: one group of two dtypes
    mixed_dtype_odd  as mixed_dtype with r = 3 (A's dim 0 padded to 4 over 2 ranks)
    frozen_mixed     as mixed_dtype with block 0's adapters frozen too (a group without trainable parameters)
    mixed_trainable  block 0's bf16 base trainable beside its fp32 adapters (two trainable dtypes)
"""

import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg_mod

CASES = ("lora_mp", "mixed_dtype", "mixed_dtype_odd", "frozen_mixed", "mixed_trainable")
LOG: list[str] = []


def _label(group) -> str:
    return group._module_fqn or "<root>"


def _in_final_callback() -> bool:
    return any(f.name == "_root_post_backward_final_callback" for f in traceback.extract_stack())


def patch_fsdp() -> None:
    """Wrap FSDPParamGroup's unshard / pre_backward / post_backward / finalize_backward and the module's
    foreach_all_gather / foreach_reduce (looked up in _fsdp_param_group's namespace at call time)."""
    G = pg_mod.FSDPParamGroup
    all_gather, reduce = pg_mod.foreach_all_gather, pg_mod.foreach_reduce
    unshard, pre, post, finalize = G.unshard, G.pre_backward, G.post_backward, G.finalize_backward
    current = {}

    def logged_unshard(self, async_op=False):
        current["group"] = self
        return unshard(self, async_op)

    def logged_all_gather(fsdp_params, *args, **kwargs):
        result = all_gather(fsdp_params, *args, **kwargs)
        g, out = current["group"], result.all_gather_output
        params = [(p._param_fqn, p.sharded_param.requires_grad) for p in fsdp_params]
        LOG.append(f"all-gather {_label(g)} state={g._training_state.name} dtype={out.dtype} "
                   f"bytes={out.numel() * out.element_size()} params(requires_grad)={params}")
        return result

    def logged_reduce(fsdp_params, grads, *args, **kwargs):
        LOG.append(f"reduce-scatter params={[p._param_fqn for p in fsdp_params]} grad dtypes={[g.dtype for g in grads]}")
        return reduce(fsdp_params, grads, *args, **kwargs)

    def logged_pre(self, *args, **kwargs):
        LOG.append(f"pre_backward {_label(self)}")
        return pre(self, *args, **kwargs)

    def logged_post(self, *args, **kwargs):
        where = "root's final callback" if _in_final_callback() else "autograd"
        LOG.append(f"post_backward {_label(self)} (from {where})")
        return post(self, *args, **kwargs)

    def logged_finalize(self):
        if self._all_gather_result is not None:
            LOG.append(f"finalize_backward {_label(self)}: an all-gather was issued and never used (waited, dropped)")
        return finalize(self)

    pg_mod.foreach_all_gather, pg_mod.foreach_reduce = logged_all_gather, logged_reduce
    G.unshard, G.pre_backward, G.post_backward, G.finalize_backward = (logged_unshard, logged_pre, logged_post,
                                                                       logged_finalize)


class LoRABlock(nn.Module):
    def __init__(self, d: int, r: int, base_dtype: torch.dtype):
        super().__init__()
        self.base = nn.Linear(d, d, bias=False).to(base_dtype).requires_grad_(False)
        self.A = nn.Linear(d, r, bias=False)
        self.B = nn.Linear(r, d, bias=False)

    def forward(self, x):  # x: (B, T, d)
        return self.base(x.to(self.base.weight.dtype)).to(x.dtype) + self.B(self.A(x))


class Net(nn.Module):
    def __init__(self, case: str, d: int = 16, vocab: int = 32):
        super().__init__()
        r = 3 if case == "mixed_dtype_odd" else 2
        base_dtype = torch.float32 if case == "lora_mp" else torch.bfloat16
        self.embed = nn.Embedding(vocab, d).requires_grad_(False)
        self.blocks = nn.ModuleList([LoRABlock(d, r, base_dtype) for _ in range(2)])
        self.head = nn.Linear(d, vocab, bias=False).requires_grad_(False)
        if case == "mixed_trainable":
            self.blocks[0].base.requires_grad_(True)
        if case == "frozen_mixed":
            self.blocks[0].A.requires_grad_(False)
            self.blocks[0].B.requires_grad_(False)

    def forward(self, tokens):  # (B, T) -> (B, T, vocab)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def worker(rank: int, case: str, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    patch_fsdp()
    torch.manual_seed(0)
    model = Net(case)
    mp_policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if case == "lora_mp" else MixedPrecisionPolicy()
    for unit in (model.embed, *model.blocks):
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    tokens = torch.randint(0, 32, (2, 5))
    try:
        for step in range(2):  # step 1 is logged (step 0 runs the lazy init too)
            LOG.clear()
            LOG.append(f"--- step {step}")
            model(tokens).float().sum().backward()
        grads = {n: None if p.grad is None else tuple(p.grad.to_local().shape) for n, p in model.named_parameters()}
        LOG.append(f"sharded gradients after the step: {grads}")
    except Exception as exc:  # mixed_trainable: FSDP2 refuses it
        LOG.append(f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
    if rank == 0:
        queue.put(list(LOG))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(cases: list[str]) -> None:
    ctx = mp.get_context("spawn")
    for case in cases:
        queue, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=worker, args=(rank, case, port, queue)) for rank in range(2)]
        for p in procs:
            p.start()
        print(f"===== {case} (torch {torch.__version__}, 2 gloo ranks, rank 0's log)")
        print("\n".join(queue.get(timeout=120)), flush=True)
        for p in procs:
            p.join()


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
