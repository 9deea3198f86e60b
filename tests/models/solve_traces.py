"""Hand-written ModelTraces for the solver's tests: uniform stacks (root with embed, N blocks, norm,
head), with every number chosen by hand, and a hand-written profile, so tests do not depend on the
tracer or on profiles/."""

from __future__ import annotations

from shard_planner.hardware.profile import HardwareProfile, Interconnect
from shard_planner.trace.types import Affine, ModelTrace, ModuleTrace

MIB = 2**20
GIB = 2**30


def _mod(fqn, type_name, parent, children, h, params=0, *, saved=0.0, inp=0.0, out=0.0, fwd_rise=0.0,
         bwd_rise=0.0, flops=0.0, calls=1):
    return ModuleTrace(
        fqn=fqn, type_name=type_name, parent=parent, children=tuple(children), structural_hash=h,
        param_count=params, param_bytes_by_dtype={"float32": 4 * params} if params else {}, buffer_bytes=0,
        calls=calls, input_bytes=Affine(0, inp), output_bytes=Affine(0, out),
        saved_bytes_self=Affine(0, saved), fwd_flops_self=Affine(0, flops), bwd_flops_self=Affine(0, 2 * flops),
        fwd_peak_rise_bytes=Affine(0, fwd_rise), bwd_peak_rise_bytes=Affine(0, bwd_rise),
    )


def stack_trace(n_layers: int = 4, *, block_params: int = 64 * MIB // 2, embed_params: int = 16 * MIB // 2,
                head_params: int = 16 * MIB // 2, saved_per_sample: float = 32 * MIB,
                input_per_sample: float = 2 * MIB, flops_per_sample: float = 1e12, seq: int = 128,
                split_block: bool = True) -> ModelTrace:
    """A GPT-like stack. Blocks hold ``block_params`` (half attention, half MLP when ``split_block``);
    each block saves ``saved_per_sample`` bytes per sample (all in its MLP/attention children), keeps
    ``input_per_sample`` when checkpointed, and does ``flops_per_sample`` forward FLOPs (backward 2x)."""
    mods = []
    layer_names = [f"layers.{i}" for i in range(n_layers)]
    mods.append(_mod("", "Model", None, ["embed", "layers", "norm", "head"], "root"))
    mods.append(_mod("embed", "Embedding", "", [], "emb", embed_params, saved=0.0, out=input_per_sample,
                     fwd_rise=input_per_sample, flops=0.0))
    mods.append(_mod("layers", "ModuleList", "", layer_names, "list", calls=0))
    for name in layer_names:
        kids = [f"{name}.attn", f"{name}.mlp"] if split_block else []
        own = 0 if split_block else block_params
        mods.append(_mod(name, "Block", "layers", kids, "block", own, saved=0.0 if split_block else saved_per_sample,
                         inp=input_per_sample, out=input_per_sample, fwd_rise=saved_per_sample + input_per_sample,
                         bwd_rise=2 * input_per_sample, flops=0.0 if split_block else flops_per_sample))
        if split_block:
            for kid in ("attn", "mlp"):
                mods.append(_mod(f"{name}.{kid}", kid, name, [], kid, block_params // 2, saved=saved_per_sample / 2,
                                 inp=input_per_sample, out=input_per_sample,
                                 fwd_rise=saved_per_sample / 2 + input_per_sample, bwd_rise=input_per_sample,
                                 flops=flops_per_sample / 2))
    mods.append(_mod("norm", "Norm", "", [], "norm", 1024, saved=input_per_sample, inp=input_per_sample,
                     out=input_per_sample, fwd_rise=2 * input_per_sample, bwd_rise=input_per_sample, flops=1e6))
    mods.append(_mod("head", "Linear", "", [], "head", head_params, saved=input_per_sample, inp=input_per_sample,
                     out=4 * input_per_sample, fwd_rise=4 * input_per_sample, bwd_rise=4 * input_per_sample,
                     flops=flops_per_sample / 4))
    order = ["", "embed", *[m for name in layer_names for m in
                              ([name, f"{name}.attn", f"{name}.mlp"] if split_block else [name])], "norm", "head"]
    return ModelTrace(
        model_path="tests/models/solve_traces.py", model_class="Model", compute_dtype="bfloat16",
        batch_sizes=(1, 2), tokens_per_sample=seq, modules=tuple(mods), forward_order=tuple(order),
        backward_order=tuple(reversed(order)), batch_input_bytes=Affine(0, 8 * seq),
        loss_saved_bytes=Affine(0, 0.0), loss_peak_rise_bytes=Affine(0, 8 * input_per_sample),
        loss_flops=Affine(0, 1e6), fingerprint="feedfacecafebeef",
    )


def profile(*, gpus_per_node: int = 8, busbw: float = 100e9, latency_s: float = 20e-6,
            reserved_bytes: int = 512 * MIB, memory_bytes: int = 80 * GIB) -> HardwareProfile:
    """An H100-like device with numbers that keep the hand computations simple."""
    return HardwareProfile(
        name="test-gpu", device="cuda", memory_bytes=memory_bytes, usable_fraction=1.0,
        reserved_bytes=reserved_bytes, per_process_group_bytes=1 * GIB,
        peak_flops_per_s={"bfloat16": 1e15, "float32": 5e14}, compute_efficiency=0.5,
        memory_bandwidth_bytes_per_s=3e12, host_to_device_bytes_per_s=25e9,
        interconnect=Interconnect(gpus_per_node=gpus_per_node, intra_node_latency_s=latency_s,
                                  intra_node_busbw_bytes_per_s=busbw, inter_node_latency_s=2 * latency_s,
                                  inter_node_busbw_bytes_per_s=busbw / 4),
    )
