"""The strategy comparison on one multi-GPU machine: calibrate, simulate, then train four arms.

    python scripts/compare_strategies.py --out runs/compare_8gpu                    (8 GPUs, Wan 2.1 1.3B, ~25 min)
    python scripts/compare_strategies.py --tiny --procs 2 --out /tmp/cmp_cpu         (the tiny model on a CPU)
    python scripts/compare_strategies.py --quick                                     (the same in about 1.5 min)
    python scripts/compare_strategies.py --tiny --procs 2 --plan                     (the estimate only)

Every mode prints its estimated run time first. --quick (implies --tiny, 2 processes) checks the whole path on a
CPU: it skips step 2 (the committed CPU calibration, results/calibration_cpu_tiny.json, is copied into OUT and
used, so the simulated column comes from that file, not this machine), runs the simulator on fewer micro-batches,
and times 4 steps after 1 warm-up per arm.

1. one synthetic latent corpus in the short-clip mix (conf/data/wan_short.yaml: 480p image 25 %, 720p image 10 %,
   480p 17 f 15 %, 480p 33 f 15 %), written once to OUT/corpus and read by every run;
2. calibration on this machine with the runs' model, precision and checkpointing (scripts/calibrate.py, all ranks);
3. the simulator on that calibration at R = procs (scripts/simulate_cluster.py): best m_comp / target ms, written into
   the calibration (which the runs then read), and each arm's predicted tokens/s;
4. four arms through train.py, each started the way a user starts it (`launch.num_processes`), FSDP2, M = 4:
       1 equal_token (m_tokens = 14040) + reference AdaLN      2 equal_token + fused AdaLN
       3 dual_constraint at the simulator's best m_comp + fused 4 balanced at the simulator's best target + fused
   warm-up steps, then timed steps; busy time sampled from profiler traces;
5. OUT/summary.md: per arm tokens/s, samples/s, busy CV, idle, step-time CV, peak memory, the simulator's tokens/s
   beside the measured, the commands; OUT/compare.png (val/loss against samples seen, throughput, balance).
A benchmark, never a test: it asserts nothing and prints the table last.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo root

from training.cli import run_main  # noqa: E402
from training.compare import compare, read_rows, summarize  # noqa: E402

QUICK_MBS = 512  # the simulator's micro-batches per candidate run under --quick (its default: 4096)
CPU_CALIBRATION = os.path.join(ROOT, "results", "calibration_cpu_tiny.json")  # --quick's, copied into OUT
QUICK_CAVEAT = ("--quick: the simulated column comes from the committed calibration (one process, another machine's "
                "load, no FSDP collectives), not from this set-up, so it checks the path, not the prediction: the "
                "measured 2-process gloo runs pay collectives and share the cores. Compare the two columns only "
                "without --quick, where the calibration is measured in the runs' own set-up.")
# Run-time model of the estimate printed up front (seconds; on a 2-core CPU for --tiny, 8 H200s otherwise):
# (fixed, per step) of one arm, the calibration and the simulation. The tiny arm and quick simulation were measured
# on this repo's 2-core development machine on 2026-12-02 with other jobs running (load 1-3): --quick took 89 s, its
# arms 17-18 s each, the simulation 13 s (on a busier machine, load ~5, it took 145 s); the GPU numbers come from
# the run times in the module docstring.
COSTS = {"tiny": {"arm": (17.0, 0.3), "calibration": 480 + 60, "simulation": 110, "simulation_quick": 15},
         "gpu": {"arm": (90.0, 3.0), "calibration": 480 + 120, "simulation": 120, "simulation_quick": 30}}
MIX = {"i480": 0.25, "i720": 0.10, "v480_17f": 0.15, "v480_33f": 0.15}
TINY_MIX = {"img_64": 0.3, "img_64x96": 0.2, "vid_64_9f": 0.3, "vid_64x96_17f": 0.2}


def run(cmd: list[str], log_path: str, timeout: float) -> float:
    """Run a command from the repo root, teeing its output to log_path; returns its wall seconds."""
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              env=dict(os.environ, WANDB_MODE=os.environ.get("WANDB_MODE", "disabled")))
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"command failed ({proc.returncode}); the end of {log_path}:\n{tail}")
    return time.perf_counter() - t0


def write_corpus(out: str, tiny: bool, samples: int) -> str:
    from data.buckets import bucket_table
    from data.index import SampleIndex
    from data.synthetic import write_synthetic_corpus
    from training.config import compose_config

    root = os.path.join(out, "corpus")
    try:
        SampleIndex.load(root)
        return root
    except FileNotFoundError:
        pass
    cfg = compose_config([] if tiny else ["conf=wan21_1p3b", "data=wan_short"])
    mix = TINY_MIX if tiny else MIX
    write_synthetic_corpus(root, bucket_table(cfg.data.buckets, patch=cfg.model.patch), mix, num_samples=samples, num_val=8,
                           latent_channels=cfg.model.in_channels, text_dim=cfg.model.text_dim, seed=0,
                           samples_per_shard=64, dtype="float32" if tiny else "float16")
    return root


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default=os.path.join("runs", "compare_strategies"),
                    help="output folder (default runs/compare_strategies)")
    ap.add_argument("--procs", type=int, default=None, help="processes (GPUs) per arm (default 8; --quick: 2)")
    ap.add_argument("--tiny", action="store_true", help="tiny model, tiny buckets, CPU-sized steps")
    ap.add_argument("--quick", action="store_true", help="--tiny in about 1.5 min on a 2-core CPU: the committed "
                    "CPU calibration, a short simulation, 1 + 4 steps per arm (module docstring)")
    ap.add_argument("--plan", action="store_true", help="print the estimated run time, run nothing")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per arm (default 5; --quick: 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps after the warm-up (default 30; --quick: 4)")
    ap.add_argument("--samples", type=int, default=None,
                    help="synthetic corpus size, epochs repeat it (default 1024; --quick: 256)")
    ap.add_argument("--minutes-per-arm", type=float, default=4.0, help="a run over this is stopped (timeout)")
    ap.add_argument("--m-tokens", type=int, default=None, help="equal_token's m_tokens (default: the mix's S_max)")
    ap.add_argument("--skip-calibration", action="store_true", help="reuse OUT/calibration.json")
    args = ap.parse_args(argv)
    args.tiny = args.tiny or args.quick
    for name, full, quick in (("procs", 8, 2), ("warmup", 5, 1), ("steps", 30, 4), ("samples", 1024, 256)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def estimate(args) -> dict[str, float]:
    """Seconds per phase by COSTS: what this run is expected to take, printed before anything runs."""
    c = COSTS["tiny" if args.tiny else "gpu"]
    fixed, per_step = c["arm"]
    phases = {}
    if not (args.quick or args.skip_calibration):
        phases["calibration"] = c["calibration"]
    phases["simulation"] = c["simulation_quick" if args.quick else "simulation"]
    phases["4 arms"] = 4 * min(fixed + per_step * (args.warmup + args.steps), args.minutes_per_arm * 60 + 300)
    return phases


def main(argv=None) -> None:
    args = parse_args(argv)
    phases = estimate(args)
    total = sum(phases.values())
    print(f"estimated run time: about {total / 60:.1f} min ({total:.0f} s: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()) + f"; {args.procs} processes, "
          f"{args.warmup} + {args.steps} steps per arm{', quick' if args.quick else ''})", flush=True)
    if args.plan:
        return
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    py = sys.executable
    corpus = write_corpus(out, args.tiny, args.samples)
    cal = os.path.join(out, "calibration.json")
    if args.quick:  # the committed CPU calibration, copied: the simulator writes its choices into the copy
        shutil.copyfile(CPU_CALIBRATION, cal)
    base = (["logging.wandb=disabled", "train.progress=false"] if args.tiny else
            ["conf=wan21_1p3b", "data=wan_short", "logging.wandb=disabled", "train.progress=false"])
    # the AdaLN kernel is the only fused op the arms vary; the rest of the glue stays the reference's in
    # the calibration and every arm, so arm 1 is the paper's starting point
    base += [f"data.index={corpus}", "train.micro_batches=4", "model.fused_ops=torch"]
    m_tokens = args.m_tokens or (120 if args.tiny else 14040)
    commands = {}

    # 2. calibration, in the runs' parallel set-up
    if not (args.skip_calibration or args.quick):
        buckets = list(TINY_MIX if args.tiny else MIX)
        cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.procs}",
               "scripts/calibrate.py", *base, f"scheduling.calibration={cal}",
               f"+calibrate.buckets=[{','.join(buckets)}]", "+calibrate.max_points=12",
               "+calibrate.time_budget_s=480"]
        commands["calibrate"] = " ".join(cmd[1:])
        run(cmd, os.path.join(out, "calibrate.log"), 900)
    # 3. the simulator at R = procs on this corpus: best settings into the calibration, predictions per strategy
    sim_out = os.path.join(out, "simulation")
    cmd = [py, "scripts/simulate_cluster.py", f"--calibration={cal}", f"--corpus={corpus}", f"--ranks={args.procs}",
           "--g=2", "--unconstrained", "--M=4", f"--out={sim_out}", "--write-chosen", "--no-model-truth"]
    if args.quick:
        cmd.append(f"--mbs={QUICK_MBS}")
    commands["simulate"] = " ".join(cmd[1:])
    run(cmd, os.path.join(out, "simulate.log"), 900)
    predicted = {}  # (strategy, "best") → the sweep's best; ("equal_token", "at_m_tokens") → at the arms' m_tokens
    with open(os.path.join(sim_out, "simulation_unconstrained.csv")) as f:
        for r in csv.DictReader(f):
            if int(r["R"]) != args.procs:
                continue
            if r["table"] == "best":
                predicted[(r["strategy"], "best")] = float(r["tokens_per_s"])
            elif r["table"] == "sweep" and r["strategy"] == "equal_token" and round(float(r["value"])) == m_tokens:
                predicted[("equal_token", "at_m_tokens")] = float(r["tokens_per_s"])

    # 4. the arms
    arms = [("1_equal_token_reference_adaln", ["scheduling=equal_token", f"scheduling.m_tokens={m_tokens}",
                                               "model.adaln_backend=torch"], ("equal_token", "at_m_tokens")),
            ("2_equal_token_fused_adaln", ["scheduling=equal_token", f"scheduling.m_tokens={m_tokens}",
                                           "model.adaln_backend=auto"], ("equal_token", "at_m_tokens")),
            ("3_dual_constraint", ["scheduling=dual_constraint", f"scheduling.calibration={cal}",
                                   "model.adaln_backend=auto"], ("dual_constraint", "best")),
            ("4_balanced", ["scheduling=balanced", f"scheduling.calibration={cal}", "model.adaln_backend=auto"],
             ("balanced", "best"))]
    steps = args.warmup + args.steps
    summary = []
    for name, extra, sim_key in arms:
        run_dir = os.path.join(out, name)
        cmd = [py, "train.py", *base, *extra, f"name={name}", f"run_dir={run_dir}", f"launch.num_processes={args.procs}",
               f"train.steps={steps}", f"train.val_every={max(1, steps // 5)}", "checkpoint.every=0",
               "checkpoint.at_end=false", "metrics.busy_every=5",
               "overwrite=true"]  # a rerun into the same --out: the arm's earlier run moves aside, nothing is lost
        commands[name] = " ".join(cmd[1:])
        wall = run(cmd, os.path.join(out, f"{name}.log"), args.minutes_per_arm * 60 + 300)
        rows = read_rows(run_dir)
        s = summarize(rows)
        s.update(arm=name, wall_s=round(wall, 1), predicted_tokens_per_s=predicted.get(sim_key))
        summary.append(s)

    # 5. the report
    compare([os.path.join(out, a[0]) for a in arms], [a[0] for a in arms], out)
    lines = ["| arm | tokens/s | simulated tokens/s | samples/s | busy CV | idle | step-time CV | peak GiB | val/loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    for s in summary:
        lines.append(f"| {s['arm']} | {fmt(s.get('perf/tokens_per_s'), ',.0f')} | "
                     f"{fmt(s.get('predicted_tokens_per_s'), ',.0f')} | {fmt(s.get('perf/samples_per_s'), '.2f')} | "
                     f"{fmt(s.get('balance/busy_cv'), '.3f')} | {fmt(s.get('balance/idle_fraction'), '.3f')} | "
                     f"{fmt(s.get('balance/step_time_cv'), '.3f')} | {fmt(s.get('memory/peak_gib'), '.1f')} | "
                     f"{fmt(s.get('val/loss'), '.4f')} |")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(f"# Strategy comparison, {args.procs} processes, {time.strftime('%Y-%m-%d')}\n\n")
        f.write("\n".join(lines) + "\n\n")
        if args.quick:
            f.write(QUICK_CAVEAT + "\n\n")
        f.write("## Commands (from the repo root)\n\n")
        f.write("\n".join(f"- {k}: `{v}`" for k, v in commands.items()) + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"arms": summary, "commands": commands}, f, indent=1)
    print("\n".join(lines))
    if args.quick:
        print(QUICK_CAVEAT)


if __name__ == "__main__":
    run_main(main)
