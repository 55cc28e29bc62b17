"""Simulate the four strategies on R ranks under a fixed global batch; write a report, CSV and plots.

    python scripts/simulate_cluster.py --calibration results/calibration_h200_graphs.json --out runs/simulation
    python scripts/simulate_cluster.py --calibration FILE --quick          (R = 8, g = 2·S_max only: about 95 s)
    python scripts/simulate_cluster.py --calibration FILE --unconstrained  (also the earlier M = 4 protocol)
    python scripts/simulate_cluster.py --calibration FILE --matrix-only    (the batch rule × planner matrix alone)
    python scripts/simulate_cluster.py --calibration FILE --w1-bound       (what any one-step planner can reach)
    python scripts/simulate_cluster.py --calibration FILE --truth-points T --ranks 8 --matrix-g 2 --mbs 2048 \
        --points-for dual_constraint:reformed,cost:reformed     (the (S, B) those cells run; which to measure next)

The protocol (scheduling/protocol.py): every strategy holds the same expected real tokens per rank per optimizer
step, g = {1, 2, 3.66, 8} · S_max (±10 %), best-tuned inside it over its knob and M (balanced also over the
planning window); the planner predicts with the calibration's cost model, each micro-batch takes its measured time
(the calibration's repeats, interpolated between them; scheduling/truth.py), plus FSDP's collectives at
--bandwidth GB/s when given. The same selection under the old model truth is reported beside it. Everything is
written into --out (a folder; nothing under results/ unless named); --write-chosen also records the best settings
in the calibration file, which training reads for scheduling.tokens_per_step.

The report leads with the matrix (scheduling/protocol.py run_matrix): every batch rule under every planner (stream,
sorted, reformed, windowed W = 2, 4, 8; --planners picks some), each cell best-tuned inside the same g (--matrix-g) and memory bound, as tokens/s ÷
the paper's system (dual_constraint in stream order), and what of the best cell's gain is the planner's and what
the batch rule's. It is written to simulation_matrix.csv too.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from scheduling.calibrate import HBM_FRACTION, Calibration  # noqa: E402
from scheduling.protocol import (MATRIX_PLANNERS, MATRIX_RULES, PAPER, STRATEGIES,  # noqa: E402
                                 cell_plans, cell_points, describe_setting, extra_truth_points, inputs_from,
                                 matrix_shares, planner_label, points_to_measure, record_chosen, record_chosen_at_g,
                                 run_fixed_batch, run_matrix, run_unconstrained, run_w1_bounds, scan_time_s,
                                 share_measured)
from scheduling.simulate import DEFAULT_MIX, G_FACTORS, KNOB, Mix  # noqa: E402
from training.cli import run_main  # noqa: E402


def mix_from_index(root: str) -> Mix:
    from collections import Counter

    from data.index import SampleIndex

    index = SampleIndex.load(root)
    counts = Counter((r["bucket"], int(r["S"])) for r in index.records if r.get("split", "train") != "val")
    return Mix.of([(b, S, n) for (b, S), n in sorted(counts.items(), key=lambda kv: kv[0][1])])


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--calibration", required=True, help="a calibration file (scripts/calibrate.py writes one)")
    ap.add_argument("--out", default=os.path.join("runs", "simulation"), help="output folder (default runs/simulation)")
    ap.add_argument("--corpus", default=None, help="a sample index folder: its bucket mix replaces the default mix")
    ap.add_argument("--mode", default=None, help="the calibration's checkpointing record (default: its only one); "
                    "auto: model.checkpointing=auto as training runs it, on a file that measured none and full "
                    "(keep too where measured)")
    ap.add_argument("--graph-max-tokens", type=int, default=16384, help="with --mode auto: train.graph_max_tokens, "
                    "the CUDA graphs' cap on one GPU (0: no graphs)")
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--g", default=",".join(f"{g:g}" for g in G_FACTORS), help="g ÷ S_max values")
    ap.add_argument("--bandwidth", type=float, default=None,
                    help="GB/s per rank within a node for FSDP's collectives (e.g. 350 on NVLink); none: no comm")
    ap.add_argument("--inter-node-bandwidth", type=float, default=50.0, help="GB/s per rank beyond 8 ranks")
    ap.add_argument("--slow-rank", default=None, help="RANK:FACTOR, e.g. 0:1.1: one rank persistently slower")
    ap.add_argument("--truth-points", action="append", default=[], metavar="CAL",
                    help="another calibration of the same model and GPU whose measured points join the truth (e.g. "
                    "scripts/h200_truth.sh's micro-batches of the headline's cells; repeatable); the planner keeps "
                    "--calibration's cost model")
    ap.add_argument("--replay", default=None, help="a replay's JSON (scripts/replay_plans.py): its measured "
                    "micro-batches join the truth")
    ap.add_argument("--mbs", type=int, default=None, help="micro-batches per candidate run (the final run: 4×; "
                    "default 4096, --quick 2048)")
    ap.add_argument("--per-m", type=int, default=None, help="candidate batch tables per M (default 6, --quick 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="R = 8 and g = 2·S_max only, fewer candidates and "
                    "micro-batches: about 95 s on 2 CPU cores")
    ap.add_argument("--no-model-truth", action="store_true", help="skip the old mode's rows")
    ap.add_argument("--unconstrained", action="store_true", help="also the earlier protocol (M = 4, no batch bound)")
    ap.add_argument("--M", type=int, default=4, help="M of the unconstrained protocol")
    ap.add_argument("--write-chosen", action="store_true", help="record the best settings in the calibration file")
    ap.add_argument("--matrix-g", default="2,3.66", help="g ÷ S_max values of the batch rule × planner matrix "
                    "(--quick: 2)")
    ap.add_argument("--matrix-only", action="store_true", help="the matrix alone, not the strategy comparison")
    ap.add_argument("--planners", default=None, help="the matrix's columns, e.g. stream,sorted,reformed,W=8 "
                    "(default: all of " + ",".join(planner_label(p, w) for p, w in MATRIX_PLANNERS) + "; stream "
                    "is always run: the paper's system is a stream cell)")
    ap.add_argument("--no-matrix", action="store_true", help="the strategy comparison alone")
    ap.add_argument("--w1-bound", action="store_true", help="alone: at each R and --matrix-g, the bounds on any "
                    "planner that keeps each step's samples (no window), on each rule's best sorted table, beside "
                    "stream, sorted and a planner that re-forms the step's micro-batches (scheduling/step_bound.py)")
    ap.add_argument("--points-for", default=None, metavar="RULE:PLANNER,...", help="alone: at each R and --matrix-g, "
                    "every distinct (bucket, B) these matrix cells' final runs plan (seed + 1, as the matrix), each "
                    "with its share of the cell's micro-batch time and whether the truth measured it; the fewest "
                    "unmeasured ones that bring each cell to --points-target measured, as calibrate.points, and the "
                    "device time scripts/h200_truth.sh part t takes to time them")
    ap.add_argument("--points-target", type=float, default=0.95, help="with --points-for: the measured share each "
                    "cell should reach (default 0.95)")
    args = ap.parse_args(argv)
    others = {"--points-for": args.points_for, "--w1-bound": args.w1_bound, "--matrix-only": args.matrix_only,
              "--no-matrix": args.no_matrix, "--write-chosen": args.write_chosen,
              "--unconstrained": args.unconstrained}
    for alone in ("--points-for", "--w1-bound"):  # each writes its own tables, nothing else
        clash = [k for k, v in others.items() if v and k != alone]
        if others[alone] and clash:
            ap.error(f"{alone} writes its tables alone: drop {', '.join(clash)}")
    if args.mbs is None:
        args.mbs = 2048 if args.quick else 4096
    if args.matrix_only and (args.no_matrix or args.write_chosen or args.unconstrained):
        ap.error("--matrix-only writes the matrix alone: drop --no-matrix, --write-chosen and --unconstrained")
    return args


# Seconds one comparison of the four strategies (one R, one g, one truth) takes at 4096 micro-batches per candidate
# (quick: 3 candidates per M, otherwise 6); the time scales with --mbs. The unconstrained protocol adds about
# UNCONSTRAINED_S per rank count. A matrix row (one batch rule under the five planners, one R and g) at 4096: full
# from the 14B's matrix (35 s of CPU a row at --mbs 2048), quick as half of it (3 candidates per M); the matrix's
# cells also serve the comparison's steady reading. --quick (the matrix and the comparison) took 93 s on this repo's
# 2-core development machine on 2026-12-02 with other jobs running (load ~3; estimated 98 s).
COMPARISON_S = {"quick": 30.0, "full": 45.0}
UNCONSTRAINED_S = 20.0
MATRIX_ROW_S = {"quick": 35.0, "full": 70.0}


def matrix_planners(spec) -> tuple:
    """The (planner, window) columns --planners names (None: every column of MATRIX_PLANNERS); stream always."""
    if spec is None:
        return MATRIX_PLANNERS
    by_label = {planner_label(p, w): (p, w) for p, w in MATRIX_PLANNERS}
    want = ["stream"] + [c.strip() for c in spec.split(",") if c.strip() and c.strip() != "stream"]
    bad = [c for c in want if c not in by_label]
    if bad:
        raise SystemExit(f"--planners: unknown column(s) {bad}; choose from {list(by_label)}")
    return tuple(by_label[c] for c in want)


def estimate_s(n_comparisons: int, n_ranks: int, args, n_matrix_rows: int = 0) -> float:
    scale = args.mbs / 4096
    kind = "quick" if args.quick else "full"
    return scale * (n_comparisons * COMPARISON_S[kind] + n_matrix_rows * MATRIX_ROW_S[kind]
                    + (n_ranks * UNCONSTRAINED_S if args.unconstrained else 0.0))


READING_TITLE = {"steady": "every step a batch of g (expected tokens ±10 %, their CV over steps ≤ 10 %)",
                 "expected": "the expected tokens alone (±10 %; balanced without a window)"}


def header(inp, cal: Calibration, cal_path: str, mix: Mix, ranks, elapsed: float) -> list[str]:
    lines = [f"# Cluster simulation under a fixed global batch ({datetime.date.today()})", "",
             f"Command: `python scripts/simulate_cluster.py {' '.join(sys.argv[1:])}` ({elapsed:.0f} s).", "",
             f"Input: `{cal_path}` — {cal.data.get('source')}, {cal.data.get('device')}, {cal.data.get('date')}.",
             ""]
    lines += [f"- {n}" for n in cal.data.get("notes", []) + inp.notes]
    t = inp.truth
    by_r = inp.m_mem_by_world_size(ranks)
    if by_r is not None and len(set(by_r.values())) == 1:
        by_r = None
    bound = (f"m_mem = {inp.m_mem:,.0f} tokens ({HBM_FRACTION:.0%} of HBM)" if by_r is None else
             "m_mem = " + ", ".join(f"{v:,.0f} tokens at R = {R}" for R, v in by_r.items())
             + f" ({HBM_FRACTION:.0%} of HBM, FSDP's states over R ranks)")
    lines += ["", f"Planner's cost model: {inp.cost.describe()}. {bound}, p = {inp.p:.3f}, optimizer "
              f"{inp.optim_ms:.0f} ms / R a step.",
              f"Truth: {t.describe()}."
              + (f" {inp.comm.describe(8)}." if inp.comm else " No FSDP communication modelled."),
              "", "Mix (shares of samples): " + ", ".join(f"{n} S={S} {100 * s:.0f} %"
                                                        for n, S, s in zip(mix.names, mix.S, mix.share)), ""]
    return lines + loo_report(t)


def loo_report(truth) -> list[str]:
    """The truth's interpolation error: each measured (S, B) left out and interpolated from the others (the rule
    the truth uses where nothing was measured), against its measured time."""
    errs = truth.loo_errors() if hasattr(truth, "loo_errors") else []
    if not errs:
        return []
    rows = [e if isinstance(e[0], str) else ("", *e) for e in errs]
    worst = max(rows, key=lambda e: abs(e[4]))
    inner = [abs(e[4]) for e in rows if not _edge(truth, e)]
    lines = ["## The truth's interpolation error (leave-one-out)", "",
             f"Each measured (S, B) interpolated from the other points, against its measured time: median |error| "
             f"{100 * sorted(abs(e[4]) for e in rows)[len(rows) // 2]:.1f} %, the largest {100 * worst[4]:+.1f} % "
             f"({(worst[0] + ' ') if worst[0] else ''}S = {worst[1]}, B = {worst[2]})"
             + (f"; within the measured lengths (not a policy's longest or shortest) at most "
                f"{100 * max(inner):.1f} %" if inner else "") + ". Each cell's `measured` column: the share of its "
             "micro-batch time drawn from measured (S, B), the rest interpolated.", "",
             "| policy | S | B | measured ms | left-out interpolation |", "|---|---|---|---|---|"]
    lines += [f"| {e[0] or '—'} | {e[1]} | {e[2]} | {e[3]:,.0f} | {100 * e[4]:+.1f} % |" for e in rows]
    return lines + [""]


def _edge(truth, e) -> bool:
    """Whether a left-out point was its policy's longest or shortest measured length (extrapolated without it)."""
    t = truth.truths[e[0]] if e[0] else truth
    return e[1] in (t.S_list[0], t.S_list[-1])


