"""A plan's tensor parallelism: which module is split how over the ``tp`` ranks of a node (issue 30).

The degree is ``Mesh.tp`` (shard_planner/parallel/mesh.py owns every size); this record is the rest of the plan
file's ``tensor_parallel`` section: one :class:`Style` per module (by fully qualified name, as the model
file or transformers builds it) and the two options, sequence parallelism and loss parallelism.

    tp = TensorParallel(styles={"layers.0.attention.wq": "colwise", ...}, sequence_parallel=True)
    tp.style_of("layers.0.attention.wq")       # Style.COLWISE
    tp.styles_by_fqn                            # {fqn: Style}, forward order as given

What each style does, as torch.distributed.tensor.parallel does it (torch 2.13) and torchtitan's Llama plan
uses it (torchtitan/models/llama3/infra/parallelize.py ``apply_tp``, torchtitan <= 0.2; the same layouts in
torchtitan 0.3's models/common/decoder_sharding.py):

[Note: The tensor-parallel styles]
  ``colwise``      ColwiseParallel(): an ``nn.Linear`` whose weight is split on its output dimension (Shard(0) of
                   the (out, in) weight, bias Shard(0)); input Replicate, output Shard(-1) handed on as the local
                   tensor (``use_local_output=True``): wq/wk/wv, w1/w3 (q/k/v/gate/up projections). No
                   collective in forward; its input's gradient is Partial, summed where the input was
                   gathered (the sequence all-gather's backward is a reduce-scatter) or all-reduced without
                   sequence parallelism.
  ``rowwise``      RowwiseParallel(): weight split on its input dimension (Shard(1)), bias Replicate; input
                   Shard(-1) (the colwise output's local tensor). Its Partial output is reduce-scattered to
                   Shard(1) on the sequence with sequence parallelism (``output_layouts=Shard(1)``), else
                   all-reduced to Replicate: wo, w2 (o/down projections).
  ``embedding``    RowwiseParallel(input_layouts=Replicate()) on an ``nn.Embedding``: its (vocab, dim) weight split
                   on the vocabulary (Shard(0)); each rank looks up its rows and the Partial output is
                   reduce-scattered to Shard(1) with sequence parallelism, else all-reduced.
  ``head``         ColwiseParallel on the output layer: input Shard(1) (all-gathered) with sequence parallelism,
                   else Replicate; output Shard(-1) kept as a DTensor for ``loss_parallel()`` (cross-entropy
                   over the vocabulary shards: two all-reduces of (batch, seq) statistics) when loss
                   parallelism is on, else all-gathered to Replicate logits.
  ``norm``         SequenceParallel(): a norm that runs on its Shard(1) sequence slice, parameters replicated
                   (their gradients all-reduced over the tp group, as DTensor Partial). Sequence parallelism only.
  ``gather_input`` PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()): the
                   attention and feed-forward modules' sequence input is all-gathered before their colwise
                   projections (the all-gather's backward: a reduce-scatter). Sequence parallelism only. The
                   input is the first positional argument, or the keyword argument named by
                   ``gather_input:NAME`` (transformers' decoder layers call ``self_attn(hidden_states=...)``).
  ``grad_all_reduce`` transformers' ``replicated_with_grad_allreduce`` (transformers/distributed/tensor_parallel.py
                   ``ReplicatedWithGradAllReduce``): a module between a colwise and a rowwise layer that normalises
                   along the split axis (Qwen3's per-head ``q_norm`` / ``k_norm``, which see this rank's heads), its
                   parameters whole on every rank as plain tensors, no collective in forward; each parameter's
                   gradient covers this rank's heads only and is summed over the tp group once autograd has
                   accumulated it (a post-accumulate-grad hook: one all-reduce of its bytes per step).

A model runs under tensor parallelism only if its code never assumes full sizes inside a split region: a
``view(B, T, n_heads, head_dim)`` of a colwise output fails on the local tensor; ``view(B, T, -1, head_dim)``
(torchtitan's and transformers' attention) works.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from shard_planner.errors import PlanError, UserError
from shard_planner.parallel.mesh import degree_divides


class Style(str, Enum):
    """How one module is split: [Note: The tensor-parallel styles]."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    EMBEDDING = "embedding"
    HEAD = "head"
    NORM = "norm"
    GATHER_INPUT = "gather_input"
    GRAD_ALL_REDUCE = "grad_all_reduce"


SEQUENCE_DIM = 1  # (batch, seq, hidden) activations: sequence parallelism splits dim 1 (torchtitan's Shard(1))
GATHER_KWARG_SEPARATOR = ":"  # "gather_input:hidden_states": the keyword argument that is gathered


