"""Record the FSDP2 allocation sequence of real CPU steps in a spawned gloo world, and check it against the
memory walk's (issue 29; cost/alloc_sequence.py, execute/alloc_record.py).

Each rank builds the plan's model as ``shard-planner run`` does (execute/worker.py: seeded, on the CPU,
``apply_plan``, the plan's optimizer), trains ``warmup`` steps, then records one steady-state step in the
order the memory walk simulates it (cost/schedule.py): forward, loss, backward, the optimizer step and
``zero_grad(set_to_none=True)`` — the run calls ``zero_grad`` first in each step, which frees the previous
step's gradients at the same point of the cycle. Every plan runs in one launch (one process group).
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shard_planner.cost.alloc_sequence import SeqEvent, SequenceCheck, compare_sequences, walk_sequence
from shard_planner.execute.launch import free_port
from shard_planner.plan import Plan


@dataclass(frozen=True)
class PlanSequences:
    """One plan's real sequences, one per rank."""

    plan: Plan
    ranks: tuple[tuple[SeqEvent, ...], ...]


def record_sequences(plans: list[Plan], world_size: int = 2, warmup: int = 2) -> list[PlanSequences]:
    """Each plan's recorded step on every rank of a spawned gloo world of ``world_size``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(world_size, free_port(), plans, out_dir, warmup),
                           nprocs=world_size, join=True, start_method="spawn")
        out = []
        for i, plan in enumerate(plans):
            ranks = []
            for r in range(world_size):
                with open(os.path.join(out_dir, f"{i}-{r}.json")) as f:
                    ranks.append(tuple(SeqEvent(**e) for e in json.load(f)))
            out.append(PlanSequences(plan, tuple(ranks)))
    return out


def _rank_main(rank: int, world_size: int, port: int, plans: list[Plan], out_dir: str, warmup: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for i, plan in enumerate(plans):
            events = record_plan_step(plan, rank, warmup)
            with open(os.path.join(out_dir, f"{i}-{rank}.json"), "w") as f:
                json.dump([asdict(e) for e in events], f)
            gc.collect()
    finally:
        dist.destroy_process_group()


def record_plan_step(plan: Plan, rank: int, warmup: int) -> list[SeqEvent]:
    """This rank's recorded steady-state step of ``plan`` (module docstring), in an initialised world."""
    from shard_planner.execute.alloc_record import SequenceRecorder, real_sequence
    from shard_planner.execute.apply import apply_plan, build_mesh
    from shard_planner.execute.stepper import build_on_device, make_optimizer, make_step_batch
    from shard_planner.model.hf import model_options
    from shard_planner.model.modelfile import load_model_file

    model_file = load_model_file(plan.model.path, model_options(plan.model))  # as planned (runner.py)
    device = torch.device("cpu")
    model = apply_plan(build_on_device(model_file, device), plan, build_mesh(plan, "cpu"))
    optimizer = make_optimizer(plan, model.parameters())
    mb = plan.training.micro_batch

    def step(s: int, tracker=None) -> None:
        phase = (lambda name: setattr(tracker, "phase", name)) if tracker is not None else (lambda name: None)
        phase("forward")
        inputs, targets = make_step_batch(model_file, mb, s, rank, device)
        loss = model_file.loss(model_file.forward(model, inputs, targets), targets)  # as the run's step (worker.py)
        phase("backward")
        loss.backward()
        phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for s in range(warmup):
        step(s)
    gc.collect()
    recorder = SequenceRecorder(_unit_names(model, plan), track=(model, optimizer))
    with recorder:
        step(warmup, recorder)
    return real_sequence(recorder)


def _unit_names(model: torch.nn.Module, plan: Plan):
    """FSDPParamGroup -> the name of the plan's unit it is (its modules' names)."""
    fqn_of = {id(m): fqn for fqn, m in model.named_modules()}
    by_modules = {frozenset(u.modules): u.name for u in plan.units}
    return lambda group: by_modules[frozenset(fqn_of[id(m)] for m in group.modules)]


@dataclass(frozen=True)
class PlanCheck:
    """One plan's sequences checked, per rank, against the walk's."""

    name: str
    plan: Plan
    simulated_events: int
    ranks: tuple[SequenceCheck, ...]

    def failures(self) -> frozenset[str]:
        """What does not match on some rank (SequenceCheck.failures)."""
        return frozenset().union(*(r.failures() for r in self.ranks))


def check_plans(named_plans: dict[str, Plan], world_size: int = 2) -> list[PlanCheck]:
    """Record each plan's step in one spawned world and compare every rank with the plan's memory walk
    (each model traced once per param dtype, on the cpu-gloo profile)."""
    from shard_planner.cost.model import CostModel
    from shard_planner.model.hf import model_options
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.hardware.profile import load_profile
    from shard_planner.trace import trace_model

    recorded = record_sequences(list(named_plans.values()), world_size)
    profile, models = load_profile("cpu-gloo"), {}
    out = []
    for name, rec in zip(named_plans, recorded):
        key = (rec.plan.model.path, rec.plan.training.numerics.compute_dtype)
        if key not in models:
            model_file = load_model_file(key[0], model_options(rec.plan.model))
            models[key] = CostModel(trace_model(model_file, dtype=key[1]), profile)
        simulated = walk_sequence(models[key], rec.plan)
        out.append(PlanCheck(name, rec.plan, len(simulated),
                             tuple(compare_sequences(list(r), simulated) for r in rec.ranks)))
    return out


def example_plans(world_size: int = 2) -> dict[str, Plan]:
    """The plans the check runs on (tests/execute/test_alloc_sequence.py, benchmarks/bench_alloc_sequence.py):
    examples/llama.py, gpt2.py and unet.py (tiny), bf16 with fp32 reduce, AdamW, one unit per block unless
    grouped; with and without checkpointing, reshard_after_forward False and explicit prefetch."""
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.plan import Cluster, Mesh, ModelRef, Prefetch, Training, Unit
    from shard_planner.trace.structure import model_fingerprint

    examples = Path(__file__).resolve().parents[2] / "examples"

    def plan(model: str, groups, micro_batch: int, *, reshard=True, ckpt=False, fwd=0, bwd=1) -> Plan:
        path = str(examples / model)
        units = [Unit(("",), False)] + [Unit(tuple(g), reshard, ckpt) for g in groups]
        return Plan(ModelRef(path, model_fingerprint(load_model_file(path).build())),
                    Cluster(world_size, world_size, "cpu-gloo", 2**30), Mesh(world_size),
                    Training(micro_batch, "adamw", "bfloat16"), tuple(units), Prefetch(fwd, bwd))

    layers = [[f"layers.{i}"] for i in range(2)]
    blocks = [[f"blocks.{i}"] for i in range(4)]
    unet = ["inc", "downs.0", "downs.1", "bottleneck", "ups.0.up", "ups.0.conv", "ups.1", "ups.2", "outc"]
    return {
        "llama, one unit per layer": plan("llama.py", layers, 4),
        "llama, checkpointing": plan("llama.py", layers, 4, ckpt=True),
        "llama, reshard False, prefetch 1/2": plan("llama.py", layers, 4, reshard=False, fwd=1, bwd=2),
        "gpt2, checkpointing": plan("gpt2.py", blocks, 4, ckpt=True),
        "gpt2, 2 blocks/unit, reshard False, prefetch 1/2": plan(
            "gpt2.py", [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]], 4, reshard=False, fwd=1, bwd=2),
        "unet, checkpointing": plan("unet.py", [[b] for b in unet], 4, ckpt=True),
    }
