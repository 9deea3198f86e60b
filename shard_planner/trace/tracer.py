"""``trace_model``: one forward + loss + backward per batch size, under FakeTensorMode, recorded per module.

The stage, in order:

- The model is built under :class:`FakeTensorMode` (no real memory; ``trace/build.py``), its floating
  parameters are cast to the compute dtype as FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` does
  (parameters are recorded as built, before the cast and with their ``requires_grad``: a model file
  that freezes weights is traced as that fine-tune, ``trace/params.py``), and floating
  inputs are cast at the root's entry (``cast_forward_inputs``).
- Each batch size is one traced step (``trace/capture.py``), with repeated identical blocks traced once
  (``trace/twins.py``, [Note: twins]); a step whose templates turn out to run a shared module is traced
  again without them. ``trace_model(..., reuse=False)`` traces everything.
- ``trace/replay.py`` turns each step's log into per-module numbers and fits the two batch sizes.

Trace files are read by ``trace/files.py``; a real CPU step checks a trace in ``trace/realrun.py``.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from shard_planner.errors import ModelFileError, UserError
from shard_planner.model.modelfile import ModelFile, load_model_file
from shard_planner.plan import Plan
from shard_planner.parallel.tensor_parallel import TensorParallel
from shard_planner.trace.build import build_fake, cast_parameters
from shard_planner.trace.capture import Step, run_step
from shard_planner.trace.dynamo_deferred import dynamo_deferred
from shard_planner.trace.flops import FlopCounter
from shard_planner.trace.hf_paths import real_run_paths
from shard_planner.trace.kernel_ops import fit_records
from shard_planner.trace.records import StepResult
from shard_planner.trace.routing import ASSUMPTION as ROUTING_ASSUMPTION
from shard_planner.trace.replay import module_traces, static_facts, step_result
from shard_planner.trace.structure import model_fingerprint, structural_hashes
from shard_planner.trace.twins import ReuseFacts, reuse_facts
from shard_planner.trace.tp_local import RankEmulation, check_tensor_parallel, fit_collectives, shard_parameters
from shard_planner.trace.types import Affine, ModelTrace
from shard_planner.units import compute_dtype_name

logger = logging.getLogger(__name__)


def trace_model(
    model_file: ModelFile | str,
    *,
    batch_sizes: tuple[int, int] = (1, 2),
    dtype: str = "bfloat16",
    reuse: bool = True,
    tensor_parallel: TensorParallel | None = None,
    tp_size: int = 1,
) -> ModelTrace:
    """Trace ``model_file`` (a ModelFile or its path) at two micro-batch sizes, without real memory.

    ``dtype`` is the compute dtype (``"bfloat16"``/``"bf16"`` or ``"float32"``/``"fp32"``): floating
    parameters are cast to it as FSDP2's mixed precision does. ``reuse=False`` traces every repeated
    block for real (for checking the reuse; see [Note: twins]). ``tp_size`` > 1 traces one rank of tensor
    parallelism with the styles ``tensor_parallel`` (trace/tp_local.py, [Note: A tensor-parallel rank traced
    locally]); at 1 the styles are unused and the trace is the one without them.
    """
    started = time.perf_counter()
    mf = load_model_file(model_file) if isinstance(model_file, (str, Path)) else model_file
    dtype_name = compute_dtype_name(dtype)
    tp = check_tensor_parallel(tensor_parallel, tp_size)
    compute = getattr(torch, dtype_name)
    b1, b2 = (int(b) for b in batch_sizes)
    if b1 < 1 or b2 < 1 or b1 == b2:
        raise UserError(f"batch_sizes must be two different positive sizes, got {tuple(batch_sizes)}")
    with dynamo_deferred(), _quiet_fake_tensor_logger():  # [Note: torch._dynamo during a trace]
        # Tensors a model file made at import time, outside the mode, are converted when first used.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = build_fake(mf, fake_mode)
        modules = list(model.named_modules())
        hashes = structural_hashes(model)
        fingerprint = model_fingerprint(model)  # of the whole model, which the executor builds and checks
        if tp is not None:
            shard_parameters(model, tp, tp_size, fake_mode)
        static = static_facts(modules)  # parameters as built (one rank's): dtypes before the cast, requires_grad
        _check_something_trains(mf, model)
        cast_parameters(model, compute, fake_mode)
        flops = FlopCounter()
        banned: set[str] = set()  # modules that turned out not to be faithful templates, for both sizes
        facts = reuse_facts(model, hashes, reuse)
        with real_run_paths(mf, b1):  # transformers' mask helpers: [Note: transformers under fake tensors]
            (r1, routed), (r2, _) = [_trace_batch(fake_mode, model, modules, mf, compute, facts, flops, banned, b,
                                                  None if tp is None else (tp, tp_size)) for b in (b1, b2)]
    if routed:
        logger.warning("%s: %s", mf.path, ROUTING_ASSUMPTION)
    if r1.forward_order != r2.forward_order:
        logger.warning("forward order differs between batch sizes %d and %d; using %d's", b1, b2, b1)

    def fit(get) -> Affine:
        return Affine.fit(b1, float(get(r1)), b2, float(get(r2)))

    seq_len = mf.training.get("seq_len")
    return ModelTrace(
        model_path=str(mf.path),
        model_class=type(model).__name__,
        compute_dtype=dtype_name,
        batch_sizes=(b1, b2),
        tokens_per_sample=int(seq_len) if seq_len is not None else None,
        modules=module_traces(modules, static, hashes, (b1, b2), r1, r2),
        forward_order=r1.forward_order,
        backward_order=r1.backward_order,
        batch_input_bytes=fit(lambda r: r.batch_input_bytes),
        loss_saved_bytes=fit(lambda r: r.loss_saved_bytes),
        loss_peak_rise_bytes=fit(lambda r: r.loss_peak_rise_bytes),
        loss_flops=fit(lambda r: r.loss_flops),
        fingerprint=fingerprint,
        trace_seconds=time.perf_counter() - started,
        reused_modules=r1.reused_modules,
        loss_ops=r1.loss_ops,
        loss_kernels=fit_records(list(r1.loss_kernels), list(r2.loss_kernels), b1, b2),
        training=dict(mf.training),
        forward_cache=r1.forward_cache,
        tp_size=tp_size if tp is not None else 1,
        tensor_parallel=tp,
        loss_tp_collectives=fit_collectives(list(r1.loss_tp_collectives), list(r2.loss_tp_collectives), b1, b2),
    )


def trace_for_plan(model_file: ModelFile | str, plan: Plan) -> ModelTrace:
    """``model_file`` traced as ``plan`` runs it: one rank at the plan's tensor-parallel degree and styles, in
    its numerics' compute dtype (what ``estimate``, ``report`` and ``run``'s prediction price the plan on)."""
    return trace_model(model_file, dtype=plan.training.numerics.compute_dtype, tensor_parallel=plan.tensor_parallel,
                       tp_size=plan.mesh.tp_size)


def _check_something_trains(mf: ModelFile, model: nn.Module) -> None:
    """A model whose parameters are all frozen has nothing to train (its loss has no gradient to compute)."""
    params = list(model.parameters())
    if params and not any(p.requires_grad for p in params):
        raise ModelFileError(f"{mf.path}: build_model() froze every parameter (requires_grad False): nothing to "
                             "train; leave the parameters to fine-tune trainable")


def _trace_batch(fake_mode: FakeTensorMode, model: nn.Module, modules: list[tuple[str, nn.Module]], mf: ModelFile,
                 compute: torch.dtype, facts: ReuseFacts, flops: FlopCounter, banned: set[str],
                 batch_size: int, tp: tuple[TensorParallel, int] | None = None) -> tuple[StepResult, int]:
    """One traced step at ``batch_size``, and how many data-dependent ops it answered under the routing
    assumption ([Note: balanced routing]); again without the templates that ran a shared module or whose
    output a caller modified in place (added to ``banned``; [Note: unsafe reuse])."""
    while True:
        with fake_mode:
            inputs, targets = mf.batch(batch_size)
        step = Step(model, mf, compute, facts, flops, banned, RankEmulation(*tp) if tp is not None else None)
        with fake_mode:
            run_step(step, modules, inputs, targets)
        del inputs, targets
        for p in model.parameters():
            p.grad = None
        tainted, unsafe = step.tainted_templates(), step.unsafe_reuse() - banned
        if not tainted and not unsafe:
            return step_result(step), step.known.answered
        if unsafe:
            logger.warning("%s: not reusing identical blocks' traces for %s (a caller modifies their output in "
                           "place); tracing them for real", mf.path, _listed(sorted(unsafe)))
        if tainted:
            logger.debug("re-tracing batch %d without templates %s (shared modules)", batch_size, sorted(tainted))
        banned |= tainted | unsafe


def _listed(fqns: list[str], shown: int = 4) -> str:
    more = f" and {len(fqns) - shown} more" if len(fqns) > shown else ""
    return ", ".join(fqns[:shown]) + more


@contextmanager
def _quiet_fake_tensor_logger():
    """FakeTensorMode logs a whole traceback on a shape error; the error reaches the user as one line."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    old = log.level
    if not logging.getLogger("shard_planner").isEnabledFor(logging.DEBUG):
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(old)
