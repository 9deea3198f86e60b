"""One ZeRO-3 training step of a model file under DeepSpeed on CPU/gloo, world size 1, with a DeepSpeed
config: prints a JSON line of which parameters DeepSpeed left persistent (never partitioned) and the loss.

    DS_ACCELERATOR=cpu python tests/ecosystem/ds_step.py MODEL_FILE CONFIG_JSON
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def main(model_path: str, config_path: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # what a launcher sets
    dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed

    from shard_planner.model.modelfile import load_model_file

    config = json.loads(open(config_path).read())
    config["optimizer"]["params"]["torch_adam"] = True  # DeepSpeed's FusedAdam needs a GPU; same AdamW maths
    model_file = load_model_file(model_path)
    model = model_file.build()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inputs, targets = model_file.batch(config["train_micro_batch_size_per_gpu"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model_file.loss(engine(*inputs), targets)
    engine.backward(loss)
    engine.step()
    persistent = [n for n, p in engine.module.named_parameters() if getattr(p, "ds_persist", False)]
    statuses = {n: p.ds_status.name for n, p in engine.module.named_parameters()}
    print(json.dumps({"persistent": persistent, "status": statuses, "loss": float(loss)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
