"""``shard-planner calibrate``: measure this machine and write a hardware profile (TOML)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from shard_planner.errors import UserError
from shard_planner.units import format_bytes


@dataclass(frozen=True)
class CalibrateRequest:
    world_size: int
    device: str
    output: Path
    name: str


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate",
        help="measure matmul throughput, memory bandwidth and collective latency/bandwidth; write a profile",
        description="Measure this machine (gloo on CPU, NCCL on GPU): matmul FLOP/s in fp32 and bf16, memory "
        "bandwidth, and all-gather / reduce-scatter times over several sizes in a spawned world, fitted "
        "to the ring model (latency per step and bus bandwidth); and the framework overheads of the time model: "
        "per aten op, per FSDP2 unit and step, per optimizer parameter tensor. Writes a profile TOML for --profile.",
    )
    p.add_argument("--world-size", type=int, default=2, metavar="N", help="ranks for the collectives (default 2)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="default: cuda if available")
    p.add_argument("-o", "--output", default="profiles/local.toml", help="profile to write (default profiles/local.toml)")
    p.add_argument("--name", default=None, help="profile name (default: the output file's stem)")
    return p


def run(args: argparse.Namespace) -> int:
    from shard_planner.execute.calibrate import calibrate, write_profile

    if args.world_size < 2:
        raise UserError(f"--world-size must be at least 2 (collectives need two ranks), got {args.world_size}")
    out = Path(args.output)
    if out.suffix != ".toml":
        raise UserError(f"-o {args.output}: a profile is a .toml file")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device on this machine")
    req = CalibrateRequest(args.world_size, args.device, out, args.name or out.stem)
    profile, text = calibrate(req.world_size, req.device, req.name)
    req.output.parent.mkdir(parents=True, exist_ok=True)
    write_profile(text, str(req.output))
    ic = profile.interconnect
    print(f"device {profile.device}: matmul {profile.peak_flops_per_s['float32'] / 1e9:.1f} GFLOP/s fp32, "
          f"{profile.peak_flops_per_s['bfloat16'] / 1e9:.1f} GFLOP/s bf16; copy {profile.memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s; "
          f"memory {format_bytes(profile.memory_bytes)}")
    print(f"collectives over {req.world_size} ranks: latency {ic.intra_node_latency_s * 1e6:.1f} us per step, "
          f"busbw {ic.intra_node_busbw_bytes_per_s / 1e9:.3f} GB/s")
    print(f"overheads: {profile.per_op_overhead_s * 1e6:.1f} us per op, {profile.per_unit_overhead_s * 1e3:.2f} ms per "
          f"FSDP unit and step, {profile.per_param_tensor_optimizer_overhead_s * 1e6:.0f} us per optimizer tensor")
    print(f"wrote {req.output}")
    return 0
