"""``plan``'s tensor-parallel degrees: which to search (``--tp``, or each that divides the node on a GPU profile),
each traced in the helper process at its degree, then one search over them (solve/tp_search.py).

The helper process (cli/background.py) traced the model at degree 1; here it derives the styles
(tp_degrees.py) and traces one rank at every other degree, one after another, while this process waits
for them; then every degree but the best screened one is searched there too, beside this process's own
search of the best (solve/tp_search.py ``beside``)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from shard_planner.errors import UserError

logger = logging.getLogger(__name__)


def degrees_to_search(args: argparse.Namespace, gpus_per_node: int, device: str, from_trace_file: bool) -> list[int]:
    """``[--tp]`` (checked against the cluster), else the candidate degrees on a GPU profile and ``[1]`` on a
    CPU one or for a trace.json (tp_degrees.py [Note: Which degrees are searched])."""
    from shard_planner.tp_degrees import candidate_degrees

    if args.tp is not None:
        if gpus_per_node % args.tp or args.gpus % args.tp:
            raise UserError(f"--tp {args.tp} must divide the GPUs per node ({gpus_per_node}) and --gpus ({args.gpus}): "
                            "tensor parallelism stays inside a node")
        if args.tp > 1 and from_trace_file:
            raise UserError(f"--tp {args.tp}: a trace.json holds one rank at one degree; plan the model file to "
                            "trace it at another")
        return [args.tp]
    if device == "cpu" or from_trace_file:
        return [1]
    return candidate_degrees(args.gpus, gpus_per_node)


def plan_degrees(args: argparse.Namespace, hf, dtype: str, degrees: list[int], trace, request, helper):
    """The plan over ``degrees`` (``trace``: the model traced at degree 1); the styles derived and the other
    degrees traced by ``helper``, each screened here as it arrives (solve/tp_search.py)."""
    from shard_planner.solve import plan_model
    from shard_planner.solve.tp_search import DegreeOption, plan_over_degrees

    if degrees == [1]:
        return plan_model(trace, request)
    found = helper.submit(_degree_styles, args.model, hf, degrees, args.sequence_parallel, args.loss_parallel,
                          trace.tokens_per_sample).result()
    traced = {t: helper.submit(_trace_at, args.model, hf, dtype, styles, t) for t, styles in found.styles.items()}
    if len(traced) == 1 and 1 not in degrees and not found.refused:  # --tp N: that degree alone
        (t, call), = traced.items()
        return plan_model(call.result(), replace(request, tensor_parallel=found.styles[t]))

    def options():
        if 1 in degrees:
            yield DegreeOption(None, trace)
        for t, call in traced.items():  # each as the helper finishes it, screened before the next is read
            yield DegreeOption(found.styles[t], call.result())

    return plan_over_degrees(options(), request, refused=found.refused,
                             beside=helper.submit if helper.forked else None)


def _degree_styles(model: str, hf, degrees: list[int], sequence_parallel: bool, loss_parallel: bool,
                   seq_len: int | None):
    """In the helper: tp_degrees.degree_styles of the model file."""
    from shard_planner.modelfile import load_model_file
    from shard_planner.tp_degrees import degree_styles

    return degree_styles(load_model_file(model, hf), degrees, sequence_parallel=sequence_parallel,
                         loss_parallel=loss_parallel, seq_len=seq_len)


def _trace_at(model: str, hf, dtype: str, styles, degree: int):
    """In the helper: one rank of the model at ``degree`` with ``styles``, traced."""
    from shard_planner.modelfile import load_model_file
    from shard_planner.trace import trace_model

    return trace_model(load_model_file(model, hf), dtype=dtype, tensor_parallel=styles, tp_size=degree)
