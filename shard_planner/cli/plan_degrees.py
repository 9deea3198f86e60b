"""``plan``'s tensor-parallel degrees: which to search (``--tp``, or each that divides the node on a GPU profile),
each traced and screened in a helper process, then the layout search over their splits (solve/layout_search.py;
the splits are tensor-parallel degrees alone until pipeline stages join them).

    work = DegreeWork.start(args, hf, dtype, degrees, second)   # before degree 1's trace is back
    result = work.plan(trace, request, helper)
    work.trace_of(result.plan)   # the trace of one rank at the chosen degree: what the report draws

[Note: Two helpers for the degrees]
  The degree search is CPU work in pieces that do not wait on each other, and the tracing has to be done
  in the helper processes (cli/background.py: this process never imports torch). The command forks a
  second helper beside the one that traces degree 1; the second derives the styles (trace/tp_degrees.py, a
  forward of the model built without memory, each repeated block recorded from its first: trace/tp_call_twins.py;
  about 1.2 CPU-s on Llama 3 70B besides that helper's torch import) while the first traces and this process
  imports the planner, where this process would otherwise wait. Then the second traces the first degree
  above 1 and traces and screens (layout_search.screen) the last, the first helper traces those between (0.6-0.8
  s each at 70B), and this process screens degree 1 and each of the others as it comes (0.6-0.9 s each):
  three processes on two cores, each with about the same work. On Llama 3 70B at 256 GPUs the screens end
  at about 6 s where one helper doing it all took 8.2 s. The degrees to search in full but the best
  screened one are searched in the helpers (``beside``, the second first), at the same time as this
  process's search. On two cores this keeps both busy from the start: Llama 3 70B on 256 GPUs and 405B on
  512 use about 25 CPU-seconds, so nothing can bring them under about 12.5 s on this machine.
  Each trace and the styles come from the trace cache when it holds them (trace/trace_cache.py: planning
  the same model again at another budget or GPU count): the helpers then import no torch (and are forked
  after this process imported the planner: cli/plan.py [Note: Importing before the helpers fork]), and when
  every degree's trace is there the two helpers screen the degrees above 1 in turn (``_deal``), since their
  traces cost nothing, while this process screens degree 1.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from dataclasses import dataclass, field, replace

from shard_planner.errors import UserError
from shard_planner.parallel.mesh import ModelSplit

logger = logging.getLogger(__name__)


def degrees_to_search(args: argparse.Namespace, gpus_per_node: int, device: str) -> list[int]:
    """``[--tp]`` (checked against the cluster), else the candidate degrees on a GPU profile and ``[1]`` on a
    CPU one or for a trace.json (trace/tp_degrees.py [Note: Which degrees are searched])."""
    from shard_planner.model.modelfile import is_trace_file
    from shard_planner.trace.tp_degrees import candidate_degrees, check_node_degree

    from_trace_file = is_trace_file(args.model)
    if args.tp is not None:
        check_node_degree(args.tp, args.gpus, gpus_per_node)
        if args.tp > 1 and from_trace_file:
            raise UserError(f"--tp {args.tp}: a trace.json holds one rank at one degree; plan the model file to "
                            "trace it at another")
        return [args.tp]
    if device == "cpu" or from_trace_file:
        return [1]
    return candidate_degrees(args.gpus, gpus_per_node)


@dataclass
class DegreeWork:
    """The degrees above 1 on their way: the styles being derived in the ``second`` helper."""

    args: argparse.Namespace
    hf: object
    dtype: str
    degrees: list[int]
    second: object  # cli/background.py Helper
    styles_call: object | None  # its Call, None when only degree 1 is planned
    traces: dict = field(default_factory=dict)  # ModelSplit -> the trace of one rank of it, as each arrives

    @classmethod
    def start(cls, args: argparse.Namespace, hf, dtype: str, degrees: list[int], second) -> "DegreeWork":
        """Start deriving the styles of ``degrees`` above 1 in ``second`` (the sequence length is checked
        later, against degree 1's trace)."""
        call = second.submit(_degree_styles, args.model, hf, degrees, args.sequence_parallel,
                             args.loss_parallel) if degrees != [1] else None
        return cls(args, hf, dtype, degrees, second, call)

    def plan(self, trace, request, helper, while_waiting=None):
        """The plan over the degrees (``trace``: the model traced at degree 1), [Note: Two helpers for the
        degrees]; ``while_waiting``: what this process does once its own search is done, while it waits for
        those in the helpers (solve/layout_search.py ``plan_over_layouts``)."""
        from shard_planner.solve import plan_model
        from shard_planner.solve.layout_search import LayoutOption, plan_over_layouts

        self.traces[ModelSplit()] = trace
        if self.styles_call is None:
            return plan_model(trace, request)
        found = self.styles_call.result().with_sequence(trace.tokens_per_sample)
        if len(found.styles) == 1 and 1 not in self.degrees and not found.refused:  # --tp N: that degree alone
            (t, styles), = found.styles.items()
            option = self.second.submit(_trace_and_screen, self.args.model, self.hf, self.dtype, styles, t, None)
            return plan_model(self._kept(option.result()).trace, replace(request, tensor_parallel=styles))
        from shard_planner.trace.trace_cache import holds

        cached = all(holds(_trace_key(self.args.model, self.hf, self.dtype, t, s)) for t, s in found.styles.items())
        calls = {t: who.submit(_trace_and_screen, self.args.model, self.hf, self.dtype, found.styles[t], t,
                                replace(request, tensor_parallel=found.styles[t]) if screen_there else None)
                 for t, (who, screen_there) in _deal(list(found.styles), self.second, helper, cached).items()}

        def options():  # those not screened in a helper are screened here, as they come
            if 1 in self.degrees:
                yield LayoutOption(ModelSplit(), trace)
            for call in calls.values():
                yield self._kept(call.result())

        searching = itertools.cycle([self.second, helper])
        beside = (lambda fn, *a: next(searching).submit(fn, *a)) if helper.forked else None
        return plan_over_layouts(options(), request, refused=found.refused, beside=beside,
                                 while_waiting=while_waiting)


    def _kept(self, option):
        """``option`` (a LayoutOption), its trace kept for :meth:`trace_of`."""
        self.traces[option.split] = option.trace
        return option

    def trace_of(self, plan):
        """The trace of one rank at ``plan``'s tensor-parallel degree, the one its prediction was made on (the
        report's units, timeline and allocator line are that rank's: report/__init__.py [Note: One rank's
        trace])."""
        return self.traces[plan.mesh.split]


def _deal(degrees: list[int], second, first, cached: bool = False) -> dict[int, tuple[object, bool]]:
    """Who traces each of ``degrees`` (above 1), and whether it screens it too (else this process does): the
    second helper traces the first degree and traces and screens the last, the first helper (the one that
    traced degree 1) traces those between; in the order the traces are read ([Note: Two helpers for the
    degrees]). When the trace cache holds every one of them (``cached``), a "trace" is a file read, so the two
    helpers (forked after this process imported the planner: cli/plan.py [Note: Importing before the helpers
    fork]) screen them in turn, the second first, while this process screens degree 1."""
    if cached:
        return {t: (second if i % 2 == 0 else first, True) for i, t in enumerate(degrees)}
    if len(degrees) < 2:
        return {t: (second, True) for t in degrees}
    return {degrees[0]: (second, False), **{t: (first, False) for t in degrees[1:-1]}, degrees[-1]: (second, True)}


def load_and_trace(model: str, hf, dtype: str):
    """(trace, TRAINING defaults, fine-tune) of the model file (or transformers config) ``model`` at degree 1,
    from the trace cache when it holds them (trace/trace_cache.py)."""
    from shard_planner.trace.trace_cache import cached

    def traced():
        from shard_planner.model.modelfile import load_model_file
        from shard_planner.trace import trace_model

        model_file = load_model_file(model, hf)
        return trace_model(model_file, dtype=dtype), model_file.defaults, model_file.finetune

    return cached(model_cache_key(model, hf, dtype), traced)


def model_cache_key(model: str, hf, dtype: str):
    """The trace cache's key of ``model`` at degree 1, with its TRAINING defaults and fine-tune."""
    from shard_planner.trace.trace_cache import CacheKey

    return CacheKey("model", model, (hf, dtype, 1))


def _degree_styles(model: str, hf, degrees: list[int], sequence_parallel: bool, loss_parallel: bool):
    """In a helper: tp_degrees.degree_styles of the model file (from the trace cache when it holds them)."""
    from shard_planner.trace.trace_cache import CacheKey, cached

    def derived():
        from shard_planner.model.modelfile import load_model_file
        from shard_planner.trace.tp_degrees import degree_styles

        return degree_styles(load_model_file(model, hf), degrees, sequence_parallel=sequence_parallel,
                             loss_parallel=loss_parallel)

    return cached(CacheKey("styles", model, (hf, tuple(degrees), sequence_parallel, loss_parallel)), derived)


def _trace_and_screen(model: str, hf, dtype: str, styles, degree: int, request):
    """In a helper: one rank of the model at ``degree`` with ``styles``, traced (or from the trace cache), and
    its screen (solve/layout_search.py ``screen``; none when ``request`` is None), as a LayoutOption."""
    from shard_planner.solve.layout_search import LayoutOption, screen
    from shard_planner.trace.trace_cache import cached

    def traced():
        from shard_planner.model.modelfile import load_model_file
        from shard_planner.trace import trace_model

        return trace_model(load_model_file(model, hf), dtype=dtype, tensor_parallel=styles, tp_size=degree)

    trace = cached(_trace_key(model, hf, dtype, degree, styles), traced)
    return LayoutOption(ModelSplit(tp=degree), trace, styles, screen(trace, request) if request is not None else None)


def _trace_key(model: str, hf, dtype: str, degree: int, styles):
    """The trace cache's key of one rank of ``model`` at ``degree`` with ``styles`` (trace/trace_cache.py)."""
    from shard_planner.trace.trace_cache import CacheKey

    return CacheKey("trace", model, (hf, dtype, degree, styles))
