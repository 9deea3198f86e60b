"""Tensor parallelism at scale, on paper: ``shard-planner plan`` for Llama 3 8B / 70B / 405B shapes on 8-512
H100 80GB (profile h100-80gb, ``--mem 80GB``, seq 8192), the layout it chooses, every tensor-parallel
degree's outcome, its wall time against the 15 s target (issue 30 item 5), and the planner's prediction for
torchtitan's OWN published layout beside torchtitan's published figure. Nothing here is fitted to those
figures.

    python benchmarks/bench_tp_scale.py [--runs 3] [--cases a,b,c,d] [--trace-cache DIR]

Cases (examples/llama.py at SHARD_PLANNER_SIZE, SHARD_PLANNER_SEQ=8192; ``plan --gpus G --mem 80GB
--global-batch B``, the command run as a subprocess with its report, into a temp dir, ``--runs`` times):
  a) 8B, 8 GPUs, global batch 16;   b) 70B, 256 GPUs, global batch 512;
  c) 405B, 512 GPUs, global batch 256;   d) 405B, 128 GPUs, global batch 32.

Published figures (tokens/s/GPU, quoted from the pages; Llama 3.1 shapes, seq 8192, torchtitan's llama3 tomls):
- pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md ("done by the torchtitan team at the end of
  2024"; torch 1963fc8 2024/12/23, torchtitan 9dec370 2024/12/26). Hardware: Grand Teton, "Each H100 GPU is
  equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth", "400 Gb/s per GPU" RDMA, 8 GPUs per host
  with NVLink, "the default 500W power limit".
  Table 1 "1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16.
  Selective activation checkpointing.": FSDP 5,762 (82.4 GiB); FSDP + torch.compile 6,667 (77.0 GiB);
  FSDP + torch.compile + Float8 8,532 (76.8 GiB).
  Table 4 "2D parallelism (FSDP + TP) + torch.compile + Float8. Llama 3.1 70B model. 256 GPUs (FSDP 32, TP 8).
  Local batch size 16, global batch size 512. Full activation checkpointing.": 2D 829 (71.9 GiB);
  2D + AsyncTP 876 (67.6 GiB).
  Table 5 "3D parallelism (FSDP + TP + PP) + torch.compile + Float8 + AsyncTP. Llama 3.1 405B model. 512 GPUs
  (FSDP 8, TP 8, PP8). Local batch size 32, global batch size 256. Full activation checkpointing.":
  1F1B 100 (82.5 GiB); Interleaved 1F1B 128 (72.7 GiB).
- pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (June 2025, same hardware text):
  "Llama3 70b on 256 H100s with FSDP=32, TP=8, torch.compile, full AC, local batch size 16", None (bfloat16):
  "Vanilla TP tokens/sec" 597.3, "Async TP tokens/sec" 652.4 (per GPU by their size). Without Float8, this is
  the figure closest to what the planner models for case b.
- pytorch/torchtitan docs/performance.md, an older version: "Llama 3.1 (405B) on 128 H100 (94GB memory)",
  "We do see OOM for 1D parallelism (FSDP2), so we only tested 2D parallelism (FSDP2 + Tensor Parallel)";
  405B, batch size 2, full AC: 109 WPS, 29.0% MFU, optimizations None; 177 WPS, 23.46%, Float8; 185 WPS,
  24.52%, Float8 + Async TP; "global batch size = local batch size 2 * number of FSDP ranks 16 = 32" (so TP
  8). Footnote 1: "We used HBM2e based lower TDP SXM H100(95GB) for our test, the actual peak TFLOPs number is
  between SXM and NVL". The page gives no compile setting for these rows.

Mirrored layouts (:func:`mirror_plan`): examples/llama.py at the case's shape, one rank traced at TP 8 with
the styles ``plan`` derives (tp_degrees.degree_styles: sequence and loss parallel, torchtitan's defaults),
Mesh(shard=gpus // 8, tp=8); one unit per block, resharded after forward, the root not resharded; bf16
parameters, fp32 reduction, AdamW, no accumulation, prefetch as FSDP2's default; full AC on every block.
Case a is torchtitan's 1-D run: Mesh(shard=8), local batch 2, selective AC with torchtitan's "op" rule
(as benchmarks/bench_torchtitan.py). Case c: torchtitan ran PP 8, which the planner does not model; the
mirror is what is comparable, FSDP 64 x TP 8 at the same global batch (micro-batch 256 / 64 = 4), no
pipeline, so no bubble: its prediction is not torchtitan's layout. Priced with CostModel(trace,
h100-80gb) (.estimate: step time, tokens/s, MFU, allocated peak; cost/fits.device_fit: the allocator's
verdict on 80 GB). Not modelled: torch.compile, Float8, async TP, PP; the profile is the 700 W 80 GB SXM
part, theirs 500 W 96 GB HBM2e at 2.4 TB/s. The h100-80gb profile's compute_efficiency was fitted to the
Table 1 FSDP row (benchmarks/bench_torchtitan.py), so case a's mirror is not a check of it.

A degree whose throughput in the plan file is above the chosen one's (a screened-only degree can be: the
screen's figures are its heuristic plans') is settled by ``plan ... --tp N``, that degree searched alone.

Writes reports/benchmarks/tp_scale.csv (every row, a ``table`` column says which) and tp_scale.md.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import EXAMPLES, OUT_DIR, ROOT, load_text, print_table, write_csv  # noqa: E402
from shard_planner.fileio import write_atomic  # noqa: E402

LLAMA = EXAMPLES / "llama.py"
SEQ = 8192
TARGET_S = 15.0
GIB = 1 << 30
TABLE_PAGE = "benchmarks/llama3_h100_202412_torchtitan.md"
ASYNC_PAGE = "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
OLD_PAGE = "docs/performance.md (older version)"


@dataclass(frozen=True)
class Published:
    label: str  # the techniques, as the page names them
    tokens_per_s_gpu: float
    mem_gib: float | None
    source: str


@dataclass(frozen=True)
class Case:
    key: str
    size: str  # examples/llama.py SHARD_PLANNER_SIZE
    gpus: int
    global_batch: int
    tt_layout: str  # torchtitan's published layout, in words
    mirror_tp: int
    mirror_micro_batch: int
    mirror_ac: str  # "full" or "op"
    published: tuple[Published, ...]
    closest: int  # index of the published figure closest to what the planner models
    differs: str

    @property
    def name(self) -> str:
        return f"{self.key}) {self.size.upper()}, {self.gpus} GPUs, gb {self.global_batch}"


CASES = (
    Case("a", "8b", 8, 16, "FSDP 8, local batch 2, selective AC (op)", 1, 2, "op",
         (Published("FSDP", 5762, 82.4, TABLE_PAGE + " table 1"),
          Published("FSDP + compile", 6667, 77.0, TABLE_PAGE + " table 1"),
          Published("FSDP + compile + Float8", 8532, 76.8, TABLE_PAGE + " table 1")), 0,
         "none in the FSDP row but the hardware (500 W, 96 GB HBM2e vs the profile's 700 W 80 GB SXM); the profile's "
         "compute_efficiency was fitted to this row, so it is no check; compile and Float8 rows not modelled"),
    Case("b", "70b", 256, 512, "FSDP 32 x TP 8, local batch 16, full AC", 8, 16, "full",
         (Published("2D + compile (bf16), vanilla TP", 597.3, None, ASYNC_PAGE),
          Published("2D + compile (bf16), async TP", 652.4, None, ASYNC_PAGE),
          Published("2D + compile + Float8", 829, 71.9, TABLE_PAGE + " table 4"),
          Published("2D + compile + Float8 + AsyncTP", 876, 67.6, TABLE_PAGE + " table 4")), 0,
         "torch.compile (all rows), Float8 and async TP (some) not modelled; 500 W 96 GB HBM2e parts vs the "
         "profile's 700 W 80 GB SXM"),
    Case("c", "405b", 512, 256, "FSDP 8 x TP 8 x PP 8, local batch 32, full AC", 8, 4, "full",
         (Published("3D 1F1B + compile + Float8 + AsyncTP", 100, 82.5, TABLE_PAGE + " table 5"),
          Published("3D interleaved 1F1B + compile + Float8 + AsyncTP", 128, 72.7, TABLE_PAGE + " table 5")), 1,
         "PP 8 not modelled: the mirror is FSDP 64 x TP 8 at the same global batch (micro-batch 4), no pipeline "
         "bubble; compile, Float8, async TP not modelled; 500 W 96 GB HBM2e parts"),
    Case("d", "405b", 128, 32, "FSDP 16 x TP 8, local batch 2, full AC", 8, 2, "full",
         (Published("2D, no optimizations", 109, None, OLD_PAGE),
          Published("2D + Float8", 177, None, OLD_PAGE),
          Published("2D + Float8 + Async TP", 185, None, OLD_PAGE)), 0,
         "Float8 and async TP (some rows) not modelled; HBM2e lower-TDP 95 GB parts vs the profile's 700 W 80 GB SXM"),
)


# ---- the plan command, as a user runs it ----
def run_plan(case: Case, out_dir: Path, extra: tuple[str, ...] = ()) -> dict:
    """``plan`` for ``case`` (and ``extra`` arguments) in a fresh process, its report written beside the plan:
    wall and CPU seconds, the load before it, its time line, the plan file."""
    env = dict(os.environ, SHARD_PLANNER_SIZE=case.size, SHARD_PLANNER_SEQ=str(SEQ),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"plan_{case.key}.json"
    argv = [sys.executable, "-m", "shard_planner.cli.main", "plan", str(LLAMA), "--gpus", str(case.gpus),
            "--mem", "80GB", "--global-batch", str(case.global_batch), "-o", str(path), *extra]
    load = load_text()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"plan for case {case.key} failed ({done.returncode}): {done.stderr[-2000:]}")
    time_line = next((ln for ln in done.stdout.splitlines() if ln.startswith("time:")), "")
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return dict(wall_s=wall_s, cpu_s=cpu_s, load=load, time_line=time_line, plan=json.loads(path.read_text()))


def ac_summary(units: list[dict]) -> str:
    """'80 selective, 1 full, 1 none (reshard 2 x80, ...)' over the plan file's units."""
    def ac(u):
        a = u.get("activation_checkpoint")
        return "full" if a is True else ("none" if a is False or a is None else str(a))

    def count(values):
        seen: dict[str, int] = {}
        for v in values:
            seen[v] = seen.get(v, 0) + 1
        return ", ".join(f"{n} {k}" for k, n in sorted(seen.items(), key=lambda kv: -kv[1]))

    return f"AC: {count(ac(u) for u in units)}; reshard: {count(str(u['reshard_after_forward']) for u in units)}"


