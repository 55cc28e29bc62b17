#!/usr/bin/env bash
# Two ranks of train.py on one GPU (results/two_ranks_one_gpu.md): the multi-rank CUDA code — FSDP2 over CUDA
# parameters, bf16 autocast, DCP checkpoints from GPU memory, resume — run for real where only one GPU is lent.
# PART letters, in one device call each group (~9 min for pabc, ~6 for dek):
#   p. which collectives NCCL and gloo serve on CUDA tensors with both ranks on cuda:0 (scripts/bench/two_ranks_probe.py);
#   a. one process (M = 4) and two (M = 2, launch.debug_share_gpu=$MODE) over the same samples: self-launched
#      (launch.num_processes=2), torchrun, accelerate launch; checkpoints at step 3 of the first two;
#   b. resume 2 → 1 and 1 → 2 from those step-3 checkpoints;
#   r. the same resumes from a one-process and a two-process run of 3 steps (in place of a);
#   d. a second one-process run: the run-to-run spread of the GPU's own kernels, the tolerance's control;
#   e. the live shape benchmark (scheduling.calibration=auto, no file) over 2 processes and over 1.
# MODE (gloo | host | nccl): the process group of the two-rank runs (training/shared_gpu.py); default: gloo where the
# probe found every collective served and right, else host. GPUS=2 on a two-GPU machine runs one process per GPU
# on NCCL instead (no debug option): the multi-GPU check this rehearses.
# Needs .whl/ (bash scripts/make_wheels.sh): the GPU image lacks diffusers, hydra, omegaconf.
set -uo pipefail
source scripts/h200_env.sh h200_two_ranks_out
PART=${PART:-pabde}
# $LOGS (the logs, metrics, probes and calibrations) is packed into $OUT/two_ranks.tgz at the end: a device call
# returns at most 8 files
LOGS=/tmp/two_ranks_logs; mkdir -p "$LOGS"
trap 'tar czf "$OUT/two_ranks.tgz" -C "$LOGS" . 2>/dev/null' EXIT
RUNS=/tmp/runs
mkdir -p $RUNS
export ADAPTIVELOAD_CACHE=/tmp/al_cache
# the 1.3B's width on a small bucket table (480p images and 17-frame clips), the paper's equal-token rule so that
# the plan needs no calibration, every block recomputed, eager (graphs are one-process only). LAYERS of its 30
# blocks (default 4): gloo moves every all-gather and reduce-scatter through host memory, and at 30 blocks a
# two-rank step took 42 s (1.7 s in one process) on the H200
SMALL=(conf=wan21_1p3b model.num_layers=${LAYERS:-4} scheduling=equal_token scheduling.calibration=null scheduling.m_tokens=7800
       model.checkpointing=full model.keep_attention=false train.cuda_graphs=off train.steps=6 train.val_every=3
       train.progress=false logging.wandb=disabled data.synthetic.num_samples=48 data.synthetic.mix.i720=0
       data.synthetic.mix.v480_33f=0 data.synthetic.mix.v480_49f=0 data.synthetic.mix.v480_81f=0
       data.synthetic.mix.v720_81f=0 checkpoint.at_end=false checkpoint.keep_last=2)
CKPT=(checkpoint.every=3)
NOCKPT=(checkpoint.every=0)
pick() {  # the two-rank runs' process group: MODE, else gloo where the probe found it serve every collective right
  if [[ ${GPUS:-1} == 2 ]]; then TWO=(); return; fi
  if [[ -n ${MODE:-} ]]; then TWO=(launch.debug_share_gpu=$MODE); return; fi
  TWO=(launch.debug_share_gpu=host)
  [[ -f $LOGS/probe_gloo.json ]] && python3 - "$LOGS/probe_gloo.json" <<'EOF2' && TWO=(launch.debug_share_gpu=gloo)
import json, sys
p = json.load(open(sys.argv[1]))
sys.exit(0 if p["rows"] and all(r["right"] for r in p["rows"]) else 1)
EOF2
}

losses() {  # run name → its metrics in OUT, and the losses on one line
  cp $RUNS/$1/metrics.jsonl "$LOGS/metrics_$1.jsonl" 2>/dev/null
  python3 - "$LOGS/metrics_$1.jsonl" "$1" <<'EOF'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except OSError:
    sys.exit(print(sys.argv[2], "no metrics"))
print(sys.argv[2], "train/loss", {r["step"]: round(r["train/loss"], 6) for r in rows if "train/loss" in r},
      "val/loss", {r["step"]: round(r["val/loss"], 6) for r in rows if "val/loss" in r},
      "step_s", [round(r["time/step_s"], 2) for r in rows if "time/step_s" in r])
EOF
}
train() {  # name, launcher words..., -- overrides...
  local name=$1; shift
  local cmd=(); while [[ $1 != -- ]]; do cmd+=("$1"); shift; done; shift
  local t0=$SECONDS
  timeout ${LIMIT:-150} "${cmd[@]}" "${SMALL[@]}" name=$name run_dir=$RUNS/$name "$@" > "$LOGS/train_$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s: ${cmd[*]} $*" | tee -a "$OUT/runs.txt"
  grep -E "process\(es\)|debug_share_gpu|resum|Error|error:|refus" "$LOGS/train_$name.log" | head -6 | cut -c1-400
  losses $name
  return $rc
}

