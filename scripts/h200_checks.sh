#!/usr/bin/env bash
# One device call on the H200: GPU-only tests natively, then a few steps of conf=wan21_1p3b through train.py
# (world size 1, the same path as CPU runs). Logs and metrics go to $OUT (or ./h200_out).
# Needs .whl/ (bash scripts/make_wheels.sh) on the GPU image, which lacks hydra/omegaconf/wandb/diffusers.
set -uo pipefail
source scripts/h200_env.sh h200_out
python3 -m pytest -q -p no:cacheprovider tests/test_precision_gpu.py tests/test_wan_parity.py tests/test_wan_fused.py -k "cuda or fsdp2" 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
STEPS=${STEPS:-8}
python3 train.py conf=wan21_1p3b name=h200_1p3b run_dir="$OUT/run" data.cache_dir=/tmp/cache train.steps=$STEPS \
  train.val_every=4 train.progress=false checkpoint.every=0 checkpoint.at_end=false logging.wandb=disabled \
  metrics.busy_every=4 2>&1 | tee "$OUT/train.log" | tail -25
