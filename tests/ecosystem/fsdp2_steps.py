"""Train a model file 3 steps on 2 gloo ranks (CPU) with an exported FSDP2 snippet, its optimizer being
the one its usage line builds; prints a JSON line of the losses on rank 0.

    python tests/ecosystem/fsdp2_steps.py MODEL_FILE SNIPPET_PY
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, model_path: str, snippet_path: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    from shard_planner.modelfile import load_model_file

    namespace: dict = {}
    exec(compile(open(snippet_path).read(), snippet_path, "exec"), namespace)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    model_file = load_model_file(model_path)
    torch.manual_seed(0)
    model = namespace["apply_sharding"](model_file.build(), mesh)
    usage = namespace["__doc__"].split("optimizer = ", 1)[1].splitlines()[0]  # the snippet's own optimizer
    optimizer = eval(usage, {"torch": torch, "model": model})
    losses = []
    for step in range(3):
        torch.manual_seed(100 + rank * 10 + step)
        inputs, targets = model_file.batch(2)
        loss = model_file.loss(model(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    if rank == 0:
        print(json.dumps({"losses": losses, "lr": optimizer.param_groups[0]["lr"]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "29563"), nprocs=2)
