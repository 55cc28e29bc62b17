#!/usr/bin/env bash
# The 14B simulation's truth where its headline lives (results/simulation_h200.md), one device
# call per part, each within 10 minutes:
#   t  every distinct (bucket, B) of the headline cells at R = 8, g = 2·S_max — dual_constraint's table (the paper's
#      system in stream order and our best passing cell, sorted: 98 42 18 8 5 2 1) and the W = 8 cells' tables
#      (cost 90 39 16 7 4 2 1, dual 98 38 14 6 4 2 1): 15 micro-batches on a full-width slice of Wan 14B at K = 4
#      blocks, then again at 2 (the part outside the blocks separates: Calibration.affine_scales), one warm-up and
#      3 timed repeats each (scripts/calibrate.py +calibrate.points; eager, as under FSDP). Time: by the committed
#      14B calibration the points take ≈ 47 s a pass at 4 blocks (×4 with the warm-up) and ≈ 25 s at 2, + builds
#      and plain steps ≈ 5 min. Writes $OUT/truth_h200_14b_points.json.
#   r  the long buckets replayed (scripts/replay_plans.py): the simulator's default mix (all seven buckets, the
#      720p clip included), R = 8, M = 2, K = 8 steps (a whole window's length), no warm-up step (each distinct
#      micro-batch runs once untimed first), on a 2-block slice: the paper's system (dual_constraint, stream) and
#      the best passing cell (dual_constraint, sorted) — scripts/replay_settings_14b_headline.json. Planned with,
#      and compared against the truth of, CAL14T (default: part t's file, committed as
#      results/truth_h200_14b_points.json): "as_run" is its 2-block measurement, no extrapolation. Time:
#      ≈ 226 s of micro-batches a plan by the cost model, ≈ 8.5 min in all. CAL14T=results/calibration_h200_14b.json
#      plans as the committed simulation did; the truth of part t's file is then priced on the same plans on a CPU:
#      the same command with --dry-run --truth FILE (the plans are deterministic).
# POINTS="[bucket:B,...]" times other points (e.g. the W = 8 cells' four left unmeasured:
# [v480_17f:14,v480_33f:7,v480_33f:6,v480_49f:4]).
# Needs .whl/ (bash scripts/make_wheels.sh; carry it): the GPU image lacks hydra and omegaconf.
set -uo pipefail
source scripts/h200_env.sh h200_truth_out
PART=${PART:-t}
POINTS=${POINTS:-"[i480:98,i720:42,v480_17f:18,v480_33f:8,v480_49f:5,v480_81f:2,v720_81f:1,i480:90,i720:39,i720:38,v480_17f:16,v480_17f:14,v480_33f:7,v480_33f:6,v480_49f:4]"}
if [[ $PART == *t* ]]; then
  timeout "${T_T:-420}" python3 scripts/calibrate.py conf=wan21_8gpu launch.num_processes=1 train.cuda_graphs=off \
    model.checkpointing=full +calibrate.blocks=4 +calibrate.memory_blocks=2 +calibrate.fsdp_ranks=8 \
    "+calibrate.points=$POINTS" +calibrate.warmup=1 +calibrate.repeats=3 +calibrate.time_budget_s=${BUDGET_S:-240} \
    +calibrate.memory_time_budget_s=${BUDGET2_S:-110} +calibrate.out="$OUT/truth_h200_14b_points.json" 2>&1 \
    | tee "$OUT/calibrate_points.log" | grep -vE '^\s*$' | cut -c1-400 | tail -40
fi
if [[ $PART == *r* ]]; then
  CAL=${CAL14T:-results/truth_h200_14b_points.json}
  timeout "${T_R:-560}" python3 scripts/replay_plans.py --out "$OUT" --name wan14b_2blocks_long_R8 \
    --settings scripts/replay_settings_14b_headline.json --steps 8 --warmup 0 --blocks 2 --calibration "$CAL" \
    --truth "${TRUTH14:-$CAL}" conf=wan21_8gpu launch.num_processes=1 model.checkpointing=full 2>&1 \
    | tee "$OUT/replay_long.log" | grep -vE '^  step' | cut -c1-400
fi
