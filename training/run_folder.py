"""The run folder: a fresh run never writes into one that holds another run (docs/contracts.md §7).

A folder holds a run when it has any of RUN_FILES: metrics, checkpoints (also a diverged or half-written one), a
wandb run and its id, the resolved config, samples, traces. Into such a folder

    resume=auto | PATH   continues that run (training/resume.py)
    overwrite=true       a fresh run; the old run's files are moved into `replaced-<date>-<time>/` in the folder,
                         never deleted (nothing already written is lost); its wandb id is not reused
    neither              refused before anything is built, naming what is there and the three ways on

Hydra multirun (`-m`): every job is its own run — `name-<job number>` in `run_dir-<job number>` — and the jobs of
one sweep share a wandb group (the name they were given), so they can be compared and never collide.
"""
from __future__ import annotations

import glob
import os
import shutil
import time
from typing import Optional

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


def multirun_job(raw: dict, job_num: int) -> dict:
    """A Hydra multirun job's config: its own name and run folder (when run_dir was left at runs/<name>), and the
    sweep's name as the wandb group."""
    name = raw["name"]
    out = {**raw, "name": f"{name}-{job_num}", "logging": {**raw.get("logging", {})}}
    if raw.get("run_dir") == os.path.join("runs", name):
        out["run_dir"] = os.path.join("runs", f"{name}-{job_num}")
    else:
        out["run_dir"] = f"{raw['run_dir'].rstrip('/')}-{job_num}"
    out["logging"].setdefault("group", None)
    if out["logging"]["group"] is None:
        out["logging"]["group"] = name
    return out
