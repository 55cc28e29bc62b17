"""The run folder: one run at a time, never written through a link, files written whole (docs/contracts.md §7).

One writer. Before anything is written, the main process takes `run_dir/run.lock`: an exclusive `fcntl.flock` on a
file it holds open for the run's whole life, holding {pid, host, started}. A second run into the same folder is
refused at once (exit 2) with the holder named; the other ranks of a run share their main process' lock (it tells
them the outcome). The kernel drops the lock when its holder dies, however it dies, so a lock file left by a killed
run is proven stale when its flock is free and it names this host: it is taken over, with a warning naming the run
that left it. One naming another host is taken over only with `overwrite=true` (this host cannot tell whether that
run still lives where the file system's locks do not span hosts). A run that ends removes its lock file.

What is there. A folder holds a run when it has any of RUN_FILES: metrics, checkpoints (also a diverged,
abandoned or half-written one), a wandb run and its id, the resolved config, samples, traces. Into such a folder

    resume=auto | PATH   continues that run (training/resume.py); resume=auto where it left no checkpoint starts
                         afresh, its files moved aside as overwrite=true moves them
    overwrite=true       a fresh run; the old run's files (its train.log too) are moved into
                         `replaced-<date>-<time>/` in the folder, never deleted (nothing already written is lost); its
                         wandb id is not reused
    neither              refused before anything is built, naming what is there and the three ways on

A refused run leaves nothing behind: not the folder (when it made it), not its lock file.

No links. A run folder's entries (RUN_FILES, train.log, run.lock, calibration.json) that are symbolic links are refused
when the run starts, and every file of it is opened with `open_in`: O_NOFOLLOW at every component below the folder
(the folder itself may be a link: `runs/` on a scratch disk), and only regular files. `write_whole` writes a file
through a temporary name and a rename, so a reader sees the old file or the new one; a full disk raises
"no space left on <path>" (`NoSpaceLeft`) and leaves the old file.

Hydra multirun (`-m`): every job is its own run — `name-<its swept values>` in `run_dir-<its swept values>`, e.g.
runs/lr-optim.lr_0.003 (job_label) — and the jobs of one sweep share a wandb group (the name they were given), so
they can be compared and never collide.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import glob
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
from typing import Optional, Sequence

log = logging.getLogger(__name__)
MAX_LABEL = 96  # characters of a multirun job's label (job_label); a longer one falls back to the job number

RUN_FILES = ("metrics.jsonl", "step_*", "diverged_step_*", "abandoned-*", "*.tmp", "wandb", "wandb_id.txt",
             "config.yaml", "samples", "traces")
LOCK = "run.lock"
LOG_FILE = "train.log"
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's, which the console keeps


class NoSpaceLeft(OSError):
    """A write that found the disk full; the message names the path."""


def no_space(e: BaseException, path: Optional[str] = None) -> Optional[NoSpaceLeft]:
    """NoSpaceLeft for `path` when `e` (or an exception it wraps, up to 20 deep) is ENOSPC/EDQUOT, else None. With
    path None, the one found says where: a NoSpaceLeft as it is, another error by the file it names."""
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            if path is None and isinstance(e, NoSpaceLeft):
                return e
            return NoSpaceLeft(errno.ENOSPC, f"no space left on {path or e.filename or 'the device'}")
        nested = [v[0] if isinstance(v, tuple) and v else v  # DCP's CheckpointException: {rank: (error, trace)}
                  for v in (getattr(e, "failures", None) or {}).values()]
        nested = [v for v in nested if isinstance(v, BaseException)]
        for inner in nested:
            if (found := no_space(inner, path)) is not None:
                return found
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


# ---------------------------------------------------------------------------------------------------------------
# Opening a run folder's files without following a link
# ---------------------------------------------------------------------------------------------------------------

class LinkRefused(ValueError):
    """A run-folder file that is a link, or not a regular file."""


_FLAGS = {"r": os.O_RDONLY, "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL, "r+": os.O_RDWR, "c": os.O_RDWR | os.O_CREAT}


def _parts(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or os.path.isabs(rel):
        raise LinkRefused(f"{rel!r} is not a path inside its folder")
    return parts


def open_fd(root: str, rel: str, mode: str = "r") -> int:
    """An fd of root/rel opened with `mode` (r, w, a, x, r+, c: read-write, made if missing; a 'b' is ignored),
    following no link below root and refusing anything but a regular file (a FIFO or device would block or never
    end); a file opened for writing must have no other hard link (its other name could be any file of the user's)."""
    flags = _FLAGS[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    parts = _parts(rel)
    where = os.path.join(root, *parts)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for p in parts[:-1]:
            try:
                nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(os.path.join(root, p)):
                    raise LinkRefused(f"{os.path.join(root, p)} is a link: {_LINK_FIX}") from None
                raise
            os.close(dfd)
            root, dfd = os.path.join(root, p), nfd
        try:
            fd = os.open(parts[-1], flags, 0o644, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise LinkRefused(f"{where} is a link: {_LINK_FIX}") from None
            if (found := no_space(e, where)) is not None:
                raise found from None
            raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise LinkRefused(f"{where} is not a regular file")
    if mode.replace("b", "") != "r" and st.st_nlink > 1:
        os.close(fd)
        raise LinkRefused(f"{where} has {st.st_nlink} hard links: {_LINK_FIX}")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


_LINK_FIX = "a run folder's files are never read or written through a link; replace it by the file it points to"


def open_in(root: str, rel: str, mode: str = "r", **kwargs):
    """open(root/rel, mode) through `open_fd`: no link below root, regular files only."""
    return os.fdopen(open_fd(root, rel, mode), mode, **kwargs)


def write_all(fd: int, data: bytes, path: str) -> None:
    """Write all of `data` to fd; a full disk is NoSpaceLeft naming `path`."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        if (found := no_space(e, path)) is not None:
            raise found from None
        raise


def write_whole(root: str, rel: str, data: bytes | str) -> None:
    """root/rel holds `data` or what it held before, never a part (temp file + rename; a link there is replaced,
    its target never written). A full disk is NoSpaceLeft naming the path, and no temp file is left."""
    data = data.encode() if isinstance(data, str) else data
    head, name = os.path.split(rel)
    tmp = os.path.join(head, f".{name}.{os.getpid()}.part")
    path = os.path.join(root, rel)
    fd = open_fd(root, tmp, "w")
    try:
        write_all(fd, data, path)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(os.path.join(root, tmp))
        raise
    os.close(fd)
    os.replace(os.path.join(root, tmp), path)


def read_text(root: str, rel: str) -> str:
    with open_in(root, rel, "rb") as f:
        return f.read().decode()


# ---------------------------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------------------------

class FolderBusy(ValueError):
    """Another run holds the folder's lock."""


def _holder_text(h: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"])) if "started" in h else "?"
    return f"pid {h.get('pid', '?')} on host {h.get('host', '?')}, started {started}"


def _read_holder(fd: int, wait_s: float = 0.0) -> dict:
    """The {pid, host, started} a lock file holds ({} if none, after waiting up to wait_s for its writer)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            h = json.loads(os.pread(fd, 4096, 0) or b"{}")
            if isinstance(h, dict) and (h or time.monotonic() >= deadline):
                return h
        except ValueError:  # being written
            if time.monotonic() >= deadline:
                return {}
        time.sleep(0.02)


@dataclasses.dataclass
class RunLock:
    """The held lock of a run folder (main process); `release()` at the run's end removes the file."""
    path: str
    fd: Optional[int]

    def release(self) -> None:
        if self.fd is None:
            return
        try:  # unlinked before it is unlocked: a process that opened the old file sees another inode and retries
            if _same_file(self.fd, self.path):
                os.unlink(self.path)
        finally:
            os.close(self.fd)
            self.fd = None


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock(run_dir: str, overwrite: bool) -> RunLock:
    """Take run_dir's lock (making the folder); FolderBusy naming the holder when another run has it."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK)
    while True:
        fd = open_fd(run_dir, LOCK, "c")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd, wait_s=2.0)
            os.close(fd)
            raise FolderBusy(f"run_dir={run_dir} is in use by another run ({_holder_text(holder)}; {path}). Wait "
                             f"for it to end, or start this one under another name=<new name>") from None
        if _same_file(fd, path):
            break
        os.close(fd)  # the holder removed it between our open and our flock: take the new file
    previous, host = _read_holder(fd), socket.gethostname()
    if previous:
        if previous.get("host") != host and not overwrite:
            os.close(fd)
            raise FolderBusy(f"run_dir={run_dir} has a lock left by {_holder_text(previous)} ({path}), which this "
                             f"host cannot check. If that run has ended, set overwrite=true to take the lock over")
        log.warning("run_dir=%s: the lock left by %s, which ended without releasing it, is taken over", run_dir,
                    _holder_text(previous))
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": host, "started": time.time()}).encode(), 0)
    return RunLock(path, fd)


# ---------------------------------------------------------------------------------------------------------------
# What is there, and opening the folder for a run
# ---------------------------------------------------------------------------------------------------------------

def run_files(run_dir: str) -> list[str]:
    """The names in run_dir that belong to a run (RUN_FILES), sorted."""
    if not os.path.isdir(run_dir):
        return []
    found = set()
    for pattern in RUN_FILES:
        found.update(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, pattern)))
    return sorted(found)


def links_in(run_dir: str) -> list[str]:
    """The run-folder entries (RUN_FILES, train.log, run.lock, calibration.json) that are symbolic links."""
    names = set(run_files(run_dir)) | {LOG_FILE, LOCK, "calibration.json"}
    return sorted(n for n in names if os.path.islink(os.path.join(run_dir, n)))


def claim(run_dir: str, resume: Optional[str], overwrite: bool) -> Optional[str]:
    """Make run_dir ready for this run (the main process calls it, holding the lock); returns the folder the old
    run's files moved to, if any. ValueError for a fresh run into a folder that holds another."""
    links = links_in(run_dir)
    if links:
        raise LinkRefused(f"run_dir={run_dir} holds links ({', '.join(links)}): {_LINK_FIX}")
    from training.checkpoint import list_checkpoints  # here: training.checkpoint imports this module

    there = run_files(run_dir)
    if resume == "auto" and there and not list_checkpoints(run_dir):
        # a run that left no checkpoint (stopped before its first): resume=auto starts from scratch, so its files
        # move aside as overwrite=true moves them, never written over or appended to (a relaunch keeps working)
        return _move_aside(run_dir, there)
    if resume or not there:
        return None
    if not overwrite:
        shown = ", ".join(there[:6]) + (f" and {len(there) - 6} more" if len(there) > 6 else "")
        raise ValueError(f"run_dir={run_dir} already holds a run ({shown}). Continue it with resume=auto (and a "
                         f"higher train.steps where it has finished), start "
                         f"another with name=<new name>, or set overwrite=true to move its files aside (into "
                         f"{run_dir}/replaced-<date>-<time>/) and start afresh there")
    return _move_aside(run_dir, there)


def _move_aside(run_dir: str, names: list[str]) -> str:
    """The run's files (and its train.log) moved into run_dir/replaced-<date>-<time>/; returns that folder."""
    aside = os.path.join(run_dir, time.strftime("replaced-%Y%m%d-%H%M%S"))
    os.makedirs(aside)
    for name in names + ([LOG_FILE] if os.path.isfile(os.path.join(run_dir, LOG_FILE)) else []):
        shutil.move(os.path.join(run_dir, name), os.path.join(aside, name))  # its log goes with it
    return aside


class RunFolder:
    """The run folder held for one run: the lock (main process), train.log. Every rank constructs it; the main
    process decides and the others raise its refusal too, so no rank writes into a folder it does not hold."""

    def __init__(self, run_dir: str, resume: Optional[str], overwrite: bool, ctx):
        self.run_dir, self.lock, self._log = run_dir, None, None
        error, aside = None, None
        if ctx.is_main:
            made = not os.path.isdir(run_dir)
            try:
                self.lock = lock(run_dir, overwrite)
                aside = claim(run_dir, resume, overwrite)
                self._log = logging.StreamHandler(open_in(run_dir, LOG_FILE, "a"))
            except (ValueError, OSError) as e:
                error = e
                self.close()
                if made:
                    _remove_if_empty(run_dir)
        refusal = ctx.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if refusal is not None:
            raise ValueError(refusal.split(": ", 1)[1])
        if self._log is not None:
            self._log.setFormatter(logging.Formatter(LOG_FORMAT))
            logging.getLogger().addHandler(self._log)
        if aside:
            log.warning("%s: the run that was in %s moved to %s", "overwrite=true" if overwrite and not resume else
                        "resume=auto found no checkpoint to resume", run_dir, aside)

    def close(self) -> None:
        if self._log is not None:
            logging.getLogger().removeHandler(self._log)
            self._log.close()
            self._log = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


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
    out["run_dir"] = f"{raw['run_dir'].rstrip('/')}-{label}"  # runs/<name> → runs/<name>-<label>
    if out["logging"].get("group") is None:
        out["logging"]["group"] = name
    return out
