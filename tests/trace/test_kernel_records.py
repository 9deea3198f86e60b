"""Kernel records (trace/kernel_ops.py, [Note: kernel records]): each aten op's class, speed-deciding
shape and bytes; per module fitted over the two traced batch sizes; priced by cost/kernels.py."""

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from shard_planner.cost.kernels import device_of, has_kernel_records, module_kernel_s, records_time_s
from shard_planner.hardware.profile import load_profile
from shard_planner.trace import trace_model
from shard_planner.trace.kernel_ops import OpSample, classify, fit_records, grouped_mm_dims, grouped_mm_flop
from shard_planner.trace.types import ModelTrace
from shard_planner.plan.numerics import Numerics

aten = torch.ops.aten


def _classify(func, *args, flops=0, **kwargs):
    with FakeTensorMode():
        fake = [torch.empty(a, dtype=torch.bfloat16) if isinstance(a, tuple) else a for a in args]
        out = func(*fake, **kwargs)
        return classify(func, tuple(fake), kwargs, out, flops)


def test_matmuls_record_m_n_k_layout_and_bytes():
    # row-major operands: layout 1, "kn" (cost/kernels.py [Note: matmul layouts])
    s = _classify(aten.mm.default, (32, 64), (64, 128), flops=7)
    assert s == OpSample("matmul", (1, 32, 128, 64, 1), 7, (32 * 64 + 64 * 128 + 32 * 128) * 2, 0, "mm")
    s = _classify(aten.addmm.default, (128,), (32, 64), (64, 128))
    assert s.dims == (1, 32, 128, 64, 1) and s.bytes == (128 + 32 * 64 + 64 * 128 + 32 * 128) * 2
    assert _classify(aten.bmm.default, (4, 32, 64), (4, 64, 16)).dims == (4, 32, 16, 64, 1)


def _classified(build, step) -> list[OpSample]:
    """Under FakeTensorMode: ``build()`` makes (modules, inputs) untraced, then every kernel that
    ``step(*built)`` dispatches, as :func:`classify` records it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            s = classify(func, args, kwargs or {}, out, 0)
            if s is not None:
                seen.append(s)
            return out

    with FakeTensorMode():
        built = build()
        with Record():
            step(*built)
    return seen


def test_a_linear_layers_three_gemms_record_their_layouts():
    """Forward x @ W^T is "kk" (0), the input gradient dY @ W "kn" (1), the weight gradient dY^T @ X
    "mn" (3): the layouts CPU bf16 runs 12x apart (cost/kernels.py [Note: matmul layouts])."""
    ops = _classified(lambda: (torch.nn.Linear(64, 32), torch.randn(4, 16, 64, requires_grad=True)),
                      lambda lin, x: (lin(x) ** 2).sum().backward())
    seen = [s.dims for s in ops if s.op_class == "matmul"]
    assert sorted(seen) == [(1, 32, 64, 64, 3), (1, 64, 32, 64, 0), (1, 64, 64, 32, 1)]


def test_a_matmul_records_the_larger_batch_layout():
    """The layout is a code, not a size: where a size-1 dimension at the smaller traced batch made it
    differ (its stride is arbitrary), the record keeps the larger batch's."""
    (r,) = fit_records([OpSample("matmul", (1, 10, 64, 1, 1), 1280, 10)], [OpSample("matmul", (1, 10, 64, 16, 3), 20480, 20)],
                       1, 16)
    assert r.dims_at(1) == (1, 10, 64, 1, 3) and r.dims_at(8) == (1, 10, 64, 8, 3)


def test_convolutions_are_their_own_class():
    ops = _classified(lambda: (torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ConvTranspose2d(8, 4, 2, stride=2),
                               torch.randn(2, 8, 16, 16, requires_grad=True)),
                      lambda conv, up, x: (up(conv(x)) ** 2).sum().backward())
    seen = [s.op_class for s in ops if s.op_class.startswith("conv")]
    assert seen == ["conv_fwd", "conv_fwd", "conv_bwd", "conv_bwd"]


def test_views_and_allocations_run_no_kernel():
    assert _classify(aten.transpose.int, (4, 8), 0, 1) is None
    assert _classify(aten._unsafe_view.default, (4, 8), [32]) is None
    assert _classify(aten.add.Tensor, (4, 8), (4, 8)) == OpSample("elementwise", (), 0, 3 * 4 * 8 * 2, 0, "add")
    assert _classify(aten._to_copy.default, (4, 8), dtype=torch.float32).op_class == "copy"
    assert _classify(aten._softmax.default, (4, 8), -1, False).op_class == "reduction"