def chosen_row(case: Case, runs: list[dict]) -> dict:
    """The chosen plan of ``case`` (the last run's file; every run's answer is compared) and its wall times."""
    plan = runs[-1]["plan"]
    mesh, training, pred = plan["mesh"], plan["training"], plan["predicted"]
    same = all(json.dumps(r["plan"]["units"]) == json.dumps(plan["units"]) and r["plan"]["mesh"] == mesh
               for r in runs)
    tps = pred["tokens_per_s"] / case.gpus
    closest = case.published[case.closest]
    return dict(table="chosen", case=case.name, gpus=case.gpus, global_batch=case.global_batch,
                mesh=f"FSDP {mesh['shard']}" + (f" x HSDP {mesh['replicate']}" if mesh.get("replicate", 1) > 1 else "")
                + (f" x TP {mesh['tp']}" if mesh.get("tp", 1) > 1 else ""), tp=mesh.get("tp", 1),
                micro_batch=f"{training['micro_batch']} x {training.get('accumulation_steps', 1)}",
                prefetch=f"{plan['prefetch']['forward']}/{plan['prefetch']['backward']}",
                checkpointing=ac_summary(plan["units"]), pred_tps_gpu=round(tps), mfu_pct=round(100 * pred["mfu"], 1),
                peak_gib=round(pred["peak_bytes"] / GIB, 2),
                reserved_gib=round(pred["reserved_peak_bytes"] / GIB, 2) if pred.get("reserved_peak_bytes") else None,
                alloc_retries=pred.get("alloc_retries_per_step"),
                published_closest=f"{closest.tokens_per_s_gpu:g} ({closest.label})",
                pred_vs_published_pct=round(100 * (tps / closest.tokens_per_s_gpu - 1), 1),
                same_plan_every_run=same, solver=plan["solver"]["method"])


