"""The run folder: one run at a time (the lock), plain names, nothing read or written through a link, metrics rows
that cannot tear. Each guard is fed the one input it exists to refuse."""
import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from training.dist import DistContext
from training.run_folder import (LOCK, FolderBusy, LinkRefused, NoSpaceLeft, RunFolder, claim, lock, open_in,
                                 run_files, write_whole)

CTX = DistContext()


def test_a_second_lock_on_a_folder_is_refused_naming_its_holder_and_released_at_the_end(tmp_path):
    run_dir = str(tmp_path / "run")
    held = lock(run_dir, overwrite=False)
    holder = json.load(open(os.path.join(run_dir, LOCK)))
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(FolderBusy, match=rf"in use by another run \(pid {os.getpid()} on host "
                                         rf"{socket.gethostname()}, started 20\d\d-"):
        lock(run_dir, overwrite=True)  # overwrite=true takes no live lock
    held.release()
    assert not os.path.exists(os.path.join(run_dir, LOCK))
    lock(run_dir, overwrite=False).release()


def test_a_lock_held_by_another_process_is_refused(tmp_path):
    """flock is per open file: a child process holding it is another run, whatever its file says."""
    run_dir = str(tmp_path / "run")
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from training.run_folder import lock; "
        "lock(sys.argv[2], False); print('held', flush=True); time.sleep(60)"),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), run_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusy, match=f"pid {child.pid} on host"):
            lock(run_dir, overwrite=False)
    finally:
        child.kill()
        child.wait()
    lock(run_dir, overwrite=False).release()  # the kernel dropped the dead child's lock: proven stale


def test_a_stale_lock_is_reported_and_taken_over_and_another_hosts_only_with_overwrite(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK).write_text(json.dumps({"pid": 999999, "host": socket.gethostname(), "started": 0}))
    with caplog.at_level("WARNING"):
        lock(str(run_dir), overwrite=False).release()
    assert "the lock left by pid 999999" in caplog.text and "taken over" in caplog.text
    (run_dir / LOCK).write_text(json.dumps({"pid": 12, "host": "another-host", "started": 0}))
    with pytest.raises(FolderBusy, match="left by pid 12 on host another-host.*overwrite=true"):
        lock(str(run_dir), overwrite=False)
    lock(str(run_dir), overwrite=True).release()


def test_a_refused_run_leaves_the_folder_as_it_was(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(os.listdir(run_dir))
    with pytest.raises(ValueError, match="already holds a run"):
        RunFolder(str(run_dir), None, False, CTX)
    assert sorted(os.listdir(run_dir)) == before  # no run.lock, no train.log
    held = lock(str(run_dir), overwrite=False)
    with pytest.raises(FolderBusy):
        RunFolder(str(run_dir), "auto", False, CTX)
    held.release()
    assert sorted(os.listdir(run_dir)) == before
    fresh = tmp_path / "fresh"
    folder = RunFolder(str(fresh), None, False, CTX)
    assert sorted(os.listdir(fresh)) == [LOCK, "train.log"]
    folder.close()
    assert os.listdir(fresh) == ["train.log"]


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "a\\b", " x", "x\0y"])
def test_name_must_be_a_plain_folder_name(name):
    from training.config import TrainConfig

    with pytest.raises(ValueError, match="name must be a plain folder name.*got name="):
        TrainConfig(name=name)
    TrainConfig(name="run-1_a.b")


def test_diverged_and_abandoned_checkpoints_are_a_runs_files(tmp_path):
    for n in ("diverged_step_5", "abandoned-20260101-000000", "notes.txt"):
        os.makedirs(tmp_path / n)
    assert run_files(str(tmp_path)) == ["abandoned-20260101-000000", "diverged_step_5"]
    with pytest.raises(ValueError, match=r"already holds a run \(abandoned-20260101-000000, diverged_step_5\)"):
        claim(str(tmp_path), None, False)


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl", "train.log", "wandb_id.txt", "step_4"])
def test_a_link_in_a_run_folder_is_refused_and_its_target_untouched(tmp_path, name):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    os.symlink(target, run_dir / name)
    with pytest.raises(LinkRefused, match=f"holds links \\({name}\\).*never read or written through a link"):
        RunFolder(str(run_dir), "auto", False, CTX)
    assert target.read_text() == "keep me\n" and sorted(os.listdir(run_dir)) == [name]


