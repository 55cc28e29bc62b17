#!/usr/bin/env bash
# One device call on the H200: the committed calibration checked by real steps at given bucket:B (calibrate.check:
# does the planners' largest micro-batch fit, and is its time as predicted? CHECK=..., REPEATS=...), then a fresh
# calibration of Wan 2.1 1.3B (conf=wan21_1p3b, full recompute, 12 timed points, the last one the memory probe at
# the shortest bucket; SCAN=0 skips it). Everything lands in $OUT.
# Needs .whl/ (bash scripts/make_wheels.sh) on the GPU image, which lacks hydra/omegaconf/wandb/diffusers.
set -uo pipefail
source scripts/h200_env.sh h200_out
CHECK=${CHECK:-"[i480:464,i720:201]"}
if [ "$CHECK" != "none" ]; then
  python3 scripts/calibrate.py conf=wan21_1p3b scheduling.calibration=results/calibration_h200.json \
    "+calibrate.check=$CHECK" +calibrate.repeats=${REPEATS:-2} +calibrate.out="$OUT/memory_check.json" 2>&1 \
    | tee "$OUT/memory_check.log" | tail -8
fi
[ "${SCAN:-1}" = 0 ] && exit 0
python3 scripts/calibrate.py conf=wan21_1p3b "+calibrate.buckets=[i480,v480_17f,v480_33f,v480_81f,v720_49f,v720_81f]" \
  +calibrate.max_points=12 +calibrate.time_budget_s=${BUDGET_S:-330} +calibrate.fit_min_tokens=10000 \
  +calibrate.out="$OUT/calibration_h200.json" 2>&1 | tee "$OUT/calibrate.log" | tail -20
