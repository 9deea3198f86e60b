"""The GPU kernel model against one device: time kernels of training shapes there, price them here.

Two modes, so the device machine only measures:

    python benchmarks/gpu_kernels.py measure --out OUT/kernels.json        # on the GPU (benchmarks/gpu_check.sh)
    python benchmarks/gpu_kernels.py report OUT/kernels.json [--profile h200]   # anywhere, no GPU

``measure`` times, with CUDA events around ``reps`` back-to-back calls after a warm-up (the median of
three such batches; random operands, never zeros), the kernels a transformer's training step runs:

- GEMMs of the Linear layers of widths 768-4096 (QKV, output, MLP up and down, the vocabulary head) at
  2k-32k tokens, in the three operand layouts a Linear runs (forward x @ W^T "kk", input gradient
  dY @ W "kn", weight gradient dY^T @ X "mn": cost/kernels.py [Note: matmul layouts]), and square GEMMs;
- ``scaled_dot_product_attention`` (causal, bf16) at sequences 512-16384, head dims 64 and 128, forward
  alone and forward + backward (the backward is the difference);
- memory-bound kernels (add, GELU, SiLU, LayerNorm, RMSNorm, softmax, the fp32 cross-entropy of a
  vocabulary head, a bf16 -> fp32 cast, the foreach AdamW step), with the bytes they must move;
- the device gap between kernels (CUDA-graph replay of tiny kernels) and the host's cost per eager op.

``report`` prices every sample with the cost model's own functions (cost/kernels.py ``matmul_time_s``,
``attention_time_s``, ``memory_bound_time_s``) on the profile's ``[kernels]`` table and prints predicted
vs measured per class, writing reports/benchmarks/gpu_kernels.{csv,md}.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shard_planner.execute.kernel_timing import events_s  # noqa: E402  (after the path insert)

WIDTHS = (768, 1024, 2048, 4096)
TOKENS = (2048, 8192, 32768)
VOCAB = 50368  # MPT's vocabulary (../shared/data/published_fsdp_runs.csv)
SQUARE = (512, 1024, 2048, 4096, 8192)
ATTENTION = [(s, d) for s in (512, 1024, 2048, 4096, 8192, 16384) for d in (64, 128)]
ATTENTION_TOKENS = 32768  # batch x sequence of each attention sample
ATTENTION_WIDTH = 2048  # heads x head dim
LAYOUTS = ("kk", "kn", "mk", "mn")  # cost/kernels.py MATMUL_LAYOUTS order


def linear_gemms() -> list[tuple[int, int, int, int]]:
    """(M, N, K, layout index) of each Linear's forward, input gradient and weight gradient."""
    out = []
    for d in WIDTHS:
        for t in TOKENS:
            for n_out, n_in in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d)):
                out += [(t, n_out, n_in, 0), (t, n_in, n_out, 1), (n_out, n_in, t, 3)]
        t = TOKENS[1]
        out += [(t, VOCAB, d, 0), (t, d, VOCAB, 1), (VOCAB, d, t, 3)]
    return out + [(n, n, n, 1) for n in SQUARE]


# ---- measure (on the GPU) ----

def _reps(flops: float, rate: float = 4e14) -> int:
    """Enough calls that a batch runs ~20 ms at ``rate``, at least 3, at most 200."""
    return int(min(200, max(3, 0.02 / max(flops / rate, 1e-7))))


def measure_gemms(dtype) -> list[dict]:
    import torch

    from shard_planner.execute.calibrate_kernels import layout_operands

    rows = []
    for m, n, k, layout in linear_gemms():
        a, b = layout_operands(m, n, k, layout, torch.device("cuda"), dtype)
        t = events_s(lambda: a @ b, _reps(2 * m * n * k))
        rows.append(dict(kind="matmul", m=m, n=n, k=k, layout=LAYOUTS[layout], time_s=t))
    return rows


def measure_attention(dtype) -> list[dict]:
    import torch
    import torch.nn.functional as F

    rows = []
    for s, d in ATTENTION:
        b, h = max(1, ATTENTION_TOKENS // s), ATTENTION_WIDTH // d
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, s, d, device="cuda", dtype=dtype)
        flops = 4.0 * b * h * s * s * d
        fwd = events_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), _reps(flops, 2e14))

        def both():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

        total = events_s(both, _reps(3.5 * flops, 2e14))
        rows.append(dict(kind="attention", batch=b, heads=h, seq=s, head_dim=d, causal=1, fwd_s=fwd,
                         bwd_s=max(total - fwd, 1e-9)))
    return rows


