"""Replay the planner's plans for R ranks on one device: every planned micro-batch run for real, balance measured.

    python scripts/replay_plans.py --out runs/replay_1p3b --ranks 8 --steps 6 --warmup 1 --micro-batches 2 \
        --strategies equal_token,dual_constraint,balanced --factor 2 \
        --mix i480:0.25,i720:0.10,v480_17f:0.15,v480_33f:0.15 conf=wan21_1p3b
    python scripts/replay_plans.py --out OUT --settings settings.json conf=wan21_8gpu launch.num_processes=1 \
        --blocks 4 --calibration OUT/calibration_14b_slice.json                   (a 4-block slice of Wan 14B)
    python scripts/replay_plans.py --out /tmp/replay --ranks 2 --steps 2          (the tiny default, on a CPU)
    python scripts/replay_plans.py ... --dry-run                                  (plans and predictions only)

Trailing key=value arguments are Hydra overrides of the training config (as for train.py).

What it does, per strategy setting:
1. The sample table of a bucket mix (scheduling.simulate.Mix: shares of samples, in a seeded order; default: the
   simulator's DEFAULT_MIX restricted to the config's buckets, else the config's data.synthetic.mix), sized as the
   simulator sizes it (or --samples, e.g. to reach the epoch's end and its padding micro-batches).
2. Batch sizes per bucket: given (--batch-sizes, or a settings entry), or the strategy's rule
   (scheduling.policy.resolve_schedule, as training resolves it for R ranks) from its knob: --m-tokens, --m-comp/--p,
   --target-ms, --m-mem, or --factor F = the simulator's sweep factor (m_tokens = F·S_max; m_comp = F·S_max^p;
   target = F × the predicted ms of S_max at B = 1). The cost model (--calibration, default the config's
   scheduling.calibration; without one, FLOPs at --peak-tflops or 100 TFLOP/s) gives every micro-batch's pred_ms.
3. warm-up + K plans for R ranks and M micro-batches (scheduling.replay.plan_steps: training's planner).
4. The model of the config (models.build.build_model; --blocks k builds k of its blocks at full width), its
   optimizer, EMA, precision and checkpointing; each distinct (bucket, B) micro-batch once, untimed (kernels
   compiled, allocator grown); then each step's R·M micro-batches in (slot, rank) order through the trainer's own
   step (training.step.train_step: forward and backward of every micro-batch, the optimizer once), on synthetic
   host inputs of each bucket's shape (padding micro-batches: loss weight 0). Each micro-batch is timed by the
   trainer's clock (CUDA events; perf_counter on a CPU); the step by the wall clock between two device syncs; the
   step's time outside its micro-batches (clipping, optimizer, EMA, the host's gaps) is its optim_ms.
5. scheduling.replay computes tokens/s, samples/s, busy CV, idle and step-time CV from the measured times and, for
   the same plans, from the planner's prediction (pred_ms; the calibration's optim_ms), the simulator's numbers.

With --blocks k < layers every time (micro-batches and optim_ms) is also reported scaled ×layers/k to the full depth
(per-block cost is identical; the non-block part is over-counted by the same factor, as scripts/calibrate.py
does); the metrics use the scaled times, `measured_as_run` the times of the k-block model. --cuda-graphs off (the
default) runs every micro-batch eagerly, as a multi-process FSDP run does; auto captures small ones as one process
of train.py does: each setting is planned beside the graphs' pool and captures up to its own largest planned
micro-batch within train.graph_max_tokens (its Schedule.graph_tokens; none where every one is over it), the setting's
`execution` in NAME.json.

Output in --out: NAME.json (meta; one entry per setting with its summaries — measured, measured_as_run, predicted —
and one row per micro-batch: step (< 0: warm-up), warmup, rank, slot, bucket, S, B, real, pred_ms, measured_ms,
scaled_ms; `comparisons`: balanced ÷ dual_constraint and the others, measured and predicted; `points`: every timed
(S, B) with its scaled times, as a calibration's points), NAME.md (the printed tables). The JSON is rewritten
after each setting, so a run stopped midway keeps what it measured. A benchmark: it asserts nothing.

Settings file (--settings): a JSON list of entries, or {"settings": [entries], "mix": {name: share} (or
[{"bucket", "share"}, ...]), "ranks": R, "micro_batches": M, "calibration": path} whose values stand in for the
options not given (other keys are ignored). An entry:
    {"strategy": "balanced",                                   required
     "label": "balanced@2x",                                   default: the strategy (labels must differ)
     "batch_sizes": {"i480": 31, ...} or [31, ...],            per bucket (a list: in the mix's order); or a knob:
     "m_tokens" | "m_comp", "p" | "target_microbatch_ms" | "factor", "m_mem", "mem_budget_gib",
     "M": 2, "window": 1, "planner": "sorted",                 default: --micro-batches, --window, --planner (the
                                                               rule's default: scheduling.planner)
     "setting": {...}, "tokens_per_step": g, "note": "..."}    carried into the output, not read
A knob beats a factor; the command line's knobs fill what an entry leaves unset. --strategies picks entries by
label or strategy (default: every entry).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from training.cli import run_main  # noqa: E402
from training.replay import ReplayOptions, replay  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the training config (key=value)")
    p.add_argument("--out", default=os.path.join("runs", "replay"), help="output folder (default runs/replay)")
    p.add_argument("--name", default="replay", help="file stem of the outputs (default replay)")
    p.add_argument("--settings", default=None, help="JSON settings file (module docstring)")
    p.add_argument("--strategies", default=None,
                   help="comma list of strategies, or of the settings file's labels (default: the config's "
                        "scheduling.strategy, or every settings entry)")
    p.add_argument("--ranks", type=int, default=None, help="R, ranks planned for (default 8)")
    p.add_argument("--steps", type=int, default=12, help="K, timed steps (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="planned steps run before the timed ones (default 2)")
    p.add_argument("--micro-batches", type=int, default=None, help="M (default: train.micro_batches)")
    p.add_argument("--batch-sizes", default=None, help="B per bucket for every strategy: name=B,name=B,...")
    p.add_argument("--m-tokens", type=float, default=None)
    p.add_argument("--m-mem", type=float, default=None)
    p.add_argument("--mem-budget-gib", type=float, default=None)
    p.add_argument("--m-comp", type=float, default=None)
    p.add_argument("--p", type=float, default=None)
    p.add_argument("--target-ms", type=float, default=None, help="target_microbatch_ms (cost, balanced)")
    p.add_argument("--factor", type=float, default=None,
                   help="each strategy's knob as the simulator's sweep factor (module docstring)")
    p.add_argument("--window", type=int, default=None, help="scheduling.window (with --planner windowed; default 1)")
    p.add_argument("--planner", default=None, choices=("stream", "sorted", "windowed", "reformed"),
                   help="scheduling.planner for every entry without its own (default: the rule's)")
    p.add_argument("--calibration", default=None, help="calibration file (default: scheduling.calibration)")
    p.add_argument("--mix", default=None, help="bucket mix as name:share,... (shares of samples)")
    p.add_argument("--samples", type=int, default=None, help="entries in the epoch (default: enough for every step)")
    p.add_argument("--seed", type=int, default=None, help="plan seed (default: train.seed)")
    p.add_argument("--blocks", type=int, default=None, help="build k of the model's blocks (Wan); times ×layers/k")
    p.add_argument("--cuda-graphs", choices=("off", "auto"), default="off",
                   help="off (default): eager, as a multi-process FSDP run; auto: as one process of train.py")
    p.add_argument("--peak-tflops", type=float, default=None, help="for MFU (default: metrics.peak_tflops)")
    p.add_argument("--truth", action="append", default=None, metavar="CAL",
                   help="a calibration file whose measured points price the same plans as the simulator's truth does "
                   "(at the full depth, and at the replay's own depth where it timed it); repeat it to merge several: "
                   "the simulator's truth is its --calibration's points and its --truth-points files', so name "
                   "those, the calibration first (its optimizer step)")
    p.add_argument("--dry-run", action="store_true", help="plan and predict only; no model")
    return p.parse_intermixed_args(argv)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return replay(ReplayOptions(**vars(parse_args(argv))), "python scripts/replay_plans.py " + " ".join(argv))


if __name__ == "__main__":
    run_main(main)
