#!/usr/bin/env bash
# Issue 9 on the H200 (results/step_h200.md): the GPU tests of the fused ops and of Wan's parity with diffusers,
# then scripts/bench_step.py with Python's collector paused inside timed steps (--gc-off), each process with its own
# diffusers baseline: (a) the targets' shapes with the glue saving (ours@saved) and remaking (ours@glue) its tensors,
# offload, the MLP whole, the (b) columns (every block keeping its self-attention), the memory breakdown, a profile
# and the longest-sequence search; (b) the other three shapes like for like. About 11 minutes in all: one device
# call each (PART=a, PART=b; default both). Results land in $OUT (or ./h200_step_out); copy them to results/step_h200/.
# Needs .whl/ (bash ../shared/device/make_wheels.sh): the GPU image lacks diffusers.
set -uo pipefail
source scripts/h200_env.sh h200_step_out
PART=${PART:-ab}
if [[ $PART == *a* ]]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gelu_ffn.py tests/test_adaln_linear.py \
    tests/test_rope_attention.py tests/test_wan.py \
    -k "gelu or grad_kernel or chunked or adaln_linear or rope_attention or cuda or fused_glue or lora" 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -4
  timeout 420 python3 scripts/bench_step.py --out "$OUT/a" --shapes 3,2 --fast-backend native --reps 3 --gc-off \
    --memtrace --profile \
    --impls diffusers@default,ours@saved,ours@glue,ours@offload,ours@unchunked,ours@keep,ours@keep+unchunked 2>&1 \
    | tee "$OUT/bench_a.log" | grep -E "impl|longest|Error|step_peak|frame_at" | tail -40
fi
if [[ $PART == *b* ]]; then
  timeout 300 python3 scripts/bench_step.py --out "$OUT/b" --shapes 0,1,4 --fast-backend native --reps 5 --gc-off \
    --longest '' --impls diffusers@default,ours@saved,ours@glue,ours@offload 2>&1 \
    | tee "$OUT/bench_b.log" | grep -E "impl|Error" | tail -20
fi