@dataclass(frozen=True)
class ModuleStyle:
    """One module's style; ``kwarg`` names the gathered keyword argument of a ``gather_input`` (None: the
    first positional argument)."""

    style: Style
    kwarg: str | None = None

    @staticmethod
    def parse(text: str, where: str) -> "ModuleStyle":
        name, _, kwarg = text.partition(GATHER_KWARG_SEPARATOR)
        try:
            style = Style(name)
        except ValueError:
            raise PlanError(f"{where}: unknown tensor-parallel style {text!r}; one of "
                            f"{', '.join(s.value for s in Style)}") from None
        if kwarg and style is not Style.GATHER_INPUT:
            raise PlanError(f"{where}: only gather_input names an argument ({text!r})")
        return ModuleStyle(style, kwarg or None)

    @property
    def text(self) -> str:
        return self.style.value + (GATHER_KWARG_SEPARATOR + self.kwarg if self.kwarg else "")


@dataclass(frozen=True)
class TensorParallel:
    """The plan file's ``tensor_parallel`` section: ``styles`` maps module fqn -> style text (see
    :class:`ModuleStyle`); ``sequence_parallel``: activations between the split regions are Shard(1) on the
    sequence (norms run on their slice); ``loss_parallel``: the output layer's logits stay split on the
    vocabulary into the loss."""

    styles: dict[str, str] = field(default_factory=dict)
    sequence_parallel: bool = True
    loss_parallel: bool = True

    def __post_init__(self):
        if not isinstance(self.styles, dict) or not self.styles:
            raise PlanError("tensor_parallel.styles must name at least one module's style")
        parsed = {fqn: ModuleStyle.parse(text, f"tensor_parallel.styles[{fqn!r}]") for fqn, text in self.styles.items()}
        if not self.sequence_parallel:
            only_sp = sorted(f for f, s in parsed.items() if s.style in (Style.NORM, Style.GATHER_INPUT))
            if only_sp:
                raise PlanError(f"tensor_parallel.styles[{only_sp[0]!r}]: norm and gather_input are sequence "
                                "parallelism's styles; set tensor_parallel.sequence_parallel true or drop them")
        heads = [f for f, s in parsed.items() if s.style is Style.HEAD]
        if self.loss_parallel and not heads:
            raise PlanError("tensor_parallel.loss_parallel needs the output layer's style \"head\"")
        if len(heads) > 1:
            raise PlanError(f"tensor_parallel.styles: one output layer (\"head\"), got {len(heads)}: {heads[:2]}")

    @property
    def styles_by_fqn(self) -> dict[str, ModuleStyle]:
        return {fqn: ModuleStyle.parse(text, fqn) for fqn, text in self.styles.items()}

    def style_of(self, fqn: str) -> ModuleStyle | None:
        text = self.styles.get(fqn)
        return None if text is None else ModuleStyle.parse(text, fqn)

    def check_sequence(self, degree: int, seq_len: int | None) -> None:
        """With sequence parallelism, a :class:`UserError` when ``degree`` does not divide ``seq_len`` tokens per
        sample (None: no sequence to check): every rank holds an equal slice of it."""
        if self.sequence_parallel and seq_len is not None and not degree_divides(degree, seq_len):
            raise UserError(f"sequence parallelism of degree {degree}: the sequence length {seq_len} does not divide "
                            f"by {degree}; choose a tp degree or sequence length so that it does")

    @property
    def head_fqn(self) -> str | None:
        return next((f for f, s in self.styles_by_fqn.items() if s.style is Style.HEAD), None)

    @property
    def description(self) -> str:
        """For people: ``sequence parallel, loss parallel`` (or ``no sequence parallelism``)."""
        parts = ["sequence parallel" if self.sequence_parallel else "no sequence parallelism"]
        if self.loss_parallel:
            parts.append("loss parallel")
        return ", ".join(parts)


# The grad_all_reduce style at run time, here below its two users: the executor (execute/tensor_parallel.py
# GradAllReduce) and the FSDP2 export, which writes this function into its file as it is (report/export/
# fsdp2_tp.py). torch is imported when it runs, so this vocabulary module stays free of it.
def sum_gradients_over(module: torch.nn.Module, group) -> None:
    """Hook each parameter the forward of ``module`` sees so that its gradient is summed over the process group
    ``group`` once autograd has accumulated it."""
    import torch
    import torch.distributed._functional_collectives as funcol

    hooked = {}

    def sum_over_group(param):
        param.grad.copy_(funcol.all_reduce(param.grad, "sum", group))

    def hook_parameters(mod, _args):  # on the parameters the forward sees (FSDP2's unsharded ones)
        if torch.is_grad_enabled():
            for name, param in mod.named_parameters(recurse=False):
                if param.requires_grad and hooked.get(name) is not param:
                    param.register_post_accumulate_grad_hook(sum_over_group)
                    hooked[name] = param

    module.register_forward_pre_hook(hook_parameters)
