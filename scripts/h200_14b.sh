#!/usr/bin/env bash
# Wan 2.1 14B costs on one H200, in one device call (≈ 5 min; at most 9.5): a full-width slice of K = 18 of its 40
# blocks, timed and measured by scripts/calibrate.py, then measured again at K/2 = 9 blocks; the file
# ($OUT/calibration_h200_14b.json, committed as results/calibration_h200_14b.json) holds the cost model ×40/18 and the
# memory model of FSDP over 8 ranks (scheduling/fsdp_memory.py). Micro-batches run eager, as under FSDP.
#
# K: the most blocks whose fp32 weights, gradients and AdamW moments (16 B/param) plus the activations of the
# scan's largest ladder micro-batch (75,600 tokens) fit the scan's budget, 90 % of the H200's 150.1 GB = 135.1 GB.
# A block has 351.39 M parameters, the rest of the model 232.72 M: 16·(232.72 M + 18·351.39 M) = 104.9 GB; the
# activations, from Wan 1.3B's measured 148 KiB a token (≈ 2·dim bytes a block for the checkpointed inputs, the rest
# one block's recompute, ∝ dim): 18·10.2 KB + 199 KB ≈ 384 KB a token → 29.0 GB at 75,600 tokens: 133.9 GB.
# 19 blocks: 110.5 + 29.8 = 140.3 GB, over. The optimizer step (20.1 B/param on the 1.3B) at 18 blocks: 131.8 GB.
# The file's notes redo this arithmetic with the measured slice.
#
# Time, from the 1.3B's H200 fit scaled per block (linear terms × 7.6 = the blocks' parameter ratio, attention ×
# 3.3 = the width ratio): 18 blocks take ≈ 8.2 s at i480 B = 48, 7.8 s at v480_17f B = 9, 12 s at v480_81f B = 2,
# 24 s at v720_81f B = 1, 16 s for the memory probe (i480 at its bound, B ≈ 92). The scan's 7 points, one warm-up and
# one timed step each: ≈ 150 s; at 9 blocks the same points ≈ 75 s; plain steps, model builds, kernel compiles and
# this script's set-up ≈ 90 s. The time budgets (270 s for the scan, 100 s for the second depth) stop starting new
# points if the device is 2× slower than that, within the call's 10 minutes; a file is written after each depth.
#
# Needs .whl/ (bash scripts/make_wheels.sh): the GPU image lacks hydra and omegaconf.
set -uo pipefail
source scripts/h200_env.sh h200_14b_out
K=${K:-18}
timeout "${LIMIT:-570}" python3 scripts/calibrate.py conf=wan21_8gpu launch.num_processes=1 train.cuda_graphs=off \
  +calibrate.blocks="$K" +calibrate.memory_blocks=$((K / 2)) +calibrate.fsdp_ranks=8 \
  "+calibrate.buckets=[i480,v480_17f,v480_81f,v720_81f]" +calibrate.max_points=8 +calibrate.top_tokens=75600 \
  +calibrate.warmup=1 +calibrate.repeats=1 +calibrate.time_budget_s=270 +calibrate.memory_time_budget_s=100 \
  +calibrate.out="$OUT/calibration_h200_14b.json" 2>&1 | tee "$OUT/calibrate.log" | grep -vE '^\s*$' | cut -c1-600
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$OUT/gpu.txt"