def test_attention_records_batch_heads_seq_head_dim_causal():
    q = (2, 4, 128, 64)  # (B, H, S, D)
    s = _classify(aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q, is_causal=True)
    assert s.op_class == "attention_fwd" and s.dims == (8, 128, 128, 64, 1)
    s = _classify(aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q)
    assert s.dims == (8, 128, 128, 64, 0)
    with FakeTensorMode():
        t = [torch.empty(q, dtype=torch.bfloat16) for _ in range(4)]
        lse = torch.empty((2, 4, 128), dtype=torch.float32)
        func = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        args = (t[0], t[1], t[2], t[3], t[0], lse, 0.0, True)
        s = classify(func, args, {}, func(*args), 5)
    assert s.op_class == "attention_bwd" and s.dims == (8, 128, 128, 64, 1) and s.flops == 5


def test_grouped_mm_shapes_and_flops():
    a, b = torch.empty(64, 32), torch.empty(4, 32, 16)  # 64 tokens routed to 4 experts, K 32, N 16
    assert grouped_mm_dims(a, b) == (4, 16, 16, 32)
    assert grouped_mm_flop((64, 32), (4, 32, 16), (64, 16)) == 2 * 64 * 32 * 16
    assert grouped_mm_flop((4, 16, 32), (4, 32, 16), (4, 16, 16)) == 2 * 4 * 16 * 16 * 32
    assert grouped_mm_flop((32, 64), (64, 16), (4, 32, 16)) == 2 * 32 * 16 * 64  # weight grads: K = tokens


def test_fit_pairs_ops_and_makes_dims_affine():
    seq1 = [OpSample("matmul", (1, 32, 128, 64), 100, 10), OpSample("elementwise", (), 0, 5),
            OpSample("matmul", (1, 32, 128, 64), 100, 10)]
    seq2 = [OpSample("matmul", (1, 64, 128, 64), 200, 16), OpSample("elementwise", (), 0, 9),
            OpSample("matmul", (1, 64, 128, 64), 200, 16)]
    recs = {r.op_class: r for r in fit_records(seq1, seq2, 1, 2)}
    mm = recs["matmul"]
    assert mm.count == 2 and mm.flops.at(4) == 800 and mm.bytes.at(3) == 2 * 22
    assert mm.dims_at(1) == (1, 32, 128, 64) and mm.dims_at(8) == (1, 256, 128, 64)
    assert recs["elementwise"].bytes.at(5) == 21
    assert fit_records(seq1, seq2[:2], 1, 2) == ()  # sequences that do not pair: no records


@pytest.fixture()
def tiny_trace(monkeypatch):
    monkeypatch.setenv("SHARD_PLANNER_SHAPE", json.dumps(
        dict(n_layers=2, d_model=64, d_ffn=256, n_heads=4, vocab=512, seq_len=32)))
    return trace_model("examples/shape.py")


def test_trace_carries_records_that_match_its_flops(tiny_trace):
    t = tiny_trace
    assert has_kernel_records(t)
    for m in t.modules:  # every FLOP the tracer counts sits in a record of the same module and phase
        for b in (1, 3):
            assert sum(r.flops.at(b) for r in m.fwd_kernels) == pytest.approx(m.fwd_flops_self.at(b))
            assert sum(r.flops.at(b) for r in m.bwd_kernels) == pytest.approx(m.bwd_flops_self.at(b))
    up = t.module("blocks.1.ffn.up")  # a twin of blocks.0: records copied from its template
    mm = [r for r in up.fwd_kernels if r.op_class == "matmul"]
    assert [r.dims_at(3) for r in mm] == [(1, 96, 256, 64, 0)]  # (batch, tokens = 3 x 32, d_ffn, d_model, "kk")
    attn = [r for r in t.module("blocks.0.attn").fwd_kernels if r.op_class == "attention_fwd"]
    assert [r.dims_at(2) for r in attn] == [(8, 32, 32, 16, 1)]
    assert {r.op_class for r in t.loss_kernels} >= {"loss", "reduction"}
    again = ModelTrace.from_json(t.to_json())
    assert again == t


def test_old_traces_load_and_price_from_flops(tiny_trace):
    d = json.loads(tiny_trace.to_json())
    d.pop("loss_kernels")
    for m in d["modules"]:
        m.pop("fwd_kernels"), m.pop("bwd_kernels")
    old = ModelTrace.from_dict(d)
    assert not has_kernel_records(old)


def test_module_kernel_times_on_a_gpu_profile(tiny_trace):
    dev = device_of(load_profile("a100-80gb"), "bfloat16")
    per = module_kernel_s(tiny_trace, 4, dev, fallback_flops_per_s=1e12)
    up = tiny_trace.module("blocks.0.ffn.up")
    assert per["blocks.0.ffn.up"][0] == pytest.approx(records_time_s(up.fwd_kernels, 4, dev))
    # tiny kernels: each costs about its launch gap, far above FLOPs at peak
    assert per["blocks.0.ffn.up"][0] > up.fwd_flops_self.at(4) / 312e12


