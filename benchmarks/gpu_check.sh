#!/usr/bin/env bash
# One prepared GPU check for a machine with ONE GPU (sized for an H200; under 8 minutes):
#   1. predicted vs measured peak memory (torch.cuda.max_memory_allocated, reserved beside it) and step
#      time (CUDA events, median after warm-up) for four plans of a ~1B Llama-style model
#      (examples/llama.py, SHARD_PLANNER_SIZE=1b: Llama 3.2 1B shapes, seq 4096) at world size 1,
#      all in one launch of `shard_planner.execute.run_plans` (benchmarks/gpu_plans.py);
#   2. per-module forward/backward compute timings and achieved FLOP/s, which calibrate the time model
#      (benchmarks/gpu_modules.py);
#   3. the GPU-marked tests (tests/ -m gpu).
# Usage: benchmarks/gpu_check.sh [--dry-run]
#   --dry-run: the same steps on CPU with the tiny model and one timed step, to check the script
#   without a GPU. Results go to $OUT (the device tool's output folder) or a fresh temporary folder.
# Needs torch with CUDA; the repository is put on PYTHONPATH, so no install is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t shard-planner-gpu-check.XXXXXX)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

if [[ "${1:-}" == "--dry-run" ]]; then
  export SHARD_PLANNER_SIZE=tiny DEVICE=cpu
  PLAN_ARGS=(--steps 1 --warmup 1 --timeout 120) MOD_ARGS=(--reps 2 --dtype float32)
else
  export SHARD_PLANNER_SIZE=1b DEVICE=cuda
  PLAN_ARGS=(--steps 5 --warmup 2 --timeout 270) MOD_ARGS=(--reps 10)
fi

stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
stamp "shard-planner GPU check: SHARD_PLANNER_SIZE=$SHARD_PLANNER_SIZE device=$DEVICE out=$OUT"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "devices", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
if [[ "$DEVICE" == cuda ]]; then
  timeout 20 nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,power.limit --format=csv || true
fi

stamp "1/3 plans of the Llama model: predicted vs measured (world size 1)"
timeout 330 "$PY" benchmarks/gpu_plans.py --device "$DEVICE" --profile h200 --out "$OUT/plans" "${PLAN_ARGS[@]}" \
  || echo "!! step 1 failed (exit $?)"

stamp "2/3 per-module compute timings"
timeout 120 "$PY" benchmarks/gpu_modules.py --device "$DEVICE" --out "$OUT/module_times.json" "${MOD_ARGS[@]}" \
  || echo "!! step 2 failed (exit $?)"

if [[ "$DEVICE" == cuda ]]; then
  stamp "3/3 GPU-marked tests"
  timeout 60 "$PY" -m pytest -q -m gpu tests/test_run.py tests/test_memtrack.py -p no:cacheprovider \
    || echo "!! step 3 failed (exit $?)"
else
  stamp "3/3 GPU-marked tests: skipped (no GPU in a dry run)"
fi
stamp "done; results in $OUT"
