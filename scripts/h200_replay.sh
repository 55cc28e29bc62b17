#!/usr/bin/env bash
# The planner's plans for R = 8 ranks replayed on one H200 (scripts/replay_plans.py): every planned micro-batch run
# for real through the trainer's step, eager as in a multi-process FSDP run, timed by CUDA events; measured
# tokens/s, busy CV and idle beside the simulator's prediction for the same plans. One device call per part, each
# within 10 minutes:
#   a  Wan 2.1 1.3B at full depth (conf=wan21_1p3b: 30 blocks, bf16, full recompute), predicted by the committed
#      calibration (CAL13, default results/calibration_h200.json);
#   b  a K14-block slice (default 4) of Wan 2.1 14B at full width (conf=wan21_8gpu launch.num_processes=1; times
#      ×40/K14), predicted by the 14B calibration (CAL14, default results/calibration_h200_14b.json, which
#      scripts/h200_14b.sh writes: its m_mem is FSDP's over 8 ranks); where that file does not exist, this slice is
#      calibrated first in the same call, eager, on the mix's buckets (8 points; its m_mem is then M_MEM14).
# Settings: SETTINGS13 / SETTINGS14 (replay_plans.py's settings file, e.g. the simulator's at a chosen g); without
# one, the file written below: equal_token, dual_constraint and balanced at the simulator's sweep factor 2
# (m_tokens = 2·S_max, m_comp = 2·S_max^p, target = 2 × the predicted ms of S_max at B = 1), M = 2, on the four
# shortest buckets of the simulator's default mix with their shares (i480 .25, i720 .10, v480_17f .15, v480_33f .15).
# The longer buckets take 1–10 s a sample on the 1.3B: 7 steps × 16 micro-batches × 3 strategies of them would not
# fit 10 minutes. At factor 2 every micro-batch holds ≥ 23k tokens, above the ~10k under which an eager 1.3B
# micro-batch waits on the host (results/calibration_h200.md), so the calibration's model applies to all of them.
#
# Time (K = STEPS = 6 timed steps after WARMUP = 1, R·M = 16 micro-batches a step):
#   a  the planner's own prediction of the micro-batches it plans (the script prints it first; --dry-run on a CPU):
#      equal_token 107 s (B 18 7 3 2: 0.68–1.17 s each), dual_constraint 129 s (B 53 15 4 2: 1.0–2.0 s), balanced
#      125 s (B 31 12 4 2: 1.0–1.2 s) = 361 s; + each distinct micro-batch once (12, ≈ 15 s, the first with Triton's
#      compiles, ≈ 20 s more) + 21 optimizer steps with EMA (< 2 s) + start (wheels, imports, model: ≈ 40 s)
#      ≈ 7.5 minutes.
#   b  per block, 14B costs 7.6× the 1.3B's projections (351 M against 46 M parameters a block) and 3.3× its
#      attention (dim 5120 against 1536): 4 blocks ≈ 0.0183 ms a token + 6.8e-7·B·S² ms + 7.6 ms a sample, 0.6–1.0×
#      the 1.3B's 30 blocks at these sizes; the same arithmetic gives 260 s of micro-batches (B 18 7 3 2, 21 9 4 2
#      and, as the slice's power fit puts p at 1.2–1.45, 27–48 14 4 2; 0.6–1.8 s each) + the calibration (8 points
#      × 3 steps of under 1 s, ≈ 60 s with its build; none with CAL14's file) + the distinct micro-batches once +
#      start ≈ 6.5 minutes.
# Memory of the 14B slice (b): a block holds 351 M parameters, the rest of the model 235 M; fp32 weights, gradients,
# AdamW's two moments and the EMA are 20 bytes a parameter: 4 blocks + the rest ≈ 1.64 B parameters ≈ 33 GB.
# Activations with every block recomputed, at most: each block's input kept in fp32 (5120 · 4 bytes a token) + one
# block's recompute in bf16 ((14·5120 + 3·13824)·2 bytes) ≈ 0.3 MB a token, ≤ 23 GB at the largest planned
# micro-batch (dual_constraint's i480, 42–75k tokens); ≈ 60 GB of the H200's 150 in all. Each further block adds
# 7 GB of state: ~12 blocks would fit; the 10-minute call is what holds K14 at 4. M_MEM14 = 100,000 tokens (used
# only without the 14B calibration's memory model) bounds B·S for the 14B on 8 H200s (FSDP: 14.3 B parameters × 20 bytes / 8 = 36 GB a GPU; 40 kept block inputs and one
# recompute, 0.6–1 MB a token, in the ≈ 80 GB left of the 90 % budget: 80k–130k tokens); at factor 2 it bounds
# nothing.
# Needs .whl/ (bash scripts/make_wheels.sh; carry it): the GPU image lacks hydra and omegaconf.
set -uo pipefail
source scripts/h200_env.sh h200_replay_out
PART=${PART:-a}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-1}
default_settings() {  # $1: the file
  cat > "$1" <<'EOF'
{"mix": {"i480": 0.25, "i720": 0.10, "v480_17f": 0.15, "v480_33f": 0.15}, "ranks": 8, "micro_batches": 2,
 "settings": [{"strategy": "equal_token", "factor": 2}, {"strategy": "dual_constraint", "factor": 2},
              {"strategy": "balanced", "factor": 2}]}
EOF
}
if [[ $PART == *a* ]]; then
  S13=${SETTINGS13:-$OUT/settings_1p3b.json}
  [ -n "${SETTINGS13:-}" ] || default_settings "$S13"
  timeout 570 python3 scripts/replay_plans.py --out "$OUT" --name wan1p3b_R8 --settings "$S13" --ranks 8 \
    --steps "$STEPS" --warmup "$WARMUP" --calibration "${CAL13:-results/calibration_h200.json}" conf=wan21_1p3b \
    2>&1 | tee "$OUT/wan1p3b_R8.log" | grep -vE '^  step' | cut -c1-400
fi
if [[ $PART == *b* ]]; then
  K14=${K14:-4}
  S14=${SETTINGS14:-$OUT/settings_14b.json}
  [ -n "${SETTINGS14:-}" ] || default_settings "$S14"
  CAL=${CAL14:-results/calibration_h200_14b.json}
  MEM=()
  [ -n "${M_MEM14:-}" ] && MEM=(--m-mem "$M_MEM14")
  LIMIT=570
  if [ ! -f "$CAL" ]; then  # no 14B calibration yet: this slice's own, eager as the replay runs (no memory model)
    CAL=$OUT/calibration_wan14b_${K14}blocks.json
    MEM=(--m-mem "${M_MEM14:-100000}")
    timeout 200 python3 scripts/calibrate.py conf=wan21_8gpu launch.num_processes=1 train.cuda_graphs=off \
      +calibrate.blocks="$K14" "+calibrate.buckets=[i480,i720,v480_17f,v480_33f]" +calibrate.max_points=8 \
      +calibrate.time_budget_s=120 +calibrate.out="$CAL" 2>&1 | tee "$OUT/calibrate_wan14b.log" | tail -4
    LIMIT=370
  fi
  timeout $LIMIT python3 scripts/replay_plans.py --out "$OUT" --name wan14b_${K14}blocks_R8 --settings "$S14" --ranks 8 \
    --steps "$STEPS" --warmup "$WARMUP" --blocks "$K14" ${MEM[@]+"${MEM[@]}"} --calibration "$CAL" \
    conf=wan21_8gpu launch.num_processes=1 2>&1 | tee "$OUT/wan14b_R8.log" | grep -vE '^  step' | cut -c1-400
fi
