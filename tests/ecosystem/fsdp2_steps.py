"""Train a model file 3 steps on gloo ranks (CPU) with an exported FSDP2 snippet: the device mesh its usage
line builds (on "cpu"; the world size is the mesh's), the optimizer its usage line builds, and with tensor
parallelism the loss and its backward in its loss_context(), the ranks of one tp group taking the same batch;
prints a JSON line of the losses on rank 0.

    python tests/ecosystem/fsdp2_steps.py MODEL_FILE SNIPPET_PY [PORT]
"""

import contextlib
import json
import math
import os
import re
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def usage_line(snippet: str, name: str) -> str:
    """The right-hand side of ``name = ...`` in the snippet's usage (its docstring)."""
    doc = snippet.split('"""', 2)[1]
    return doc.split(f"{name} = ", 1)[1].splitlines()[0]


def mesh_of(snippet: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The shape and dimension names of the usage's init_device_mesh call."""
    found = re.match(r'init_device_mesh\("cuda", (\(.*?\)), mesh_dim_names=(\(.*?\))\)', usage_line(snippet, "mesh"))
    return eval(found.group(1)), eval(found.group(2))


def worker(rank: int, model_path: str, snippet_path: str, port: str, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from shard_planner.model.modelfile import load_model_file

    snippet = open(snippet_path).read()
    namespace: dict = {}
    exec(compile(snippet, snippet_path, "exec"), namespace)
    shape, names = mesh_of(snippet)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_rank = rank // (dict(zip(names, shape)).get("tp", 1))  # tp ranks are the fastest mesh dimension
    model_file = load_model_file(model_path)
    torch.manual_seed(0)
    model = namespace["apply_sharding"](model_file.build(), mesh)
    optimizer = eval(usage_line(snippet, "optimizer"), {"torch": torch, "model": model})
    loss_context = namespace.get("loss_context", contextlib.nullcontext)
    losses = []
    for step in range(3):
        torch.manual_seed(100 + dp_rank * 10 + step)
        inputs, targets = model_file.batch(2)
        with loss_context():
            loss = model_file.loss(model(*inputs), targets)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    if rank == 0:
        print(json.dumps({"losses": losses, "lr": optimizer.param_groups[0]["lr"], "world": world}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = math.prod(mesh_of(open(sys.argv[2]).read())[0])
    mp.spawn(worker, args=(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "29563", world), nprocs=world)
