"""The CUDA caching allocator on a GPU against its simulation (issue 29, build item 4; benchmarks/gpu_check.sh step 8).

    SHARD_PLANNER_SIZE=1b python benchmarks/gpu_allocator.py measure --out OUT/allocator        # on the GPU
    SHARD_PLANNER_SIZE=tiny python benchmarks/gpu_allocator.py measure --device cpu --out /tmp/a  # rehearsal
    python benchmarks/gpu_allocator.py report OUT/allocator [--md FILE]                         # anywhere

``measure`` takes a few plans of examples/llama.py (``CASES``: the per-block plan of benchmarks/gpu_plans.py,
the planner's plan for --mem 24GB made now, and on a GPU the one it made on 2026-12-04 under the old 8% rule),
predicts each with the cost model here (cost/fits.py, cost/reserved.py: the reserved peak in both allocator
modes, the smallest memory without retries, and the smallest ``set_per_process_memory_fraction`` cap the two
steps survive, by replaying the simulated calls: cost/allocator_replay.py), then for each allocator mode
starts one process (the mode is read when CUDA starts: ``PYTORCH_ALLOC_CONF``) that
  1. records the allocator's history (``torch.cuda.memory._record_memory_history``) from before the model is
     built, trains ``--steps`` steps, and saves the snapshot (``torch.cuda.memory._snapshot()``: segments per
     stream and the trace of every alloc and free), ``torch.cuda.memory_stats()`` (``reserved_bytes.all.peak``,
     ``num_alloc_retries``, ...), the device memory outside the allocator (``mem_get_info`` less reserved)
     and the allocator configuration the process ran with;
  2. in the plan's own mode only, sweeps ``set_per_process_memory_fraction`` at the predicted cap x
     ``FACTORS`` and at the plan's --mem (less the measured outside memory), building the model afresh at
     each cap and training ``--steps`` steps: pass or OOM (and where), ``num_alloc_retries`` after each step,
     step times (CUDA events), the reserved peak.
Results go to ``OUT/<case>/``: ``case.json`` (plan and prediction), ``<mode>.json``, ``snapshot-<mode>.pickle``.

``report`` replays every recorded trace through the simulator (``events_from_snapshot`` + ``replay``): the
simulator alone must match the measured reserved peak to the page; it puts the walk's prediction beside it,
and the sweep: where the real step runs out of memory against the predicted cap, and what retries cost.

``--device cpu`` rehearses all of it without CUDA: gloo, no cap, no memory statistics, and the snapshot is
written from the simulation's own calls (so the replay path runs and must match exactly).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = str(ROOT / "examples" / "llama.py")
PROFILE = "h200"
FACTORS = (0.95, 1.0, 1.02, 1.05, 1.1)  # x the predicted smallest cap (issue 29, build item 4)
MODES = {"expandable": True, "default": False}  # file stem -> expandable_segments
CONF = {True: "expandable_segments:True", False: "expandable_segments:False"}
OLD_PLAN = ROOT / "benchmarks" / "data" / "h200_2026-12-04" / "planner" / "llama1b-24GB.json"
CASES = ("planner-24GB", "per-block", "planner-24GB-2026-12-04")  # in order of priority
MAX_ENTRIES = 2_000_000  # the history's ring buffer: far above a few steps of a 1B model
MiB, GiB = 2**20, 2**30


# ---- the cases and their predictions (here, before any run) ----

def make_case(name: str, device: str):
    """The plan of case ``name`` (None: not on this device), with its model file here."""
    from shard_planner.plan import load_plan

    if name == "per-block":
        from gpu_plans import make_plans

        return make_plans(MODEL, PROFILE, 141 * GiB)["per-block"]
    if name == "planner-24GB":
        return _planner_plan(24 * GiB)
    if name == "planner-24GB-2026-12-04" and device == "cuda":
        plan = load_plan(OLD_PLAN)
        return replace(plan, model=replace(plan.model, path=MODEL, relative_path=None))
    return None


@functools.lru_cache(maxsize=1)
def _cost_model():
    """The example's trace (at SHARD_PLANNER_SIZE) priced on the profile: traced once per measure."""
    from shard_planner.cost import CostModel
    from shard_planner.hardware.profile import load_profile
    from shard_planner.trace import trace_model

    return CostModel(trace_model(MODEL), load_profile(PROFILE))


