"""Tier 2: the sequence recorder (execute/alloc_record.py) in one process over a fake process group (FSDP2
runs its hooks and allocates its buffers; the collectives do nothing)."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

from shard_planner.cost.alloc_sequence import AG_OUTPUT, ALLOC, FREE, RS_INPUT, SHARDED_GRAD, UNSHARDED
from shard_planner.execute.alloc_record import SequenceRecorder, real_sequence

D = 32


def _sharded_model(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D, bias=False), nn.Linear(D, 2 * D, bias=False))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


def _unit_of(model):
    names = {id(m): "<root>" if not n else n for n, m in model.named_modules()}
    return lambda group: names[id(group.modules[0])]


def _step(model, optimizer, tracker=None):
    def phase(name):
        if tracker is not None:
            tracker.phase = name

    phase("forward")
    loss = model(torch.randn(4, D)).float().pow(2).mean()
    phase("backward")
    loss.backward()
    phase("optimizer")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_labels_fsdp2_buffers_by_identity(fake_world):
    model = _sharded_model(fake_world)
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, optimizer)
    originals = (pg.FSDPParamGroup.unshard, pg.foreach_reduce)
    recorder = SequenceRecorder(_unit_of(model), track=(model, optimizer))
    with recorder:
        _step(model, optimizer, recorder)
    assert (pg.FSDPParamGroup.unshard, pg.foreach_reduce) == originals  # unwrapped on exit
    events = real_sequence(recorder)
    layer1 = [(e.op, e.kind, e.size_bytes, e.phase) for e in events if e.unit == "1"]
    bf16, fp32 = D * 2 * D * 2, D * 2 * D * 4  # layer 1: (2D, D) in bf16 gathered, fp32 reduce-scattered
    assert layer1 == [
        (ALLOC, AG_OUTPUT, bf16, "forward"), (ALLOC, UNSHARDED, bf16, "forward"),
        (FREE, UNSHARDED, bf16, "forward"), (FREE, AG_OUTPUT, bf16, "forward"),  # by the root's post-forward
        (ALLOC, AG_OUTPUT, bf16, "backward"), (ALLOC, UNSHARDED, bf16, "backward"),
        (FREE, AG_OUTPUT, bf16, "backward"), (FREE, UNSHARDED, bf16, "backward"),
        (ALLOC, RS_INPUT, fp32, "backward"), (ALLOC, SHARDED_GRAD, fp32 // 2, "backward"),
        (FREE, RS_INPUT, fp32, "backward"), (FREE, SHARDED_GRAD, fp32 // 2, "optimizer"),
    ]
    ag = next(e for e in events if e.unit == "1")
    assert ag.scratch_bytes == bf16 // 2  # the cast copy of this rank's shard
    rs = next(e for e in events if e.unit == "1" and e.kind == SHARDED_GRAD)
    assert rs.grad_bytes == bf16  # its one gradient, held by foreach_reduce until it returns
    assert {e.unit for e in events} == {"0", "1"}  # the root owns no parameter: no buffers


def test_the_gradient_held_through_the_reduce_scatter_is_the_units_last_parameters(fake_world):
    """FSDP2 (torch 2.13) frees a unit's gradients after the reduce-scatter copy-in but its last
    parameter's, named by ``foreach_reduce``'s loop variable until it returns (cost/alloc_sequence.py
    [Note: What the sequence check found]); the memory walk holds the first module's instead."""
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(D, 2 * D), nn.Linear(2 * D, D))  # parameters: w0, b0, w1, b1 (D elements)
    model = nn.Sequential(inner)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(inner, mesh=fake_world, mp_policy=mp)
    fully_shard(model, mesh=fake_world, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, optimizer)
    recorder = SequenceRecorder(_unit_of(model), track=(model, optimizer))
    with recorder:
        _step(model, optimizer, recorder)
    held = [e.grad_bytes for e in real_sequence(recorder) if (e.op, e.kind) == (ALLOC, SHARDED_GRAD)]
    assert held == [D * 2]  # the last bias in bf16; the first module's weight and bias would be (2D x D + 2D) x 2