def measure_memory_bound() -> list[dict]:
    """(name, op class as the trace records it, bytes read + written, time)."""
    import torch
    import torch.nn.functional as F

    rows = []
    n_tok, d = 16384, 2048
    x = torch.randn(n_tok, d, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n_tok, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    e = x.numel() * 2
    cases = {
        "add bf16": ("elementwise", lambda: x + y, 3 * e),
        "gelu bf16": ("elementwise", lambda: F.gelu(x), 2 * e),
        "silu bf16": ("elementwise", lambda: F.silu(x), 2 * e),
        "layer_norm bf16": ("reduction", lambda: F.layer_norm(x, (d,), w, w), 2 * e),
        "rms_norm bf16": ("reduction", lambda: F.rms_norm(x, (d,), w), 2 * e),
        "softmax bf16": ("reduction", lambda: torch.softmax(x, -1), 2 * e),
        "cast bf16->fp32": ("copy", lambda: x.float(), 3 * e),
    }
    for name, (cls, fn, nbytes) in cases.items():
        rows.append(dict(kind="memory", name=name, op_class=cls, bytes=nbytes, time_s=events_s(fn, 400)))
    logits = torch.randn(8192, VOCAB, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, VOCAB, (8192,), device="cuda")

    def ce():
        F.cross_entropy(logits.float(), target).backward()

    # fp32 upcast (read 2, write 4), log-softmax forward (read 4, write 4), backward (read 4 + 4, write 4),
    # cast back to the bf16 gradient (read 4, write 2): 36 bytes per logit
    rows.append(dict(kind="memory", name="cross_entropy fwd+bwd (fp32)", op_class="loss",
                     bytes=36 * logits.numel(), time_s=events_s(ce, 10)))
    params = [torch.randn(4096, 4096, device="cuda", requires_grad=True) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    n = sum(p.numel() for p in params)
    for impl in ("foreach", "fused"):  # foreach: torch's CUDA default (optim/optimizer.py _default_to_fused_or_foreach)
        opt = torch.optim.AdamW(params, lr=1e-4, **{impl: True})
        rows.append(dict(kind="optimizer", name=f"AdamW {impl}, {len(params)} tensors", elements=n,
                         tensors=len(params), time_s=events_s(opt.step, 10)))
    return rows


def measure_launch() -> list[dict]:
    import torch

    from shard_planner.execute.kernel_timing import LAUNCH_KERNELS, tiny_kernel_graph

    gap = events_s(tiny_kernel_graph(torch.device("cuda")).replay, 20) / LAUNCH_KERNELS
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5000):
        x.add_(1)
    host = (time.perf_counter() - t0) / 5000
    torch.cuda.synchronize()
    return [dict(kind="launch", name="device gap per kernel (graph replay)", time_s=gap),
            dict(kind="launch", name="host per eager op (x.add_(1))", time_s=host)]


def measure_host() -> list[dict]:
    """What CPU offload runs on (cost/time.py): the host's copy bandwidth and its AdamW step with the
    threads one rank gets here (execute/launch.py threads_per_rank), pinned host <-> device copies."""
    import torch

    from shard_planner.cost.host_share import threads_per_rank, usable_cores
    from shard_planner.execute.kernel_timing import fastest_host_s

    def host_s(fn) -> float:  # the fastest of 3 host-clock calls after a warm-up, the device synchronised
        return fastest_host_s(fn, torch.device("cuda" if torch.cuda.is_available() else "cpu"), 3)

    threads = threads_per_rank(1, usable_cores())
    torch.set_num_threads(threads)
    n = 256 * 2**20  # 1 GiB of fp32
    src, dst = torch.randn(n), torch.empty(n)
    rows = [dict(kind="host", name=f"host copy, {threads} threads", bytes=8 * n, time_s=host_s(lambda: dst.copy_(src)))]
    params = [torch.randn(4096, 4096, requires_grad=True) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    for impl in ("foreach", "single-tensor"):  # CPU default: single-tensor (optim/optimizer.py, CUDA-only foreach)
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=impl == "foreach")
        rows.append(dict(kind="host_optimizer", name=f"CPU AdamW {impl}, {threads} threads", elements=16 * 4096 * 4096,
                         tensors=16, time_s=host_s(opt.step)))
    if not torch.cuda.is_available():
        return rows
    pinned = torch.empty(n, pin_memory=True)
    dev = torch.empty(n, device="cuda")
    rows.append(dict(kind="pcie", name="pinned host -> device", bytes=4 * n, time_s=host_s(lambda: dev.copy_(pinned))))
    rows.append(dict(kind="pcie", name="device -> pinned host", bytes=4 * n, time_s=host_s(lambda: pinned.copy_(dev))))
    return rows


def warm_clocks(seconds: float = 2.0) -> None:
    """Back-to-back 8192^3 GEMMs, so that the SM clock has left its idle state before any sample
    (nvidia-smi read 345 MHz idle on this project's H200)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def attention_kernels() -> list[str]:
    """The CUDA kernels one causal bf16 SDPA forward + backward runs (which backend PyTorch chose)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})