def _planner_plan(mem_bytes: int):
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.solve import PlanRequest, plan_model

    mf, cm = load_model_file(MODEL), _cost_model()
    request = PlanRequest(gpus=1, gpus_per_node=1, mem_budget_bytes=mem_bytes, profile=cm.profile,
                          micro_batch=int(mf.training.get("micro_batch", 1)), model_path=MODEL, profile_name=PROFILE)
    return plan_model(cm.trace, request).plan


def predict(plan) -> dict:
    """What the cost model says of ``plan`` on its --mem, in both allocator modes (bytes)."""
    from shard_planner.cost.allocator_replay import CapKind, smallest_surviving_cap
    from shard_planner.cost.fits import device_fit

    cm = _cost_model()
    est = cm.estimate(plan, timeline=False)
    out = {"allocated_peak_bytes": est.memory.peak_bytes - est.memory.memory_at_peak.get("overhead", 0),
           "outside_bytes": est.memory.memory_at_peak.get("overhead", 0), "modes": {}}
    for stem, expandable in MODES.items():
        p = replace(plan, cluster=replace(plan.cluster, expandable_segments=expandable))
        fit, events = device_fit(cm, p), cm.reserved_events(p, expandable_segments=expandable)
        out["modes"][stem] = {
            "reserved_peak_bytes": fit.free.reserved_peak_bytes, "no_retry_bytes": fit.free.no_retry_bytes,
            "smallest_cap_bytes": smallest_surviving_cap(events, expandable, CapKind.FRACTION),
            "fits_mem": fit.survives, "retries_per_step_at_mem": fit.retries_per_step, "verdict": fit.describe(),
            "events": len(events)}
    return out


def synthetic_snapshot(plan, expandable: bool) -> dict:
    """A ``_snapshot()``-shaped dict of the simulation's own calls (the CPU rehearsal's stand-in for a GPU's)."""
    from shard_planner.cost.allocator_replay import ALLOC

    trace, addr = [], {}
    for action, key, size, stream in _cost_model().reserved_events(plan, expandable):
        if action is ALLOC:
            addr[key] = (1 << 40) + 4096 * key  # a distinct address per allocation
            trace.append({"action": "alloc", "addr": addr[key], "size": size, "stream": stream})
        else:
            trace.append({"action": "free_completed", "addr": addr.pop(key), "size": 0, "stream": stream})
    return {"segments": [], "device_traces": [trace]}


# ---- measure: the parent ----

def measure(out: Path, device: str, cases: list[str], steps: int, timeout_s: float) -> None:
    from shard_planner.plan import save_plan

    out.mkdir(parents=True, exist_ok=True)
    for name in cases:
        t0 = time.perf_counter()
        plan = make_case(name, device)
        if plan is None:
            print(f"-- {name}: not on {device}")
            continue
        folder = out / name
        folder.mkdir(exist_ok=True)
        save_plan(plan, folder / "plan.json")
        prediction = predict(plan)
        (folder / "case.json").write_text(json.dumps({"case": name, "prediction": prediction}, indent=1) + "\n")
        own = "expandable" if plan.cluster.expandable_segments else "default"
        for stem, expandable in MODES.items():
            caps = _sweep_caps(plan, prediction["modes"][stem]) if stem == own else []
            spec = {"plan": str(folder / "plan.json"), "device": device, "steps": steps, "caps": caps,
                    "snapshot": str(folder / f"snapshot-{stem}.pickle"), "out": str(folder / f"{stem}.json")}
            _run_child(spec, expandable, timeout_s)
            if device == "cpu":  # the rehearsal's snapshot: the simulation's own calls
                with open(spec["snapshot"], "wb") as f:
                    pickle.dump(synthetic_snapshot(plan, expandable), f)
        print(f"-- {name}: {time.perf_counter() - t0:.1f} s")


