"""A trace at a tensor-parallel degree is one rank of torch's DTensor tensor parallelism (trace/tp_local.py,
[Note: A tensor-parallel rank traced locally]), checked against the real thing: ``parallelize_module`` with
the plan's ``torch_tp_plan`` on a tiny TP-ready Llama (tests/models/trace_tp_llama.py), in this process under
torch's fake process group (collectives return at once, tensors keep their local shapes, the arithmetic is
real): its parameters' local shapes, the collectives CommDebugMode counts, the bytes saved for backward.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

import pytest
import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from shard_planner.errors import UserError
from shard_planner.execute.tensor_parallel import torch_tp_plan
from shard_planner.model.modelfile import load_model_file
from shard_planner.parallel.tensor_parallel import Style, TensorParallel
from shard_planner.trace import trace_model
from shard_planner.trace.types import ModelTrace
from tests.models import trace_tp_llama
from tests.paths import REPO

MODEL = str(REPO / "tests" / "models" / "trace_tp_llama.py")
BATCH = 2  # a traced size: collectives and saves compared at it
OPTIONS = [(True, True), (True, False), (False, True), (False, False)]  # (sequence parallel, loss parallel)


def plan(sequence_parallel: bool = True, loss_parallel: bool = True) -> TensorParallel:
    styles = trace_tp_llama.tp_styles()
    if not sequence_parallel:
        styles = {f: s for f, s in styles.items() if s not in (Style.NORM.value, Style.GATHER_INPUT.value)}
    return TensorParallel(styles, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)


@lru_cache(maxsize=None)
def traced(tp_size: int, sequence_parallel: bool = True, loss_parallel: bool = True, reuse: bool = True) -> ModelTrace:
    tp = plan(sequence_parallel, loss_parallel) if tp_size > 1 else None
    return trace_model(MODEL, tensor_parallel=tp, tp_size=tp_size, reuse=reuse)


@pytest.fixture
def tp_mesh(request):
    """A fake process group of ``request.param`` ranks (this process is rank 0) and its 1-D "tp" mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    try:
        yield init_device_mesh("cpu", (request.param,), mesh_dim_names=("tp",))["tp"]
    finally:
        dist.destroy_process_group()


