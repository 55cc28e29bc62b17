"""Simulate the four strategies on a cluster of R ranks; write a table, CSV and plots; record the best settings.

    python scripts/simulate_cluster.py                                the issue-4 protocol on the H200 calibration
    python scripts/simulate_cluster.py calibration=PATH corpus=INDEX_DIR ranks=8,16,64,1024 out=results/simulation

Arguments (key=value): calibration (default results/calibration_h200.json; until that measured file exists, a
calibration fitted to issue 4's 12 H200 points, written to results/calibration_h200_issue4.json and said so in
it), corpus (a sample index folder: its bucket mix replaces issue 4's default mix), ranks (8,16,64,1024), sweep_ranks
(8,16,64: each strategy's knob is swept there; larger R reuse the largest swept R's best), M (4), mbs (micro-batches
simulated per run, 32768: the cost-aware strategies' best settings differ by under 1 %, within the noise of
a run of 8192), seed (0), out (results/simulation), write_chosen (true: the best settings go into the
calibration file's "chosen", which training reads), mode (the calibration's checkpointing record; default full).
"""
from __future__ import annotations

import csv
import datetime
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduling.calibrate import HBM_FRACTION, Calibration  # noqa: E402
from scheduling.simulate import (DEFAULT_MIX, KNOB, Mix, SimResult, analytic_idle,  # noqa: E402
                                 issue4_h200_calibration, simulate, sizes_for, sweep)

STRATEGIES = ("equal_token", "dual_constraint", "cost", "balanced")
MEASURED = os.path.join("results", "calibration_h200.json")
FALLBACK = os.path.join("results", "calibration_h200_issue4.json")


def parse_args(argv) -> dict:
    opts = dict(calibration=None, corpus=None, ranks="8,16,64,1024", sweep_ranks="8,16,64", M="4", mbs="32768",
                seed="0", out=os.path.join("results", "simulation"), write_chosen="true", mode=None)
    for a in argv:
        k, sep, v = a.partition("=")
        if not sep or k not in opts:
            raise SystemExit(f"unknown argument {a!r}; known (key=value): {sorted(opts)}")
        opts[k] = v
    return opts


def load_calibration(path):
    """(Calibration, path): the given file, the measured H200 one, or the issue-4 fit (written on first use)."""
    if path:
        return Calibration.load(path), path
    if os.path.exists(MEASURED):
        return Calibration.load(MEASURED), MEASURED
    if os.path.exists(FALLBACK):
        return Calibration.load(FALLBACK), FALLBACK
    cal = issue4_h200_calibration()
    cal.save(FALLBACK)
    return cal, FALLBACK


def mix_from_index(root: str) -> Mix:
    from collections import Counter

    from data.index import SampleIndex

    index = SampleIndex.load(root)
    counts = Counter((r["bucket"], int(r["S"])) for r in index.records if r.get("split", "train") != "val")
    return Mix.of([(b, S, n) for (b, S), n in sorted(counts.items(), key=lambda kv: kv[0][1])])


def steps_for(R: int, M: int, mbs: int) -> int:
    return max(16, math.ceil(mbs / (R * M)))


