"""The loss a plan's step computes over the output layer (``model.loss`` in the plan file; ``--loss``; a model
file's ``TRAINING["loss"]``): the names, which shard_planner/model/loss.py implements.

- ``model``: the model file's ``loss_fn`` (a transformers model's own loss from its ``labels``);
- ``chunked``: torchtune's ``CEWithChunkedOutputLoss`` (the output layer on chunks of the sequence, each
  chunk's logits upcast to fp32 alone);
- ``fused``: Liger Kernel's fused linear cross-entropy (the output layer and the loss in one function, the
  whole logits never held).
"""

MODEL, CHUNKED, FUSED = "model", "chunked", "fused"
LOSSES = (MODEL, CHUNKED, FUSED)
CHUNKS = 8  # torchtune's num_output_chunks in every recipe that uses CEWithChunkedOutputLoss
IGNORE_INDEX = -100  # targets every loss skips: transformers', F.cross_entropy's, torchtune's and Liger's

DESCRIPTIONS = {
    MODEL: "the model file's loss",
    CHUNKED: f"chunked cross-entropy ({CHUNKS} chunks along the sequence, as torchtune's CEWithChunkedOutputLoss)",
    FUSED: "fused output layer and cross-entropy (Liger Kernel's fused linear cross-entropy)",
}
