#!/bin/sh
# The ground truth of docs/frozen_facts.md: examples/llama_lora.py (tiny) planned for 2 ranks on cpu-gloo and
# run with real FSDP2 on 2 gloo CPU ranks. Run from the repository root: sh docs/frozen_baseline/run.sh
set -e
SP="${SP:-python -m shard_planner.cli.main}"
D=docs/frozen_baseline
for kind in lora wq_wv none; do  # the solver's plan (one unit: the root, reshard False); none: the control
    mkdir -p $D/solver_$kind
    SHARD_PLANNER_FINETUNE=$kind $SP plan examples/llama_lora.py --gpus 2 --profile cpu-gloo --mem 1GB --no-report \
        -o $D/solver_$kind/plan.json
    SHARD_PLANNER_FINETUNE=$kind $SP run $D/solver_$kind/plan.json --world-size 2 --device cpu
done
for kind in lora wq_wv none; do  # one unit per module of the top level, reshard True (none: the control)
    mkdir -p $D/units_$kind
    python $D/set_units.py $D/solver_$kind/plan.json $D/units_$kind/plan.json ":keep" tok_embeddings layers.0 layers.1 norm output
    SHARD_PLANNER_FINETUNE=$kind $SP estimate examples/llama_lora.py --plan $D/units_$kind/plan.json --write
    SHARD_PLANNER_FINETUNE=$kind $SP run $D/units_$kind/plan.json --world-size 2 --device cpu --no-checkpoint
done
