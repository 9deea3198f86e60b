"""Tensor-parallel plans of the Llama example (examples/llama.py) for the export tests: torchtitan's Llama styles
(tests/models/trace_tp_llama.py ``tp_styles``), one unit per block and the root, made by hand (the planner's CLI
has no tensor-parallel option to ask for a degree)."""

from __future__ import annotations

from shard_planner.model.modelfile import load_model_file
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.parallel.tensor_parallel import TensorParallel
from shard_planner.trace.structure import model_fingerprint
from tests.ecosystem.conftest import LLAMA, llama_size
from tests.models.trace_tp_llama import llama, tp_styles

GIB = 2**30


def llama_tp_plan(size: str = "8b", *, shard: int = 32, replicate: int = 1, tp: int = 8, sequence_parallel: bool = True,
                  loss_parallel: bool = True, styles: dict[str, str] | None = None, **training) -> Plan:
    """A plan of examples/llama.py at ``size`` (SHARD_PLANNER_SIZE) on replicate x shard x tp GPUs of 8 per node."""
    import torch

    with llama_size(size):
        cfg = llama.config()
        with torch.device("meta"):
            fingerprint = model_fingerprint(load_model_file(LLAMA).build())
    n = cfg["n_layers"]
    if styles is None:
        styles = tp_styles(n)
        if not sequence_parallel:
            styles = {f: s for f, s in styles.items() if s not in ("norm", "gather_input")}
    world = replicate * shard * tp
    units = (Unit(("",)), *(Unit((f"layers.{i}",)) for i in range(n)))
    return Plan(ModelRef(LLAMA, fingerprint, cfg["seq_len"]), Cluster(world, min(world, 8), "h100-80gb", 80 * GIB),
                Mesh(shard=shard, replicate=replicate, tp=tp), Training(**{"micro_batch": 1, **training}), units,
                Prefetch(1, 1), tensor_parallel=TensorParallel(styles, sequence_parallel, loss_parallel))
