"""Shared output for the benchmarks: one table printed, the same rows as CSV, figures as PNG, all under
reports/benchmarks/ (any benchmark may use these).

    rows = [{"model": "gpt2", "error_pct": 1.2}, ...]
    print_table(rows, title="accuracy")
    write_csv(rows, "accuracy")          # reports/benchmarks/accuracy.csv
    save_figure(fig, "accuracy")         # reports/benchmarks/accuracy.png
"""

from __future__ import annotations

import csv
import io
import math
import os
import statistics
import sys
from pathlib import Path

from shard_planner.fileio import write_atomic

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = Path(os.environ.get("SHARD_PLANNER_BENCH_OUT", ROOT / "reports" / "benchmarks"))
EXAMPLES = ROOT / "examples"


def _cell(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.4g}"
    if v is None:
        return "-"
    return str(v)


def print_table(rows: list[dict], *, title: str | None = None, columns: list[str] | None = None,
                stream=None) -> None:
    """Print ``rows`` as an aligned text table (Markdown-compatible pipes)."""
    stream = stream or sys.stdout
    if not rows:
        print(f"{title or 'table'}: no rows", file=stream)
        return
    columns = columns or list(rows[0])
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    if title:
        print(f"\n## {title}", file=stream)
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |", file=stream)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=stream)
    for row in cells:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |", file=stream)
    stream.flush()


def write_csv(rows: list[dict], name: str, *, columns: list[str] | None = None) -> Path:
    """Write ``rows`` to reports/benchmarks/NAME.csv (atomically) and return the path."""
    columns = columns or (list(rows[0]) if rows else [])
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({c: r.get(c) for c in columns})
    path = OUT_DIR / f"{name}.csv"
    write_atomic(path, buf.getvalue())
    return path


def save_figure(fig, name: str) -> Path:
    """Save a matplotlib figure to reports/benchmarks/NAME.png and close it."""
    import matplotlib.pyplot as plt

    path = OUT_DIR / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    os.replace(tmp, path)
    plt.close(fig)
    return path


def error_pct(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured, in percent."""
    return (predicted - measured) / measured * 100.0 if measured else float("nan")


def summarize(values: list[float]) -> tuple[float, float]:
    """(median of |v|, max of |v|) over the finite values; NaNs when there are none."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return float("nan"), float("nan")
    return statistics.median(finite), max(finite)


def set_model_size(size: str | None) -> None:
    """Choose the example models' size (``SHARD_PLANNER_SIZE``); None: their default (tiny)."""
    if size is None:
        os.environ.pop("SHARD_PLANNER_SIZE", None)
    else:
        os.environ["SHARD_PLANNER_SIZE"] = size


def load_text() -> str:
    """The machine's load average (1, 5, 15 min), for the notes beside timings on a shared machine."""
    return " ".join(f"{v:.1f}" for v in os.getloadavg())


def timed_profile(model: str, profile, *, world_size: int, dtype: str = "bfloat16", micro_batch: int | None = None):
    """``profile`` pricing compute from the example ``model``'s module times, measured here first as a
    user would (``shard-planner calibrate --model``): ``world_size`` processes sharing the cores as the
    ranks will, in ``dtype``, at ``micro_batch`` (default: the model file's)."""
    import time

    from shard_planner.execute.module_timing import measure_module_timings

    t0 = time.perf_counter()
    timings = measure_module_timings(str(EXAMPLES / f"{model}.py"), micro_batch=micro_batch, dtype=dtype,
                                     world_size=world_size, device="cpu")
    print(f"  {model}: module times in {dtype} at world size {world_size}, {time.perf_counter() - t0:.0f} s "
          f"(load {load_text()})", flush=True)
    return profile.with_timings(timings)


def quiet_logs() -> None:
    import logging

    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)


# ---- plans built by hand, for measuring the cost model and the planner against ----
def base_plan(model_path: str, trace, *, world_size: int, mem_budget_bytes: int = 2**40,
              profile: str = "cpu-gloo"):
    """A plan of ``model_path`` with only its root as a unit, the model file's training settings, for
    ``world_size`` ranks: the starting point of :func:`plan_variants`."""
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.plan import ROOT, Cluster, Mesh, ModelRef, Plan, Training, Unit

    training = load_model_file(model_path).training
    return Plan(
        model=ModelRef(model_path, trace.fingerprint, seq_len=trace.tokens_per_sample),
        cluster=Cluster(gpus=world_size, gpus_per_node=max(8, world_size), profile=profile,
                        mem_budget_bytes=mem_budget_bytes),
        mesh=Mesh(shard=world_size),
        training=Training(micro_batch=int(training["micro_batch"]), optimizer=training.get("optimizer", "adamw"),
                          lr=float(training.get("lr", 1e-3))),
        units=(Unit((ROOT,), reshard_after_forward=False),),
    )


