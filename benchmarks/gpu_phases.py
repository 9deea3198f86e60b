"""Where one plan's step time goes on one GPU: forward + backward and the optimizer step timed apart, and
torch.profiler's top host and device ops of one step (benchmarks/gpu_check.sh territory: needs CUDA).

    SHARD_PLANNER_SIZE=1b python benchmarks/gpu_phases.py PLAN.json [--steps 3] [--out phases.json]

Builds the plan's model with the executor's own pieces (execute/worker.py: build_on_device, apply_plan,
make_optimizer, the _Stepper's batch and loss) in a world of one rank, so that what it times is what
``shard-planner run`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from shard_planner.execute.apply import apply_plan, build_mesh
    from shard_planner.execute.kernel_timing import host_samples
    from shard_planner.execute.worker import build_on_device, make_optimizer, make_step_batch
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.plan import load_plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: gloo, to rehearse the script")
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    plan = load_plan(args.plan)
    mf = load_model_file(plan.model.path)
    model = apply_plan(build_on_device(mf, device), plan, build_mesh(plan, device.type))
    optimizer = make_optimizer(plan, model.parameters())

    def fwd_bwd(s):
        inputs, targets = make_step_batch(mf, plan.training.micro_batch, s, 0, device)
        mf.loss(mf.forward(model, inputs), targets).backward()

    rows = []
    for s in range(args.steps + 1):  # the first is a warm-up
        optimizer.zero_grad(set_to_none=True)
        # one host-clock call each, the device synchronised before and after
        row = dict(step=s, fwd_bwd_s=host_samples(lambda: fwd_bwd(s), device, 1)[0],
                   optimizer_s=host_samples(optimizer.step, device, 1)[0])
        print(row)
        rows.append(row)
    optimizer.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fwd_bwd(99)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    print(table)
    timed = rows[1:]
    summary = {k: statistics.median(r[k] for r in timed) for k in ("fwd_bwd_s", "optimizer_s")}
    print("median", summary)
    if args.out:
        args.out.write_text(json.dumps(dict(plan=str(args.plan), steps=rows, median=summary, profile=table)) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
