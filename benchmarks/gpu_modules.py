"""Per-module compute timings that calibrate the time model (benchmarks/gpu_check.sh).

Runs one forward of the model (params in the compute dtype, as FSDP2's MixedPrecisionPolicy computes)
to capture each selected module's real inputs, then times each module alone: forward, and backward
from a random output gradient, each the median of ``--reps`` runs (CUDA events on GPU, wall clock on
CPU), with FLOPs counted by ``torch.utils.flop_counter.FlopCounterMode`` and the achieved FLOP/s. The
last row is the fp32 cross-entropy loss over the logits. Writes the numbers as JSON.

    SHARD_PLANNER_SIZE=1b python benchmarks/gpu_modules.py --device cuda --out OUT/module_times.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shard_planner.model.modelfile import load_model_file  # noqa: E402

MODEL = str(ROOT / "examples" / "llama.py")
MODULES = ("tok_embeddings", "layers.0", "layers.0.attention_norm", "layers.0.attention",
           "layers.0.feed_forward", "norm", "output")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _timer(device: torch.device):
    def time_it(fn) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return time_it


def _flops(fn) -> int:
    """FLOPs of ``fn`` by FlopCounterMode; 0 (shown as '-') where it cannot count them: torch 2.11's SDPA
    formula rejects grouped-query shapes (seen on an H200 machine), which torch 2.13 counts."""
    try:
        with FlopCounterMode(display=False) as counter:
            fn()
    except AssertionError as exc:
        print(f"no FLOP count: {exc}")
        return 0
    return counter.get_total_flops()


def _fresh(args):
    """The captured inputs again; the first floating one (the activation) as a leaf that needs grad, as
    in training (the rotary cos/sin of a block need none)."""
    out, first = [], True
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and first:
            a, first = a.detach().requires_grad_(True), False
        out.append(a)
    return tuple(out)


def time_module(name, fn_args, module, reps, time_it):
    def forward():
        return module(*_fresh(fn_args))

    out = forward()
    grad = torch.randn_like(out)
    for _ in range(2):  # warm-up: kernels chosen, caches filled
        forward().backward(grad)
    fwd = [time_it(lambda: forward()) for _ in range(reps)]
    bwd = []
    for _ in range(reps):
        y = forward()
        bwd.append(time_it(lambda: y.backward(grad)))
    fwd_flops = _flops(forward)
    y = forward()
    bwd_flops = _flops(lambda: y.backward(grad))
    return _row(name, statistics.median(fwd), statistics.median(bwd), fwd_flops, bwd_flops)


def _row(name, fwd_s, bwd_s, fwd_flops, bwd_flops):
    return {"module": name, "fwd_s": fwd_s, "bwd_s": bwd_s, "fwd_flops": fwd_flops, "bwd_flops": bwd_flops,
            "fwd_flops_per_s": fwd_flops / fwd_s if fwd_s else None,
            "bwd_flops_per_s": bwd_flops / bwd_s if bwd_s else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, help="default: the model file's TRAINING micro_batch")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    device = torch.device(args.device)
    mf = load_model_file(MODEL)
    torch.manual_seed(0)
    with torch.device(device):
        model = mf.build()
    model.to(DTYPES[args.dtype])
    mb = args.micro_batch or mf.training.get("micro_batch", 1)
    inputs, targets = mf.batch(mb)
    inputs, targets = tuple(t.to(device) for t in inputs), targets.to(device)

    captured = {}
    handles = [model.get_submodule(name).register_forward_pre_hook(
        lambda mod, a, name=name: captured.setdefault(name, tuple(
            x.detach().clone() if isinstance(x, torch.Tensor) else x for x in a)))
        for name in MODULES]
    with torch.no_grad():
        logits = model(*inputs)
    for h in handles:
        h.remove()

    time_it = _timer(device)
    rows = [time_module(name, captured[name], model.get_submodule(name), args.reps, time_it) for name in MODULES]
    logits = logits.detach()

    def loss_fwd():
        logits.grad = None  # no accumulation kernel in the timings
        return mf.loss(logits.requires_grad_(True), targets)

    loss_fwd().backward()
    fwd = [time_it(loss_fwd) for _ in range(args.reps)]
    bwd = []
    for _ in range(args.reps):
        loss = loss_fwd()
        bwd.append(time_it(loss.backward))
    loss = loss_fwd()
    rows.append(_row("loss (fp32 cross-entropy)", statistics.median(fwd), statistics.median(bwd),
                     _flops(loss_fwd), _flops(lambda: loss.backward())))

    name = device.type if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"per-module compute, {name}, {args.dtype}, micro-batch {mb}, seq {mf.training.get('seq_len')}, "
          f"median of {args.reps}")
    print(f"{'module':28} {'fwd ms':>9} {'bwd ms':>9} {'fwd GFLOP':>10} {'bwd GFLOP':>10} {'fwd TFLOP/s':>12} {'bwd TFLOP/s':>12}")
    for r in rows:
        tf = lambda v: f"{v / 1e12:12.1f}" if v else f"{'-':>12}"  # noqa: E731
        print(f"{r['module']:28} {r['fwd_s'] * 1e3:9.3f} {r['bwd_s'] * 1e3:9.3f} {r['fwd_flops'] / 1e9:10.2f} "
              f"{r['bwd_flops'] / 1e9:10.2f} {tf(r['fwd_flops_per_s'])} {tf(r['bwd_flops_per_s'])}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": name, "dtype": args.dtype, "micro_batch": mb,
                                          "seq_len": mf.training.get("seq_len"), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
