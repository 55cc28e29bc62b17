"""Create a wandb report comparing the strategies of one group of runs: throughput, balance and loss, one line each.

    python scripts/wandb_report.py --entity E --group G [--project adaptiveload] [--x samples_seen] [--title T]
    python scripts/wandb_report.py --entity E --group G --dry-run      # print the panels as JSON; no network

The group is the runs' wandb group: logging.group, or for `python train.py -m ...` the sweep's `name`. Lines are
grouped by the config key scheduling.strategy (mean over its runs, min–max band); the x-axis is samples_seen unless
--x says tokens_seen or _step. Needs `pip install wandb-workspaces`, `wandb login`, WANDB_MODE not offline, and runs
logged offline uploaded first (`wandb sync runs/*/wandb/offline-run-*`); prints the report's URL.
Offline, scripts/compare_runs.py compares runs from their metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo root

from training.cli import run_main  # noqa: E402
from training.wandb_report import (DEFAULT_METRICS, X_CHOICES, build_report, check_ready,  # noqa: E402
                                   panel_definitions, save_report)


def default_project() -> str:
    """The project that logging=online writes to."""
    from omegaconf import OmegaConf

    return OmegaConf.load(os.path.join(ROOT, "conf", "logging", "online.yaml")).project


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--entity", required=True, help="wandb entity (user or team) that owns the project")
    ap.add_argument("--project", default=None, help="wandb project (default: conf/logging/online.yaml's)")
    ap.add_argument("--group", required=True, help="wandb group of the runs to compare")
    ap.add_argument("--x", default="samples_seen", choices=X_CHOICES, help="x-axis (default: samples_seen)")
    ap.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS), help="y keys, one panel each")
    ap.add_argument("--title", default=None, help="report title (default: '<group>: scheduling strategies ...')")
    ap.add_argument("--dry-run", action="store_true", help="print the panel definitions as JSON and stop")
    args = ap.parse_args(argv)
    try:
        panels = panel_definitions(args.entity, args.project or default_project(), args.group, args.x, args.metrics)
        if args.dry_run:
            print(json.dumps(panels, indent=2))
            return
        check_ready()  # before building: a missing package or login is named before anything else
        print(save_report(build_report(panels, title=args.title)))
    except (ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    run_main(main)
