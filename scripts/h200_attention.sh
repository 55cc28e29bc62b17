#!/usr/bin/env bash
# The trainer at the GPU's limit (results/attention_h200.md, results/step_h200.md), one device call per part:
#   t  the GPU tests of model.attention_backend (every backend against fp32 math, Wan and the MMDiT; cuDNN handed a
#      gradient laid out unlike its output), the fused attention's kernels, Wan's parity with diffusers and the
#      MMDiT's GPU test, and the CUDA graphs' (replays against eager; a side stream's cuBLAS workspaces freed) (~2 min)
#   k  SDPA's kernels at Wan's shapes and the cuDNN key-mask check (scripts/bench/attention.py, ~1.5 min)
#   L  cuDNN's time by q/k/v/dO layout and call path (raw SDPA, ops.attention_backend.sdpa, the aten ops
#      ops/rope_attention.py calls) at Wan 1.3B's self- and cross-attention, taking turns, ROUNDS rounds (default 4)
#      (attention.py --layouts, ~1 min; ran on an H100 on 2026-12-07, results/attention_h100.md calls 11-12)
#   a  the 1.3B step against diffusers at cuDNN with gradient checkpointing at S = 32760, 14040, 75600, with the
#      device-time profile at the first (~5 min); its blocks compiled only where IMPLS_A names diffusers@compile;
#      PEAK_LIMIT_A=lowest searches ours@policy and ours@keep within compiled diffusers' peak too
#   b  the same at 16×1560 and 4×7800, with diffusers' compiled blocks, no recompute (ours@none) and the device-time
#      split of every shape (~3.5 min)
#   p  ours@glue and ours@none with their device-time split at 2×14040, 1×32760, 1×75600 (SHAPES_P: step.py's
#      shape indices), beside diffusers@cudnn: the ceiling table's measured parts (~3.5 min)
#   n  a KN-block (default 4) full-width slice of Wan 14B at 720p 81 frames with no recompute (ours@none), beside
#      ours@glue, ours@keep and diffusers@cudnn; REPS_N timed steps after one warm-up (default 1) (~2.5 min;
#      KN=14 REPS_N=3: T_N=300)
#   m  the MMDiT at HunyuanVideo width against diffusers' default and cuDNN backends (~1.5 min)
#   w  a 10-block full-width slice of Wan 14B at 720p 81 frames: MFU, ours against diffusers@cudnn (~4 min)
#   d  which kernel torch's default SDPA choice is at Wan's shapes (the baseline's backend; seconds)
#   c  the 1.3B calibrated with the policies model.checkpointing=auto, keep_attention=auto choose among (none,
#      full, keep), under the preset's execution (cuDNN, CUDA graphs where they serve); REPS timed steps a point
#      (default 1; 2 took 188 s of scan) (~3.5 min)
#   s  the small micro-batches (1×1560, 4×1560, 1×7800: step.py's shapes 5-7) against diffusers at its best, its
#      blocks compiled and then its whole micro-batch captured as a CUDA graph, beside ours eager, no recompute and
#      ours@graph (what train.py runs there) (~4 min; ran on an H100 three times on 2026-12-07, the last with
#      cuBLAS's workspaces cleared after each graph column: results/attention_h100.md call 12)
#   C  the 14B slice (4 of 40 blocks, FSDP's memory over 8 ranks) calibrated under the three policies, two timed
#      steps a point, the second depth BUDGET14_2_S for each policy (CAL14_S, default 420 s; ran on an H100 in 355 s
#      on 2026-12-07, results/attention_h100.md call 13; the H200's is still to take)
#   g  the held-out check of that calibration: five micro-batches (four scan shapes and i480 B = 10, which no scan
#      timed) under full and keep, eager and then every one captured in a CUDA graph, 3 repeats each (~2.5 min)
#   r  train.py conf=wan21_1p3b, this commit (checkpointing=auto, keep_attention=auto) beside the previous main
#      unpacked in ./prev, the same batches; EXPANDABLE=1 also runs this commit under
#      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (~5 min; ~7.5 with EXPANDABLE)
#   v  the MMDiT at HunyuanVideo width with text lengths that change every step (VARY steps, default 24), ours
#      against diffusers, then ours@auto again under TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (~3 min; ran on an H100)
# Results land in $OUT (default ./h200_attention_out); copy them to results/. Needs .whl/ (bash scripts/make_wheels.sh).
set -uo pipefail
source scripts/h200_env.sh h200_attention_out
PART=${PART:-tk}
if [[ $PART == *t* ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_backend.py tests/test_rope_attention.py \
    tests/test_wan_parity.py tests/test_wan_fused.py tests/test_mmdit.py tests/test_cuda_graphs.py \
    -k "cuda or gpu or every_backend or fused_ops_model or laid_out" 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
  python3 -m pytest -q -s -p no:cacheprovider tests/test_attention_backend.py -k laid_out 2>&1 | grep "raw SDPA" \
    | tee "$OUT/cudnn_grad_layout.txt"
fi
if [[ $PART == *d* ]]; then
  python3 - <<'PY' 2>&1 | tee "$OUT/default_choice.txt"
import torch
names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}
for B, S in ((16, 1560), (1, 32760), (1, 75600)):
    x = torch.randn(B, S, 12, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    print(f"torch {torch.__version__} default SDPA choice, bf16 q [B={B}, H=12, S={S}, 128] (BSHD memory):",
          names[int(torch._fused_sdp_choice(x, x, x))])
PY
fi
if [[ $PART == *c* ]]; then
  timeout ${CAL_S:-300} python3 scripts/calibrate.py conf=wan21_1p3b model.checkpointing=auto model.keep_attention=auto \
    "+calibrate.buckets=[i480,v480_17f,v480_33f,v480_81f,v720_49f,v720_81f]" +calibrate.max_points=8 \
    +calibrate.top_tokens=${TOP:-40000} +calibrate.repeats=${REPS:-1} +calibrate.time_budget_s=${BUDGET_S:-100} \
    +calibrate.out="$OUT/calibration_h200_policies.json" 2>&1 \
    | tee "$OUT/calibrate.log" | grep -vE '^\s*$' | cut -c1-300 | tail -25
fi
if [[ $PART == *s* ]]; then
  timeout ${T_S:-300} python3 scripts/bench/step.py --out "$OUT/s" --shapes 5,6,7 --fast-backend _native_cudnn --reps 3 \
    --gc-off --longest '' --impls "${IMPLS_S:-diffusers@fast,diffusers@compile,diffusers@graph,ours@glue,ours@policy,ours@graph,ours@none}" \
    2>&1 | tee "$OUT/bench_s.log" | grep -E "^\||Error|error" | cut -c1-400 | tail -12
fi
if [[ $PART == *C* ]]; then
  timeout ${CAL14_S:-420} python3 scripts/calibrate.py conf=wan21_8gpu launch.num_processes=1 train.cuda_graphs=off \
    model.checkpointing=auto model.keep_attention=auto +calibrate.blocks=4 +calibrate.memory_blocks=2 \
    +calibrate.fsdp_ranks=8 +calibrate.repeats=2 +calibrate.time_budget_s=${BUDGET14_S:-90} \
    +calibrate.memory_time_budget_s=${BUDGET14_2_S:-45} +calibrate.out="$OUT/calibration_h200_14b_policies.json" 2>&1 \
    | tee "$OUT/calibrate_14b.log" | grep -vE '^\s*$' | cut -c1-300 | tail -30
fi
if [[ $PART == *g* ]]; then
  for g in eager graphs; do
    if [ $g = eager ]; then X=(train.cuda_graphs=off); else X=(train.cuda_graphs=auto train.graph_max_tokens=40000); fi
    echo "== $g"; timeout 150 python3 scripts/calibrate.py conf=wan21_1p3b model.checkpointing=full "${X[@]}" \
      "+calibrate.points=[v480_33f:1,v480_33f:2,v480_17f:1,v480_17f:5,i480:10]" +calibrate.warmup=1 \
      +calibrate.repeats=3 +calibrate.out="$OUT/held_out_policies_$g.json" 2>&1 | grep -E "S=|Error|error" | cut -c1-200
  done
fi
if [[ $PART == *r* ]]; then  # train.py, this commit against the previous main unpacked in ./prev, same batches;
  # PROF_STEP=N: that step of this commit's run traced (its device time by kernel kind and the GPU's idle time:
  # $OUT/new/traces/stepN_rank0_split.json), and left out of the medians
  common=(conf=wan21_1p3b scheduling=equal_token scheduling.m_tokens=32760 train.steps=${STEPS:-7} train.val_every=1000
          train.progress=false checkpoint.every=0 checkpoint.at_end=false logging.wandb=disabled data.cache_dir=/tmp/cache)
  timeout ${NEW_S:-150} python3 train.py "${common[@]}" name=new run_dir="$OUT/new" scheduling.tokens_per_step=null train.micro_batches=4 model.checkpointing=auto \
    model.keep_attention=auto scheduling.calibration="${CAL:-results/calibration_h200_policies.json}" \
    ${PROF_STEP:+metrics.profile_steps=[$PROF_STEP,$PROF_STEP]} 2>&1 | tee "$OUT/train_new.log" \
    | grep -E "attention:|scheduling:|perf|Error" | cut -c1-300 | tail -6
  runs="new old"
  if [ -n "${EXPANDABLE:-}" ]; then  # the same run under the allocator's expandable segments (fragmentation's remedy)
    runs="new old exp"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout ${NEW_S:-150} python3 train.py "${common[@]}" name=exp \
      run_dir="$OUT/exp" scheduling.tokens_per_step=null train.micro_batches=4 model.checkpointing=auto \
      model.keep_attention=auto scheduling.calibration="${CAL:-results/calibration_h200_policies.json}" 2>&1 \
      | tee "$OUT/train_exp.log" | grep -E "scheduling:|Error" | cut -c1-300 | tail -3
  fi
  [ -d prev ] && (cd prev && timeout ${OLD_S:-120} python3 train.py "${common[@]}" name=old run_dir="$OUT/old" \
    scheduling.calibration=results/calibration_h200.json 2>&1 \
    | tee "$OUT/train_old.log" | grep -E "scheduling:|Error" | cut -c1-300 | tail -4)
  for r in $runs; do [ -f "$OUT/$r/metrics.jsonl" ] && python3 -c "
import json, statistics as st
rows = [json.loads(l) for l in open('$OUT/$r/metrics.jsonl') if 'perf/mfu' in l]
steady = [r for r in rows[3:] if r['step'] != int('${PROF_STEP:-0}')] or rows  # a profiled step is slowed
print('$r', len(rows), 'steps; median after 3: mfu', round(st.median(r['perf/mfu'] for r in steady), 4),
      'tokens/s', round(st.median(r['perf/tokens_per_s'] for r in steady)), 'peak GiB',
      max(r.get('memory/peak_gib', 0) for r in rows), 'reserved GiB', max(r.get('memory/reserved_peak_gib', 0) for r in rows),
      'alloc retries', max(r.get('memory/alloc_retries', 0) for r in rows))" 2>&1 | tail -1; done
fi
if [[ $PART == *k* ]]; then
  timeout 150 python3 scripts/bench/attention.py --out "$OUT" --reps 5 2>&1 | tee "$OUT/attention.log" \
    | grep -E "^\||error|Error" | tail -20
fi
if [[ $PART == *L* ]]; then
  timeout 150 python3 scripts/bench/attention.py --layouts --out "$OUT" --reps 5 --rounds ${ROUNDS:-4} 2>&1 \
    | tee "$OUT/attention_layouts.log" | tail -12
fi
if [[ $PART == *a* ]]; then
  timeout ${T_A:-330} python3 scripts/bench/step.py --out "$OUT/a" --shapes 3,2,4 --fast-backend _native_cudnn --reps 3 \
    --gc-off --profile --longest '' --peak-limit "${PEAK_LIMIT_A:-fast}" \
    --impls "${IMPLS_A:-diffusers@default,diffusers@fast,ours@glue,ours@policy,ours@keep}" 2>&1 | tee "$OUT/bench_a.log" | grep -E "^\||Error|error" | cut -c1-400 | tail -12
fi
if [[ $PART == *b* ]]; then
  timeout ${T_B:-240} python3 scripts/bench/step.py --out "$OUT/b" --shapes 0,1 --fast-backend _native_cudnn --reps 3 \
    --gc-off --longest '' --profile-every \
    --impls "${IMPLS_B:-diffusers@default,diffusers@fast,diffusers@compile,ours@glue,ours@policy,ours@keep,ours@none}" \
    2>&1 | tee "$OUT/bench_b.log" | grep -E "^\||Error|error" | cut -c1-400 | tail -12
fi
if [[ $PART == *p* ]]; then
  timeout ${T_P:-120} python3 scripts/bench/step.py --out "$OUT/p" --shapes ${SHAPES_P:-2,3,4} --fast-backend _native_cudnn --reps 2 \
    --gc-off --longest '' --profile-every --impls ours@glue,ours@none 2>&1 | tee "$OUT/bench_p.log" \
    | grep -E "^\||Error|error|memory" | cut -c1-400 | tail -8
fi
if [[ $PART == *n* ]]; then
  timeout ${T_N:-180} python3 scripts/bench/step.py --model 14b --blocks "${KN:-4}" --out "$OUT/n" --shapes 4 \
    --fast-backend _native_cudnn --reps "${REPS_N:-1}" --long-tokens 1000000 --gc-off --longest '' \
    --impls diffusers@fast,ours@glue,ours@keep,ours@none \
    2>&1 | tee "$OUT/bench_n.log" | grep -E "^\||Error|error|memory" | cut -c1-400 | tail -8
fi
if [[ $PART == *m* ]]; then
  timeout ${T_M:-150} python3 scripts/bench/mmdit.py --out "$OUT/m" 2>&1 | tee "$OUT/mmdit.log" | grep -E "impl|Error" | tail -12
fi
if [[ $PART == *v* ]]; then
  timeout ${T_V:-180} python3 scripts/bench/mmdit.py --out "$OUT/v" --vary-text "${VARY:-24}" 2>&1 \
    | tee "$OUT/mmdit_vary.log" | grep -E "impl|Error" | cut -c1-400 | tail -8
  TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 timeout ${T_V2:-90} python3 scripts/bench/mmdit.py --out "$OUT/v" \
    --vary-text "${VARY:-24}" --impls ours@auto 2>&1 | tee "$OUT/mmdit_vary_avoid.log" | grep -E "impl|Error" | tail -4
fi
if [[ $PART == *w* ]]; then
  timeout 300 python3 scripts/bench/step.py --model 14b --blocks "${K:-10}" --out "$OUT/w" --shapes 4 \
    --fast-backend _native_cudnn --reps 1 --gc-off --longest '' --impls diffusers@fast,ours@glue,ours@keep 2>&1 \
    | tee "$OUT/bench_w.log" | grep -E "^\||Error|error" | cut -c1-400 | tail -8
fi