if [[ $PART == *p* ]]; then
  for b in nccl gloo; do
    timeout 120 torchrun --standalone --nproc_per_node 2 scripts/bench/two_ranks_probe.py --backend $b \
      --out "$LOGS/probe_$b.json" > "$LOGS/probe_$b.log" 2>&1
    echo "probe $b: rc=$?"; grep -vE "^\s*$" "$LOGS/probe_$b.log" | grep -vE "W[0-9]{4}|\*\*\*\*" | head -30 | cut -c1-300
  done
fi
pick
[[ -f $LOGS/two_mode.txt && $PART != *a* ]] && read -ra TWO < "$LOGS/two_mode.txt"
echo "two-rank process group: ${TWO[*]:-NCCL, one GPU each}" | tee -a "$OUT/gpu.txt"
if [[ $PART == *a* ]]; then
  train one python3 train.py -- train.micro_batches=4 "${CKPT[@]}"
  if ! train two_self python3 train.py -- train.micro_batches=2 launch.num_processes=2 "${TWO[@]}" "${CKPT[@]}" \
       && [[ ${TWO[*]} == *gloo* ]]; then
    echo "gloo failed in the trainer: the host-staged group instead" | tee -a "$OUT/gpu.txt"
    tail -30 "$LOGS/train_two_self.log" | cut -c1-400 > "$LOGS/two_self_gloo_failure.txt"
    TWO=(launch.debug_share_gpu=host); rm -rf $RUNS/two_self
    train two_self python3 train.py -- train.micro_batches=2 launch.num_processes=2 "${TWO[@]}" "${CKPT[@]}"
  fi
  echo "${TWO[*]}" > "$LOGS/two_mode.txt"
  train two_torchrun torchrun --standalone --nproc_per_node 2 train.py -- train.micro_batches=2 "${TWO[@]}" \
    "${NOCKPT[@]}"
  train two_accelerate accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
    --dynamo_backend no --main_process_port 29533 train.py -- train.micro_batches=2 "${TWO[@]}" "${NOCKPT[@]}"
  rm -rf $RUNS/two_torchrun $RUNS/two_accelerate
fi
if [[ $PART == *r* ]]; then  # b's resumes from runs of 3 steps (quicker where a and its checkpoints are not here)
  train one python3 train.py -- train.micro_batches=4 train.steps=3 "${CKPT[@]}"
  train two_self python3 train.py -- train.micro_batches=2 train.steps=3 launch.num_processes=2 "${TWO[@]}" "${CKPT[@]}"
fi
if [[ $PART == *[br]* ]]; then
  train two_to_one python3 train.py -- train.micro_batches=4 resume=$RUNS/two_self/step_3 "${NOCKPT[@]}"
  train one_to_two python3 train.py -- train.micro_batches=2 launch.num_processes=2 "${TWO[@]}" \
    resume=$RUNS/one/step_3 "${NOCKPT[@]}"
fi
if [[ $PART == *d* ]]; then
  train one_again python3 train.py -- train.micro_batches=4 "${NOCKPT[@]}"
fi
if [[ $PART == *e* ]]; then
  CAL=(scheduling=balanced scheduling.calibration=auto scheduling.benchmark_points=${POINTS:-4} scheduling.benchmark_time_s=${BENCH_S:-90}
       train.steps=2 train.val_every=100)
  train cal_two python3 train.py -- train.micro_batches=2 launch.num_processes=2 "${TWO[@]}" "${CAL[@]}" "${NOCKPT[@]}"
  cp $RUNS/cal_two/calibration.json "$LOGS/calibration_two.json" 2>/dev/null
  if [[ ${CAL_ONE:-1} == 1 ]]; then
    train cal_one python3 train.py -- train.micro_batches=4 "${CAL[@]}" "${NOCKPT[@]}"
    cp $RUNS/cal_one/calibration.json "$LOGS/calibration_one.json" 2>/dev/null
  fi
  grep -h "scheduling" "$LOGS"/train_cal_*.log | cut -c1-400
fi
df -h /tmp | tail -1
