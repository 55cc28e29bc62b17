#!/usr/bin/env bash
# Small micro-batches on the H200 (results/small_step_h200.md), PART=tbr in one device call (~8 min), lmr in a
# second:
#   t. the GPU tests of the micro-batch graphs (replay against eager) and of the fused ops' small-variance rows;
#   b. scripts/bench/small_step.py: diffusers, our eager step and its CUDA-graph replay at B·S = 1×1560, 4×1560,
#      1×7800 (SHAPES to change), the host profile of one eager micro-batch, the optimizer step;
#   l. scripts/bench/step.py's five shapes, diffusers against our eager and graph columns;
#   m. the MMDiT at HunyuanVideo width (2 dual + 4 single blocks) at the three small shapes;
#   r. the whole training step through train.py (conf=wan21_1p3b, one 480p image per micro-batch, M = 1, the
#      optimizer and EMA included) with train.cuda_graphs=off and auto: time/step_s over steps 11-40.
# Needs .whl/ (bash scripts/make_wheels.sh): the GPU image lacks diffusers, hydra, omegaconf.
set -uo pipefail
source scripts/h200_env.sh h200_small_out
PART=${PART:-tbr}
if [[ $PART == *t* ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_adaln.py \
    tests/test_qk_norm_rope.py -k "gpu or cuda" 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
fi
if [[ $PART == *b* ]]; then
  timeout 330 python3 scripts/bench/small_step.py --out "$OUT" --shapes "${SHAPES:-1x1560,4x1560,1x7800}" \
    --columns "${COLUMNS:-diffusers,eager,graph}" 2>&1 | tee "$OUT/bench.log" | grep -vE '^\{' | cut -c1-900
fi
if [[ $PART == *l* ]]; then  # the step benchmark's shapes: no lower than before, the graph where it is captured too
  timeout 330 python3 scripts/bench/small_step.py --out "$OUT/long" --no-profile --kernels '' \
    --shapes 16x1560,4x7800,2x14040,1x32760,1x75600 --columns diffusers,eager,graph 2>&1 \
    | tee "$OUT/bench_long.log" | grep -vE '^\{' | cut -c1-600
  cp "$OUT/long/bench_small_step.json" "$OUT/bench_long.json"; rm -r "$OUT/long"
fi
if [[ $PART == *m* ]]; then  # the MMDiT at HunyuanVideo width
  timeout 240 python3 scripts/bench/small_step.py --model mmdit --out "$OUT/mmdit" --no-profile --kernels '' \
    --shapes "${SHAPES:-1x1560,4x1560,1x7800}" 2>&1 | tee "$OUT/bench_mmdit.log" | grep -vE '^\{' | cut -c1-600
  cp "$OUT/mmdit/bench_small_step.json" "$OUT/bench_mmdit_small.json"; rm -r "$OUT/mmdit"
fi
if [[ $PART == *r* ]]; then
  for g in off auto; do
    timeout 200 python3 train.py conf=wan21_1p3b name=small_$g run_dir=/tmp/runs/small_$g train.cuda_graphs=$g \
      train.steps=40 train.micro_batches=1 scheduling.m_tokens=1560 train.val_every=100000 checkpoint.every=0 \
      checkpoint.at_end=false train.progress=false logging.wandb=disabled data.synthetic.num_samples=64 \
      data.synthetic.mix.i720=0 data.synthetic.mix.v480_17f=0 data.synthetic.mix.v480_33f=0 \
      data.synthetic.mix.v480_49f=0 data.synthetic.mix.v480_81f=0 data.synthetic.mix.v720_81f=0 \
      > "$OUT/train_$g.log" 2>&1
    cp /tmp/runs/small_$g/metrics.jsonl "$OUT/trainer_$g.jsonl" 2>/dev/null
    python3 - "$OUT/trainer_$g.jsonl" $g <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = [r for r in rows if 10 < r.get("step", 0) and "time/step_s" in r]
if rows:
    keys = ("time/step_s", "time/fwd_s", "time/bwd_s", "time/optim_s", "time/data_wait_s", "memory/peak_gib")
    print(sys.argv[2], {k: round(statistics.median(r[k] for r in rows), 4) for k in keys}, "B", rows[-1]["batch/B"])
EOF
    grep -E "CUDA graphs|Error|error" "$OUT/train_$g.log" | head -5
  done
fi