def degree_rows(case: Case, plan: dict) -> list[dict]:
    """Every degree's outcome from the plan file's ``layouts``; ``chosen_over_pct``: the chosen degree's
    throughput over this one's, in percent (what the docs quote as "+x% over FSDP alone")."""
    chosen = plan["mesh"].get("tp", 1)
    outcomes = plan.get("layouts") or []
    chosen_sps = next((o.get("samples_per_s") for o in outcomes if o["split"]["tp"] == chosen), None)
    rows = []
    for o in outcomes:
        sps = o.get("samples_per_s")
        rows.append(dict(table="degrees", case=case.name, degree=o["split"]["tp"], chosen=o["split"]["tp"] == chosen,
                         judged=o["judged"], layout=o.get("fastest_plan") or "",
                         tps_gpu=round(sps * SEQ / case.gpus) if sps else None,
                         chosen_over_pct=round(100 * (chosen_sps / sps - 1), 1) if sps and chosen_sps else None,
                         step_s=round(o["step_time_s"], 3) if o.get("step_time_s") else None,
                         compute_s=round(o["compute_s"], 3) if o.get("compute_s") else None,
                         exposed_comm_s=round(o["exposed_comm_s"], 3) if o.get("exposed_comm_s") is not None else None,
                         tp_comm_s=round(o["split_comm_s"], 3) if o.get("split_comm_s") is not None else None,
                         peak_gib=round(o["peak_bytes"] / GIB, 2) if o.get("peak_bytes") else None,
                         refused=o.get("refused") or ""))
    return rows


