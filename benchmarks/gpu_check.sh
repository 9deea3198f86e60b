#!/usr/bin/env bash
# One prepared GPU check for a machine with ONE GPU (sized for an H200: steps 1-5 took 3.5 minutes there on
# 2026-12-04, step 6 about 3 more; each step has its own timeout, so give the call the device's 10 minutes):
#   1. kernels of training shapes (GEMMs in the three layouts a Linear runs, FlashAttention forward and
#      backward, memory-bound kernels, launch gaps) timed with CUDA events, and the host's AdamW and PCIe
#      copies (benchmarks/gpu_kernels.py);
#   2. step time and peak memory of published MPT shapes with real FSDP2 at world size 1, with and
#      without full activation checkpointing (benchmarks/gpu_shapes.py);
#   3. predicted vs measured peak memory and step time for four plans of a ~1B Llama-style model
#      (examples/llama.py, SHARD_PLANNER_SIZE=1b: Llama 3.2 1B shapes, seq 4096) (benchmarks/gpu_plans.py);
#   4. per-module forward/backward compute timings and achieved FLOP/s (benchmarks/gpu_modules.py);
#   5. the GPU-marked tests (tests/ -m gpu);
#   6. the planner's own plans for the Llama-1B example (benchmarks/data/h200_2026-12-04/planner: --mem 16GB and
#      24GB offload to the CPU, 40GB checkpoints selectively) run by `shard-planner run`, and the offload plans'
#      forward + backward and optimizer step timed apart (benchmarks/gpu_phases.py);
#   7. `calibrate`'s kernel sweeps on the device, timed by execute/kernel_timing.py (captured CUDA graphs;
#      never run on a GPU before 2026-12-04's session 12), written as the [kernels] table they fit, to set
#      beside step 1's measured constants (`python benchmarks/gpu_kernels.py report`). The full
#      `shard-planner calibrate` needs two GPUs for its collectives.
#   8. the CUDA caching allocator against its simulation (issue 29, benchmarks/gpu_allocator.py): for the planner's
#      Llama-1B plan for --mem 24GB made now, the per-block plan of step 3 and the 24GB plan of step 6, in each
#      allocator mode, the allocator's recorded history and snapshot (segments per stream, reserved_bytes.all.peak,
#      num_alloc_retries) and the configuration the process ran with; in the plan's mode a
#      set_per_process_memory_fraction sweep at the predicted smallest cap x {0.95, 1, 1.02, 1.05, 1.1} and at the
#      plan's --mem: pass / OOM, retries per step, step time. `python benchmarks/gpu_allocator.py report DIR`
#      replays each recorded trace through the simulator, anywhere. About 4 minutes on an H200 (estimated, not yet
#      run); its timeout keeps the cases done.
# Steps 1 and 2 only measure: their samples are priced afterwards, anywhere, by the scripts' report modes
# (`python benchmarks/gpu_kernels.py report kernels.json`, `python benchmarks/gpu_shapes.py report shapes/`).
# Usage: [GPU_CHECK_STEPS="8 2 3"] benchmarks/gpu_check.sh [--dry-run]
#   GPU_CHECK_STEPS: the steps to run, in their order here (default: all). All eight take longer than one
#   10-minute device call (steps 1-7 about 8.5 minutes on 2026-12-04, step 8 about 4 more): run step 8 first
#   and on its own when it is what the session is for (GPU_CHECK_STEPS=8), the rest in a second call.
#   --dry-run: the same steps on CPU with tiny models and one timed step (no kernel sweep), to check the
#   script without a GPU. Results go to $OUT (the device tool's output folder) or a fresh temporary
#   folder: log.txt, and results.tar.gz with everything else (the tool brings back at most 8 files).
# Needs torch with CUDA; the repository is put on PYTHONPATH, so no install is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t shard-planner-gpu-check.XXXXXX)}
RES=$(mktemp -d -t shard-planner-gpu-results.XXXXXX)  # packed into $OUT/results.tar.gz after each step
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

if [[ "${1:-}" == "--dry-run" ]]; then
  export SHARD_PLANNER_SIZE=tiny DEVICE=cpu
  PLAN_ARGS=(--steps 1 --warmup 1 --timeout 120) MOD_ARGS=(--reps 2 --dtype float32)
  SHAPE_ARGS=(--device cpu --steps 1 --warmup 1 --timeout 120)
else
  export SHARD_PLANNER_SIZE=1b DEVICE=cuda
  PLAN_ARGS=(--steps 5 --warmup 2 --timeout 110) MOD_ARGS=(--reps 10)
  SHAPE_ARGS=(--device cuda --steps 5 --warmup 2 --timeout 60)
fi