def _sweep_caps(plan, predicted_mode: dict) -> list[dict]:
    """The caps to sweep: the predicted smallest cap x FACTORS, and --mem when it is below the device's memory
    (the plan made for a smaller GPU, run under that cap; the child takes off it the outside memory it measures)."""
    from shard_planner.hardware.profile import load_profile

    caps = [{"label": f"x{f:g}", "cap_bytes": int(predicted_mode["smallest_cap_bytes"] * f)} for f in FACTORS]
    if plan.cluster.mem_budget_bytes < load_profile(PROFILE).memory_bytes:
        caps.append({"label": "--mem", "mem_bytes": plan.cluster.mem_budget_bytes})
    return caps


def _run_child(spec: dict, expandable: bool, timeout_s: float) -> None:
    env = dict(os.environ, PYTORCH_ALLOC_CONF=CONF[expandable], MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29600 + (os.getpid() % 200)))
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    spec_path = Path(spec["out"]).with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec) + "\n")
    try:
        done = subprocess.run([sys.executable, __file__, "_child", str(spec_path)], env=env, timeout=timeout_s,
                              capture_output=True, text=True)
        print(done.stdout[-3000:], done.stderr[-2000:] if done.returncode else "", end="")
        if done.returncode:
            print(f"!! {spec['out']}: exit {done.returncode}")
    except subprocess.TimeoutExpired:
        print(f"!! {spec['out']}: over {timeout_s:.0f} s")


# ---- the child: one allocator mode in one process ----

class _Run:
    """The plan's model and optimizer on the device, trained step by step as `run` does (execute/worker.py)."""

    def __init__(self, plan, device):
        from shard_planner.execute.apply import apply_plan, build_mesh
        from shard_planner.execute.worker import build_on_device, make_optimizer
        from shard_planner.model.modelfile import load_model_file

        self.plan, self.device = plan, device
        self.mf = load_model_file(MODEL)
        self.model = apply_plan(build_on_device(self.mf, device), plan, build_mesh(plan, device.type))
        self.optimizer = make_optimizer(plan, self.model.parameters())

    def step(self, s: int) -> float:
        """One step; its seconds (CUDA events on a GPU, else the wall clock)."""
        import torch

        from shard_planner.execute.worker import make_step_batch

        cuda = self.device.type == "cuda"
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        t0 = time.perf_counter()
        if cuda:
            start.record()
        self.optimizer.zero_grad(set_to_none=True)
        inputs, targets = make_step_batch(self.mf, self.plan.training.micro_batch, s, 0, self.device)
        self.mf.loss(self.mf.forward(self.model, inputs), targets).backward()
        self.optimizer.step()
        if not cuda:
            return time.perf_counter() - t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def close(self) -> None:
        import gc

        import torch

        self.model = self.optimizer = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def child(spec_path: str) -> int:
    import torch
    import torch.distributed as dist

    from shard_planner.hardware.allocator_conf import effective_conf
    from shard_planner.plan import load_plan

    spec = json.loads(Path(spec_path).read_text())
    cuda = spec["device"] == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    plan = load_plan(spec["plan"])
    result = {"allocator_conf": effective_conf(os.environ), "torch_version": torch.__version__,
              "device": spec["device"], "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
              "total_bytes": torch.cuda.mem_get_info(device)[1] if cuda else None}
    result["record"] = _recorded(plan, device, spec)
    outside = result["record"].get("outside_bytes") or 0
    result["sweep"] = [_capped(plan, device, spec["steps"], cap, outside) for cap in spec["caps"]]
    Path(spec["out"]).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()
    print(f"{spec['out']}: {json.dumps(_brief(result))}")
    return 0


