"""The tensor-parallel degrees ``plan`` searches for a model, and the styles each is traced with.

    degrees = candidate_degrees(gpus=256, gpus_per_node=8)             # [1, 2, 4, 8]
    found = degree_styles(model_file, degrees, sequence_parallel=True, loss_parallel=True)
    found.styles    # degree -> TensorParallel (the same styles for every degree above 1)
    found.refused   # LayoutOutcome per degree ruled out, with the reason (a dimension it does not divide)

[Note: Which degrees are searched]
  Tensor parallelism stays inside a node (its collectives are on the compute stream's critical path,
  every block, so they need NVLink: torchtitan's 2-D runs use TP 8 inside 8-GPU hosts, FSDP across
  them, docs/performance.md / benchmarks/llama3_h100_202412_torchtitan.md), so the degrees are those of
  ``CANDIDATE_DEGREES`` that divide the GPUs per node and the GPUs. Each must also divide every split
  dimension of the model (attention heads, key/value heads, MLP width, vocabulary, with sequence
  parallelism the sequence: tp_styles.check_divisible); a degree that does not is an outcome with the
  dimension named. A transformers model is split by its own plan (hf.tp_plan), without sequence
  parallelism (tp_styles [Note: Sequence parallelism's styles]: it reads the sequence length off the
  embedding's output) and without loss parallelism (its loss views the logits as (-1, vocab), which a
  vocabulary-sharded DTensor cannot be), so those two are turned off for it and the log says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from shard_planner.errors import UserError, first_line
from shard_planner.parallel.mesh import ModelSplit, degree_divides
from shard_planner.plan.loss import MODEL
from shard_planner.plan.points import LayoutOutcome
from shard_planner.parallel.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

CANDIDATE_DEGREES = (1, 2, 4, 8)


def check_node_degree(tp: int, gpus: int, gpus_per_node: int) -> None:
    """A :class:`UserError` (one line) when ``--tp`` does not divide the GPUs per node and the GPUs: tensor
    parallelism stays inside a node ([Note: Which degrees are searched])."""
    if not degree_divides(tp, gpus_per_node, gpus):
        raise UserError(f"--tp {tp} must divide the GPUs per node ({gpus_per_node}) and --gpus ({gpus}): "
                        "tensor parallelism stays inside a node")


def candidate_degrees(gpus: int, gpus_per_node: int) -> list[int]:
    """The degrees of ``CANDIDATE_DEGREES`` that divide the GPUs per node and the GPUs ([Note: Which degrees
    are searched])."""
    return [t for t in CANDIDATE_DEGREES if degree_divides(t, gpus_per_node, gpus)]


@dataclass(frozen=True)
class DegreeStyles:
    """The styles to trace each searchable degree above 1 with, and the degrees ruled out with their reason."""

    styles: dict[int, TensorParallel] = field(default_factory=dict)
    refused: tuple[LayoutOutcome, ...] = ()

    def with_sequence(self, seq_len: int | None) -> "DegreeStyles":
        """The degrees whose sequence parallelism ``seq_len`` tokens per sample do not divide moved to the
        refused ones (TensorParallel.check_sequence; None: no sequence to split)."""
        styles, refused = {}, list(self.refused)
        for t, tp in self.styles.items():
            try:
                tp.check_sequence(t, seq_len)
            except UserError as e:
                refused.append(_refused(t, first_line(e)))
                continue
            styles[t] = tp
        return DegreeStyles(styles, tuple(sorted(refused, key=lambda o: o.split)))


def degree_styles(model_file, degrees: list[int], *, sequence_parallel: bool, loss_parallel: bool,
                  seq_len: int | None = None) -> DegreeStyles:
    """For each of ``degrees`` above 1: the model's styles (tp_styles.derive_tensor_parallel, from its
    structure or its transformers plan), or why that degree is refused
    (the styles cannot be derived; a dimension the degree does not divide); the model built without memory, as
    the tracer builds it (trace/build.py). ``seq_len``: the sequence length sequence parallelism splits (None:
    not checked here: :meth:`DegreeStyles.with_sequence`)."""
    from shard_planner.trace.dynamo_deferred import dynamo_deferred

    wanted = [t for t in degrees if t > 1]
    if not wanted:
        return DegreeStyles()
    if model_file.loss_name != MODEL:  # its loss on vocabulary-split logits would need collectives: model/loss.py
        why = f"--loss {model_file.loss_name} is not combined with tensor parallelism yet"
        return DegreeStyles(refused=tuple(_refused(t, why) for t in wanted))
    with dynamo_deferred():  # [Note: torch._dynamo during a trace]: this forward needs it no more than a trace
        return _styles_of(model_file, wanted, sequence_parallel, loss_parallel, seq_len)


def _styles_of(model_file, wanted: list[int], sequence_parallel: bool, loss_parallel: bool,
               seq_len: int | None) -> DegreeStyles:
    """:func:`degree_styles` of ``wanted`` (each above 1)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shard_planner.model.hf import is_transformers_model, tp_plan
    from shard_planner.trace.tp_adapters import lora_layers
    from shard_planner.trace.tp_styles import check_divisible, derive_tensor_parallel
    from shard_planner.trace.build import build_fake
    from shard_planner.trace.hf_paths import real_run_paths

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake(model_file, fake_mode)  # as the tracer builds it: no memory, transformers' paths too
    hf_plan = tp_plan(model)
    is_transformers = is_transformers_model(model)
    if is_transformers and (sequence_parallel or loss_parallel):
        logger.info("%s is a transformers model: tensor parallelism by its own plan, without sequence or loss "
                    "parallelism (shard_planner/trace/tp_degrees.py [Note: Which degrees are searched])",
                    type(model).__name__)
        sequence_parallel = loss_parallel = False
    if sequence_parallel and lora_layers(model):
        logger.info("%s has LoRA layers: tensor parallelism without sequence parallelism (shard_planner/trace/"
                    "tp_adapters.py [Note: LoRA adapters under tensor parallelism])", type(model).__name__)
        sequence_parallel = False
    try:
        if is_transformers and hf_plan is None:
            raise UserError(f"transformers has no tensor-parallel plan for {type(model).__name__}")
        with real_run_paths(model_file, 1):  # trace/hf_paths.py [Note: transformers under fake tensors]
            with fake_mode:  # as a trace makes it (trace/tracer.py _trace_batch): no real tensor to convert
                inputs, _targets = model_file.batch(1)
            tp = derive_tensor_parallel(model, inputs, sequence_parallel=sequence_parallel,
                                        loss_parallel=loss_parallel, hf_tp_plan=hf_plan, fake_mode=fake_mode)
    except UserError as e:
        why = first_line(e)
        return DegreeStyles(refused=tuple(_refused(t, why) for t in wanted))
    styles, refused = {}, []
    for t in wanted:
        try:
            check_divisible(model, tp, t, seq_len=seq_len)
        except UserError as e:
            refused.append(_refused(t, first_line(e)))
            continue
        styles[t] = tp
    return DegreeStyles(styles, tuple(refused))


def _refused(degree: int, why: str) -> LayoutOutcome:
    """The outcome of a degree ruled out before tracing, with why."""
    return LayoutOutcome(ModelSplit(tp=degree), judged="refused", refused=why)
