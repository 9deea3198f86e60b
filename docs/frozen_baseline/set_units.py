"""Rewrite a plan's units (the ground-truth runs of docs/frozen_facts.md): set_units.py PLAN OUT UNIT...

UNIT is a module's fqn ("" is the root), reshard after forward True; "fqn:keep" for False. The frontier and
baselines are dropped (they belong to the solver's plan); run `shard-planner estimate --plan OUT --write`
after, so that the plan's prediction is the new units'.
"""
import json
import sys

src, out, *units = sys.argv[1:]
plan = json.load(open(src))
plan["units"] = [{"modules": [u.split(":")[0]], "reshard_after_forward": not u.endswith(":keep"),
                  "activation_checkpoint": False} for u in units]
plan["frontier"], plan["baselines"] = [], []
with open(out, "w") as f:
    json.dump(plan, f, indent=1)