def run_protocol(cal: Calibration, mode: str, mix: Mix, ranks, sweep_ranks, M: int = 4, mbs: int = 8192,
                 seed: int = 0, log=print) -> dict:
    cost = cal.cost_model(mode)
    power = cal.cost_model(mode, "power")
    memory = cal.memory_model(mode)
    if memory is not None and cal.hbm_bytes:
        m_mem = memory.m_mem(HBM_FRACTION * cal.hbm_bytes, min(mix.S))
    elif (cal.data.get("chosen") or {}).get("m_mem"):  # a CPU calibration: no device memory, its stated bound
        m_mem = cal.data["chosen"]["m_mem"]
        log(f"no memory model: m_mem={m_mem} from the calibration's chosen settings")
    else:
        raise SystemExit(f"{cal.path}: the protocol needs a memory model and the device memory (m_mem at "
                         f"{HBM_FRACTION:.0%} of HBM), or a chosen m_mem")
    if m_mem < mix.S_max:
        raise SystemExit(f"m_mem={m_mem} at {HBM_FRACTION:.0%} of HBM is below the longest bucket's S={mix.S_max}")
    p = power.params["p"]
    optim_ms = cal.optim_ms(mode)
    kw = dict(residuals=cost.residuals, optim_ms=optim_ms, seed=seed)  # the sweeps choose on this draw
    ev = dict(kw, seed=seed + 1)  # every reported row on this one, as sweep() re-draws its best
    best: dict = {}
    rows: list[SimResult] = []
    sweeps: list[tuple[str, SimResult]] = []
    for R in ranks:
        K = steps_for(R, M, mbs)
        src = R if R in sweep_ranks else max(r for r in sweep_ranks if r <= R) if any(r <= R for r in sweep_ranks) \
            else min(sweep_ranks)
        for s in STRATEGIES:
            t0 = time.perf_counter()
            if R in sweep_ranks:
                b, runs = sweep(cost.predict, mix, s, R, p=p, m_mem=m_mem, M=M, steps=K, **kw)
                sweeps += [("sweep", r) for r in runs]
            else:
                st = best[(src, s)].setting
                b = simulate(cost.predict, mix, s, sizes_for(s, mix, st, cost.predict), R, M, K, setting=st, **ev)
            best[(R, s)] = b
            rows.append(b)
            log(f"R={R:<5} {s:<16} {b.tokens_per_s:>12.0f} tok/s  CV {100 * b.compute_cv:5.2f} %  "
                f"idle {100 * b.idle_fraction:5.2f} %  ({time.perf_counter() - t0:.1f} s)")
        st = {"m_tokens": mix.S_max, "factor": 1.0}
        base = simulate(cost.predict, mix, "equal_token", sizes_for("equal_token", mix, st, cost.predict), R, M, K,
                        setting=st, **ev)
        best[(R, "equal_token@S_max")] = base
        rows.append(base)
    filled = {}  # equal_token's best among the sweep's whole multiples of S_max (every bucket filled), re-drawn
    for R in sweep_ranks:
        cands = [r for tag, r in sweeps if r.strategy == "equal_token" and r.R == R
                 and float(r.setting.get("factor", 0)) % 1 == 0]
        if cands:
            f = max(cands, key=lambda r: r.tokens_per_s)
            filled[R] = simulate(cost.predict, mix, "equal_token", f.batch_sizes, R, M, steps_for(R, M, mbs),
                                 setting=f.setting, **ev)
    m_rows = []
    for R in [r for r in (8, 64) if r in ranks]:
        for s in STRATEGIES:
            st = best[(R, s)].setting
            for m in (1, 2, 4, 8):
                m_rows.append(simulate(cost.predict, mix, s, sizes_for(s, mix, st, cost.predict), R, m,
                                       steps_for(R, m, mbs), setting=st, **ev))
    w_rows = []
    for R in [r for r in (8, 64) if r in ranks]:
        st = best[(R, "balanced")].setting
        for w in (1, 2, 4):
            w_rows.append(simulate(cost.predict, mix, "balanced", sizes_for("balanced", mix, st, cost.predict), R, M,
                                   steps_for(R, M, mbs), window=w, setting=st, **ev))
    return dict(best=best, rows=rows, sweeps=sweeps, filled=filled, m_rows=m_rows, w_rows=w_rows, m_mem=m_mem, p=p,
                optim_ms=optim_ms, ranks=list(ranks), sweep_ranks=list(sweep_ranks), M=M, mbs=mbs, mix=mix,
                cost=cost, memory=memory)


def _setting(r: SimResult) -> str:
    knob = KNOB[r.strategy]
    v = r.setting[knob]
    return f"{knob}={v:.4g} ({r.setting['factor']:g}×)"


