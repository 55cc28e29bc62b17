#!/usr/bin/env bash
# Issue 9, the (b) columns and the other shapes after ops/adaln_linear.py + ops/rope_attention.py (~8 minutes): the
# GPU tests, then the targets' shapes with every block recomputed and the most keeping attention (kept blocks
# offloaded too), the MLP chunked and whole; then 1560 / 7800 / 75600 like for like. Results in $OUT.
set -uo pipefail
source scripts/h200_env.sh h200_step2_out
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gelu_ffn.py tests/test_adaln_linear.py \
  tests/test_rope_attention.py tests/test_wan.py \
  -k "gelu or grad_kernel or chunked or adaln_linear or rope_attention or cuda or fused_glue or lora or keep" 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
timeout 260 python3 scripts/bench_step.py --out "$OUT/a" --shapes 3,2 --fast-backend native --reps 3 --longest '' \
  --impls diffusers@default,ours@glue,ours@offload,ours@unchunked,ours@keep,ours@keep+unchunked,ours@policy 2>&1 \
  | tee "$OUT/bench_a.log" | grep -E "impl|Error" | tail -20
timeout 170 python3 scripts/bench_step.py --out "$OUT/b" --shapes 0,1,4 --fast-backend native --reps 3 --longest '' \
  --impls diffusers@default,ours@glue,ours@offload 2>&1 | tee "$OUT/bench_b.log" | grep -E "impl|Error" | tail -20
