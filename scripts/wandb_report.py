"""Create a wandb report comparing the runs of one group: throughput, balance and loss, a line per config value.

    python scripts/wandb_report.py --entity E --group G [--group-by KEY ...] [--project P] [--x samples_seen]
    python scripts/wandb_report.py --entity E --group G --dry-run      # print the panels as JSON; no network

The group is the runs' wandb group: logging.group, or for `python train.py -m ...` the sweep's `name`. Lines are
grouped by --group-by's config keys (mean over their runs, min–max band); by default by the keys whose values differ
between the group's runs (optim.lr for `-m optim.lr=1e-3,3e-3`), read from their folders' config.yaml (--runs, else
runs/*/ whose logging.group is G) or, online, from wandb; scheduling.strategy where none differs. The x-axis is
samples_seen unless --x says tokens_seen or _step. Needs `pip install wandb-workspaces`, `wandb login`, WANDB_MODE
not offline, and runs logged offline uploaded first (`wandb sync runs/*/wandb/offline-run-*`); prints the report's
URL. Offline, scripts/compare_runs.py compares runs from their metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo root

from training.cli import run_main  # noqa: E402
from training.run_configs import group_run_dirs, read_run_config  # noqa: E402
from training.wandb_report import (DEFAULT_METRICS, STRATEGY_KEY, X_CHOICES, build_report,  # noqa: E402
                                   check_ready, default_group_by, group_configs, panel_definitions, save_report)


def default_project() -> str:
    """The project that logging=online writes to."""
    from omegaconf import OmegaConf

    return OmegaConf.load(os.path.join(ROOT, "conf", "logging", "online.yaml")).project


def group_by_from_runs(args) -> list[str]:
    """--group-by's default: the config keys that differ between the group's runs, read from their folders (--runs,
    else runs/*/ of the group), else (not under --dry-run) from wandb. Says which keys and from where on stderr."""
    folders = args.runs or group_run_dirs(args.group)
    configs = [c for c in map(read_run_config, folders) if c is not None]
    where = f"{len(configs)} run folder(s)"
    if len(configs) < 2 and not args.dry_run:
        check_ready()
        configs, where = group_configs(args.entity, args.project, args.group), "wandb"
    keys = default_group_by(configs)
    print(f"group-by: {', '.join(keys)} (" + ("the keys that differ between the runs" if keys != [STRATEGY_KEY]
                                               else "no config key differs between the runs")
          + f" of group {args.group} found in {where})", file=sys.stderr)
    return keys


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--entity", required=True, help="wandb entity (user or team) that owns the project")
    ap.add_argument("--project", default=None, help="wandb project (default: conf/logging/online.yaml's)")
    ap.add_argument("--group", required=True, help="wandb group of the runs to compare")
    ap.add_argument("--x", default="samples_seen", choices=X_CHOICES, help="x-axis (default: samples_seen)")
    ap.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS), help="y keys, one panel each")
    ap.add_argument("--group-by", nargs="+", default=None, metavar="KEY",
                    help="config keys whose values make the lines (default: the keys that differ between the runs)")
    ap.add_argument("--runs", nargs="+", default=None, metavar="DIR",
                    help="run folders whose config.yaml give the default --group-by (default: runs/*/ of the group)")
    ap.add_argument("--title", default=None, help="report title (default: '<group>: by <keys>')")
    ap.add_argument("--dry-run", action="store_true", help="print the panel definitions as JSON and stop")
    args = ap.parse_args(argv)
    try:
        args.project = args.project or default_project()
        group_by = args.group_by or group_by_from_runs(args)
        panels = panel_definitions(args.entity, args.project, args.group, args.x, args.metrics, group_by)
        if args.dry_run:
            print(json.dumps(panels, indent=2))
            return
        check_ready()  # before building: a missing package or login is named before anything else
        print(save_report(build_report(panels, title=args.title)))
    except (ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    run_main(main)