def write_outputs(res: dict, cal: Calibration, cal_path: str, out: str) -> list[str]:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    best, mix = res["best"], res["mix"]
    files = []
    # CSV: every run
    with open(out + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["table", "strategy", "R", "M", "window", "knob", "value", "factor", "steps", "samples", "tokens",
                    "time_s", "tokens_per_s", "samples_per_s", "compute_cv", "idle_fraction", "compute_cv_pred",
                    "step_time_cv", "batch_sizes"])
        tagged = ([("best", r) for r in res["rows"]] + res["sweeps"] + [("M", r) for r in res["m_rows"]]
                  + [("window", r) for r in res["w_rows"]])
        for tag, r in tagged:
            knob = KNOB[r.strategy]
            w.writerow([tag, r.strategy, r.R, r.M, r.window, knob, r.setting.get(knob), r.setting.get("factor"),
                        r.steps, r.samples, r.tokens, f"{r.time_s:.3f}", f"{r.tokens_per_s:.1f}",
                        f"{r.samples_per_s:.3f}", f"{r.compute_cv:.5f}", f"{r.idle_fraction:.5f}",
                        f"{r.compute_cv_pred:.5f}", f"{r.step_time_cv:.5f}", " ".join(map(str, r.batch_sizes))])
    files.append(out + ".csv")

    lines = [f"# Cluster simulation: four strategies × R ranks (scripts/simulate_cluster.py, {datetime.date.today()})",
             "", f"Input: `{cal_path}` — {cal.data.get('source')}, {cal.data.get('device')}, "
             f"{cal.data.get('date')}.", ""]
    lines += [f"- {n}" for n in cal.data.get("notes", [])]
    c, m = res["cost"], res["memory"]
    lines += ["", f"Cost model ({c.form}, full depth): {c.describe()}.",
              (f"Memory model ({'measured' if m.measured else 'estimated'}): {m.describe()} → m_mem = "
               f"{res['m_mem']} tokens at {HBM_FRACTION:.0%} of {cal.hbm_bytes / 2**30:.1f} GiB (every bucket "
               f"from S = {min(mix.S)} up)." if m is not None and cal.hbm_bytes else
               f"No memory model: m_mem = {res['m_mem']} tokens (the calibration's chosen bound).")
              + f" p = {res['p']:.3f} (power fit). Optimizer: {res['optim_ms']:.0f} ms / R per step.", "",
              "Protocol (issue 4, part 6): mix = shares of samples "
              + ", ".join(f"{n} S={S} {100 * s:.0f} %" for n, S, s in zip(mix.names, mix.S, mix.share))
              + f"; M = {res['M']} micro-batches per rank; each step runs the real planner (scheduling/balance.py);"
              " step time = Σ over slots of the slowest rank (FSDP synchronises every slot) + optimizer / R;"
              " per-micro-batch noise bootstrapped from the cost fit's relative residuals; each strategy at its best"
              f" setting of a sweep at R ∈ {res['sweep_ranks']} (larger R reuse the largest swept R's setting): a"
              " grid, then every distinct setting between the best grid point's neighbours, chosen on one draw of"
              " samples and noise (the sweep plot's) and every row here simulated on another;"
              f" ≥ {res['mbs']} micro-batches per run (K = max(16, {res['mbs']}/(R·M)) steps).", "",
              "| R | strategy | setting | B per bucket | tokens/s | samples/s | × eq@S_max | × eq best | compute CV | "
              "idle | step-time CV |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for R in res["ranks"]:
        base, eqb = best[(R, "equal_token@S_max")], best[(R, "equal_token")]
        for s in ("equal_token@S_max",) + STRATEGIES:
            r = best[(R, s)]
            lines.append(f"| {R} | {s} | {_setting(r)} | {' '.join(map(str, r.batch_sizes))} | "
                         f"{r.tokens_per_s:,.0f} | {r.samples_per_s:.2f} | {r.tokens_per_s / base.tokens_per_s:.2f} | "
                         f"{r.tokens_per_s / eqb.tokens_per_s:.2f} | {100 * r.compute_cv:.1f} % | "
                         f"{100 * r.idle_fraction:.1f} % | {100 * r.step_time_cv:.1f} % |")
    lines += ["", "## Targets (issue 4)", ""]
    for R in [r for r in (8, 16, 64) if r in res["ranks"]]:
        b = best[(R, "balanced")]
        lines.append(f"- R={R}: balanced compute CV {100 * b.compute_cv:.2f} % (≤ 2 %: "
                     f"{'met' if b.compute_cv <= 0.02 else 'NOT met'}), idle {100 * b.idle_fraction:.2f} % "
                     f"(≤ 3 %: {'met' if b.idle_fraction <= 0.03 else 'NOT met'}); tokens/s "
                     f"{b.tokens_per_s / best[(R, 'equal_token@S_max')].tokens_per_s:.2f}× equal_token@S_max (≥ 1.5), "
                     f"{b.tokens_per_s / best[(R, 'equal_token')].tokens_per_s:.2f}× equal_token best (≥ 1.4), "
                     f"{b.tokens_per_s / best[(R, 'dual_constraint')].tokens_per_s:.2f}× dual_constraint best "
                     f"(≥ {1.04 if R == 8 else 1.1 if R == 64 else '—'})")
    lines += ["", "With the per-sample cost fixed by the mix, a strategy's tokens/s is ∝ (1 − idle): no planner can "
              "beat a baseline by more than 1 / (1 − the baseline's idle fraction).", "",
              "Noise-free idle of the one-bucket strategies at their best settings, each rank's micro-batch an "
              "independent draw (scheduling.simulate.analytic_idle: a check on the simulated idle above; as R → ∞ "
              "the most any planner can gain over that setting is 1 / (1 − idle)):", ""]
    for R in [r for r in (8, 16, 64) if r in res["ranks"]]:
        parts = []
        for s in ("equal_token", "dual_constraint", "cost"):
            sz = best[(R, s)].batch_sizes
            i_R, i_inf = analytic_idle(res["cost"].predict, mix, sz, R), analytic_idle(res["cost"].predict, mix, sz,
                                                                                       None)
            parts.append(f"{s} {100 * i_R:.1f} % (simulated {100 * best[(R, s)].idle_fraction:.1f} %; R → ∞ "
                         f"{100 * i_inf:.1f} %, ceiling {1 / (1 - i_inf):.3f}×)")
        lines.append(f"- R={R}: " + "; ".join(parts))
    lines += _equal_token_filled(res, best, list(mix.S))
    lines += ["",
              "## Micro-batches per rank (M), best settings of M = 4", "",
              "| R | strategy | M=1 | M=2 | M=4 | M=8 | idle at M=1 / 2 / 4 / 8 |", "|---|---|---|---|---|---|---|"]
    for R in [r for r in (8, 64) if r in res["ranks"]]:
        for s in STRATEGIES:
            rr = [r for r in res["m_rows"] if r.R == R and r.strategy == s]
            lines.append(f"| {R} | {s} | " + " | ".join(f"{r.tokens_per_s:,.0f}" for r in rr) + " | "
                         + " / ".join(f"{100 * r.idle_fraction:.1f} %" for r in rr) + " |")
    lines += ["", "## Window (balanced, scheduling.window = steps planned together)", "",
              "| R | W | tokens/s | compute CV | idle |", "|---|---|---|---|---|"]
    for r in res["w_rows"]:
        lines.append(f"| {r.R} | {r.window} | {r.tokens_per_s:,.0f} | {100 * r.compute_cv:.2f} % | "
                     f"{100 * r.idle_fraction:.2f} % |")
    lines += ["", "Plots: " + ", ".join(f"`{os.path.basename(out)}_{k}.png`" for k in
                                        ("throughput", "balance", "M", "sweep")) + f"; every run: "
              f"`{os.path.basename(out)}.csv`."]
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    files.append(out + ".md")
    files += _plots(res, out)
    return files


def _plots(res: dict, out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best, ranks = res["best"], res["ranks"]
    names = ("equal_token@S_max",) + STRATEGIES
    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in names:
        ax.plot(ranks, [best[(R, s)].tokens_per_s / best[(R, "equal_token@S_max")].tokens_per_s for R in ranks],
                "o-", label=s)
    ax.set(xscale="log", xlabel="ranks R", ylabel="tokens/s ÷ equal_token@S_max", title="Throughput (M = 4)")
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.legend()
    ax.grid(alpha=0.3)
    files.append(_save(fig, out + "_throughput.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in names:
        axes[0].plot(ranks, [100 * best[(R, s)].compute_cv for R in ranks], "o-", label=s)
        axes[1].plot(ranks, [100 * best[(R, s)].idle_fraction for R in ranks], "o-", label=s)
    for a, t in zip(axes, ("compute CV over ranks (%)", "idle fraction (%)")):
        a.set(xscale="log", xlabel="ranks R", title=t)
        a.set_xticks(ranks, [str(r) for r in ranks])
        a.grid(alpha=0.3)
    axes[0].legend()
    files.append(_save(fig, out + "_balance.png"))

    Rs = sorted({r.R for r in res["m_rows"]})
    if not Rs:  # the M study runs at 8 and 64 ranks only
        return files
    fig, axes = plt.subplots(1, len(Rs), figsize=(5 * len(Rs), 4), squeeze=False)
    for a, R in zip(axes[0], Rs):
        for s in STRATEGIES:
            rr = [r for r in res["m_rows"] if r.R == R and r.strategy == s]
            a.plot([r.M for r in rr], [r.tokens_per_s for r in rr], "o-", label=s)
        a.set(xscale="log", xlabel="micro-batches per rank M", ylabel="tokens/s", title=f"R = {R}")
        a.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        a.grid(alpha=0.3)
    axes[0][0].legend()
    files.append(_save(fig, out + "_M.png"))

    Rs = res["sweep_ranks"]
    fig, axes = plt.subplots(1, len(Rs), figsize=(5 * len(Rs), 4), squeeze=False)
    for a, R in zip(axes[0], Rs):
        for s in STRATEGIES:
            rr = sorted((r for t, r in res["sweeps"] if r.R == R and r.strategy == s), key=lambda r: r.setting["factor"])
            a.plot([r.setting["factor"] for r in rr], [r.tokens_per_s for r in rr], "o-", label=s)
        a.set(xscale="log", xlabel="knob ÷ its S_max value (m_tokens, m_comp, target ms)", ylabel="tokens/s",
              title=f"sweep, R = {R}")
        a.set_xticks([0.5, 1, 2, 4], ["0.5", "1", "2", "4"])
        a.minorticks_off()
        a.grid(alpha=0.3)
    axes[0][0].legend()
    files.append(_save(fig, out + "_sweep.png"))
    return files


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def record_chosen(cal: Calibration, res: dict, mode: str) -> None:
    """The best settings per world size into the calibration's "chosen" (training reads them; config beats them)."""
    by_r = {}
    for R in res["ranks"]:
        by_r[str(R)] = {}
        for s in STRATEGIES:
            st = res["best"][(R, s)].setting
            keep = {"equal_token": ("m_tokens",), "dual_constraint": ("m_comp", "p"),
                    "cost": ("target_microbatch_ms",), "balanced": ("target_microbatch_ms",)}[s]
            by_r[str(R)][s] = {k: st[k] for k in keep}
    mix = res["mix"]
    cal.data["chosen"] = {
        "by": "scripts/simulate_cluster.py", "date": datetime.date.today().isoformat(), "mode": mode,
        "m_mem": int(res["m_mem"]), "m_mem_why": f"memory model at {HBM_FRACTION:.0%} of HBM",
        "m_mem_S_min": int(min(res["mix"].S)),  # safe for buckets from this S up (training checks it)
        "micro_batches": res["M"], "reference_world_size": 8,
        "mix": [{"bucket": n, "S": S, "share": s} for n, S, s in zip(mix.names, mix.S, mix.share)],
        "criterion": "highest simulated tokens/s (≡ samples/s: the mix is fixed)", "by_world_size": by_r}


def _equal_token_filled(res, best, S: list) -> list:
    """equal_token's best over the settings that fill every bucket to the token budget (m_tokens = k·S_max, k whole:
    the longest bucket then holds k samples), beside its best over the whole sweep — which may sit where the longest
    bucket is left under-filled at B = 1, a compute cap equal_token does not name."""
    longest = S.index(max(S))
    out = []
    for R, filled in sorted(res.get("filled", {}).items()):
        b, eqb = best[(R, "balanced")], best[(R, "equal_token")]
        if filled.batch_sizes == eqb.batch_sizes:
            continue
        B = eqb.batch_sizes[longest]
        out.append(f"- R={R}: equal_token's best of the whole sweep, m_tokens = {eqb.setting['factor']:g}·S_max, "
                   f"leaves its longest bucket at B = {B} "
                   f"({100 * (1 - B * S[longest] / eqb.setting['m_tokens']):.0f} % under "
                   f"the token budget); over the settings that fill every bucket (m_tokens = k·S_max) its best is "
                   f"k = {filled.setting['factor']:g} at {filled.tokens_per_s:,.0f} tokens/s, idle "
                   f"{100 * filled.idle_fraction:.1f} %, and balanced is "
                   f"{b.tokens_per_s / filled.tokens_per_s:.2f}× that.")
    return ["", "Equal-token's best and its under-filled longest bucket:", ""] + out if out else []


def main(argv) -> None:
    o = parse_args(argv)
    cal, path = load_calibration(o["calibration"])
    mode = cal.mode_name(o["mode"])
    mix = mix_from_index(o["corpus"]) if o["corpus"] else Mix.of(DEFAULT_MIX)
    ranks = [int(r) for r in o["ranks"].split(",")]
    sweep_ranks = [int(r) for r in o["sweep_ranks"].split(",") if int(r) in ranks] or ranks[:1]
    print(f"input {path} ({cal.data.get('source')}); mode {mode}; mix {dict(zip(mix.names, mix.S))}")
    t0 = time.perf_counter()
    res = run_protocol(cal, mode, mix, ranks, sweep_ranks, int(o["M"]), int(o["mbs"]), int(o["seed"]))
    files = write_outputs(res, cal, path, o["out"])
    if o["write_chosen"].lower() in ("1", "true", "yes"):
        record_chosen(cal, res, mode)
        cal.save(path)
        files.append(path)
    print(f"wrote {', '.join(files)} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