def item_runs(trace) -> tuple[list[list[str]], list[str]]:
    """(blocks as runs of contiguous siblings, other items) of the planner's search space: the repeated
    blocks (or every item, for a model without repeated blocks) and the one-off modules."""
    from shard_planner.solve.space import find_items

    items = find_items(trace)
    blocks = [i for i in items if not i.may_join_root] or list(items)
    others = [i.fqn for i in items if i not in blocks]
    runs: list[list[str]] = []
    for i in blocks:
        if runs and runs[-1][-1] in _siblings_before(trace, blocks, i):
            runs[-1].append(i.fqn)
        else:
            runs.append([i.fqn])
    return runs, others


def _siblings_before(trace, items, item) -> set[str]:
    """The item before ``item`` when the two may share a unit: same parent, and no sibling holding
    parameters registered between them (the executor's rule, ownership.contiguous_among)."""
    from shard_planner.plan.ownership import contiguous_among

    idx = items.index(item)
    if idx == 0 or items[idx - 1].parent != item.parent:
        return set()
    siblings = [c for c in trace.module(item.parent).children if trace.subtree_param_count(c) > 0]
    return {items[idx - 1].fqn} if contiguous_among(siblings, (items[idx - 1].fqn, item.fqn)) else set()


def layout(trace, kind: str) -> list[tuple[str, ...]]:
    """Unit module lists (root excluded) for a layout: "per-block", "per-item", "pairs", "one-group",
    "root-only"."""
    runs, others = item_runs(trace)
    blocks = [fqn for run in runs for fqn in run]
    if kind == "root-only":
        return []
    if kind == "per-block":
        return [(b,) for b in blocks]
    if kind == "per-item":  # every item of the planner's space (it already keeps tied weights together)
        from shard_planner.solve.space import find_items

        return [(i.fqn,) for i in find_items(trace)]
    if kind == "pairs":
        return [tuple(run[k:k + 2]) for run in runs for k in range(0, len(run), 2)]
    if kind == "one-group":
        return [tuple(run) for run in runs]
    raise ValueError(f"unknown layout {kind!r}")


def make_units(groups, *, reshard=True, ac=False):
    """Units for ``groups`` (root first, kept: FSDP2's default for the root). ``reshard``/``ac``: a value
    for every unit, or a function of the unit's index."""
    from shard_planner.plan import ROOT, Unit

    def pick(v, i):
        return v(i) if callable(v) else v

    return (Unit((ROOT,), reshard_after_forward=False),) + tuple(
        Unit(tuple(g), reshard_after_forward=pick(reshard, i), activation_checkpoint=pick(ac, i))
        for i, g in enumerate(groups))


def plan_variants(trace, base, *, int_reshard: int | None = None) -> list[tuple[str, object]]:
    """At least 10 diverse plans of one model: layouts (per block, per item, grouped, one group, root
    only) x reshard (True / False / mixed / ``int_reshard`` when given) x prefetch (0-2) x activation
    checkpointing x fp32 or bf16 compute x CPU offload."""
    from dataclasses import replace

    from shard_planner.plan import Prefetch, Training

    per_block = layout(trace, "per-block")
    half = max(1, len(per_block) // 2)
    variants = [
        ("per-block reshard", replace(base, units=make_units(per_block))),
        ("per-block keep", replace(base, units=make_units(per_block, reshard=False))),
        ("per-item pf1/1", replace(base, units=make_units(layout(trace, "per-item")), prefetch=Prefetch(1, 1))),
        ("per-block pf2/2", replace(base, units=make_units(per_block), prefetch=Prefetch(2, 2))),
        ("pairs reshard", replace(base, units=make_units(layout(trace, "pairs")))),
        ("one-group keep", replace(base, units=make_units(layout(trace, "one-group"), reshard=False))),
        ("per-block AC", replace(base, units=make_units(per_block, ac=True))),
        ("pairs keep AC pf1/2", replace(base, units=make_units(layout(trace, "pairs"), reshard=False, ac=True),
                                        prefetch=Prefetch(1, 2))),
        ("per-block fp32", replace(base, units=make_units(per_block),
                                   training=replace(base.training, param_dtype="float32"))),
        ("per-block offload", replace(base, units=make_units(per_block),
                                      training=replace(base.training, cpu_offload=True))),
        ("root only", base),
        ("mixed reshard/AC pf1/1", replace(base, units=make_units(per_block, reshard=lambda i: i % 2 == 0,
                                                                 ac=lambda i: i < half), prefetch=Prefetch(1, 1))),
    ]
    if int_reshard is not None:
        variants += [
            (f"per-block reshard {int_reshard}", replace(base, units=make_units(per_block, reshard=int_reshard))),
            (f"pairs reshard {int_reshard} AC", replace(base, units=make_units(layout(trace, "pairs"),
                                                                               reshard=int_reshard, ac=True))),
        ]
    assert all(isinstance(p.training, Training) for _, p in variants)
    return variants