def measure(out: Path, only: list[str] | None = None) -> None:
    import torch

    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    meta = dict(device=torch.cuda.get_device_name(0), sm_count=props.multi_processor_count, torch=torch.__version__,
                cuda=torch.version.cuda, when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    rows: list[dict] = []
    warm_clocks()
    try:
        meta["attention_kernels"] = attention_kernels()
    except Exception as exc:
        print(f"!! attention kernels not recorded: {type(exc).__name__}: {exc}")
    sweeps = (("launch", measure_launch), ("gemm", lambda: measure_gemms(torch.bfloat16)),
              ("memory", measure_memory_bound), ("attention", lambda: measure_attention(torch.bfloat16)),
              ("host", measure_host))
    for what, fn in sweeps if not only else [s for s in sweeps if s[0] in only]:
        t0 = time.perf_counter()
        try:
            rows += fn()
        except Exception as exc:  # keep what the other sweeps measured
            print(f"!! {what} sweep failed: {type(exc).__name__}: {exc}")
        print(f"{what} sweep: {time.perf_counter() - t0:.1f} s")
        out.write_text(json.dumps(dict(meta=meta, samples=rows), indent=1) + "\n")
    print(f"{len(rows)} samples -> {out}")


# ---- report (anywhere) ----

def price(rows: list[dict], profile_name: str) -> list[dict]:
    """Each measured sample beside the cost model's time for it on ``profile_name``."""
    from shard_planner.cost.kernels import (KernelOp, attention_time_s, device_of, matmul_time_s,
                                            memory_bound_time_s)
    from shard_planner.cost.optimizer import optimizer_step_bytes
    from shard_planner.execute.calibrate_kernels import attention_ops, matmul_op
    from shard_planner.hardware.profile import load_profile

    profile = load_profile(profile_name)
    dev = device_of(profile, "bfloat16")
    out = []
    for r in rows:
        if r.get("op_class") == "optimizer":  # the first run's format: 28 bytes per element recorded
            r = dict(r, kind="optimizer", elements=r["bytes"] // 28)
        if r["kind"] == "matmul":
            op = matmul_op(r["m"], r["n"], r["k"], 2, LAYOUTS.index(r["layout"]))
            out.append(dict(cls=f"matmul {r['layout']}", what=f"{r['m']}x{r['n']}x{r['k']}", measured_s=r["time_s"],
                            predicted_s=matmul_time_s(op, dev), tflops=op.flops / r["time_s"] / 1e12))
        elif r["kind"] == "attention":
            fwd, bwd = attention_ops(r["batch"] * r["heads"], r["seq"], r["head_dim"], r["causal"], 2)
            what = f"b{r['batch']} h{r['heads']} s{r['seq']} d{r['head_dim']}"
            causal = (r["seq"] + 128) / (2 * r["seq"])  # the kernel's work over the full count (FA2 tiles of 128)
            out.append(dict(cls="attention fwd", what=what, measured_s=r["fwd_s"],
                            predicted_s=attention_time_s(fwd, dev, False), tflops=fwd.flops * causal / r["fwd_s"] / 1e12))
            out.append(dict(cls="attention bwd", what=what, measured_s=r["bwd_s"],
                            predicted_s=attention_time_s(bwd, dev, True), tflops=bwd.flops * causal / r["bwd_s"] / 1e12))
        elif r["kind"] == "memory":
            op = KernelOp(r["op_class"], 1, 0.0, float(r["bytes"]))
            out.append(dict(cls=r["op_class"], what=r["name"], measured_s=r["time_s"],
                            predicted_s=memory_bound_time_s(op, dev), tflops=r["bytes"] / r["time_s"] / 1e12))
        elif r["kind"] == "optimizer":  # as cost/time.py prices the step: foreach bytes / bandwidth + per tensor
            nbytes = optimizer_step_bytes("adamw", r["elements"], 4)
            pred = nbytes / profile.memory_bandwidth_bytes_per_s + r["tensors"] * profile.per_param_tensor_optimizer_overhead_s
            out.append(dict(cls="optimizer", what=r["name"], measured_s=r["time_s"], predicted_s=pred,
                            tflops=nbytes / r["time_s"] / 1e12))
        elif r["kind"] == "host_optimizer":  # CPU offload: cost/time.py prices the step at the host's bandwidth
            nbytes = optimizer_step_bytes("adamw", r["elements"], 4)
            bw = profile.host_memory_bandwidth_bytes_per_s or profile.memory_bandwidth_bytes_per_s
            out.append(dict(cls="host optimizer", what=r["name"], measured_s=r["time_s"],
                            predicted_s=nbytes / bw + r["tensors"] * profile.per_param_tensor_optimizer_overhead_s,
                            tflops=nbytes / r["time_s"] / 1e12))
        elif r["kind"] in ("host", "pcie"):
            bw = (profile.host_to_device_bytes_per_s if r["kind"] == "pcie"
                  else profile.host_memory_bandwidth_bytes_per_s or profile.memory_bandwidth_bytes_per_s)
            out.append(dict(cls=r["kind"], what=r["name"], measured_s=r["time_s"], predicted_s=r["bytes"] / bw,
                            tflops=r["bytes"] / r["time_s"] / 1e12))
        else:  # launch
            ref = dev.kernels.kernel_launch_s if "gap" in r["name"] else profile.per_op_overhead_s
            out.append(dict(cls="launch", what=r["name"], measured_s=r["time_s"], predicted_s=ref, tflops=None))
    for r in out:
        r["error_pct"] = round((r["predicted_s"] / r["measured_s"] - 1) * 100, 1)
    return out


LARGE_GEMM_S = 100e-6  # GEMMs this long are device-bound; shorter eager calls wait on the host (~7-12 us each)


def implied_constants(rows: list[dict], profile_name: str) -> dict:
    """The device constants these samples imply, the rest of the profile kept: each the closed form that
    `shard-planner calibrate` uses (execute/calibrate_kernels.py), over the samples of its class.

    - ``sustained_clock_fraction``: the log mean of (time at fraction 1) / measured over the GEMMs that run
      at least LARGE_GEMM_S (the clock they hold back to back; the tile model sets the shape factor);
    - ``attention_fwd_efficiency`` / ``..._bwd_...``: the least-squares 1/efficiency (time is affine in it),
      the profile's block, tile overhead and head-dim ratio kept;
    - ``memory_efficiency``: the median achieved bytes/s of the elementwise, norm, softmax and cast kernels
      over the profile's bandwidth."""
    from dataclasses import replace as dc_replace

    from shard_planner.cost.kernels import Device, attention_time_s, device_of, matmul_time_s
    from shard_planner.execute.calibrate_kernels import _affine_eff, _closed_form_eff, attention_ops, matmul_op
    from shard_planner.hardware.profile import load_profile

    profile = load_profile(profile_name)
    dev = device_of(profile, "bfloat16")
    kc1 = dc_replace(dev.kernels, sustained_clock_fraction=1.0)
    at_one = Device(kc1, dev.peak_flops_per_s, dev.bandwidth_bytes_per_s)
    gemms = [r for r in rows if r["kind"] == "matmul" and r["time_s"] >= LARGE_GEMM_S]
    ops = [matmul_op(r["m"], r["n"], r["k"], 2, LAYOUTS.index(r["layout"])) for r in gemms]
    out = {}
    if gemms:
        out["sustained_clock_fraction"] = _closed_form_eff([matmul_time_s(o, at_one) for o in ops],
                                                           [r["time_s"] for r in gemms])
    att = [r for r in rows if r["kind"] == "attention"]
    for d, backward in (("fwd", False), ("bwd", True)) if att else ():
        name = f"attention_{d}_efficiency"
        times = {}
        for eff in (1.0, 0.5):
            dv = Device(dc_replace(dev.kernels, **{name: eff}), dev.peak_flops_per_s, dev.bandwidth_bytes_per_s)
            times[eff] = [attention_time_s(attention_ops(r["batch"] * r["heads"], r["seq"], r["head_dim"], r["causal"], 2)
                                           [int(backward)], dv, backward) for r in att]
        out[name] = _affine_eff(times[1.0], times[0.5], [r[f"{d}_s"] for r in att])
    mem = [r["bytes"] / r["time_s"] for r in rows if r["kind"] == "memory" and r["op_class"] in MEMORY_CLASSES]
    if mem:
        out["memory_efficiency"] = statistics.median(mem) / profile.memory_bandwidth_bytes_per_s
    return out


MEMORY_CLASSES = ("elementwise", "reduction", "copy")


def report(path: Path, profile_name: str, name: str | None = None) -> None:
    from common import OUT_DIR, print_table, write_csv

    from shard_planner.fileio import write_atomic

    data = json.loads(path.read_text())
    rows = price(data["samples"], profile_name)
    meta = data["meta"]
    out = io.StringIO()
    print(f"# GPU kernels: the cost model ({profile_name}) vs one device\n\nCommand: `python benchmarks/gpu_kernels.py "
          f"report {path}`; measured by `benchmarks/gpu_check.sh` on {meta['device']} ({meta['sm_count']} SMs), "
          f"torch {meta['torch']}, CUDA {meta['cuda']}, {meta['when']}. Error = predicted / measured - 1. GEMMs under "
          "~12 us wait on the host (one eager call each); the model prices that apart (per_op_overhead_s).", file=out)
    if meta.get("attention_kernels"):
        print("\nSDPA (causal, bf16) ran: " + ", ".join(k for k in meta["attention_kernels"] if "sdpa" in k or "flash" in k),
              file=out)
    table = [dict(what=r["what"], cls=r["cls"], measured_us=round(r["measured_s"] * 1e6, 2),
                  predicted_us=round(r["predicted_s"] * 1e6, 2), error_pct=r["error_pct"],
                  achieved=None if r["tflops"] is None else round(r["tflops"], 1)) for r in rows]
    print_table(table, title="per sample (achieved: TFLOP/s, or TB/s for memory-bound kernels)", stream=out)
    classes = sorted({r["cls"] for r in rows})
    summary = []
    for c in classes:
        errs = [r["error_pct"] for r in rows if r["cls"] == c]
        summary.append(dict(cls=c, samples=len(errs), median_signed_pct=round(statistics.median(errs), 1),
                            median_abs_pct=round(statistics.median(abs(e) for e in errs), 1),
                            worst_pct=max(errs, key=abs)))
    print_table(summary, title=f"per class, profile {profile_name}", stream=out)
    implied = implied_constants(data["samples"], profile_name)
    print(f"\nConstants these samples imply (the rest of {profile_name} kept; closed forms of "
          "execute/calibrate_kernels.py):\n", file=out)
    for k, v in implied.items():
        print(f"- {k} = {v:.4g}", file=out)
    print(out.getvalue())
    name = name or f"gpu_kernels_{profile_name}"
    write_csv(table, name)
    write_csv(summary, f"{name}_summary")
    write_atomic(OUT_DIR / f"{name}.md", out.getvalue())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    m = sub.add_parser("measure", help="time the kernels on this machine's GPU")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--only", nargs="*", choices=("launch", "gemm", "memory", "attention", "host"),
                   help="these sweeps only (default: all)")
    r = sub.add_parser("report", help="price a measure's samples with a profile")
    r.add_argument("samples", type=Path)
    r.add_argument("--profile", default="h200")
    r.add_argument("--name", help="report files' name under reports/benchmarks (default gpu_kernels_PROFILE)")
    args = parser.parse_args(argv)
    if args.mode == "measure":
        measure(args.out, args.only)
    else:
        report(args.samples, args.profile, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