def test_grouped_mm_flops_are_counted():
    """FlopCounterMode counts aten._grouped_mm as 0 FLOPs; the tracer's counter maps it (MoE experts)."""
    from shard_planner.trace.flops import FlopCounter

    func = aten._grouped_mm.default
    with FakeTensorMode():
        a, b = torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(4, 32, 16, dtype=torch.bfloat16)
        offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
        out = func(a, b, offs)
        n = FlopCounter().count(func, (a, b, offs), {}, out)
        sample = classify(func, (a, b, offs), {}, out, n)
    assert n == 2 * 64 * 32 * 16
    assert sample.op_class == "grouped_matmul" and sample.dims == (4, 16, 16, 32)


def test_cost_model_prices_kernels_on_gpu_profiles_only(tiny_trace):
    """A GPU profile with a [kernels] table and compute_model "roofline" prices blocks from the records;
    profiles with compute_model "flops" (h100-80gb ships it), cpu-gloo and old traces from FLOPs."""
    import dataclasses

    from shard_planner.cost.model import CostModel
    from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit

    units = (Unit(("",), False),) + tuple(Unit((f"blocks.{i}",), True) for i in range(2))
    plan = Plan(ModelRef("shape", tiny_trace.fingerprint), Cluster(8, 8, "a100-80gb", 80 * 2**30), Mesh(8),
                Training(4), units, Prefetch())
    shipped = load_profile("a100-80gb")  # ships compute_model "roofline" (h100-80gb ships "flops")
    flops = dataclasses.replace(shipped, compute_model="flops")
    assert load_profile("h100-80gb").compute_model == "flops"
    assert CostModel(tiny_trace, flops).kernel_module_s(4, Numerics()) is None
    gpu = dataclasses.replace(shipped, compute_model="roofline")
    model = CostModel(tiny_trace, gpu)
    kernels = model.kernel_module_s(4, Numerics())
    assert kernels is not None
    blocks = model.block_compute_s(model.tables(plan.units), 4, Numerics())
    t = model.tables(plan.units)
    i = next(j for j, blk in enumerate(t.blocks) if blk.fqn == "blocks.0")
    expected = sum(kernels[0][m.fqn][0] for m in tiny_trace.subtree("blocks.0"))
    assert blocks.device_fwd_s[i] == pytest.approx(expected)
    assert blocks.loss_device_s == pytest.approx(kernels[1])
    flops_only = CostModel(tiny_trace, flops)
    assert flops_only.kernel_module_s(4, Numerics()) is None
    rate = gpu.flops_per_s("bfloat16")
    assert (flops_only.block_compute_s(t, 4, Numerics()).device_fwd_s[i]
            == pytest.approx(t.blocks[i].fwd_flops.at(4) / rate))
    assert CostModel(tiny_trace, load_profile("cpu-gloo")).kernel_module_s(4, Numerics()) is None


def test_roofline_needs_a_kernels_table_and_a_known_model():
    import dataclasses

    from shard_planner.errors import ProfileError

    gpu = load_profile("h100-80gb")
    with pytest.raises(ProfileError, match="needs a \\[kernels\\] table"):
        dataclasses.replace(gpu, compute_model="roofline", kernels=None)
    with pytest.raises(ProfileError, match="compute_model must be one of flops, roofline"):
        dataclasses.replace(gpu, compute_model="kernels")


def test_fit_pairs_around_a_copy_only_the_larger_batch_runs():
    # transformers' causal-LM loss: labels[..., 1:].contiguous() clones at batch 2, not at batch 1
    # ([Note: copies only one batch size runs]); before, the whole sequence gave no records
    seq1 = [OpSample("matmul", (1, 32, 128, 64, 0), 100, 10), OpSample("copy", (), 0, 4, 0, "constant_pad_nd"),
            OpSample("reduction", (), 0, 50), OpSample("loss", (), 0, 30)]
    seq2 = [OpSample("matmul", (1, 64, 128, 64, 0), 200, 16), OpSample("copy", (), 0, 8, 0, "constant_pad_nd"),
            OpSample("copy", (), 0, 6, 3, "clone"), OpSample("reduction", (), 0, 100), OpSample("loss", (), 0, 60)]
    recs = fit_records(seq1, seq2, 1, 2)
    by = {}
    for r in recs:
        by.setdefault(r.op_class, []).append(r)
    assert by["matmul"][0].flops.at(4) == 400 and by["reduction"][0].bytes.at(4) == 200
    assert by["loss"][0].bytes.at(3) == 90
    paired, lone = sorted(by["copy"], key=lambda r: r.bytes.fixed)
    assert paired.bytes.at(4) == 16 and paired.count == 1
    assert lone.count == 1 and lone.bytes.at(4) == 12 and lone.new_bytes.at(4) == 6  # 6 bytes at b=2, x b/2


def test_fit_gives_no_records_when_ops_other_than_copies_differ():
    seq1 = [OpSample("matmul", (1, 32, 128, 64, 0), 100, 10), OpSample("loss", (), 0, 30)]
    seq2 = [OpSample("matmul", (1, 64, 128, 64, 0), 200, 16), OpSample("elementwise", (), 0, 6),
            OpSample("loss", (), 0, 60)]
    assert fit_records(seq1, seq2, 1, 2) == ()
