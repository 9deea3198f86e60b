"""``shard-planner calibrate``: measure this machine and write a hardware profile (TOML); with
``--model FILE``, measure that model's per-module forward/backward times instead and write them as JSON
(shard_planner/hardware/timings.py), for ``profile.with_timings(load_timings(path))``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from shard_planner.cli.args import add_device, add_dtype, add_micro_batch, add_profile, param_dtype
from shard_planner.errors import UserError
from shard_planner.fileio import check_output_file
from shard_planner.units import format_bytes


@dataclass(frozen=True)
class CalibrateRequest:
    world_size: int
    device: str
    output: Path
    name: str
    quick: bool = False


@dataclass(frozen=True)
class TimingsRequest:
    model: str
    micro_batch: int | None
    dtype: str
    world_size: int
    device: str
    output: Path
    profile: str | None  # for the FLOP model's column; None: cpu-gloo on CPU, the default profile on GPU


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate",
        help="measure matmul throughput, memory bandwidth and collective latency/bandwidth; write a profile",
        description="Measure this machine (gloo on CPU, NCCL on GPU): matmul FLOP/s in fp32 and bf16, memory "
        "bandwidth, and all-gather / reduce-scatter times over several sizes in a spawned world, fitted "
        "to the ring model with its bus-bandwidth curve (latency per step, plateau, n_1/2); the roofline kernel "
        "model's constants (GEMM shape sweep, attention forward/backward, elementwise bandwidth, launch cost); and "
        "the framework overheads of the time model: per aten op, per FSDP2 unit and step, per optimizer parameter "
        "tensor. Writes a profile TOML for --profile that prices compute with the roofline.",
    )
    p.add_argument("--world-size", type=int, default=2, metavar="N", help="ranks for the collectives (default 2)")
    add_device(p)
    p.add_argument("-o", "--output", default=None,
                   help="file to write (default profiles/local.toml; with --model, timings.json)")
    p.add_argument("--name", default=None, help="profile name (default: the output file's stem)")
    p.add_argument("--quick", action="store_true",
                   help="fewer repeats and without the largest kernel shapes: the kernel sweep in this process takes "
                   "about half as long (CPU: 1.5 of 3 CPU-s), but most of the command is the same either way, "
                   "launching the ranks for the collectives and the framework overheads (~14 CPU-s on a 2-core "
                   "machine): the whole command is a few seconds faster at most")
    g = p.add_argument_group("module timings (--model)", "time every module's forward and backward of a "
                             "model on this device (real training steps at micro-batches B and 2B, no FSDP; the "
                             "whole model must fit on one device) and write them for the cost model")
    g.add_argument("--model", default=None, metavar="FILE", help="model file to time (instead of writing a profile)")
    add_micro_batch(g, default="the model file's TRAINING['micro_batch'], else 1; measured at B and 2B")
    add_dtype(g)
    add_profile(g, default=None, default_text="cpu-gloo on CPU, h100-80gb on GPU; for the FLOP-model column of the table")
    return p


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        return run_timings(args)
    from shard_planner.execute.calibrate import calibrate, write_profile

    args.output = args.output or "profiles/local.toml"
    if args.world_size < 2:
        raise UserError(f"--world-size must be at least 2 (collectives need two ranks), got {args.world_size}")
    out = Path(args.output)
    if out.suffix != ".toml":
        raise UserError(f"-o {args.output}: a profile is a .toml file")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device on this machine")
    req = CalibrateRequest(args.world_size, args.device, out, args.name or out.stem, args.quick)
    check_output_file(req.output, "profile")
    profile, text = calibrate(req.world_size, req.device, req.name, quick=req.quick)
    write_profile(text, str(req.output))
    ic = profile.interconnect
    print(f"device {profile.device}: matmul {profile.peak_flops_per_s['float32'] / 1e9:.1f} GFLOP/s fp32, "
          f"{profile.peak_flops_per_s['bfloat16'] / 1e9:.1f} GFLOP/s bf16; copy {profile.memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s; "
          f"memory {format_bytes(profile.memory_bytes)}")
    print(f"collectives over {req.world_size} ranks: latency {ic.intra_node_latency_s * 1e6:.1f} us per step, "
          f"busbw {ic.intra_node_busbw_bytes_per_s / 1e9:.3f} GB/s, n_1/2 {ic.intra_node_busbw_half_bytes / 1024:.1f} KiB")
    k = profile.kernels
    print(f"kernels: matmul efficiency {k['matmul_efficiency']:.3f}, tile {k['matmul_tiles'][0]}, attention "
          f"fwd {k['attention_fwd_efficiency']:.3f} bwd {k['attention_bwd_efficiency']:.3f}, memory efficiency "
          f"{k['memory_efficiency']:.3f}; compute_model {profile.compute_model}")
    print(f"overheads: {profile.per_op_overhead_s * 1e6:.1f} us per op, {profile.per_unit_overhead_s * 1e3:.2f} ms per "
          f"FSDP unit and step, {profile.per_param_tensor_optimizer_overhead_s * 1e6:.0f} us per optimizer tensor "
          f"({profile.plain_tensor_optimizer_s * 1e6:.0f} us for a plain tensor on one device)")
    print(f"wrote {req.output}")
    return 0


def run_timings(args: argparse.Namespace) -> int:
    from shard_planner.execute.module_timing import measure_module_timings
    from shard_planner.hardware.profile import DEFAULT_PROFILE, load_profile
    from shard_planner.hardware.timings import save_timings
    from shard_planner.trace.tracer import trace_model

    out = Path(args.output or "timings.json")
    if out.suffix != ".json":
        raise UserError(f"-o {out}: module timings are a .json file")
    dtype = param_dtype(args)
    if args.world_size < 1:
        raise UserError(f"--world-size must be at least 1, got {args.world_size}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device on this machine")
    req = TimingsRequest(args.model, args.micro_batch, dtype, args.world_size, args.device, out, args.profile)
    check_output_file(req.output, "module-timings")
    timings = measure_module_timings(req.model, micro_batch=req.micro_batch, dtype=req.dtype,
                                     world_size=req.world_size, device=req.device)
    profile = load_profile(req.profile or ("cpu-gloo" if timings.device == "cpu" else DEFAULT_PROFILE))
    trace = trace_model(req.model, dtype=req.dtype)
    print(timings_table(timings, trace, profile))
    save_timings(timings, req.output)
    dtype = f" --dtype {req.dtype}" if req.dtype != "bfloat16" else ""  # timings price plans of their dtype only
    print(f"wrote {req.output}; price compute from it with `shard-planner plan {req.model}{dtype} --timings "
          f"{req.output}` (estimate and tune take --timings too)")
    return 0


def timings_table(timings, trace, profile) -> str:
    """Per module kind (class): count, measured forward/backward ms (all modules of the kind, subtrees)
    at the first measured micro-batch (the requested one), and what the FLOP model says (FLOPs / throughput + ops x per-op
    overhead, shard_planner/cost/time.py)."""
    b = timings.micro_batches[0]
    rate = profile.flops_per_s(timings.param_dtype)
    op_s = profile.per_op_overhead_s
    rows: dict[str, list] = {}
    for m in trace.modules:
        t = timings.modules.get(m.fqn)
        if t is None:
            continue
        kind = "<model> " + m.type_name if m.fqn == "" else m.type_name
        r = rows.setdefault(kind, [0, 0.0, 0.0, 0.0, 0.0, False])
        sub = trace.subtree(m.fqn)
        r[0] += 1
        r[1] += t.fwd_s.at(b)
        r[2] += t.bwd_s.at(b)
        r[3] += sum(x.fwd_flops_self.at(b) for x in sub) / rate + sum(x.fwd_ops_self for x in sub) * op_s
        r[4] += sum(x.bwd_flops_self.at(b) for x in sub) / rate + sum(x.bwd_ops_self for x in sub) * op_s
        r[5] = r[5] or t.bwd_source == "derived"
    lines = [f"{timings.model_path}: module times on {timings.device} ({timings.device_name}), {timings.param_dtype}, "
             f"micro-batch {b}, {timings.world_size} process(es) x {timings.threads_per_rank} thread(s); "
             f"FLOP model: profile {profile.name}",
             f"{'module kind':28s} {'n':>3s} {'fwd ms':>9s} {'bwd ms':>9s} {'FLOP model fwd':>15s} {'bwd':>9s}"]
    for kind, (n, f, bw, ff, fb, derived) in rows.items():
        lines.append(f"{kind[:28]:28s} {n:3d} {f * 1e3:9.3f} {bw * 1e3:9.3f}{'*' if derived else ' '}"
                     f"{ff * 1e3:14.3f} {fb * 1e3:9.3f}")
    lines.append(f"{'loss_fn':28s} {'':3s} {timings.loss_fwd_s.at(b) * 1e3:9.3f} {timings.loss_bwd_s.at(b) * 1e3:9.3f}")
    if any(r[5] for r in rows.values()):
        lines.append("* backward derived from the parent's (no input needs a gradient; shard_planner/execute/module_timing.py)")
    return "\n".join(lines)
