"""One ZeRO-3 training step with AutoTP of a model file under DeepSpeed on CPU/gloo ranks, with a DeepSpeed config
whose tensor_parallel.autotp_size splits the model: prints, on rank 0, a JSON line of each parameter's local shape
after the split (ds_shape: what ZeRO-3 partitions), the data-parallel world DeepSpeed formed and the loss.

    DS_ACCELERATOR=cpu python tests/ecosystem/ds_tp_step.py MODEL_FILE CONFIG_JSON WORLD [PORT]
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, model_path: str, config_path: str, world: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed
    from deepspeed.utils import groups

    from shard_planner.model.modelfile import load_model_file

    config = json.loads(open(config_path).read())
    config["optimizer"]["params"]["torch_adam"] = True  # DeepSpeed's FusedAdam needs a GPU; same AdamW maths
    model_file = load_model_file(model_path)
    torch.manual_seed(0)
    model = model_file.build()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tp = config["tensor_parallel"]["autotp_size"]
    torch.manual_seed(100 + rank // tp)  # the ranks of one tp group take the same batch (DeepSpeed checks it)
    inputs, targets = model_file.batch(config["train_micro_batch_size_per_gpu"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model_file.loss(engine(*inputs), targets)
    engine.backward(loss)
    engine.step()
    shapes = {n: list(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters()}
    if rank == 0:
        print(json.dumps({"shapes": shapes, "dp_world": groups._get_data_parallel_world_size(),
                          "tp_world": groups.get_tensor_model_parallel_world_size(), "loss": float(loss)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[3])
    mp.spawn(worker, args=(sys.argv[1], sys.argv[2], world, sys.argv[4] if len(sys.argv) > 4 else "29583"), nprocs=world)
