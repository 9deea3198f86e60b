"""``shard-planner trace model.py``: trace a model file, write trace.json, print a per-module summary."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from shard_planner.cli.args import (add_dtype, add_hf_arguments, add_micro_batch, add_model_argument, add_output,
                                    hf_options, param_dtype, positive_int)
from shard_planner.fileio import check_output_file, write_atomic
from shard_planner.trace.types import ModelTrace
from shard_planner.units import format_bytes

TABLE_ROWS = 20  # modules shown in the summary; the rest are counted in one line


@dataclass(frozen=True)
class TraceRequest:
    model: str
    micro_batch: int | None  # the micro-batch the table shows (default: TRAINING["micro_batch"] or 1)
    dtype: str
    output: Path
    check_batch: int | None  # run a real step at this micro-batch and compare


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "trace",
        help="trace a model file under FakeTensorMode (no GPU, no real memory) and write trace.json",
        description="Run one forward + loss + backward of the model file at two micro-batch sizes under "
        "FakeTensorMode, record per-module parameters, saved activations, peaks and FLOPs, write them "
        "to a trace.json, and print a per-module summary.",
    )
    add_model_argument(p, trace_json=False)
    add_micro_batch(p, default="the model file's TRAINING['micro_batch'], else 1; the table shows the trace at it, "
                    "which is itself fitted from micro-batches 1 and 2")
    add_dtype(p)
    add_output(p, what="trace", default="trace.json")
    p.add_argument("--check", type=positive_int, default=None, metavar="B",
                   help="also run one real training step on this CPU at micro-batch B with the same instruments "
                   "and list where the fake-mode trace differs (builds the model for real: small sizes only)")
    add_hf_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    from shard_planner.model.modelfile import load_model_file
    from shard_planner.trace import compare_with_real_run, trace_model

    req = TraceRequest(args.model, args.micro_batch, param_dtype(args), Path(args.output), args.check)
    check_output_file(req.output, "trace")
    model_file = load_model_file(req.model, hf_options(args))
    trace = trace_model(model_file, dtype=req.dtype)
    write_atomic(req.output, trace.to_json())
    batch = req.micro_batch or model_file.defaults.micro_batch
    print(summary_table(trace, batch))
    print(f"wrote {req.output}")
    if req.check_batch is not None:
        diffs = compare_with_real_run(model_file, trace, batch_size=req.check_batch)
        print(check_report(diffs, req.check_batch))
    return 0


def check_report(diffs, batch: int) -> str:
    """Lines saying where a real step at micro-batch ``batch`` differs from the trace (or that it does not)."""
    if not diffs:
        return f"real-run check at micro-batch {batch}: every module's bytes, peaks and FLOPs agree within 2%"
    lines = [f"real-run check at micro-batch {batch}: {len(diffs)} numbers differ by more than 2% "
             "(code that behaves differently under fake tensors, or another kernel):"]
    for d in diffs:
        scale = 1e9 if "flops" in d.quantity else 1
        unit = "GFLOP" if scale != 1 else "bytes"
        lines.append(f"  {d.fqn or '<root>'}: {d.quantity} traced {d.traced / scale:,.6g} vs real "
                     f"{d.real / scale:,.6g} {unit}")
    return "\n".join(lines)


def summary_rows(trace: ModelTrace) -> list[str]:
    """The modules the table lists: the root's children, with containers that never run
    (ModuleList, ModuleDict) replaced by their children, largest parameter bytes first."""
    rows, stack = [], list(trace.module("").children)
    while stack:
        fqn = stack.pop()
        m = trace.module(fqn)
        if m.calls == 0 and m.children:
            stack.extend(m.children)
        else:
            rows.append(fqn)
    order = {fqn: i for i, fqn in enumerate(trace.forward_order)}
    return sorted(rows, key=lambda f: (-trace.subtree_param_bytes(f), order.get(f, len(order))))


def summary_table(trace: ModelTrace, batch: int) -> str:
    """A readable table: per listed module (largest first) and in total, at micro-batch ``batch``."""
    header = ("module", "type", "params", "param bytes", f"saved act (b={batch})", f"fwd GFLOP (b={batch})")
    lines = []

    def row(fqn: str, label: str, type_name: str) -> tuple:
        saved = trace.subtree_sum(fqn, "saved_bytes_self").at(batch)
        flops = trace.subtree_sum(fqn, "fwd_flops_self").at(batch)
        return (label, type_name, f"{trace.subtree_param_count(fqn):,}", format_bytes(trace.subtree_param_bytes(fqn)),
                format_bytes(saved), f"{flops / 1e9:,.2f}")

    fqns = summary_rows(trace)
    for fqn in fqns[:TABLE_ROWS]:
        lines.append(row(fqn, fqn, trace.module(fqn).type_name))
    more = len(fqns) - TABLE_ROWS
    total = row("", "total", trace.model_class)
    loss = ("loss_fn", "", "", "", format_bytes(trace.loss_saved_bytes.at(batch)),
            f"{trace.loss_flops.at(batch) / 1e9:,.2f} (fwd+bwd)")
    widths = [max(len(str(r[i])) for r in [header, total, loss, *lines]) for i in range(len(header))]

    def fmt(r) -> str:
        cells = [str(r[0]).ljust(widths[0]), str(r[1]).ljust(widths[1])]
        cells += [str(c).rjust(w) for c, w in zip(r[2:], widths[2:])]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    tokens = f", {trace.tokens_per_sample} tokens/sample" if trace.tokens_per_sample else ""
    root = trace.module("")
    trainable = f" ({trace.trainable_param_count:,} trainable)" if trace.has_frozen_params else ""
    out = [
        f"{trace.model_class} from {trace.model_path}: {trace.param_count:,} parameters{trainable}, compute dtype "
        f"{trace.compute_dtype}{tokens}; traced in {trace.trace_seconds:.2f} s "
        f"({trace.reused_modules} modules reused from identical blocks)",
        fmt(header), rule, *map(fmt, lines),
    ]
    if more > 0:
        out.append(f"... {more} more modules")
    out += [
        rule, fmt(total), fmt(loss),
        f"forward peak above entry {format_bytes(root.fwd_peak_rise_bytes.at(batch))}, loss peak "
        f"{format_bytes(trace.loss_peak_rise_bytes.at(batch))}, backward FLOPs "
        f"{trace.subtree_sum('', 'bwd_flops_self').at(batch) / 1e9:,.2f} G (b={batch})",
    ]
    return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover - the entry point is shard_planner.cli.main
    sys.exit("run: shard-planner trace ...")
