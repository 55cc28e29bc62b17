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
#      results/simulation_h200/truth_h200_14b_points.json): "as_run" is its 2-block measurement, no extrapolation. Time:
#      ≈ 226 s of micro-batches a plan by the cost model, ≈ 8.5 min in all. CAL14T=results/calibration_h200_14b.json
#      plans as the committed simulation did; the truth of part t's file is then priced on the same plans on a CPU:
#      the same command with --dry-run --truth FILE (the plans are deterministic).
#      REPLAY_SET=reformed replays scripts/replay_settings_14b_reformed.json instead: the best one-step cell
#      (dual_constraint × reformed, 98 41 15 7 4 2 1, M = 2) first, then the paper's system (stream), on the same 2-block
#      slice, K = 8; planned with the committed 14B calibration (the simulator's planner) unless CAL14T says otherwise,
#      priced as the simulation's truth is: the calibration's points, the headline's and the re-formed cells', merged
#      (TRUTH14: files, space-separated).
#      Time: ≈ 214 s of micro-batches and 25 distinct
#      ones (≈ 20 s) for reformed, the stream plan as measured before (263 s), ≈ 9 min in all; the stream entry runs
#      second so that a timeout costs the plan replayed before (results/replay_h200.md), not the new one.
# POINTS_SET names the list part t times (POINTS="[bucket:B,...]" times any other, e.g. the W = 8 cells' four left
# unmeasured: [v480_17f:14,v480_33f:7,v480_33f:6,v480_49f:4]):
#   headline  (the default) the 15 above; writes $OUT/truth_h200_14b_points.json.
#   reformed  the 12 (bucket, B) that bring the best one-step cell, dual_constraint × reformed (98 41 15 7 4 2 1,
#             M = 2), from 62.5 % of its micro-batch time at measured (S, B) to 95.4 %, and cost × reformed (98 42 18
#             8 5 2 1) from 66.8 % to 95.7 %: the fewest that reach 95 %, the largest share first (so a budget drops
#             the least), from `python scripts/simulate_cluster.py --calibration results/calibration_h200_14b.json
#             --truth-points results/simulation_h200/truth_h200_14b_points.json --bandwidth 350 --ranks 8
#             --matrix-g 2 --mbs 2048 --points-for dual_constraint:reformed,cost:reformed` (results/
#             simulation_h200.md, first section); then the 720p clip (v720_81f:1: 53 % of both cells' time,
#             measured before at 4 blocks only, the headline file's second depth having run out of budget first), so that its part
#             outside the blocks separates too and it gets 3 more repeats. Time by the committed 14B calibration: ≈ 120 s at 4 blocks and ≈ 65 s at 2 (4 runs a
#             point, the benchmark's own 0.7 s a point included; the same estimate gives 136 s and 54 s for the
#             headline run's measured 134 s and 50 s), + ≈ 2 min of start, wheels, builds and plain steps: ≈ 5 min.
#             Budgets 170 s and 100 s (guards: the list ends first). Writes $OUT/truth_h200_14b_reformed_points.json.
# Needs .whl/ (bash scripts/make_wheels.sh; carry it): the GPU image lacks hydra and omegaconf.
set -uo pipefail
source scripts/h200_env.sh h200_truth_out
PART=${PART:-t}
case ${POINTS_SET:-headline} in
  headline) SET_POINTS="[i480:98,i720:42,v480_17f:18,v480_33f:8,v480_49f:5,v480_81f:2,v720_81f:1,i480:90,i720:39,i720:38,v480_17f:16,v480_17f:14,v480_33f:7,v480_33f:6,v480_49f:4]"
            SET_OUT=truth_h200_14b_points.json; SET_BUDGET_S=240; SET_BUDGET2_S=110 ;;
  reformed) SET_POINTS="[v480_81f:4,v480_49f:2,v480_49f:7,v480_49f:1,v480_33f:2,v480_33f:1,v480_49f:4,v480_33f:3,v480_33f:7,v480_33f:10,v480_17f:3,v480_17f:7,v720_81f:1]"
            SET_OUT=truth_h200_14b_reformed_points.json; SET_BUDGET_S=170; SET_BUDGET2_S=100 ;;
  *) echo "POINTS_SET=$POINTS_SET: choose headline or reformed (or give POINTS)" >&2; exit 2 ;;
esac
POINTS=${POINTS:-$SET_POINTS}
if [[ $PART == *t* ]]; then
  timeout "${T_T:-420}" python3 scripts/calibrate.py conf=wan21_8gpu launch.num_processes=1 train.cuda_graphs=off \
    model.checkpointing=full +calibrate.blocks=4 +calibrate.memory_blocks=2 +calibrate.fsdp_ranks=8 \
    "+calibrate.points=$POINTS" +calibrate.warmup=1 +calibrate.repeats=3 +calibrate.time_budget_s=${BUDGET_S:-$SET_BUDGET_S} \
    +calibrate.memory_time_budget_s=${BUDGET2_S:-$SET_BUDGET2_S} +calibrate.out="$OUT/$SET_OUT" 2>&1 \
    | tee "$OUT/calibrate_points.log" | grep -vE '^\s*$' | cut -c1-400 | tail -40
fi
if [[ $PART == *r* ]]; then
  case ${REPLAY_SET:-headline} in
    headline) CAL=${CAL14T:-results/simulation_h200/truth_h200_14b_points.json}; TRUTH=${TRUTH14:-$CAL}
              R_NAME=wan14b_2blocks_long_R8; R_SETTINGS=scripts/replay_settings_14b_headline.json; R_LOG=replay_long.log ;;
    reformed) CAL=${CAL14T:-results/calibration_h200_14b.json}
              TRUTH=${TRUTH14:-$CAL results/simulation_h200/truth_h200_14b_points.json results/simulation_h200/truth_h200_14b_reformed_points.json}
              R_NAME=wan14b_2blocks_reformed_R8; R_SETTINGS=scripts/replay_settings_14b_reformed.json
              R_LOG=replay_reformed.log ;;
    *) echo "REPLAY_SET=$REPLAY_SET: choose headline or reformed" >&2; exit 2 ;;
  esac
  timeout "${T_R:-560}" python3 scripts/replay_plans.py --out "$OUT" --name "$R_NAME" \
    --settings "$R_SETTINGS" --steps 8 --warmup 0 --blocks 2 --calibration "$CAL" \
    $(printf -- '--truth %s ' $TRUTH) conf=wan21_8gpu launch.num_processes=1 model.checkpointing=full 2>&1 \
    | tee "$OUT/$R_LOG" | grep -vE '^  step' | cut -c1-400
fi
