"""The early stop of a checkpointed recomputation (trace/capture.py [Note: Early stop of the
recomputation]): the tracer's tail of each module is what torch's non-reentrant checkpoint does not run
again, and the cost model prices a fully checkpointed unit's recomputation without it."""

import textwrap
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from shard_planner.cost import CostModel
from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit
from shard_planner.hardware.profile import load_profile
from shard_planner.trace import trace_model
from shard_planner.trace.kernel_ops import classify
from shard_planner.plan.numerics import Numerics

MODEL = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    D = 64

    class Block(nn.Module):
        """Pre-norm MLP block: LayerNorm -> Linear -> GELU -> Linear, plus the residual."""

        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(D)
            self.up = nn.Linear(D, 4 * D)
            self.down = nn.Linear(4 * D, D)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(D, 8)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    def build_model():
        return Net()

    def make_batch(batch_size):
        return torch.randn(batch_size, 16, D), torch.randint(0, 8, (batch_size, 16))

    def loss_fn(out, target):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    TRAINING = {"micro_batch": 4, "optimizer": "adamw"}
''')


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("early_stop") / "mlp_blocks.py"
    path.write_text(MODEL)
    return str(path)


class _Kernels(TorchDispatchMode):
    """The aten ops dispatched that run a kernel (those the tracer records: trace/kernel_ops.classify)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if classify(func, args, kwargs or {}, out, 0) is not None:
            self.ops.append(func.overloadpacket.__name__)
        return out


def test_the_tail_is_what_a_checkpointed_recomputation_skips(model_file):
    """Run one block under torch's checkpoint: the forward's kernels that the backward does not run
    again are the down projection and the residual add, and the trace's tail of every block says so."""
    from shard_planner.model.modelfile import load_model_file

    block = load_model_file(model_file).build().blocks[0]
    x = torch.randn(4, 16, 64, requires_grad=True)
    with _Kernels() as plain:  # the block's own forward and backward kernels, without recomputation
        block(x).sum().backward()
    block.zero_grad(set_to_none=True)  # no accumulation into .grad below
    x.grad = None
    with _Kernels() as fwd:
        y = checkpoint(block, x, use_reentrant=False)
    with _Kernels() as bwd:
        y.sum().backward()
    assert Counter(plain.ops[: len(fwd.ops)]) == Counter(fwd.ops)
    recomputed = Counter(bwd.ops) - Counter(plain.ops[len(fwd.ops):])  # the checkpointed backward: its own + these
    assert sum((Counter(bwd.ops) - recomputed).values()) == len(plain.ops) - len(fwd.ops)
    assert recomputed == Counter(["native_layer_norm", "addmm", "gelu"])
    assert Counter(fwd.ops) - recomputed == Counter(["addmm", "add"])  # skipped: the down projection, the residual

    trace = trace_model(model_file)
    for i in range(3):
        tail = trace.module(f"blocks.{i}").fwd_tail_kernels
        assert sorted((r.op_class, r.count) for r in tail) == [("elementwise", 1), ("matmul", 1)]
        mm = next(r for r in tail if r.op_class == "matmul")
        assert mm.dims_at(4)[1:4] == (4 * 16, 64, 256)  # the down projection: (tokens, D) <- (tokens, 4D)
    # a Linear alone saves its input and weight before its matmul runs: checkpointed alone, nothing reruns
    assert [r.op_class for r in trace.module("blocks.0.up").fwd_tail_kernels] == ["matmul"]
    assert trace.module("blocks.0.norm").fwd_tail_kernels == ()  # it saves its outputs (mean, rstd)


def _plan(trace, model_file, ac: bool) -> Plan:
    units = (Unit(("",), False), *(Unit((f"blocks.{i}",), True, ac) for i in range(3)))
    return Plan(ModelRef(model_file, trace.fingerprint), Cluster(8, 8, "h200", 80 * 2**30), Mesh(8),
                Training(4, "adamw", "bfloat16", "float32"), units, Prefetch(0, 1))


@pytest.mark.parametrize("compute_model", ["flops", "roofline"])
def test_full_checkpointing_recomputes_the_forward_less_its_tail(model_file, compute_model):
    trace = trace_model(model_file)
    profile = replace(load_profile("h200"), compute_model=compute_model, per_op_overhead_s=0.0,
                      per_unit_overhead_s=0.0)
    cm = CostModel(trace, profile)
    share = cm.early_stop_share("blocks.0", 4, Numerics())
    price = cm.forward_price(4, Numerics())
    block = trace.module("blocks.0")
    whole = sum(price(m, None) for m in trace.subtree("blocks.0") if m.fwd_ops_self)
    assert share == pytest.approx(price(block, block.fwd_tail_kernels) / whole)
    assert 0.2 < share < 0.6  # the down projection: a third of the block's matmul FLOPs, and an add

    no_ac, full = (cm.time(_plan(trace, model_file, ac)) for ac in (False, True))
    recompute_s = full.compute_s - no_ac.compute_s
    without_stop = replace(trace, modules=tuple(replace(m, fwd_tail_kernels=()) for m in trace.modules))
    full_old = CostModel(without_stop, profile).time(_plan(without_stop, model_file, True))
    assert recompute_s == pytest.approx((full_old.compute_s - no_ac.compute_s) * (1 - share), rel=1e-6)
    # a stack that reruns the whole forward (reentrant, torch < 2.1: benchmarks/bench_published.py)
    rerun = CostModel(trace, replace(profile, checkpoint_early_stop=False))
    assert rerun.early_stop_share("blocks.0", 4, Numerics()) == 0.0
    assert rerun.time(_plan(trace, model_file, True)).compute_s == pytest.approx(full_old.compute_s, rel=1e-9)
