"""Benchmark: trace time and peak RSS of ``trace_model`` for Llama-style 8B and 70B at sequence 4096.

Each case runs in a fresh subprocess (so ``ru_maxrss`` is that case's own peak). Compared against:

- building the same model for real: the bytes its parameters take as built (fp32), and the 16 bytes
  per parameter of mixed-precision AdamW training state (ZeRO, Rajbhandari et al. 2020, §3.1) — neither
  fits this machine;
- ONE FSDPMemTracker estimate of the 8B model under FakeTensorMode at world size 8 with the fake
  process group (torch.testing._internal.distributed.fake_pg.FakeStore): fully_shard per block and
  root, bf16 mixed precision, one warm-up step (creates the optimizer states) and one tracked step.
  It takes tens of seconds; ``--quick`` skips it.

    python benchmarks/bench_trace.py [--quick] [--out reports/benchmarks/trace]

Prints a table and writes ``<out>.csv`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "examples" / "llama.py"
TARGET_S = {"8b": 5.0, "70b": 15.0}
TARGET_RSS_BYTES = 1.5 * 2**30
ZERO_MIXED_ADAM_BYTES_PER_PARAM = 16  # ZeRO §3.1: 2 (bf16 param) + 2 (bf16 grad) + 12 (fp32 master, m, v)

_TRACE_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from shard_planner.trace import trace_model
t1, c1 = time.perf_counter(), time.process_time()
trace = trace_model(sys.argv[1])
t2, c2 = time.perf_counter(), time.process_time()
warm = trace_model(sys.argv[1]).trace_seconds  # torch's lazy imports for FakeTensorMode are done now
root = trace.module("")
print(json.dumps({
    "import_s": t1 - t0, "trace_s": trace.trace_seconds, "cpu_s": c2 - c1, "wall_s": t2 - t0, "warm_s": warm,
    "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "params": trace.param_count, "param_bytes": sum(m.param_bytes for m in trace.modules),
    "reused_modules": trace.reused_modules, "modules": len(trace.modules),
    "saved_bytes_b1": trace.subtree_sum("", "saved_bytes_self").at(1),
    "fwd_peak_rise_bytes_b1": root.fwd_peak_rise_bytes.at(1),
}))
"""

_TRACKER_CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
t0 = time.perf_counter()
import torch, torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore
from shard_planner.model.modelfile import load_model_file
world = int(sys.argv[2])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
mesh = init_device_mesh("cpu", (world,))  # outside FakeTensorMode (DESIGN.md)
mf = load_model_file(sys.argv[1])
t1, c1 = time.perf_counter(), time.process_time()
with FakeTensorMode():
    model = mf.build()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)  # foreach over-reports (DESIGN.md)
    inputs, targets = mf.batch(1)
    def step():
        loss = mf.loss(model(*inputs), targets)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad()
    step()  # optimizer states exist from here on
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs(inputs)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({
    "setup_s": t1 - t0, "estimate_s": t2 - t1, "cpu_s": c2 - c1, "wall_s": t2 - t0,
    "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "peak_bytes": int(peak["Total"]), "peak_by_kind": {str(k): int(v) for k, v in peak.items()},
}))
"""


def _child(code: str, *args: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark case failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env(size: str) -> dict:
    env = dict(os.environ, SHARD_PLANNER_SIZE=size, SHARD_PLANNER_SEQ="4096")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip the FSDPMemTracker estimate (tens of seconds)")
    parser.add_argument("--out", default=str(ROOT / "reports" / "benchmarks" / "trace"),
                        help="output path without extension (default: reports/benchmarks/trace)")
    parser.add_argument("--world-size", type=int, default=8, help="world size of the FSDPMemTracker estimate")
    args = parser.parse_args(argv)

    rows = []
    for size in ("8b", "70b"):
        r = _child(_TRACE_CHILD, str(LLAMA), env=_env(size))
        rows.append({
            "case": f"shard-planner trace, Llama {size.upper()}, seq 4096",
            "seconds": round(r["trace_s"], 2),
            "cpu_seconds": round(r["cpu_s"], 2),
            "warm_seconds": round(r["warm_s"], 2),
            "process_seconds": round(r["wall_s"], 2),
            "max_rss_bytes": r["max_rss_bytes"],
            "target": f"< {TARGET_S[size]:g} s, < 1.5 GiB RSS",
            "meets_target": r["trace_s"] < TARGET_S[size] and r["max_rss_bytes"] < TARGET_RSS_BYTES,
            "notes": f"{r['params']:,} params, {r['reused_modules']}/{r['modules']} modules reused; "
                     f"saved activations at b=1 {_gib(r['saved_bytes_b1'])}",
        })
        rows.append({
            "case": f"build Llama {size.upper()} for real (no trace)",
            "seconds": "",
            "cpu_seconds": "",
            "warm_seconds": "",
            "process_seconds": "",
            "max_rss_bytes": r["param_bytes"],
            "target": "",
            "meets_target": "",
            "notes": f"fp32 parameters as built {_gib(r['param_bytes'])}; training state "
                     f"{_gib(ZERO_MIXED_ADAM_BYTES_PER_PARAM * r['params'])} (16 B/param, ZeRO): does not fit",
        })
    if not args.quick:
        r = _child(_TRACKER_CHILD, str(LLAMA), str(args.world_size), env=_env("8b"))
        rows.append({
            "case": f"FSDPMemTracker fake-mode estimate, Llama 8B, seq 4096, world {args.world_size}",
            "seconds": round(r["estimate_s"], 2),
            "cpu_seconds": round(r["cpu_s"], 2),
            "warm_seconds": "",
            "process_seconds": round(r["wall_s"], 2),
            "max_rss_bytes": r["max_rss_bytes"],
            "target": "",
            "meets_target": "",
            "notes": f"one configuration (block units, bf16); peak per rank {_gib(r['peak_bytes'])}",
        })

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cols = ["case", "seconds", "cpu_seconds", "warm_seconds", "process_seconds", "max_rss_bytes", "target", "meets_target", "notes"]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = dict(r, max_rss_bytes=_gib(r["max_rss_bytes"]) if r["max_rss_bytes"] != "" else "")
        md.append("| " + " | ".join(str(cells[c]) for c in cols) + " |")
    header = (f"# Tracer benchmark\n\nMachine: {os.cpu_count()} CPUs; torch under FakeTensorMode; "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
              f"{os.getloadavg()[0]:.1f} at the end. `seconds`: wall time of the trace (or estimate) itself, "
              f"the first in a fresh process (it includes ~2.5 s CPU of torch's one-time FakeTensorMode set-up); "
              f"`cpu_seconds`: its CPU time (less sensitive to other load); `warm_seconds`: a second trace in "
              f"the same process; `process_seconds`: the whole "
              f"subprocess with imports. `max_rss_bytes` of the build rows is the memory the parameters alone "
              f"would need.\n\n")
    out.with_suffix(".md").write_text(header + "\n".join(md) + "\n")
    width = max(len(r["case"]) for r in rows)
    for r in rows:
        secs = (f"{r['seconds']:>6} s (cpu {r['cpu_seconds']:>5} s, warm {r['warm_seconds'] or '-':>5} s)"
                if r["seconds"] != "" else " " * 35)
        rss = _gib(r["max_rss_bytes"]) if r["max_rss_bytes"] != "" else ""
        print(f"{r['case']:<{width}}  {secs}  {rss:>12}  {r['notes']}")
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
