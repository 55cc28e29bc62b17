#!/usr/bin/env bash
# Issue 9, third call of the fourth session (~7 minutes): the GPU tests after offload's selective-policy forward and
# the self-attention-only keep; S = 1560 with 7 reps and a profile of the glue saving vs remaking its tensors (the
# 1560 column was noisy); then (b) at the targets' shapes with kept blocks offloaded. Results in $OUT.
set -uo pipefail
source scripts/h200_env.sh h200_step3_out
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_adaln_linear.py tests/test_rope_attention.py \
  tests/test_wan.py -k "adaln_linear or rope_attention or cuda or fused_glue or lora" 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
timeout 120 python3 scripts/bench_step.py --out "$OUT/c" --shapes 0 --fast-backend native --reps 7 --longest '' \
  --profile --impls diffusers@default,ours@saved,ours@glue,ours@offload 2>&1 \
  | tee "$OUT/bench_c.log" | grep -E "impl|Error|total_ms" | tail -12
timeout 260 python3 scripts/bench_step.py --out "$OUT/d" --shapes 3,2 --fast-backend native --reps 3 --longest '' \
  --impls diffusers@default,ours@saved,ours@offload,ours@keep,ours@keep+unchunked 2>&1 \
  | tee "$OUT/bench_d.log" | grep -E "impl|Error" | tail -20
