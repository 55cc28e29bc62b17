"""Compare runs offline: val/loss and train/loss against samples seen, throughput, balance, memory: a PNG, a table.

    python scripts/compare_runs.py runs/equal_token runs/balanced [--out runs/compare] [--labels a b]
    python scripts/compare_runs.py runs/lr-*                      # a -m sweep: its jobs' folders

Reads each run's metrics.jsonl (docs/contracts.md §9 keys) and config.yaml. The table has a column for every config
key whose value differs between the runs (optim.lr for an LR sweep), then the summaries: throughput and balance
averaged over the steps after warm-up (rows that carry perf/tokens_per_s), the last val/loss. It is printed and
written as compare.md beside compare.png.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from training.cli import run_main  # noqa: E402
from training.compare import compare  # noqa: E402
from training.run_configs import columns, read_run_config  # noqa: E402


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders holding metrics.jsonl")
    ap.add_argument("--labels", nargs="*", help="names for the runs (default: folder names)")
    ap.add_argument("--out", default=os.path.join("runs", "compare"), help="folder for compare.png and compare.md "
                    "(default runs/compare)")
    args = ap.parse_args(argv)
    labels = args.labels or [os.path.basename(os.path.normpath(r)) for r in args.runs]
    if len(labels) != len(args.runs):
        raise SystemExit(f"--labels gives {len(labels)} names for {len(args.runs)} runs")
    md = compare(args.runs, labels, args.out, columns([read_run_config(r) for r in args.runs]))
    print(md)
    return md


if __name__ == "__main__":
    run_main(main)