def test_open_in_follows_no_link_and_opens_only_regular_files(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    os.symlink(tmp_path / "real", tmp_path / "dirlink")
    os.symlink(tmp_path / "real" / "f", tmp_path / "filelink")
    os.mkfifo(tmp_path / "fifo")
    assert open_in(str(tmp_path), "real/f").read() == "x"
    for rel in ("dirlink/f", "filelink"):
        with pytest.raises(LinkRefused, match="is a link"):
            open_in(str(tmp_path), rel, "a")
    with pytest.raises(LinkRefused, match="not a regular file"):
        open_in(str(tmp_path), "fifo")  # would block forever in a plain open()
    with pytest.raises(LinkRefused, match="not a path inside"):
        open_in(str(tmp_path), "../x")
    os.link(tmp_path / "real" / "f", tmp_path / "hardlink")  # another name of a file that may live anywhere
    assert open_in(str(tmp_path), "hardlink").read() == "x"  # read: the bytes are the same either way
    with pytest.raises(LinkRefused, match="has 2 hard links"):
        open_in(str(tmp_path), "hardlink", "a")
    assert (tmp_path / "real" / "f").read_text() == "x"
    # write_whole replaces a link by the file, never writing through it
    write_whole(str(tmp_path), "filelink", "new")
    assert (tmp_path / "real" / "f").read_text() == "x" and not os.path.islink(tmp_path / "filelink")
    assert (tmp_path / "filelink").read_text() == "new"


def test_write_whole_on_a_full_disk_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    import training.run_folder as rf

    (tmp_path / "config.yaml").write_text("old")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rf.os, "write", full)
    with pytest.raises(NoSpaceLeft, match=f"no space left on {tmp_path}/config.yaml"):
        write_whole(str(tmp_path), "config.yaml", "new")
    assert os.listdir(tmp_path) == ["config.yaml"] and (tmp_path / "config.yaml").read_text() == "old"


# -- metrics rows that cannot tear ------------------------------------------------------------------------------------

def _logger(run_dir):
    from training.metrics import LoggingConfig, MetricsLogger

    return MetricsLogger(str(run_dir), LoggingConfig(wandb="disabled"), "t", {})


def test_a_torn_last_row_is_cut_on_resume_and_skipped_on_read(tmp_path, caplog, monkeypatch):
    from training.compare import read_rows
    from training.metrics import read_metrics

    monkeypatch.setenv("WANDB_MODE", "disabled")
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/lo')
    with caplog.at_level("WARNING"):
        assert [r["step"] for r in read_metrics(str(tmp_path))] == [1]
        assert [r["step"] for r in read_rows(str(tmp_path))] == [1]  # scripts/compare_runs.py's reader
    assert "not whole rows skipped (line 2)" in caplog.text
    with caplog.at_level("WARNING"):
        logger = _logger(tmp_path)
    assert "last line was torn (21 bytes" in caplog.text
    logger.log_metrics(2, {"train/loss": 1.5})
    logger.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # every line whole again
    assert [(r["step"], r["train/loss"]) for r in rows] == [(1, 2.0), (2, 1.5)]


def test_a_glued_row_from_an_older_version_is_skipped_not_fatal(tmp_path):
    from training.metrics import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "a{"step": 3}\n{"step": 4}\n')
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 4]


def test_a_full_disk_while_logging_says_so_and_leaves_whole_rows(tmp_path, monkeypatch):
    import training.metrics as tm

    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = _logger(tmp_path)
    logger.log_metrics(1, {"train/loss": 2.0})
    real = os.write
    monkeypatch.setattr(tm.os, "write", lambda fd, data: real(fd, data[:9]))  # a short write: the disk filled
    with pytest.raises(OSError, match="written in part"):
        logger.log_metrics(2, {"train/loss": 1.0})

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tm.os, "write", full)
    with pytest.raises(NoSpaceLeft, match=f"no space left on {tmp_path}/metrics.jsonl"):
        logger.log_metrics(2, {"train/loss": 1.0})
    monkeypatch.setattr(tm.os, "write", real)
    logger.log_metrics(2, {"train/loss": 1.0})
    logger.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_each_row_is_one_write_of_the_whole_line(tmp_path, monkeypatch):
    import training.metrics as tm

    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = _logger(tmp_path)
    writes, real = [], os.write
    monkeypatch.setattr(tm.os, "write", lambda fd, data: writes.append(bytes(data)) or real(fd, data))
    logger.log_metrics(1, {"train/loss": 2.0, "batch/S": [16, 24]})
    logger.log_videos(1, {"samples/clip": "a.mp4"})
    logger.close()
    assert len(writes) == 2 and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)


# -- bounds and warnings ----------------------------------------------------------------------------------------------

def test_bounds_on_processes_layers_and_warmup():
    from tests.helpers import compose_config
    from training.config import config_warnings

    with pytest.raises(ValueError, match=r"launch.num_processes must lie in \[1, 256\]"):
        compose_config(["launch.num_processes=100000"])
    with pytest.raises(ValueError, match="model.num_layers: 100000 transformer blocks is past the 1024"):
        compose_config(["model.num_layers=100000"])
    with pytest.raises(ValueError, match=r"optim.warmup_steps=100000 is more than 100 × train.steps=400"):
        compose_config(["optim.warmup_steps=100000"])
    (warning,) = config_warnings(compose_config(["optim.warmup_steps=1000"]))
    assert "optim.warmup_steps=1000 is more than train.steps=400" in warning and "40%" in warning
    assert config_warnings(compose_config([])) == []
