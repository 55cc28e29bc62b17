"""The run folder: a fresh run never writes into one that holds another run (docs/contracts.md §7).

A folder holds a run when it has any of RUN_FILES: metrics, checkpoints (also a diverged or half-written one), a
wandb run and its id, the resolved config, samples, traces. Into such a folder

    resume=auto | PATH   continues that run (training/resume.py)
    overwrite=true       a fresh run; the old run's files are moved into `replaced-<date>-<time>/` in the folder,
                         never deleted (nothing already written is lost); its wandb id is not reused
    neither              refused before anything is built, naming what is there and the three ways on

Hydra multirun (`-m`): every job is its own run — `name-<its swept values>` in `run_dir-<its swept values>`, e.g.
runs/lr-optim.lr_0.003 (job_label) — and the jobs of one sweep share a wandb group (the name they were given), so
they can be compared and never collide.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import time
from typing import Optional, Sequence

MAX_LABEL = 96  # characters of a multirun job's label (job_label); a longer one falls back to the job number
RUN_FILES = ("metrics.jsonl", "step_*", "diverged_step_*", "*.tmp", "wandb", "wandb_id.txt", "config.yaml",
             "samples", "traces")


def run_files(run_dir: str) -> list[str]:
    """The names in run_dir that belong to a run (RUN_FILES), sorted."""
    if not os.path.isdir(run_dir):
        return []
    found = set()
    for pattern in RUN_FILES:
        found.update(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, pattern)))
    return sorted(found)


def claim(run_dir: str, resume: Optional[str], overwrite: bool) -> Optional[str]:
    """Make run_dir ready for this run (the main process calls it, before anything is built); returns the folder
    the old run's files moved to, if any. ValueError for a fresh run into a folder that holds another."""
    if resume:
        return None
    there = run_files(run_dir)
    if not there:
        return None
    if not overwrite:
        shown = ", ".join(there[:6]) + (f" and {len(there) - 6} more" if len(there) > 6 else "")
        raise ValueError(f"run_dir={run_dir} already holds a run ({shown}). Continue it with resume=auto, start "
                         f"another with name=<new name>, or set overwrite=true to move its files aside (into "
                         f"{run_dir}/replaced-<date>-<time>/) and start afresh there")
    aside = os.path.join(run_dir, time.strftime("replaced-%Y%m%d-%H%M%S"))
    os.makedirs(aside)
    for name in there:
        shutil.move(os.path.join(run_dir, name), os.path.join(aside, name))
    return aside


def job_label(job_num: int, swept: Sequence[tuple[str, str]] = ()) -> str:
    """A multirun job's suffix: its swept values as `key_value` pairs joined by `+` (`optim.lr_0.003`), characters
    other than letters, digits and `._-` made `_`, so that it is a folder name and a Hydra `name=` value alike; the
    job number where nothing was swept (or the label would pass MAX_LABEL characters)."""
    label = "+".join(f"{k}_{v}" for k, v in swept)
    label = re.sub(r"[^A-Za-z0-9._+-]", "_", label)
    return label if label and len(label) <= MAX_LABEL else str(job_num)


def multirun_job(raw: dict, job_num: int, swept: Sequence[tuple[str, str]] = ()) -> dict:
    """A Hydra multirun job's config: its own name and run folder, `<name>-<job_label>` (in runs/ when run_dir was
    left at runs/<name>), and the sweep's name as the wandb group. swept: this job's (key, value) of the keys the
    command line sweeps."""
    name, label = raw["name"], job_label(job_num, swept)
    out = {**raw, "name": f"{name}-{label}", "logging": {**raw.get("logging", {})}}
    if raw.get("run_dir") == os.path.join("runs", name):
        out["run_dir"] = os.path.join("runs", f"{name}-{label}")
    else:
        out["run_dir"] = f"{raw['run_dir'].rstrip('/')}-{label}"
    out["logging"].setdefault("group", None)
    if out["logging"]["group"] is None:
        out["logging"]["group"] = name
    return out
