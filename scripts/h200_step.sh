#!/usr/bin/env bash
# The training step against diffusers on the H200 (results/step_h200.md), one device call per part (PART=a, s, b; default all three, ~16 min):
#   a  the GPU tests of the fused ops and of Wan's parity with diffusers, then scripts/bench/step.py at S = 32760 and
#      14040 (the targets' shapes) with Python's collector paused inside timed steps (--gc-off), diffusers measured
#      in the same process: ours@glue, offload, the (b) column (every block keeping its self-attention), a profile;
#   p  the "before": the same bench (diffusers, ours@glue) on a previous commit unpacked in ./prev (untracked, so
#      that it travels; delete it after): git archive <commit> | tar -x -C prev --exclude=results --exclude=tests;
#   s  the memory-bound kernels' launch shapes at S = 32760 (AdaLN, q/k RMSNorm-RoPE, gated residual forward);
#   b  the other three shapes like for like.
# Results land in $OUT (or ./h200_step_out); copy them to results/step_h200/.
# Needs .whl/ (bash scripts/make_wheels.sh): the GPU image lacks diffusers.
set -uo pipefail
source scripts/h200_env.sh h200_step_out
PART=${PART:-asb}
if [[ $PART == *a* ]]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gated_ffn.py tests/test_gelu_ffn.py \
    tests/test_adaln_linear.py tests/test_rope_attention.py tests/test_wan_parity.py tests/test_wan_fused.py tests/test_qk_norm_rope.py \
    tests/test_gated_residual.py tests/test_adaln.py \
    -k "gated or gelu or act_grad or chunked or adaln_linear or rope_attention or cuda or fused_ops_model or lora \
        or residual or second or wan_size or bias or gate_w2 or column" 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -4
  timeout 330 python3 scripts/bench/step.py --out "$OUT/a" --shapes 3,2 --fast-backend native --reps 3 --gc-off \
    --profile --longest '' --impls "${IMPLS_A:-diffusers@default,ours@glue,ours@offload,ours@keep}" 2>&1 \
    | tee "$OUT/bench_a.log" | grep -E "impl|Error|longest" | cut -c1-200 | tail -40
fi
if [[ $PART == *p* && -d prev ]]; then
  # an older commit has the bench at scripts/bench_step.py
  (cd prev && timeout 240 python3 "$(ls scripts/bench/step.py scripts/bench_step.py 2>/dev/null | head -1)" --out "$OUT/prev" --shapes 3,2 --fast-backend native --reps 3 \
    --gc-off --longest '' --impls diffusers@default,ours@glue 2>&1 \
    | tee "$OUT/bench_prev.log" | grep -E "impl|Error" | cut -c1-200 | tail -20)
fi
if [[ $PART == *s* ]]; then
  timeout 40 python3 scripts/bench/adaln.py --out "$OUT" --name adaln_sweep --sweep --kinds sample --kernels fwd \
    --n 32760 --d 1536 --no-compile --rep-ms 40 2>&1 | grep -E "best|Error" | tail -3
  timeout 60 python3 scripts/bench/qk_norm_rope.py --out "$OUT" --name qk_sweep --sweep --kernels fwd --frames 21 \
    --no-compile --rep-ms 40 2>&1 | grep -E "best|Error" | tail -3
  timeout 60 python3 scripts/bench/gated_residual.py --out "$OUT" --name gated_sweep --sweep --kinds sample \
    --kernels fwd --n 32760 --d 1536 --no-compile --rep-ms 40 2>&1 | grep -E "best|Error" | tail -3
fi
if [[ $PART == *b* ]]; then
  timeout 420 python3 scripts/bench/step.py --out "$OUT/b" --shapes 0,1,4 --fast-backend native --reps 5 --gc-off \
    --impls diffusers@default,ours@notail,ours@glue,ours@offload 2>&1 \
    | tee "$OUT/bench_b.log" | grep -E "impl|longest|Error" | cut -c1-200 | tail -20
fi
