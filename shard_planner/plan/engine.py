"""The engine a plan runs on: the library that shards its state and runs its collectives.

    plan.engine        # "fsdp2": PyTorch's fully_shard (the only engine today)

A plan names its engine (``Plan.engine``; the plan file's ``engine``, written when it is not FSDP2, as
``mesh.tp`` is written when it is not 1: a plan file without one is FSDP2's, as every plan before the
field). The engine decides what a unit is at run time and which rules price it:
FSDP2's units are ``fully_shard`` calls, whose memory and communication rules are cost/engines/fsdp2.py's
(the step's events, each unit's bytes and collectives, the sharded state, the walks over the step).
DeepSpeed ZeRO (stages 1-3, its offload) is the next engine: its name joins ``ENGINES``, its rules stand
beside FSDP2's as cost/engines/zero.py, and every stage that reads a plan asks the plan's engine, not
FSDP2's modules (docs/extending.md, "DeepSpeed ZeRO 1-3 as a second engine").
"""

from __future__ import annotations

FSDP2 = "fsdp2"

# The engines a plan may name, each with its rules in cost/engines/ (cost/engines/__init__.py ``_engines``).
ENGINES = (FSDP2,)