def matrix_report(m: dict) -> list[str]:
    """The batch rule × planner tables, one per (R, g): each cell its tokens/s ÷ the paper's system and its idle
    fraction; below each, the split of the best cell's gain into the planner's part and the batch rule's."""
    keys = sorted({(R, gf) for R, gf, _, _ in m})
    cols = [c for c in [planner_label(p, w) for p, w in MATRIX_PLANNERS] + ["best W"] if any(k[3] == c for k in m)]
    lines = ["## Batch rule × planner (every cell best-tuned over its knob and M inside the same g and memory bound; "
             "every step a batch of g)", "",
             "Each cell: tokens/s ÷ the paper's system (dual_constraint in stream order), the idle fraction, and "
             "the share of micro-batch time at measured (S, B) (m.; the rest interpolated). balanced is the cost "
             "rule under the sorted or windowed planner, so its row is cost's.", ""]
    for R, gf in keys:
        rules = [rl for rl in MATRIX_RULES if (R, gf, rl, "stream") in m]
        paper = m[(R, gf) + PAPER]
        lines += [f"### R = {R}, g = {gf:g}·S_max (the paper's system: {paper.tokens_per_s:,.0f} tokens/s, idle "
                  f"{100 * paper.idle_fraction:.1f} %)", "",
                  "| batch rule | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for rl in rules:
            cells = []
            for c in cols:
                r = m[(R, gf, rl, c)]
                w = f", W={r.window}" if c == "best W" else ""
                ms = "" if r.measured_share is None else f", {100 * r.measured_share:.0f} % m."
                cells.append(f"{r.tokens_per_s / paper.tokens_per_s:.2f}× ({100 * r.idle_fraction:.1f} %{w}{ms})")
            lines.append(f"| {rl} | " + " | ".join(cells) + " |")
        sh = matrix_shares(m, R, gf)
        lines += ["", f"Best cell: {sh['best'][0]} × {sh['best'][1]}, {sh['total']:.2f}× the paper's system. The "
                  f"batch rule alone (best rule in stream order, {sh['best_stream_rule']}): {sh['rule_in_stream']:.2f}×; "
                  f"the planner alone (the paper's rule under its best planner, {sh['paper_rule_best_planner']}): "
                  f"{sh['planner_on_paper_rule']:.2f}×. On the best rule the planner gives "
                  f"{sh['planner_on_best_rule']:.2f}× over stream order; under the best planner the rule gives "
                  f"{sh['rule_under_best_planner']:.2f}× over the paper's.", ""]
    return lines


def write_matrix_csv(m: dict, path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["R", "g_factor", "rule", "planner_column", "planner", "window", "knob_value", "M",
                    "tokens_per_step", "tokens_per_s", "ratio_to_paper", "idle_fraction", "compute_cv",
                    "tokens_step_cv", "measured_share", "batch_sizes"])
        for (R, gf, rl, col), r in sorted(m.items(), key=lambda kv: kv[0][:3]):
            paper = m[(R, gf) + PAPER]
            w.writerow([R, gf, rl, col, r.planner, r.window, r.setting.get(KNOB[rl]), r.M,
                        r.setting.get("tokens_per_step"), f"{r.tokens_per_s:.1f}",
                        f"{r.tokens_per_s / paper.tokens_per_s:.4f}", f"{r.idle_fraction:.5f}", f"{r.compute_cv:.5f}",
                        f"{r.tokens_step_cv:.5f}", _share(r), " ".join(map(str, r.batch_sizes))])


def _share(r) -> str:
    return "" if r.measured_share is None else f"{r.measured_share:.4f}"


def report(res: dict, inp, cal: Calibration, cal_path: str, mix: Mix, args, elapsed: float) -> list[str]:
    mo = res["model"]
    readings = [r for r in ("steady", "expected") if r in res]
    ranks = sorted({k[0] for k in res[readings[0]]})
    gs = sorted({k[1] for k in res[readings[0]]})
    lines = []
    for reading, R in [(rd, R) for rd in readings for R in ranks]:
        m = res[reading]
        lines += [f"## R = {R}, {READING_TITLE[reading]}", "",
                  "| g | strategy | setting | B per bucket | tokens/step | tokens/s | ÷ dual_constraint | ÷ cost | "
                  "÷ equal_token | idle | compute CV | tokens a step: CV | old mode: tokens/s (÷ dual) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for gf in gs:
            row = {s: m[(R, gf, s)] for s in STRATEGIES}
            for s in STRATEGIES:
                r = row[s]
                old = mo.get((R, gf, s)) if reading == "steady" else None
                old_cell = (f"{old.tokens_per_s:,.0f} ({old.tokens_per_s / mo[(R, gf, 'dual_constraint')].tokens_per_s:.2f})"
                            if old else "—")
                lines.append(f"| {gf:g}·S_max | {s} | {describe_setting(r)} | {' '.join(map(str, r.batch_sizes))} | "
                             f"{r.setting.get('tokens_per_step', 0):,.0f} | {r.tokens_per_s:,.0f} | "
                             f"{r.tokens_per_s / row['dual_constraint'].tokens_per_s:.3f} | "
                             f"{r.tokens_per_s / row['cost'].tokens_per_s:.3f} | "
                             f"{r.tokens_per_s / row['equal_token'].tokens_per_s:.3f} | {100 * r.idle_fraction:.1f} % | "
                             f"{100 * r.compute_cv:.1f} % | {100 * r.tokens_step_cv:.0f} % | {old_cell} |")
        lines.append("")
    return lines


def write_csv(res: dict, path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["truth", "R", "g_factor", "strategy", "knob_value", "M", "window", "tokens_per_step",
                    "tokens_per_s", "samples_per_s", "idle_fraction", "compute_cv", "step_time_cv", "tokens_step_cv",
                    "measured_share", "batch_sizes"])
        for truth, rows in res.items():
            for (R, gf, s), r in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
                w.writerow([truth, R, gf, s, r.setting.get(KNOB[s]), r.M, r.window, r.setting.get("tokens_per_step"),
                            f"{r.tokens_per_s:.1f}", f"{r.samples_per_s:.4f}", f"{r.idle_fraction:.5f}",
                            f"{r.compute_cv:.5f}", f"{r.step_time_cv:.5f}", f"{r.tokens_step_cv:.5f}", _share(r),
                            " ".join(map(str, r.batch_sizes))])


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = res["steady"]
    ranks = sorted({k[0] for k in m})
    fig, axes = plt.subplots(1, len(ranks), figsize=(5 * len(ranks), 4), squeeze=False)
    for a, R in zip(axes[0], ranks):
        gs = sorted({k[1] for k in m if k[0] == R})
        for s in STRATEGIES:
            a.plot(gs, [m[(R, g, s)].tokens_per_s / m[(R, g, "dual_constraint")].tokens_per_s for g in gs], "o-",
                   label=s)
        a.set(xscale="log", xlabel="g ÷ S_max (tokens per rank per step)", ylabel="tokens/s ÷ dual_constraint",
              title=f"R = {R}")
        a.set_xticks(gs, [f"{g:g}" for g in gs])
        a.minorticks_off()
        a.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


W1_COLUMNS = (("sorted", "sorted"), ("re-formed", "reform"), ("bound: the table's micro-batches, any assignment",
               "rank_bound"), ("bound: re-formed, per slot", "reform_slot_bound"),
              ("bound: re-formed, per rank", "reform_rank_bound"))


def w1_report(rows: dict) -> list[str]:
    """One table per (R, g): each rule's best sorted table (its M and B per bucket), each column's tokens/s ÷ the
    paper's system on the truth's mean times; then the drawn re-formed run and its measured share."""
    lines = ["## What any one-step planner can reach (each step's samples kept, no window)", "",
             "Tokens/s on the truth's mean times (FSDP's collectives included), ÷ the paper's system "
             "(dual_constraint in stream order) on its own steps under the same times. A rule's row: the steps its "
             "best sorted cell simulates. Bounds: scheduling/step_bound.py.", ""]
    for R, gf in sorted({(R, gf) for R, gf, _ in rows}):
        paper = rows[(R, gf, "paper")]
        lines += [f"### R = {R}, g = {gf:g}·S_max (the paper's system: {paper['stream']:,.0f} tokens/s on the mean "
                  f"times)", "",
                  "| batch rule (table, M) | " + " | ".join(c for c, _ in W1_COLUMNS)
                  + " | re-formed, drawn times (idle, measured) |", "|---|" + "---|" * (len(W1_COLUMNS) + 1)]
        for name in [n for _, _, n in sorted(rows) if (R, gf, n) in rows and n != "paper"]:
            r = rows[(R, gf, name)]
            cells = [f"{r[k] / paper['stream']:.3f}×" for _, k in W1_COLUMNS]
            cells.append(f"{r['reform_drawn'] / paper['stream_drawn']:.3f}× ({100 * r['reform_idle_drawn']:.1f} %, "
                         f"{100 * (r['reform_measured_share'] or 0):.0f} %)")
            table = f"{' '.join(map(str, r['batch_sizes']))}, M={r['M']}"
            lines.append(f"| {name} ({table}) | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


# scripts/h200_truth.sh part t: a k-block slice of the model, then again at a second depth; each point a warm-up and
# 3 timed repeats
PART_T_BLOCKS = (4, 2)
PART_T_RUNS = 1 + 3


def parse_cells(spec: str) -> list[tuple[str, str]]:
    """RULE:PLANNER,... → [(rule, planner)] of the matrix's rules and its one-step planners."""
    cells = []
    for c in (c.strip() for c in spec.split(",") if c.strip()):
        rule, _, planner = c.partition(":")
        if rule not in MATRIX_RULES or planner not in ("stream", "sorted", "reformed"):
            raise SystemExit(f"--points-for: {c!r} is not RULE:PLANNER with RULE one of {list(MATRIX_RULES)} and "
                             "PLANNER one of stream, sorted, reformed")
        cells.append((rule, planner))
    return cells


def points_for(inp, mix: Mix, cells, ranks, gs, target: float, layers: int, kw: dict) -> tuple[list[str], dict]:
    """The --points-for report (markdown lines) and its record: per (R, g) each cell's distinct micro-batches, each
    cell's fewest points to measure (protocol.points_to_measure), their union in falling share (the order part t
    times them, so that a time budget drops the least), and the device time to time it at PART_T_BLOCKS."""
    lines = ["## Which (S, B) the cells run, and which to measure", "",
             f"Each cell's final run (seed + 1, as the matrix simulates it): every distinct micro-batch, its share of "
             f"the plans' micro-batch time on the truth's mean times, and whether the truth measured it. Chosen: "
             f"the fewest unmeasured points that bring the cell to ≥ {100 * target:.0f} % measured.", ""]
    record: dict = {"target": target, "at": []}
    for R in ranks:
        at = inp.at(R)
        for gf in gs:
            by_cell, chosen = {}, {}
            for rule, planner in cells:
                cell, plans = cell_plans(inp, mix, rule, planner, R, gf * mix.S_max, **kw)
                pts = cell_points(plans, at.truth, mix.names)
                by_cell[(rule, planner)] = (cell, plans, pts)
                chosen[(rule, planner)] = points_to_measure(pts, target)
            union: dict = {}
            for pts in chosen.values():
                for p in pts:
                    if (p.S, p.B) not in union or p.share > union[(p.S, p.B)].share:
                        union[(p.S, p.B)] = p
            union_pts = sorted(union.values(), key=lambda p: -p.share)
            spec = "[" + ",".join(p.name for p in union_pts) + "]"
            times = {k: scan_time_s(union_pts, at.cost.predict, k, layers, PART_T_RUNS) for k in PART_T_BLOCKS}
            lines += [f"### R = {R}, g = {gf:g}·S_max", ""]
            rec_cells = []
            for (rule, planner), (cell, plans, pts) in by_cell.items():
                mine = {(p.S, p.B) for p in chosen[(rule, planner)]}
                lines += [f"**{rule} × {planner}** (table {' '.join(map(str, cell.batch_sizes))}, M = {cell.M}; "
                          f"{len(plans)} steps, {len(pts)} distinct micro-batches): "
                          f"{100 * share_measured(pts):.1f} % of its micro-batch time measured now, "
                          f"{100 * share_measured(pts, chosen[(rule, planner)]):.1f} % with its "
                          f"{len(mine)} chosen, {100 * share_measured(pts, union_pts):.1f} % with the union's "
                          f"{len(union_pts)}.", "",
                          "| bucket | S | B | micro-batches | truth ms | share of time | measured | chosen |",
                          "|---|---|---|---|---|---|---|---|"]
                lines += [f"| {p.bucket} | {p.S} | {p.B} | {p.count} | {p.ms:,.0f} | {100 * p.share:.2f} % | "
                          f"{'yes' if p.measured else 'no'} | {'**yes**' if (p.S, p.B) in mine else ''} |"
                          for p in pts]
                lines.append("")
                rec_cells.append({"rule": rule, "planner": planner, "batch_sizes": list(cell.batch_sizes),
                                  "M": cell.M, "steps": len(plans), "tokens_per_s": cell.tokens_per_s,
                                  "measured_share": share_measured(pts),
                                  "measured_share_with_chosen": share_measured(pts, chosen[(rule, planner)]),
                                  "measured_share_with_union": share_measured(pts, union_pts),
                                  "chosen": [p.name for p in chosen[(rule, planner)]],
                                  "points": [dict(vars(p)) for p in pts]})
            lines += [f"**To measure** ({len(union_pts)} points, the largest share first): `POINTS='{spec}'`. "
                      f"Device time by the planner's cost model ({PART_T_RUNS} runs a point: a warm-up and "
                      f"{PART_T_RUNS - 1} repeats): " + ", ".join(f"{times[k]:.0f} s at {k} blocks"
                                                                  for k in PART_T_BLOCKS)
                      + " (builds, the plain step and the start of a call come on top).", ""]
            record["at"].append({"R": R, "g_factor": gf, "cells": rec_cells, "points": spec,
                                 "scan_s": {str(k): v for k, v in times.items()}})
    return lines, record


def main(argv=None) -> None:
    args = parse_args(argv)
    cal = Calibration.load(args.calibration)
    mode = "auto" if args.mode == "auto" and {"none", "full"} <= set(cal.modes) else cal.mode_name(args.mode)
    mix = mix_from_index(args.corpus) if args.corpus else Mix.of(DEFAULT_MIX)
    if mode == "auto" and (args.replay or args.truth_points):
        raise ValueError("--replay or --truth-points with --mode auto: their micro-batches carry no policy; leave "
                         "them out")
    inp = inputs_from(cal, mode, mix, args.bandwidth, args.inter_node_bandwidth,
                      extra_truth_points(cal, mode, args.truth_points, args.replay), graph_tokens=args.graph_max_tokens)
    ranks = [8] if args.quick else [int(r) for r in args.ranks.split(",")]
    gs = [2.0] if args.quick else [float(g) for g in args.g.split(",")]
    slow = None
    if args.slow_rank:
        r, f = args.slow_rank.split(":")
        slow = {int(r): float(f)}
    matrix_gs = [2.0] if args.quick else [float(g) for g in args.matrix_g.split(",")]
    n_runs = 0 if args.matrix_only else len(ranks) * len(gs) * (3 if not args.no_model_truth else 2)
    n_rows = 0 if args.no_matrix else len(ranks) * len(matrix_gs) * len(MATRIX_RULES)
    if args.w1_bound or args.points_for:  # a few cells an (R, g): about 15–40 s each at --mbs 2048
        print(f"input {args.calibration} ({cal.data.get('source')}); mode {mode}; "
              f"{'--w1-bound' if args.w1_bound else '--points-for'} at {args.mbs} micro-batches a candidate",
              flush=True)
    else:
        print(f"input {args.calibration} ({cal.data.get('source')}); mode {mode}; {n_runs} comparisons of four "
              f"strategies and {n_rows} matrix rows at {args.mbs} micro-batches a candidate: estimated run time "
              f"about {estimate_s(n_runs, len(ranks), args, n_rows):.0f} s on 2 CPU cores", flush=True)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    per_M = args.per_m or (3 if args.quick else 6)
    kw = dict(seed=args.seed, mbs=args.mbs, mbs_final=4 * args.mbs, per_M=per_M, slow_ranks=slow,
              cache={})  # the matrix's cells serve the strategy comparison's steady reading
    if args.points_for:
        kw.pop("slow_ranks")
        layers = int((cal.data.get("model") or {}).get("num_layers") or 1)
        body, record = points_for(inp, mix, parse_cells(args.points_for), ranks, matrix_gs, args.points_target,
                                  layers, kw)
        lines = header(inp, cal, args.calibration, mix, ranks, time.perf_counter() - t0) + body
        path = os.path.join(args.out, "points_for.md")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "points_for.json"), "w") as f:
            json.dump(record, f, indent=1)
        print("\n".join(body))
        print(f"wrote {path}, points_for.json ({time.perf_counter() - t0:.0f} s)")
        return
    if args.w1_bound:
        kw.pop("slow_ranks")
        body = w1_report(run_w1_bounds(inp, mix, ranks, matrix_gs, **kw))
        lines = header(inp, cal, args.calibration, mix, ranks, time.perf_counter() - t0) + body
        path = os.path.join(args.out, "w1_bound.md")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(body))
        print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
        return
    matrix = {} if args.no_matrix else run_matrix(inp, mix, ranks, matrix_gs, planners=matrix_planners(args.planners),
                                                  **kw)
    res = None if args.matrix_only else run_fixed_batch(inp, mix, ranks, gs, model_truth=not args.no_model_truth,
                                                        **kw)
    lines = header(inp, cal, args.calibration, mix, ranks, time.perf_counter() - t0)
    files = [os.path.join(args.out, "simulation.md")]
    if matrix:
        lines += matrix_report(matrix)
        files.append(os.path.join(args.out, "simulation_matrix.csv"))
        write_matrix_csv(matrix, files[-1])
    if res is not None:
        lines += report(res, inp, cal, args.calibration, mix, args, time.perf_counter() - t0)
        files += [os.path.join(args.out, f) for f in ("simulation.csv", "simulation_ratio.png")]
        write_csv(res, files[-2])
        plot(res, files[-1])
    if args.unconstrained:
        un = run_unconstrained(cal, mode, mix, ranks, ranks, args.M, args.mbs * 2, args.seed)
        lines += ["## The earlier protocol: M = " + str(args.M) + ", no batch bound (model truth)", "",
                  "| R | strategy | B per bucket | tokens/s | idle |", "|---|---|---|---|---|"]
        for (R, s), r in un["best"].items():
            lines.append(f"| {R} | {s} | {' '.join(map(str, r.batch_sizes))} | {r.tokens_per_s:,.0f} | "
                         f"{100 * r.idle_fraction:.1f} % |")
        files.append(os.path.join(args.out, "simulation_unconstrained.csv"))
        with open(files[-1], "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["table", "strategy", "R", "M", "knob", "value", "tokens_per_s", "idle_fraction",
                        "batch_sizes"])
            for tag, r in [("best", r) for r in un["rows"]] + un["sweeps"]:
                knob = KNOB[r.strategy]
                w.writerow([tag, r.strategy, r.R, r.M, knob, r.setting.get(knob), f"{r.tokens_per_s:.1f}",
                            f"{r.idle_fraction:.5f}", " ".join(map(str, r.batch_sizes))])
        if args.write_chosen:
            record_chosen(cal, un, mode)
    with open(files[0], "w") as f:
        f.write("\n".join(lines) + "\n")
    if args.write_chosen and res is not None:
        record_chosen_at_g(cal, res, mix, mode, inp.m_mem, inp.m_mem_by_ranks)
        cal.save(args.calibration)
        files.append(args.calibration)
    print(f"wrote {', '.join(files)} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1:]))
