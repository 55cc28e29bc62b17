#!/usr/bin/env bash
# Issue 9, fourth call of the fourth session (~3 minutes): is the S = 1560 column's spread (ours@glue 671-1261 ms
# in call 3, under torch.utils.checkpoint) Python's garbage collector? The same columns with it paused in timed steps.
set -uo pipefail
source scripts/h200_env.sh h200_step4_out
timeout 150 python3 scripts/bench_step.py --out "$OUT/e" --shapes 0 --fast-backend native --reps 7 --longest '' \
  --gc-off --impls diffusers@default,ours@saved,ours@glue,ours@offload 2>&1 \
  | tee "$OUT/bench_e.log" | grep -E "impl|Error" | tail -12