STEPS=" ${GPU_CHECK_STEPS:-1 2 3 4 5 6 7 8} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
pack() { tar -czf "$OUT/results.tar.gz.tmp" -C "$RES" . && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"; }
stamp "shard-planner GPU check: SHARD_PLANNER_SIZE=$SHARD_PLANNER_SIZE device=$DEVICE out=$OUT"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "devices", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
if [[ "$DEVICE" == cuda ]]; then
  timeout 20 nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,power.limit --format=csv || true
fi

if want 8; then  # first when asked for: the allocator check is what issue 29 waits for
  stamp "8/8 the CUDA caching allocator: recorded, replayed, capped (benchmarks/gpu_allocator.py)"
  timeout 290 "$PY" benchmarks/gpu_allocator.py measure --device "$DEVICE" --out "$RES/allocator" --timeout 130 \
    || echo "!! step 8 failed (exit $?)"
  pack
fi

if want 1 && [[ "$DEVICE" == cuda ]]; then
  stamp "1/8 kernel sweep"
  timeout 120 "$PY" benchmarks/gpu_kernels.py measure --out "$RES/kernels.json" || echo "!! step 1 failed (exit $?)"
elif want 1; then
  stamp "1/8 kernel sweep: skipped (CUDA only)"
fi
pack

if want 2; then
stamp "2/8 published shapes with FSDP2 at world size 1"
timeout 240 "$PY" benchmarks/gpu_shapes.py measure --out "$RES/shapes" "${SHAPE_ARGS[@]}" || echo "!! step 2 failed (exit $?)"
pack
fi

if want 3; then
stamp "3/8 plans of the Llama model: predicted vs measured (world size 1)"
timeout 120 "$PY" benchmarks/gpu_plans.py --device "$DEVICE" --profile h200 --out "$RES/plans" "${PLAN_ARGS[@]}" \
  || echo "!! step 3 failed (exit $?)"
pack
fi

if want 4; then
stamp "4/8 per-module compute timings"
timeout 60 "$PY" benchmarks/gpu_modules.py --device "$DEVICE" --out "$RES/module_times.json" "${MOD_ARGS[@]}" \
  || echo "!! step 4 failed (exit $?)"
pack
fi

if want 5 && [[ "$DEVICE" == cuda ]]; then
  stamp "5/8 GPU-marked tests"
  timeout 60 "$PY" -m pytest -q -m gpu tests/execute/test_run.py tests/execute/test_memtrack.py tests/execute/test_kernel_timing.py -p no:cacheprovider \
    || echo "!! step 5 failed (exit $?)"
elif want 5; then
  stamp "5/8 GPU-marked tests: skipped (no GPU in a dry run)"
fi

if want 6 && [[ "$DEVICE" == cuda ]]; then
  stamp "6/8 the planner's plans for Llama-1B, run"
  PLANS=benchmarks/data/h200_2026-12-04/planner
  mkdir -p "$RES/planner"
  for m in 40GB 24GB 16GB; do
    timeout 140 "$PY" -m shard_planner.cli.main run "$PLANS/llama1b-$m.json" --timeout 130 --no-checkpoint \
      -o "$RES/planner/measurement-$m.json" || echo "!! plan $m failed (exit $?)"
  done
  for m in 24GB 16GB; do
    timeout 100 "$PY" benchmarks/gpu_phases.py "$PLANS/llama1b-$m.json" --out "$RES/planner/phases-$m.json" \
      > "$RES/planner/phases-$m.txt" 2>&1 || echo "!! phases $m failed (exit $?)"
  done
  pack
fi
if want 7; then
stamp "7/8 calibrate's kernel sweeps on this device (execute/kernel_timing.py)"
timeout 150 "$PY" - "$DEVICE" "$RES/calibrated_kernels.toml" <<'PYEOF' || echo "!! step 7 failed (exit $?)"
import logging, sys, torch
from shard_planner.execute.calibrate import measure_copy_bytes_per_s, measure_matmul_flops_per_s
from shard_planner.execute.kernel_calibration import calibrate_kernels, kernels_toml
logging.basicConfig(level=logging.INFO)
device = torch.device(sys.argv[1])
dtype = "bfloat16" if device.type == "cuda" else "float32"
peak = {dtype: measure_matmul_flops_per_s(device, getattr(torch, dtype))}
cal = calibrate_kernels(device, peak, measure_copy_bytes_per_s(device), quick=device.type == "cpu")
text = "\n".join([f"# peak {dtype} {cal.peak_flops_per_s:.4g} FLOP/s, dispatch floor {cal.floor_s:.3g} s"] + kernels_toml(cal))
open(sys.argv[2], "w").write(text + "\n")
print(text)
PYEOF
pack
fi
stamp "done; results in $OUT"