def wall_row(case: Case, runs: list[dict]) -> dict:
    walls = [r["wall_s"] for r in runs]
    median = statistics.median(walls)
    return dict(table="wall", case=case.name, runs_s=" / ".join(f"{w:.1f}" for w in walls),
                median_s=round(median, 1), target_s=TARGET_S, met=median <= TARGET_S,
                cpu_s=" / ".join(f"{r['cpu_s']:.1f}" for r in runs), load_before="; ".join(r["load"] for r in runs),
                time_line=runs[-1]["time_line"].removeprefix("time: "))


# ---- torchtitan's own layout, priced ----
def _code_key(styles) -> str:
    """The trace cache's key material: the model file, the tracer's and tensor parallelism's code, the styles."""
    h = hashlib.sha256(LLAMA.read_bytes())
    code = sorted((ROOT / "shard_planner" / "trace").glob("*.py")) + [ROOT / "shard_planner" / "parallel" / "tensor_parallel.py"]
    for p in code:
        h.update(p.read_bytes())
    h.update(repr(sorted(styles.styles.items()) if styles is not None else None).encode())
    return h.hexdigest()


def trace_at(size: str, tp: int, styles, cache_dir: Path | None):
    """examples/llama.py at ``size`` and seq 8192, one rank at TP ``tp`` with ``styles`` (bf16), cached."""
    from shard_planner.trace import trace_model
    from shard_planner.trace.types import ModelTrace

    key = hashlib.sha256(f"{size}:{SEQ}:{tp}:{_code_key(styles)}".encode()).hexdigest()[:20]
    path = cache_dir / f"llama-tp{tp}-{key}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        return ModelTrace.from_json(path.read_text())
    os.environ.update(SHARD_PLANNER_SIZE=size, SHARD_PLANNER_SEQ=str(SEQ))
    trace = trace_model(str(LLAMA), dtype="bfloat16", tensor_parallel=styles if tp > 1 else None, tp_size=tp)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, trace.to_json())
    return trace


