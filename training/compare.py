"""Comparing runs offline: throughput, balance, val/loss and train/loss against samples seen, memory: a PNG and a table
(the command line: scripts/compare_runs.py).

Reads each run's metrics.jsonl (docs/contracts.md §9 keys). Throughput and balance are averaged over the steps after
warm-up (rows that carry perf/tokens_per_s); the table is returned and written as compare.md beside compare.png.
"""
from __future__ import annotations

import math
import os
from typing import Optional

from training.metrics import read_metrics

SUMMARY = (("perf/tokens_per_s", "tokens/s", "last"), ("perf/samples_per_s", "samples/s", "last"),
           ("perf/mfu", "MFU", "mean"), ("balance/compute_cv_pred", "compute CV (pred)", "mean"),
           ("balance/idle_fraction_pred", "idle (pred)", "mean"), ("balance/busy_cv", "busy CV", "mean"),
           ("balance/idle_fraction", "idle", "mean"), ("balance/step_time_cv", "step-time CV", "last"),
           ("time/step_s_max", "step s", "mean"), ("memory/peak_gib", "peak GiB", "max"))


def read_rows(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run folder?")
    rows = read_metrics(run_dir)  # a torn line is skipped, with a warning
    by_step = {}
    for r in rows:  # a resumed run may log a step twice: keep the last
        by_step[r["step"]] = {**by_step.get(r["step"], {}), **r}
    return [by_step[s] for s in sorted(by_step)]


def summarize(rows: list[dict]) -> dict:
    out = {}
    for key, _, how in SUMMARY:
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if vals:
            out[key] = {"last": vals[-1], "mean": sum(vals) / len(vals), "max": max(vals)}[how]
    val = [(r["samples_seen"], r["val/loss"]) for r in rows if r.get("val/loss") is not None]
    if val:
        out["val/loss"] = val[-1][1]
        out["samples_seen"] = val[-1][0]
    return out


def table(labels: list[str], sums: list[dict], columns: Optional[dict[str, list[str]]] = None) -> str:
    """One row per run; `columns` ({config key: its value per run}) come first, then the summaries."""
    columns = columns or {}
    cols = [(k, name) for k, name, _ in SUMMARY if any(k in s for s in sums)] + [("val/loss", "val/loss")]
    head = "| run | " + " | ".join([*columns, *(name for _, name in cols)]) + " |"
    lines = [head, "|" + "---|" * (len(columns) + len(cols) + 1)]
    for i, (label, s) in enumerate(zip(labels, sums)):
        cells = [v[i] for v in columns.values()] + [f"{s[k]:.4g}" if k in s else "—" for k, _ in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(labels, runs, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("val/loss", "val/loss vs samples seen", "samples_seen"),
              ("train/loss", "train/loss vs samples seen", "samples_seen"),
              ("perf/tokens_per_s", "tokens/s", "step"),
              ("balance/compute_cv_pred", "compute CV (predicted)", "step"),
              ("memory/peak_gib", "peak memory (GiB)", "step"))
    fig, axes = plt.subplots(2, 3, figsize=(16, 7))
    axes.flat[-1].axis("off")
    for ax, (key, title, x) in zip(axes.flat, panels):
        for label, rows in zip(labels, runs):
            pts = [(r[x], r[key]) for r in rows if r.get(key) is not None and x in r]
            if pts:
                ax.plot(*zip(*pts), label=label, marker="o" if key == "val/loss" else None, ms=3)
        ax.set_title(title)
        ax.set_xlabel(x.replace("_", " "))
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(run_dirs: list[str], labels: list[str], out: str,
            columns: Optional[dict[str, list[str]]] = None) -> str:
    """Write out/compare.png and out/compare.md for these runs (`columns`: table columns before the summaries, e.g.
    the config keys that differ); returns the markdown table."""
    runs = [read_rows(r) for r in run_dirs]
    md = table(labels, [summarize(r) for r in runs], columns)
    os.makedirs(out, exist_ok=True)
    plot(labels, runs, os.path.join(out, "compare.png"))
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write(md + "\n")
    return md
