#!/usr/bin/env bash
# Issue 9 in one device call on the H200 (~7 minutes): the GPU tests of the fused ops and of Wan's parity with
# diffusers, then scripts/bench_step.py at the five shapes in two processes, each with its own diffusers baseline:
# the targets' shapes (memory breakdown, profile, longest-sequence search), then the other three. Results land in
# $OUT (or ./h200_step_out); copy them to results/step_h200/.
# Needs .whl/ (bash ../shared/device/make_wheels.sh): the GPU image lacks diffusers.
set -uo pipefail
source scripts/h200_env.sh h200_step_out
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gelu_ffn.py tests/test_wan.py \
  -k "gelu or grad_kernel or chunked or cuda_bf16_parity or cuda_offload or fused_glue" 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
# the targets' shapes (32760, 14040) with the (b) column, the peak breakdown and the longest-sequence search ...
timeout 220 python3 scripts/bench_step.py --out "$OUT/a" --shapes 3,2 --fast-backend native --reps 3 --memtrace --profile \
  --impls diffusers@default,ours@glue,ours@offload,ours@keep 2>&1 | tee "$OUT/bench_a.log" | grep -E "impl|longest|Error|step_peak|frame_at" | tail -40
# ... then the other three shapes, like for like ("never slower")
timeout 200 python3 scripts/bench_step.py --out "$OUT/b" --shapes 0,1,4 --fast-backend native --reps 3 --longest '' \
  --impls diffusers@default,ours@glue,ours@offload 2>&1 | tee "$OUT/bench_b.log" | grep -E "impl|Error" | tail -20