def styles_for(size: str, tp: int):
    """The styles ``plan`` derives for TP ``tp`` (tp_degrees.degree_styles, sequence and loss parallel)."""
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.trace.tp_degrees import degree_styles

    os.environ.update(SHARD_PLANNER_SIZE=size, SHARD_PLANNER_SEQ=str(SEQ))
    found = degree_styles(load_model_file(str(LLAMA)), [tp], sequence_parallel=True, loss_parallel=True, seq_len=SEQ)
    if tp not in found.styles:
        raise RuntimeError(f"TP {tp} refused for {size}: {[o.refused for o in found.refused]}")
    return found.styles[tp]


def mirror_plan(case: Case, trace, styles):
    """torchtitan's layout for ``case`` (module docstring), as a Plan."""
    from shard_planner.plan.checkpointing import TORCHTITAN_OP_SAVE_OPS
    from shard_planner.plan import Cluster, Mesh, ModelRef, Plan, Prefetch, Training, Unit

    n_layers = sum(1 for m in trace.modules if m.fqn.count(".") == 1 and m.fqn.startswith("layers."))
    ac = (dict(activation_checkpoint="selective", ac_save_ops=TORCHTITAN_OP_SAVE_OPS) if case.mirror_ac == "op"
          else dict(activation_checkpoint=True))
    units = (Unit(("",), False),) + tuple(Unit((f"layers.{i}",), True, **ac) for i in range(n_layers))
    tp = case.mirror_tp
    return Plan(ModelRef(str(LLAMA), trace.fingerprint, seq_len=trace.tokens_per_sample),
                Cluster(case.gpus, 8, "h100-80gb", 80 * GIB), Mesh.fsdp(case.gpus, tp),
                Training(case.mirror_micro_batch, "adamw", "bfloat16", "float32"), units, Prefetch(0, 1),
                tensor_parallel=styles if tp > 1 else None)


def mirror_row(case: Case, cache_dir: Path | None, chosen: dict) -> dict:
    """The planner's prediction for torchtitan's layout of ``case`` beside the published figures."""
    from shard_planner.cost import CostModel
    from shard_planner.cost.fits import device_fit
    from shard_planner.hardware.profile import load_profile

    styles = styles_for(case.size, case.mirror_tp) if case.mirror_tp > 1 else None
    trace = trace_at(case.size, case.mirror_tp, styles, cache_dir)
    plan = mirror_plan(case, trace, styles)
    model = CostModel(trace, load_profile("h100-80gb"))
    est = model.estimate(plan, timeline=False)
    verdict = device_fit(model, plan)
    tps = est.time.tokens_per_s / case.gpus
    closest = case.published[case.closest]
    return dict(table="mirror", case=case.name, torchtitan_layout=case.tt_layout,
                mirrored_as=f"FSDP {plan.mesh.shard}" + (f" x TP {case.mirror_tp}" if case.mirror_tp > 1 else "")
                + f", micro-batch {case.mirror_micro_batch}, "
                + ("selective AC (op)" if case.mirror_ac == "op" else "full AC"),
                published="; ".join(f"{p.label} {p.tokens_per_s_gpu:g}" + (f" ({p.mem_gib} GiB)" if p.mem_gib else "")
                                    for p in case.published),
                pred_tps_gpu=round(tps), pred_mfu_pct=round(100 * est.time.mfu, 1),
                pred_tp_comm_s=round(est.time.tp_comm_s, 3), pred_exposed_comm_s=round(est.time.exposed_comm_s, 3),
                pred_peak_gib=round(est.memory.peak_bytes / GIB, 2),
                pred_reserved_gib=round(verdict.reserved_peak_total_bytes / GIB, 2),
                fits_80gb=verdict.verdict().split(";")[0].split(" (")[0],
                closest=f"{closest.tokens_per_s_gpu:g} ({closest.label})",
                pred_vs_closest_pct=round(100 * (tps / closest.tokens_per_s_gpu - 1), 1),
                chosen_vs_mirror_pct=round(100 * (chosen["pred_tps_gpu"] / tps - 1), 1), what_differs=case.differs)


# ---- the report ----
CHOSEN_COLS = ["case", "mesh", "micro_batch", "prefetch", "checkpointing", "pred_tps_gpu", "mfu_pct", "peak_gib",
               "reserved_gib", "alloc_retries", "published_closest", "pred_vs_published_pct", "same_plan_every_run"]
