"""The engine a plan runs on: the library that shards its state and runs its collectives, or none.

    plan.engine        # "fsdp2": PyTorch's fully_shard; "single": one device, no sharding

A plan names its engine (``Plan.engine``; the plan file's ``engine``, written when it is not FSDP2, as
``mesh.tp`` is written when it is not 1: a plan file without one is FSDP2's, as every plan before the
field). The engine decides what a unit is at run time and which rules price it:

- ``fsdp2``: units are ``fully_shard`` calls, whose memory and communication rules are
  cost/engines/fsdp2.py's (the step's events, each unit's bytes and collectives, the sharded state, the
  walks over the step).
- ``single``: one device and plain PyTorch, as torchtune's single-device recipes train (issue 39 item 4):
  no sharding, no all-gathered copies, no collectives; every floating parameter trains in the compute dtype
  (the model is cast to it, LoRA adapters included: no fp32 master weights), gradients stay in ``.grad``
  until ``zero_grad``. A unit is only a region that is activation-checkpointed or not (its reshard and the
  prefetch depths mean nothing there). Its rules are cost/engines/single.py's.

DeepSpeed ZeRO (stages 1-3, its offload) is the next engine: its name joins ``ENGINES``, its rules stand
beside FSDP2's as cost/engines/zero.py, and every stage that reads a plan asks the plan's engine, not
FSDP2's modules (docs/extending.md, "DeepSpeed ZeRO 1-3 as a second engine").
"""

from __future__ import annotations

FSDP2 = "fsdp2"
SINGLE = "single"

# The engines a plan may name, each with its rules in cost/engines/ (cost/engines/__init__.py ``_engines``).
ENGINES = (FSDP2, SINGLE)

# What each engine is, in the words the summary and the report use
DESCRIPTIONS = {FSDP2: "FSDP2 (fully_shard)", SINGLE: "one device, no sharding (plain PyTorch)"}
# The memory category sharded_params, as each engine holds the parameters: the summary's and the report's word
PARAMETERS = {FSDP2: "sharded params", SINGLE: "parameters"}


def engine_refusal(engine: str, mesh, training, no_policy: str) -> str | None:
    """What makes a plan's ``mesh`` and ``training`` (plan/__init__.py) contradict its ``engine``, in the words
    the plan file's reader sees; None when nothing does. ``no_policy``: the gradient-sync policy that means none
    (``GRADIENT_SYNCS[0]``)."""
    if engine == SINGLE and mesh.world_size != 1:
        return (f"engine \"single\" trains on one device: the mesh {mesh.shape_text} has {mesh.world_size} ranks "
                "(plan it with engine fsdp2)")
    if engine == SINGLE and (training.gradient_sync != no_policy or training.keep_params_gathered):
        return ("training.gradient_sync and keep_params_gathered are FSDP2's between micro-steps: with engine "
                f"\"single\" autograd adds every micro-step's gradients into .grad; leave them at \"{no_policy}\" "
                "and false")
    if training.optimizer_in_backward and (engine != SINGLE or training.accumulation_steps > 1):
        return ("training.optimizer_in_backward steps each parameter as its gradient is ready: engine \"single\" "
                "only, without accumulation (the gradients do not wait for later micro-steps)")
    if engine != SINGLE and training.stored_dtype is not None:
        return (f"training.stored_dtype casts the model for engine \"single\" only: engine {engine} keeps the "
                "parameters as built (remove the field)")
    return None
