#!/usr/bin/env bash
# Issue 9 in one device call on the H200 (~9 minutes; SKIP_B=1: ~7): the GPU tests of the fused ops and of Wan's parity with
# diffusers, then scripts/bench_step.py at the five shapes in two processes, each with its own diffusers baseline:
# the targets' shapes (memory breakdown, profile, longest-sequence search), then the other three. Results land in
# $OUT (or ./h200_step_out); copy them to results/step_h200/.
# Needs .whl/ (bash ../shared/device/make_wheels.sh): the GPU image lacks diffusers.
set -uo pipefail
source scripts/h200_env.sh h200_step_out
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gelu_ffn.py tests/test_adaln_linear.py \
  tests/test_rope_attention.py tests/test_wan.py \
  -k "gelu or grad_kernel or chunked or adaln_linear or rope_attention or cuda or fused_glue or lora" 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
# the targets' shapes (32760, 14040) with the (b) column, the peak breakdown and the longest-sequence search ...
timeout 330 python3 scripts/bench_step.py --out "$OUT/a" --shapes 3,2 --fast-backend native --reps 3 --memtrace --profile \
  --impls diffusers@default,ours@glue,ours@offload,ours@chunk256,ours@unchunked,ours@keep 2>&1 | tee "$OUT/bench_a.log" | grep -E "impl|longest|Error|step_peak|frame_at" | tail -40
# ... then the other three shapes, like for like ("never slower"); SKIP_B=1 leaves them to another call
[ -n "${SKIP_B:-}" ] || timeout 200 python3 scripts/bench_step.py --out "$OUT/b" --shapes 0,1,4 --fast-backend native --reps 3 --longest '' \
  --impls diffusers@default,ours@glue,ours@offload 2>&1 | tee "$OUT/bench_b.log" | grep -E "impl|Error" | tail -20