def parallelized(mesh, tp: TensorParallel, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model built for real (seed 0) in ``dtype`` (the trace's compute dtype), split by torch's styles."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = load_model_file(MODEL).build().to(dtype)
    return parallelize_module(model, mesh, torch_tp_plan(tp))


def real_step(model: nn.Module, tp: TensorParallel, pack=None):
    """Forward, loss and backward of one batch of BATCH samples (the loss under ``loss_parallel()`` if the plan
    says so), saved tensors going through ``pack`` if given."""
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel

    mf = load_model_file(MODEL)
    torch.manual_seed(1)
    inputs, targets = mf.batch(BATCH)
    hooks = saved_tensors_hooks(pack, lambda t: t) if pack is not None else nullcontext()
    with loss_parallel() if tp.loss_parallel else nullcontext():
        with hooks:
            loss = mf.loss(mf.forward(model, inputs), targets)
        loss.backward()


# ---- 1. parameters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tp_mesh", [2, 4], indirect=True)
def test_parameters_per_rank_are_the_local_shards(tp_mesh):
    t = tp_mesh.size()
    trace = traced(t)
    torch.manual_seed(0)
    real = parallelize_module_fp32(tp_mesh, plan())
    for fqn, module in real.named_modules():
        own = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters(recurse=False)]
        m = trace.module(fqn)
        assert m.param_count == sum(p.numel() for p in own), fqn
        assert m.param_bytes == sum(p.numel() * p.element_size() for p in own), fqn
    whole = traced(1)
    assert trace.module("layers.0.attention.wq").param_count * t == whole.module("layers.0.attention.wq").param_count
    assert trace.module("norm").param_count == whole.module("norm").param_count  # replicated


def parallelize_module_fp32(mesh, tp: TensorParallel) -> nn.Module:
    return parallelized(mesh, tp, torch.float32)  # parameters as built: the trace's param_bytes_by_dtype


# ---- 2. collectives --------------------------------------------------------------------------------

def real_collectives(mesh, tp: TensorParallel) -> dict[str, list[tuple[str, str, int]]]:
    """Per module (the loss: ``"<loss>"``), the collectives CommDebugMode sees in a real DTensor step, in
    order: (kind, phase, bytes of the full tensor: the all-gather's output, the others' input)."""
    from torch.distributed.tensor.debug import CommDebugMode

    kinds = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce"}
    found: dict[str, list] = defaultdict(list)

    class Sized(CommDebugMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            name = getattr(func, "_overloadpacket", None) and func._overloadpacket.__name__
            if out is not NotImplemented and name in kinds:
                full = out if name == "all_gather_into_tensor" else args[0]
                tracker = self.advanced_module_tracker
                fqn = "<loss>" if tracker.name == "Global" else tracker.name.partition(".")[2]
                found[fqn].append((kinds[name], "bwd" if tracker.is_bw else "fwd", full.numel() * full.element_size()))
            return out

    model = parallelized(mesh, tp)
    with Sized():
        real_step(model, tp)
    return dict(found)


def traced_collectives(trace: ModelTrace, batch: int) -> dict[str, list[tuple[str, str, int]]]:
    """The trace's per-module collectives at ``batch``, without the norms' parameter-gradient all-reduces
    (FSDP2's, not the DTensor step's: checked in test_norm_gradients_are_partial)."""
    out: dict[str, list] = {}
    styles = trace.tensor_parallel.styles_by_fqn
    for m in trace.modules:
        if styles.get(m.fqn) is not None and styles[m.fqn].style is Style.NORM:
            continue
        if m.tp_collectives:
            out[m.fqn] = [(c.kind, c.phase, round(c.full_bytes.at(batch))) for c in m.tp_collectives]
    if trace.loss_tp_collectives:
        out["<loss>"] = [(c.kind, c.phase, round(c.full_bytes.at(batch))) for c in trace.loss_tp_collectives]
    return out


def _gathers_own_their_reduce_scatter(found: dict, tp) -> dict:
    """The gathered input's backward reduce-scatter runs when its gradient is complete: inside the backward of
    the colwise projection autograd reaches last (wq, w1), where the module tracker attributes it; the trace
    records it on the gather_input module that issued the gather (the same block: the cost model sums per
    block). Moved to that module here."""
    gathers = {f for f, st in tp.styles_by_fqn.items() if st.style is Style.GATHER_INPUT}
    out: dict = {}
    for fqn, calls in found.items():
        parent = fqn.rpartition(".")[0]
        for c in calls:
            owner = parent if parent in gathers and c[:2] == ("reduce_scatter", "bwd") else fqn
            out.setdefault(owner, []).append(c)
    return out


@pytest.mark.parametrize("sp, lp", OPTIONS)
@pytest.mark.parametrize("tp_mesh", [2], indirect=True)
def test_collectives_match_dtensor_run(tp_mesh, sp, lp):
    want = _gathers_own_their_reduce_scatter(real_collectives(tp_mesh, plan(sp, lp)), plan(sp, lp))
    got = traced_collectives(traced(2, sp, lp), BATCH)
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}
    assert sum(map(len, want.values())) >= 17  # the real run issued them: 2 layers x 7, embedding, head, ...


@pytest.mark.parametrize("tp_mesh", [2], indirect=True)
def test_norm_gradients_are_partial(tp_mesh):
    """A norm's parameter gradient is Partial after the DTensor step (FSDP2 all-reduces it: tp_local.py's note);
    the trace records one all-reduce of it per step, in the compute dtype."""
    tp = plan()
    model = parallelized(tp_mesh, tp)
    real_step(model, tp)
    trace = traced(2)
    for fqn, style in tp.styles_by_fqn.items():
        if style.style is not Style.NORM:
            continue
        grads = [p.grad for p in model.get_submodule(fqn).parameters(recurse=False)]
        assert grads and all(g.placements[0].is_partial() for g in grads), fqn
        want = [("all_reduce", "bwd", g.numel() * g.element_size()) for g in grads]
        assert [(c.kind, c.phase, c.full_bytes.at(BATCH)) for c in trace.module(fqn).tp_collectives] == want
        assert all(c.full_bytes.per_sample == 0 for c in trace.module(fqn).tp_collectives)


# ---- 3. saved activations --------------------------------------------------------------------------

def real_saved_bytes(mesh, tp: TensorParallel) -> dict[str, int]:
    """Bytes saved for backward on this rank in the real DTensor step, per innermost module (the loss:
    ``"<loss>"``), deduplicated by storage, a DTensor counted as its local tensor; parameters are not
    activations."""
    from torch.distributed.tensor import DTensor

    model = parallelized(mesh, tp)

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    static = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[str] = []

    def leave(_module, _args, _out) -> None:
        stack.pop()

    for fqn, module in model.named_modules():
        module.register_forward_pre_hook(lambda _m, _a, fqn=fqn: stack.append(fqn))
        module.register_forward_hook(leave)
    seen: set[int] = set()
    saved: dict[str, int] = defaultdict(int)

    def pack(t):
        st = local(t).untyped_storage()
        if st.data_ptr() not in static and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            saved[stack[-1] if stack else "<loss>"] += st.nbytes()
        return t

    real_step(model, tp, pack)
    return dict(saved)


@pytest.mark.parametrize("sp, lp", OPTIONS)
@pytest.mark.parametrize("tp_mesh", [2], indirect=True)
def test_saved_bytes_match_dtensor_run(tp_mesh, sp, lp):
    want = real_saved_bytes(tp_mesh, plan(sp, lp))
    trace = traced(2, sp, lp)
    got = {m.fqn: round(m.saved_bytes_self.at(BATCH)) for m in trace.modules if m.saved_bytes_self.at(BATCH)}
    got["<loss>"] = round(trace.loss_saved_bytes.at(BATCH))
    assert got == want


# ---- 4. FLOPs --------------------------------------------------------------------------------------

def test_linear_flops_divide_by_the_degree():
    whole, rank = traced(1), traced(4)
    linears = [m.fqn for m in whole.modules if m.type_name == "Linear"]

    def flops(trace, fqns):
        return sum(trace.module(f).fwd_flops_self.at(BATCH) + trace.module(f).bwd_flops_self.at(BATCH) for f in fqns)

    assert flops(whole, linears) > 0
    assert flops(rank, linears) * 4 == flops(whole, linears)


# ---- the trace itself ------------------------------------------------------------------------------

def test_twins_change_nothing():
    reused, full = traced(2), traced(2, reuse=False)
    assert reused.reused_modules > 0 and full.reused_modules == 0
    for a, b in zip(reused.modules, full.modules):
        assert (a.fqn, a.tp_collectives, a.saved_bytes_self, a.fwd_flops_self, a.fwd_peak_rise_bytes,
                a.bwd_peak_rise_bytes) == (b.fqn, b.tp_collectives, b.saved_bytes_self, b.fwd_flops_self,
                                           b.fwd_peak_rise_bytes, b.bwd_peak_rise_bytes)


def test_json_round_trip_and_degree_one_unchanged():
    trace = traced(2)
    again = ModelTrace.from_json(trace.to_json())
    assert again == trace and again.tp_size == 2 and again.tensor_parallel == plan()
    whole = traced(1)
    assert whole.tp_size == 1 and whole.tensor_parallel is None and not whole.loss_tp_collectives
    text = whole.to_json()
    assert "tp_collectives" not in text and "tp_size" not in text and "tensor_parallel" not in text


def test_refuses_what_it_cannot_split():
    with pytest.raises(UserError, match="does not divide into 3"):
        trace_model(MODEL, tensor_parallel=plan(), tp_size=3)
    with pytest.raises(UserError, match="not a module"):
        trace_model(MODEL, tensor_parallel=TensorParallel({"nowhere": "colwise"}, False, False), tp_size=2)
    with pytest.raises(UserError, match="style rowwise splits Linear, not TransformerBlock"):
        trace_model(MODEL, tensor_parallel=TensorParallel({"layers.0": "rowwise"}, False, False), tp_size=2)
    with pytest.raises(UserError, match="needs the tensor-parallel styles"):
        trace_model(MODEL, tp_size=2)