def _recorded(plan, device, spec: dict) -> dict:
    """``steps`` steps under the allocator's history; the snapshot saved, the statistics returned."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=MAX_ENTRIES)
    run = _Run(plan, device)
    times = [run.step(s) for s in range(spec["steps"])]
    out = {"step_time_s": times}
    if cuda:
        snapshot = torch.cuda.memory._snapshot(device)
        torch.cuda.memory._record_memory_history(enabled=None)
        with open(spec["snapshot"], "wb") as f:
            pickle.dump(snapshot, f)
        free, total = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)
        out.update(stats={k: stats.get(k) for k in ("reserved_bytes.all.peak", "allocated_bytes.all.peak",
                                                      "num_alloc_retries", "num_ooms", "num_device_alloc",
                                                      "num_device_free")},
                   outside_bytes=total - free - torch.cuda.memory_reserved(device),
                   trace_entries=len(snapshot["device_traces"][0]), max_entries=MAX_ENTRIES)
    run.close()
    return out


def _capped(plan, device, steps: int, cap: dict, outside_bytes: int) -> dict:
    """The plan trained from a fresh model under one cap: pass or OOM, retries after each step, times."""
    import torch

    cuda = device.type == "cuda"
    cap_bytes = cap.get("cap_bytes") or max(0, cap["mem_bytes"] - outside_bytes)
    row = {"label": cap["label"], "cap_bytes": cap_bytes, "status": "pass", "retries_after_step": [],
           "step_time_s": []}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.reset_accumulated_memory_stats(device)
        total = torch.cuda.mem_get_info(device)[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    run = None
    try:
        run = _Run(plan, device)
        for s in range(steps):
            row["step_time_s"].append(run.step(s))
            row["retries_after_step"].append(torch.cuda.memory_stats(device)["num_alloc_retries"] if cuda else None)
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", at_step=len(row["step_time_s"]), error=str(exc).splitlines()[0][:300])
    finally:
        if run is not None:
            run.close()
        if cuda:
            row["reserved_peak_bytes"] = torch.cuda.max_memory_reserved(device)
            torch.cuda.set_per_process_memory_fraction(1.0, device)
            torch.cuda.empty_cache()
    return row


def _brief(result: dict) -> dict:
    return {"conf": result["allocator_conf"], "sweep": [(r["label"], r["status"]) for r in result["sweep"]]}


# ---- report: anywhere ----

def report(folder: Path, md: Path | None) -> str:
    lines = [f"# The CUDA caching allocator: recorded vs simulated ({folder})", ""]
    for case_file in sorted(folder.glob("*/case.json")):
        case = json.loads(case_file.read_text())
        lines += _case_lines(case_file.parent, case)
    text = "\n".join(lines) + "\n"
    print(text)
    if md is not None:
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(text)
    return text


def _case_lines(folder: Path, case: dict) -> list[str]:
    pred = case["prediction"]
    lines = [f"## {case['case']}", "", f"allocated peak predicted {_gib(pred['allocated_peak_bytes'])} GiB, outside the "
             f"allocator {_gib(pred['outside_bytes'])} GiB (the profile's)", "",
             "| mode | conf ran | measured reserved | replayed (simulator alone) | replay - measured | walk's simulation "
             "| walk error | measured retries | outside measured | trace entries |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    sweeps = []
    for stem, expandable in MODES.items():
        path = folder / f"{stem}.json"
        if not path.is_file():
            lines.append(f"| {stem} | (no result) | | | | | | | | |")
            continue
        result, p = json.loads(path.read_text()), pred["modes"][stem]
        lines.append(_mode_row(stem, expandable, folder, result, p))
        if result["sweep"]:
            sweeps.append((stem, p, result["sweep"]))
    for stem, p, sweep in sweeps:
        lines += ["", f"cap sweep ({stem}; predicted smallest cap {_gib(p['smallest_cap_bytes'])} GiB, no retries from "
                  f"{_gib(p['no_retry_bytes'])} GiB; at --mem: {p['verdict']})", "",
                  "| cap | GiB | result | retries per step | median step (ms) | reserved peak (GiB) |", "|---|---|---|---|---|---|"]
        for r in sweep:
            lines.append(_sweep_row(r))
    return lines + [""]


def _mode_row(stem: str, expandable: bool, folder: Path, result: dict, p: dict) -> str:
    from shard_planner.cost.allocator import AllocatorConfig
    from shard_planner.cost.allocator_replay import events_from_snapshot, replay

    rec = result["record"]
    replayed = None
    snap_path = folder / f"snapshot-{stem}.pickle"
    if snap_path.is_file():
        with open(snap_path, "rb") as f:
            replayed = replay(events_from_snapshot(pickle.load(f)), AllocatorConfig(expandable_segments=expandable))
    measured = (rec.get("stats") or {}).get("reserved_bytes.all.peak")
    shown = _gib(measured)
    if measured is None and replayed is not None:  # the rehearsal: nothing measured, the simulation stands in
        measured, shown = p["reserved_peak_bytes"], f"{_gib(p['reserved_peak_bytes'])} (simulated: no GPU)"
    diff = f"{(replayed.peak_reserved_bytes - measured) / MiB:+.0f} MiB" if replayed and measured else "-"
    walk_err = f"{(p['reserved_peak_bytes'] / measured - 1) * 100:+.1f}%" if measured else "-"
    retries = (rec.get("stats") or {}).get("num_alloc_retries", "-")
    outside = _gib(rec["outside_bytes"]) if rec.get("outside_bytes") is not None else "-"
    full = rec.get("trace_entries") is not None and rec.get("trace_entries") == rec.get("max_entries")
    entries = f"{rec.get('trace_entries', '-')}" + (" (FULL: the start is lost)" if full else "")
    return (f"| {stem} | {result['allocator_conf']} | {shown} | "
            f"{_gib(replayed.peak_reserved_bytes) if replayed else '-'} | {diff} | {_gib(p['reserved_peak_bytes'])} | "
            f"{walk_err} | {retries} | {outside} | {entries} |")


def _sweep_row(r: dict) -> str:
    retries = r["retries_after_step"]
    per_step = [b - a for a, b in zip([0] + retries[:-1], retries)] if retries and retries[0] is not None else []
    status = r["status"] if r["status"] == "pass" else f"OOM at step {r.get('at_step')}"
    median = f"{statistics.median(r['step_time_s'][1:] or r['step_time_s']) * 1e3:.1f}" if r["step_time_s"] else "-"
    reserved = _gib(r["reserved_peak_bytes"]) if r.get("reserved_peak_bytes") is not None else "-"
    return f"| {r['label']} | {_gib(r['cap_bytes'])} | {status} | {per_step or '-'} | {median} | {reserved} |"


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        return child(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    m.add_argument("--cases", nargs="+", choices=CASES, default=None, help="default: all on cuda, per-block on cpu")
    m.add_argument("--steps", type=int, default=3, help="steps per run (the first is the warm-up)")
    m.add_argument("--timeout", type=float, default=240.0, help="seconds per allocator mode and case")
    r = sub.add_parser("report")
    r.add_argument("folder", type=Path)
    r.add_argument("--md", type=Path, default=None, help="also write the Markdown here")
    args = ap.parse_args(argv)
    if args.command == "measure":
        cases = args.cases or (list(CASES) if args.device == "cuda" else ["per-block"])
        measure(args.out, args.device, cases, args.steps, args.timeout)
        report(args.out, args.out / "report.md")
    else:
        report(args.folder, args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
