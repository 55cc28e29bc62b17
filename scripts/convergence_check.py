"""Does a planning window keep the training objective? val/loss against samples seen, planners side by side, on a CPU.

    python scripts/convergence_check.py --out runs/convergence                 (3 seeds × 4 arms of the tiny default)
    python scripts/convergence_check.py --out runs/convergence --plan          (time one short run, print the estimate)
    python scripts/convergence_check.py --out runs/convergence --report results/convergence_cpu
    python scripts/convergence_check.py --out runs/conv_reformed --arms reformed --steps 800 \
        --reference results/convergence_cpu.csv                                  (one arm against stored stream runs)

Every arm trains the tiny default (`python train.py`, the equal_token rule on the synthetic corpus) with the same
rule, M, steps and learning-rate schedule; only the planner differs: stream, sorted (W = 1), windowed W = 4 and
W = 8, and reformed (stream's samples re-formed into other micro-batches: it runs with the tiny CPU calibration,
whose chosen m_mem = 960 tokens (8·S_max) is the bound it re-forms within and whose cost model, with its
per-micro-batch term, merges a step's micro-batches of one bucket; the batch table stays m_tokens = 240's). One
process, so R = 1: sorted then holds each step's very samples in another order (a control: its curve
must match stream's up to float rounding), while a window deals a window's micro-batches to its steps in snake
order, so a step's samples — and their count — change. The loss of a windowed step divides by the window's mean
real samples a step (training/step.py), so every sample of a window weighs the same.

Validation runs every `--val-every` steps, a multiple of 8. Windows tile each epoch from its start and every arm
takes the same number of steps an epoch, so at every epoch's end the arms have seen the same samples and between
them they differ by less than a window's (about 1 % of samples seen at a validation); the curves are compared at
the same validation step. Seeds (train.seed) change the model's initialisation, the epoch order and the noise; the
corpus is one (written once into OUT/cache).

The rule this reports (and the presets follow): a window may be used by default only where its curve lies within the
seeds' spread of stream order's — at every validation after the first 25 % of the run, the window's mean over seeds
lies within [min, max] of stream's seeds, widened by nothing (two-sided: a curve below the spread has changed what
is trained as much as one above it). Also reported: each arm's gap to stream with the same seed (paired), whose
sign says which way a window moves the loss. Runs one at a time (nice them: `nice -n 10`); each
run's folder is OUT/<arm>-s<seed>, and an existing finished run is read, not rerun. A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo root

from training.cli import run_main  # noqa: E402
from training.compare import read_rows  # noqa: E402

ARMS = {"stream": ("stream", 1), "sorted": ("sorted", 1), "W=4": ("windowed", 4), "W=8": ("windowed", 8),
        "reformed": ("reformed", 1)}
ARM_EXTRA = {"reformed": ("scheduling.calibration=results/calibration_cpu_tiny.json",)}  # its m_mem (docstring)
SETTLED_FROM = 0.25  # the rule compares validations after this fraction of the run


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default=os.path.join("runs", "convergence"), help="the runs' folder")
    ap.add_argument("--report", default=None, help="path prefix of the raw report (.csv, .json, .png); "
                    "default OUT/convergence")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--val-every", type=int, default=40, help="a multiple of 8 (the largest window)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    ap.add_argument("--plan", action="store_true", help="time a 40- and an 80-step run, print the estimate, stop")
    ap.add_argument("--extra", default="", help="more train.py overrides for every arm, space-separated")
    ap.add_argument("--reference", default=None, help="an earlier report's CSV: stream's curves are read from it "
                    "(its runs at the same --steps, --val-every and seeds) instead of run; --arms then omits stream")
    args = ap.parse_args(argv)
    if args.val_every % 8 or args.steps % args.val_every:
        ap.error("--val-every must be a multiple of 8 and divide --steps: the arms must share their x values")
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}: choose from {', '.join(ARMS)}")
    if args.reference and "stream" in args.arms.split(","):
        ap.error("--reference reads stream's curves: drop stream from --arms")
    return args


def overrides(args, arm: str, seed: int, steps: int, run_dir: str) -> list[str]:
    planner, window = ARMS[arm]
    return [f"name=conv-{arm.replace('=', '')}-s{seed}", f"run_dir={run_dir}", f"data.cache_dir={os.path.join(args.out, 'cache')}",
            f"train.seed={seed}", f"train.steps={steps}", f"train.val_every={args.val_every}", "train.log_every=8",
            "train.progress=false", "logging.wandb=disabled", "checkpoint.every=0", "checkpoint.at_end=false",
            f"scheduling.planner={planner}", f"scheduling.window={window}", *ARM_EXTRA.get(arm, ()),
            *args.extra.split()]


def train(args, arm: str, seed: int, steps: int, run_dir: str) -> float:
    """Seconds the run took (0 where a finished run was found and read instead)."""
    done = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(done) and any(r.get("step") == steps and "val/loss" in r for r in read_rows(run_dir)):
        return 0.0
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *overrides(args, arm, seed, steps, run_dir)]
    if os.path.exists(run_dir):
        cmd.append("overwrite=true")  # an unfinished earlier attempt: moved aside by the trainer
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def curve(run_dir: str) -> list[tuple[int, int, float]]:
    """(step, samples_seen, val/loss) of every validation, the step-0 point included."""
    return [(int(r["step"]), int(r["samples_seen"]), float(r["val/loss"])) for r in read_rows(run_dir)
            if r.get("val/loss") is not None]


def judge(curves: dict, arms: list[str], steps: int) -> dict:
    """Per arm: at every validation step after SETTLED_FROM of the run, is the seeds' mean inside stream's seeds'
    [min, max]? Also the final val/loss mean and spread, the largest gap to stream's mean in stream spreads, and the
    gap to stream with the same seed (paired; seeds in the same order)."""
    import numpy as np

    out = {}
    ref = curves["stream"]
    val_steps = [s for s, _, _ in next(iter(ref.values()))]
    late = [i for i, s in enumerate(val_steps) if s >= SETTLED_FROM * steps]
    ref_v = np.array([[v for _, _, v in c] for c in ref.values()])  # (seeds, validations)
    for arm in arms:
        v = np.array([[x for _, _, x in c] for c in curves[arm].values()])
        mean = v.mean(0)
        inside = [(ref_v[:, i].min() <= mean[i] <= ref_v[:, i].max()) for i in late]
        spread = ref_v.max(0) - ref_v.min(0)
        out[arm] = {"within_stream_spread": bool(all(inside)), "inside": f"{sum(inside)}/{len(inside)}",
                    "final_mean": float(mean[-1]), "final_min": float(v[:, -1].min()),
                    "final_max": float(v[:, -1].max()),
                    "late_mean": float(mean[late].mean()),
                    "paired_gap_late": float((v[:, late] - ref_v[:, late]).mean()),
                    "paired_gap_end_by_seed": [float(x) for x in v[:, -1] - ref_v[:, -1]],
                    "max_gap_in_spreads": float(max(abs(mean[i] - ref_v[:, i].mean()) / max(spread[i], 1e-12)
                                                    for i in late))}
    return out


def plot(curves: dict, arms: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm in arms:
        runs = list(curves[arm].values())
        x = np.array([n for _, n, _ in runs[0]])
        v = np.array([[x_ for _, _, x_ in c] for c in runs])
        line, = a.plot(x, v.mean(0), label=arm)
        a.fill_between(x, v.min(0), v.max(0), color=line.get_color(), alpha=0.2)
        keep = slice(len(x) // 4, None)
        b.plot(x[keep], v.mean(0)[keep], label=arm, color=line.get_color())
        b.fill_between(x[keep], v.min(0)[keep], v.max(0)[keep], color=line.get_color(), alpha=0.2)
    a.set(xlabel="samples seen", ylabel="val/loss", title="val/loss, seeds' mean and [min, max]")
    b.set(xlabel="samples seen", ylabel="val/loss", title=f"after {SETTLED_FROM:.0%} of the run")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reference_curves(path: str, seeds: list) -> dict:
    """{seed: [(step, samples_seen, val/loss)]} of stream order's runs in an earlier report's CSV."""
    out: dict = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["arm"] == "stream" and int(r["seed"]) in seeds:
                out.setdefault(int(r["seed"]), []).append((int(r["step"]), int(r["samples_seen"]),
                                                           float(r["val_loss"])))
    if sorted(out) != sorted(seeds):
        raise SystemExit(f"{path} holds stream runs of seeds {sorted(out)}, not {sorted(seeds)}")
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    arms, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    os.makedirs(args.out, exist_ok=True)
    if args.plan:  # two short runs: the difference is the steps' time, the rest start-up
        t40, t80 = (train(args, "W=8", 0, n, os.path.join(args.out, f"plan-{n}")) for n in (40, 80))
        per_step, start = max(0.0, (t80 - t40) / 40), max(0.0, 2 * t40 - t80)
        n = len(arms) * len(seeds)
        print(f"one step {per_step:.3f} s, start-up {start:.0f} s: {n} runs of {args.steps} steps about "
              f"{n * (per_step * args.steps + start):.0f} s")
        return
    t0 = time.perf_counter()
    curves: dict = {arm: {} for arm in arms}
    if args.reference:
        curves["stream"] = reference_curves(args.reference, seeds)
    times: dict = {}
    for seed in seeds:  # seed-major: a run cut short still leaves every arm of the first seeds
        for arm in arms:
            run_dir = os.path.join(args.out, f"{arm.replace('=', '')}-s{seed}")
            times[(arm, seed)] = train(args, arm, seed, args.steps, run_dir)
            curves[arm][seed] = curve(run_dir)
            print(f"{arm:<7} seed {seed}: val/loss {curves[arm][seed][-1][2]:.5f} at {curves[arm][seed][-1][1]} "
                  f"samples ({times[(arm, seed)]:.0f} s)", flush=True)
    verdict = judge(curves, arms, args.steps)
    prefix = args.report or os.path.join(args.out, "convergence")
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(prefix + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arm", "seed", "step", "samples_seen", "val_loss"])
        for arm in arms:
            for seed, c in curves[arm].items():
                w.writerows([arm, seed, s, n, f"{v:.6f}"] for s, n, v in c)
    elapsed = time.perf_counter() - t0
    meta = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
            "command": f"python scripts/convergence_check.py {' '.join(argv if argv is not None else sys.argv[1:])}",
            "steps": args.steps, "val_every": args.val_every, "seeds": seeds, "arms": arms,
            "run_s": {f"{a} s{s}": round(t, 1) for (a, s), t in times.items() if t > 0},
            "read_not_rerun": [f"{a} s{s}" for (a, s), t in times.items() if t == 0], "elapsed_s": round(elapsed, 1),
            "rule": f"within stream's seeds' [min, max] at every validation after {SETTLED_FROM:.0%} of the run",
            "verdict": verdict}
    with open(prefix + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    plot(curves, (["stream"] if args.reference else []) + arms, prefix + ".png")
    lines = ["| planner | val/loss at the end: seeds' mean [min, max] | mean after 25 % | − stream, same seed: "
             "after 25 % (at the end, per seed) | largest gap to stream's mean, in stream's spreads | mean inside "
             "stream's spread | may be a default |", "|---|---|---|---|---|---|---|"]
    for arm in arms:
        v = verdict[arm]
        ends = ", ".join(f"{x:+.4f}" for x in v["paired_gap_end_by_seed"])
        lines.append(f"| {arm} | {v['final_mean']:.4f} [{v['final_min']:.4f}, {v['final_max']:.4f}] | "
                     f"{v['late_mean']:.4f} | {v['paired_gap_late']:+.4f} ({ends}) | {v['max_gap_in_spreads']:.2f} | "
                     f"{v['inside']} | {'yes' if v['within_stream_spread'] else 'no'} |")
    print("\n".join(lines))
    print(f"wrote {prefix}.csv, .json, .png ({elapsed:.0f} s)")


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1:]))