DEGREE_COLS = ["case", "degree", "chosen", "judged", "tps_gpu", "chosen_over_pct", "step_s", "compute_s", "exposed_comm_s", "tp_comm_s",
               "peak_gib", "layout", "refused"]
MIRROR_COLS = ["case", "torchtitan_layout", "mirrored_as", "published", "closest", "pred_tps_gpu", "pred_vs_closest_pct",
               "pred_mfu_pct", "pred_tp_comm_s", "pred_peak_gib", "pred_reserved_gib", "fits_80gb",
               "chosen_vs_mirror_pct", "what_differs"]
WALL_COLS = ["case", "runs_s", "median_s", "target_s", "met", "cpu_s", "load_before"]


def report(chosen: list[dict], degrees: list[dict], mirrors: list[dict], walls: list[dict], meta: dict,
           settled: list[dict]) -> str:
    buf = io.StringIO()
    w = buf.write
    w("# Tensor parallelism at scale, on paper: Llama 3 8B / 70B / 405B on 8-512 H100 80GB\n\n")
    w(f"Command: `python benchmarks/bench_tp_scale.py --runs {meta['runs']}` ({meta['seconds']:.0f} s, "
      f"{meta['date']}; load average {meta['load_start']} at the start, {meta['load_end']} at the end; this "
      "machine has 2 cores and is shared, so the wall times are inflated by other work). Each case runs "
      "`shard-planner plan examples/llama.py --gpus G --mem 80GB --global-batch B` (profile h100-80gb, seq "
      "8192, SHARD_PLANNER_SIZE = 8b / 70b / 405b: the Llama 3 shapes) in a fresh process, report included. "
      "tokens/s/GPU are the planner's predictions; published figures and how torchtitan's layouts are "
      "mirrored: the script's docstring. Nothing is fitted to the published figures (but the profile's "
      "compute_efficiency was fitted earlier to torchtitan's 8-GPU FSDP row, case a: not a check).\n\n")
    w("The planner does not model torch.compile, Float8, async TP or pipeline parallelism; torchtitan's "
      "H100s are 500 W parts with 96 GB HBM2e (the 405B page: 95 GB), the profile the 700 W 80 GB SXM part.\n")
    print_table(chosen, title="The chosen plans (the last run's answer; `micro_batch` = micro-batch x micro-steps)",
                columns=CHOSEN_COLS, stream=buf)
    print_table(degrees, title="Every tensor-parallel degree (plan file's layouts; tokens/s/GPU = samples/s x "
                "8192 / GPUs; `screened`: the screen's fastest heuristic plan only)", columns=DEGREE_COLS, stream=buf)
    print_table(mirrors, title="torchtitan's own layout, priced by the planner, beside the published figures "
                "(`closest`: the published figure nearest to what the planner models)", columns=MIRROR_COLS,
                stream=buf)
    print_table(walls, title=f"`plan` wall time against the {TARGET_S:g} s target (issue 30 item 5: 70B on 256 "
                "and 405B on 512)", columns=WALL_COLS, stream=buf)
    over = [r["case"] for r in walls if not r["met"]]
    w("\n" + (f"Over the {TARGET_S:g} s target here: {', '.join(over)} (at the load above). " if over
              else f"Every case within {TARGET_S:g} s. ")
      + "`cpu_s`: the command's CPU seconds, its helper process included; on these 2 cores the wall time is at "
      "least about half of it even on an idle machine.\n")
    w("\nEach case's last run's time line:\n\n")
    for r in walls:
        w(f"- {r['case']}: {r['time_line']}\n")
    w("\n## A degree recorded faster than the chosen one\n\n" + "\n".join(anomaly_lines(settled)) + "\n")
    return buf.getvalue()


def anomalies(degrees: list[dict]) -> list[dict]:
    """Degrees whose recorded throughput is above the chosen one's: the plan file says the chosen degree is the
    fastest, so each is settled by searching that degree alone (:func:`settle`)."""
    found = []
    for case in dict.fromkeys(r["case"] for r in degrees):
        rows = [r for r in degrees if r["case"] == case]
        chosen = next((r for r in rows if r["chosen"]), None)
        for r in rows:
            if chosen and r is not chosen and r["tps_gpu"] and chosen["tps_gpu"] and r["tps_gpu"] > chosen["tps_gpu"]:
                found.append(dict(case=case, degree=r["degree"], judged=r["judged"], recorded_tps_gpu=r["tps_gpu"],
                                  chosen_degree=chosen["degree"], chosen_tps_gpu=chosen["tps_gpu"]))
    return found


