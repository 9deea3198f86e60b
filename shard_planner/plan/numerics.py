"""The step's numerics, one policy: the dtype of each class of tensor and each module's GEMM precision.

    numerics = plan.training.numerics           # Numerics(compute_dtype="bfloat16", reduce_scatter_dtype="float32")
    numerics.gathered_dtype("float32")          # "bfloat16": what a floating parameter is all-gathered and used in
    numerics.gemm_dtype("layers.0.attention.wq")  # "bfloat16": the dtype that module's matmuls run in

[Note: One numerics policy]
FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
``FSDPParam.init_dtype_attrs``, _fsdp_collectives.py) and torch.optim give each class of tensor its dtype:

- stored (sharded) parameters: as built; the trace records each parameter's dtype (fp32 master weights when the
  model is built in fp32, as torchtitan builds it). NF4 is a storage, not a dtype (model/param_storage.py). The
  single-device step (plan/engine.py) casts every floating parameter to the compute dtype first
  (``stored_dtype``, ``Training.stored_dtype``): stored, gradients and optimizer states in it.
- gathered (unsharded) parameters: ``param_dtype`` for a floating parameter, cast before the all-gather when its
  built dtype differs (the cast copy of the all-gather input, cost/memory.py); a non-floating one as stored.
- unsharded gradients: as the gathered parameter (autograd computes them in it): ``gathered_dtype`` too.
- the reduce-scatter: ``reduce_dtype``; equal to ``param_dtype`` it means no cast (``init_dtype_attrs`` sets
  it None), and the gradients are reduced as computed.
- sharded gradients and optimizer states: as stored (FSDP2 casts the reduce-scatter's output to the sharded
  parameter's dtype; AdamW keeps its states in the parameter's dtype).
- activations: ``param_dtype``, the dtype the modules compute in (cost/activations.py scales the traced
  compute dtype's bytes to it).
- GEMMs: each module's matmuls at :meth:`Numerics.gemm_dtype`, today the compute dtype for every module; the
  FLOP rate a module is priced at is the profile's at that dtype (cost/model.py).

Every stage asks this one object: the trace (the dtype a plan's model is traced in), cost (bytes of every
class, FLOP rates), the solver's linear model, execute (the ``MixedPrecisionPolicy`` it applies) and the
exports. The plan file keeps ``training.param_dtype`` and ``training.reduce_dtype`` (torch's names);
``Training.numerics`` is their policy, and tests/test_numerics_policy.py fails when a module outside the plan's
vocabulary reads those fields itself. float8 training on chosen Linears (docs/extending.md) extends this
policy: which modules' GEMMs run in float8 (:meth:`gemm_dtype`) and, with a float8 all-gather, what their
weights are gathered in (:meth:`gathered_dtype` of a parameter of such a module).
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_planner.dtypes import FLOAT_DTYPES


@dataclass(frozen=True)
class Numerics:
    """The dtypes of one training step ([Note: One numerics policy]): ``compute_dtype`` (FSDP2's
    ``param_dtype``) and ``reduce_scatter_dtype`` (its ``reduce_dtype``), both dtype names ("bfloat16")."""

    compute_dtype: str = "bfloat16"
    reduce_scatter_dtype: str = "float32"
    # every floating parameter stored in this dtype (the model cast to it before training: the single-device
    # step, plan/engine.py); None: as built
    stored_dtype: str | None = None

    def stored(self, built: str) -> str:
        """The dtype a parameter built in ``built`` is stored in while it trains: ``stored_dtype`` for a
        floating one when the model is cast, else as built."""
        return self.stored_dtype if self.stored_dtype is not None and built in FLOAT_DTYPES else built

    def gathered_dtype(self, stored: str) -> str:
        """The dtype a parameter stored in ``stored`` is all-gathered in, held unsharded and used by its module,
        and its unsharded gradient's (autograd computes it in the parameter's dtype)."""
        return self.compute_dtype if stored in FLOAT_DTYPES else stored

    def casts(self, stored: str) -> bool:
        """Whether a parameter stored in ``stored`` is cast before its all-gather (mixed precision applies)."""
        return stored in FLOAT_DTYPES and self.stored(stored) != self.compute_dtype

    @property
    def reduce_casts(self) -> bool:
        """Whether gradients are cast for the reduce-scatter (FSDP2's reduce dtype is not None)."""
        return self.reduce_scatter_dtype != self.compute_dtype

    def sharded_dtype(self, stored: str) -> str:
        """The dtype of a parameter's shard (on one device: the parameter), its sharded gradient and its optimizer
        states: as stored (:meth:`stored`)."""
        return self.stored(stored)

    @property
    def activation_dtype(self) -> str:
        """The dtype activations are computed and saved in."""
        return self.compute_dtype

    def gemm_dtype(self, fqn: str | None) -> str:
        """The dtype module ``fqn``'s matmuls run in (None: the loss), which sets the FLOP rate it is priced at."""
        return self.compute_dtype

    def mixed_precision(self) -> dict[str, str]:
        """FSDP2's ``MixedPrecisionPolicy`` arguments, by dtype name: what execute applies and the FSDP2 export
        writes."""
        return {"param_dtype": self.compute_dtype, "reduce_dtype": self.reduce_scatter_dtype}