def settle(case: Case, found: dict, out_dir: Path) -> dict:
    """``plan ... --tp N`` for an anomalous degree: its own searched answer, allocator verdict included."""
    run = run_plan(case, out_dir, ("--tp", str(found["degree"])))
    pred = run["plan"]["predicted"]
    tps = round(pred["tokens_per_s"] / case.gpus)
    return dict(found, table="settled", searched_alone_tps_gpu=tps,
                searched_alone_retries=pred.get("alloc_retries_per_step"),
                searched_alone_retry_ms=round(1e3 * (pred.get("alloc_retry_s") or 0.0), 1),
                searched_alone_layout=f"FSDP units: {len(run['plan']['units'])}, micro-batch "
                f"{run['plan']['training']['micro_batch']} x {run['plan']['training'].get('accumulation_steps', 1)}",
                chosen_still_faster=tps <= found["chosen_tps_gpu"])


def anomaly_lines(settled: list[dict]) -> list[str]:
    if not settled:
        return ["No degree records more throughput than the chosen one."]
    return [f"- {s['case']}: TP {s['degree']} ({s['judged']}) records {s['recorded_tps_gpu']} tokens/s/GPU in the plan "
            f"file, above the chosen TP {s['chosen_degree']}'s {s['chosen_tps_gpu']} "
            f"({100 * (s['recorded_tps_gpu'] / s['chosen_tps_gpu'] - 1):+.1f}%). Searched alone (`--tp {s['degree']}`): "
            f"{s['searched_alone_tps_gpu']} tokens/s/GPU ({s['searched_alone_layout']}; {s['searched_alone_retries']} "
            f"allocator retries per step priced at {s['searched_alone_retry_ms']} ms), so the chosen degree "
            + ("is still the faster: the screened figure did not hold once that degree was searched and judged by "
               "the allocator simulation as the chosen plan was." if s["chosen_still_faster"]
               else "is NOT the faster: the screen left a better degree unsearched.") for s in settled]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="plan runs per case; the median wall time is quoted")
    ap.add_argument("--cases", default="a,b,c,d", help="comma-separated case keys (default: all)")
    ap.add_argument("--trace-cache", type=Path, default=Path(tempfile.gettempdir()) / "shard_planner_tp_scale_traces",
                    help="directory of cached TP traces for the mirrored layouts; '' for none")
    args = ap.parse_args(argv)
    cache = args.trace_cache if str(args.trace_cache) else None
    cases = [c for c in CASES if c.key in args.cases.split(",")]
    start, load_start = time.perf_counter(), load_text()
    chosen, degrees, mirrors, walls = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            runs = []
            for i in range(args.runs):
                runs.append(run_plan(case, Path(tmp) / f"{case.key}{i}"))
                print(f"  {case.name}: run {i + 1} {runs[-1]['wall_s']:.1f} s (load {runs[-1]['load']})", flush=True)
            chosen.append(chosen_row(case, runs))
            degrees += degree_rows(case, runs[-1]["plan"])
            walls.append(wall_row(case, runs))
            mirrors.append(mirror_row(case, cache, chosen[-1]))
        by_name = {c.name: c for c in cases}
        settled = [settle(by_name[f["case"]], f, Path(tmp) / f"settle{i}") for i, f in enumerate(anomalies(degrees))]
    meta = dict(runs=args.runs, seconds=time.perf_counter() - start, load_start=load_start, load_end=load_text(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    rows = chosen + degrees + mirrors + walls + settled
    write_csv(rows, "tp_scale", columns=list(dict.fromkeys(c for r in rows for c in r)))
    text = report(chosen, degrees, mirrors, walls, meta, settled)
    print(text)
    path = OUT_DIR / "tp_scale.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
