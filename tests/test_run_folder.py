"""The run folder: one run at a time (the lock), plain names, nothing read or written through a link, metrics rows
that cannot tear. Each guard is fed the one input it exists to refuse."""
import errno
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from training.dist import DistContext
from training.run_folder import (LOCK, MAX_LABEL, FolderBusy, LinkRefused, NoSpaceLeft, RunFolder, claim, lock,
                                 open_in, run_files, write_whole)

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


# -- rules pinned one at a time (each kills mutants of training/run_folder.py the tests above let live) -------------

def test_a_refused_new_folder_is_removed_and_an_existing_empty_one_kept(tmp_path, monkeypatch):
    import training.run_folder as rf

    def full(root, rel, mode="r", **kwargs):
        raise NoSpaceLeft(errno.ENOSPC, f"no space left on {root}/{rel}")

    monkeypatch.setattr(rf, "open_in", full)  # train.log cannot be opened: the run is refused after the lock
    with pytest.raises(NoSpaceLeft, match="train.log"):
        RunFolder(str(tmp_path / "new"), None, False, CTX)
    assert not os.path.exists(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoSpaceLeft):
        RunFolder(str(tmp_path / "empty"), None, False, CTX)
    assert os.listdir(tmp_path / "empty") == []


def test_overwrite_takes_another_hosts_lock_and_moves_the_old_run_aside(tmp_path, caplog):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK).write_text(json.dumps({"pid": 12, "host": "another-host", "started": 0}))
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with caplog.at_level("WARNING"):
        folder = RunFolder(str(run_dir), None, True, CTX)
    folder.close()
    (aside,) = [d for d in os.listdir(run_dir) if d.startswith("replaced-")]
    assert os.listdir(run_dir / aside) == ["metrics.jsonl"] and "moved to" in caplog.text


def test_the_holder_is_shown_with_its_start_time_or_question_marks():
    import time

    from training.run_folder import _holder_text

    t = 1796206863.0
    shown = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    assert _holder_text({"pid": 7, "host": "h", "started": t}) == f"pid 7 on host h, started {shown}"
    assert _holder_text({}) == "pid ? on host ?, started ?"


def _chain(length, last):
    """`length` exceptions, each the cause of the one before; the deepest is `last`."""
    e = last
    for i in range(length - 1):
        outer = RuntimeError(f"wrapper {i}")
        outer.__cause__ = e
        e = outer
    return e


def test_no_space_follows_causes_and_dcp_failures_twenty_deep_and_no_further():
    from training.run_folder import no_space

    full = lambda: OSError(errno.ENOSPC, "No space left on device")  # noqa: E731
    assert no_space(RuntimeError("other"), "/p") is None
    assert no_space(OSError(errno.EACCES, "denied"), "/p") is None
    found = no_space(_chain(20, full()), "/p")
    assert isinstance(found, NoSpaceLeft) and found.errno == errno.ENOSPC and str(found) == \
        f"[Errno {errno.ENOSPC}] no space left on /p"
    assert no_space(_chain(21, full()), "/p") is None
    assert no_space(OSError(errno.EDQUOT, "quota"), "/p") is not None
    context = RuntimeError("raised while handling")
    context.__context__ = full()
    assert no_space(context, "/p") is not None

    class Failed(Exception):  # DCP's CheckpointException: {rank: (error, its traceback)} or {rank: error}
        def __init__(self, failures):
            super().__init__("failed")
            self.failures = failures

    assert no_space(Failed({0: (full(), "trace")}), "/p") is not None
    assert no_space(Failed({1: full()}), "/p") is not None
    assert no_space(Failed({0: (RuntimeError("x"), "trace"), 1: ()}), "/p") is None


@pytest.mark.parametrize("swept, label", [([("A", "B")], "A_B"), ([("k", "v" * (MAX_LABEL - 2))], None)])
def test_a_job_label_keeps_capitals_and_may_be_exactly_max_label_long(swept, label):
    from training.run_folder import job_label

    got = job_label(3, swept)
    assert got == (label or f"k_{'v' * (MAX_LABEL - 2)}") and len(got) <= MAX_LABEL


def test_a_multirun_job_copies_the_logging_section_and_leaves_the_sweeps_config_alone():
    from training.run_folder import multirun_job

    raw = {"name": "n", "run_dir": "/scratch/n/", "logging": {"wandb": "offline", "group": None}}
    job = multirun_job(raw, 0, [("a", "1")])
    assert job == {"name": "n-a_1", "run_dir": "/scratch/n-a_1", "logging": {"wandb": "offline", "group": "n"}}
    assert raw == {"name": "n", "run_dir": "/scratch/n/", "logging": {"wandb": "offline", "group": None}}
    assert multirun_job({"name": "n", "run_dir": "runs/n", "logging": {"group": "g"}}, 1)["logging"]["group"] == "g"


def test_a_holder_being_written_is_waited_for_and_read_whole(tmp_path):
    import threading
    import time

    from training.run_folder import _read_holder

    path = tmp_path / LOCK
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    later = threading.Timer(0.2, lambda: path.write_text(json.dumps({"pid": 5, "host": "h", "started": 1.0})))
    later.start()
    try:
        assert _read_holder(fd, wait_s=10.0) == {"pid": 5, "host": "h", "started": 1.0}
        t = time.monotonic()
        assert _read_holder(os.open(tmp_path / "empty", os.O_RDONLY | os.O_CREAT), wait_s=0.3) == {}
        assert time.monotonic() - t >= 0.3
    finally:
        later.cancel()
        os.close(fd)


def test_a_lock_whose_file_was_removed_is_released_without_error_and_released_twice_harmlessly(tmp_path):
    held = lock(str(tmp_path / "run"), overwrite=False)
    os.remove(tmp_path / "run" / LOCK)
    held.release()
    held.release()
    assert held.fd is None and not os.path.exists(tmp_path / "run" / LOCK)


def test_a_calibration_json_link_in_a_run_folder_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "elsewhere.json").write_text("{}")
    os.symlink(tmp_path / "elsewhere.json", run_dir / "calibration.json")
    with pytest.raises(LinkRefused, match=r"holds links \(calibration.json\)"):
        claim(str(run_dir), "auto", False)


def test_a_folder_holding_a_run_is_named_with_six_of_its_files_and_the_count_of_the_rest(tmp_path):
    for i in range(8):
        os.makedirs(tmp_path / f"step_{i}")
    with pytest.raises(ValueError, match=r"already holds a run \(step_0, step_1, step_2, step_3, step_4, step_5 and "
                                         r"2 more\)"):
        claim(str(tmp_path), None, False)
    os.rmdir(tmp_path / "step_7")
    with pytest.raises(ValueError, match=r"\(step_0, step_1, step_2, step_3, step_4, step_5 and 1 more\)"):
        claim(str(tmp_path), None, False)
    os.rmdir(tmp_path / "step_6")
    with pytest.raises(ValueError, match=r"\(step_0, step_1, step_2, step_3, step_4, step_5\)\. Continue"):
        claim(str(tmp_path), None, False)


class _Main(DistContext):
    """The main process of a run of two: what it tells the other rank is kept."""

    def __init__(self):
        super().__init__(rank=0, world_size=2)
        self.sent = []

    def broadcast_object(self, obj):
        self.sent.append(obj)
        return obj


def test_the_main_process_tells_the_other_ranks_its_refusal_and_they_raise_it(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    main = _Main()
    with pytest.raises(ValueError, match="already holds a run"):
        RunFolder(str(run_dir), None, False, main)
    assert len(main.sent) == 1 and main.sent[0].startswith(f"ValueError: run_dir={run_dir} already holds a run")
    other = DistContext(rank=1, world_size=2)
    other.broadcast_object = lambda obj: main.sent[0]
    with pytest.raises(ValueError, match=r"^run_dir=.* already holds a run"):
        RunFolder(str(run_dir), None, False, other)
    ok = _Main()
    RunFolder(str(tmp_path / "fresh"), None, False, ok).close()
    assert ok.sent == [None]


def test_the_run_folder_logs_into_train_log_in_hydras_format_until_closed(tmp_path):
    import logging

    before = list(logging.getLogger().handlers)
    folder = RunFolder(str(tmp_path / "run"), None, False, CTX)
    logging.getLogger("some.module").warning("hello %s", "there")
    folder.close()
    logging.getLogger("some.module").warning("after the close")
    assert logging.getLogger().handlers == before
    (line,) = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]\[some.module\]\[WARNING\] - hello there", line)


def test_no_space_relabels_a_full_disk_with_the_path_asked_or_keeps_the_one_it_names():
    from training.run_folder import no_space

    inner = NoSpaceLeft(errno.ENOSPC, "no space left on /r/step_3.tmp/meta.json")
    assert str(no_space(inner, "/r/step_3.tmp").strerror) == "no space left on /r/step_3.tmp"
    assert no_space(inner) is inner
    assert no_space(OSError(errno.ENOSPC, "full", "/r/metrics.jsonl")).strerror == "no space left on /r/metrics.jsonl"
    assert no_space(OSError(errno.ENOSPC, "full")).strerror == "no space left on the device"


def test_a_lock_file_replaced_between_open_and_flock_is_opened_again(tmp_path, monkeypatch):
    import training.run_folder as rf

    real, calls = rf._same_file, []

    def first_not_same(fd, path):
        calls.append(path)
        return len(calls) > 1 and real(fd, path)

    monkeypatch.setattr(rf, "_same_file", first_not_same)
    held = lock(str(tmp_path / "run"), overwrite=False)
    assert len(calls) == 2 and json.load(open(tmp_path / "run" / LOCK))["pid"] == os.getpid()
    monkeypatch.undo()
    held.release()


def test_a_run_folder_closed_twice_is_closed_once(tmp_path):
    folder = RunFolder(str(tmp_path / "run"), None, False, CTX)
    folder.close()
    folder.close()
    assert folder.lock is None and not os.path.exists(tmp_path / "run" / LOCK)


def test_overwrite_moves_the_old_run_into_a_dated_replaced_folder(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "train.log").write_text("the old run's lines\n")
    aside = claim(str(run_dir), None, True)
    assert re.fullmatch(r"replaced-\d{8}-\d{6}", os.path.basename(aside))
    assert sorted(os.listdir(aside)) == ["metrics.jsonl", "train.log"]  # its log too: the new run's starts empty
    assert os.listdir(run_dir) == [os.path.basename(aside)]


def test_a_multirun_job_without_a_logging_section_and_a_folder_ending_in_x():
    from training.run_folder import multirun_job

    job = multirun_job({"name": "n", "run_dir": "/scratch/BOX/"}, 0, [("a", "1")])
    assert job == {"name": "n-a_1", "run_dir": "/scratch/BOX-a_1", "logging": {"group": "n"}}


def test_open_fd_takes_plain_parts_names_the_full_path_and_says_no_space_at_open(tmp_path, monkeypatch):
    from training.run_folder import open_fd

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_text("x")
    assert os.read(open_fd(str(tmp_path), "sub//./f"), 1) == b"x"  # empty and "." parts dropped; read by default
    for rel in ("", ".", "./"):
        with pytest.raises(LinkRefused, match="is not a path inside its folder"):
            open_fd(str(tmp_path), rel)
    with pytest.raises(NotADirectoryError):  # a file where a folder is asked for: not called a link
        open_fd(str(tmp_path), "sub/f/g")
    os.symlink(tmp_path / "sub", tmp_path / "linked")
    with pytest.raises(LinkRefused, match=f"^{tmp_path}/linked is a link"):
        open_fd(str(tmp_path), "linked/f")
    os.symlink(tmp_path / "sub" / "f", tmp_path / "sub" / "l")
    with pytest.raises(LinkRefused, match=f"^{tmp_path}/sub/l is a link"):
        open_fd(str(tmp_path), "sub/l")
    os.link(tmp_path / "sub" / "f", tmp_path / "sub" / "hard")
    assert open_in(str(tmp_path), "sub/hard", "rb").read() == b"x"  # reading a hard-linked file, also as bytes
    real_open = os.open

    def full(path, flags, *args, **kwargs):
        if path == "new" and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", full)
    with pytest.raises(NoSpaceLeft, match=f"^\\[Errno {errno.ENOSPC}\\] no space left on {tmp_path}/sub/new$"):
        open_fd(str(tmp_path), "sub/new", "w")


def test_a_link_deeper_down_the_path_is_refused_by_name_and_a_new_file_gets_mode_644(tmp_path):
    """open_fd walks the path one folder at a time: a link two folders down is named as the link it is (not a raw
    ELOOP), and a file it makes is rw-r--r-- less the umask, never executable."""
    from training.run_folder import open_fd

    (tmp_path / "a" / "real").mkdir(parents=True)
    os.symlink(tmp_path / "a" / "real", tmp_path / "a" / "b")
    with pytest.raises(LinkRefused, match=f"^{re.escape(str(tmp_path / 'a' / 'b'))} is a link"):
        open_fd(str(tmp_path), "a/b/c", "w")
    assert os.listdir(tmp_path / "a" / "real") == []
    umask = os.umask(0o022)
    try:
        os.close(open_fd(str(tmp_path), "a/real/new", "w"))
    finally:
        os.umask(umask)
    assert oct(os.stat(tmp_path / "a" / "real" / "new").st_mode & 0o777) == oct(0o644)


def test_resume_auto_into_a_run_that_left_no_checkpoint_moves_its_files_aside(tmp_path):
    """Before, resume=auto found nothing to resume and wrote over that run's config.yaml and appended to its
    metrics.jsonl (steps 1-2 logged twice). A relaunch with resume=auto still starts; nothing is written over."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "config.yaml").write_text("name: old\n")
    aside = claim(str(run_dir), "auto", False)
    assert sorted(os.listdir(aside)) == ["config.yaml", "metrics.jsonl"]
    assert os.listdir(run_dir) == [os.path.basename(aside)]
    # a run with a checkpoint is resumed in place: nothing moves
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "step_2").mkdir()
    (run_dir / "step_2" / "meta.json").write_text("{}")
    assert claim(str(run_dir), "auto", False) is None and (run_dir / "metrics.jsonl").exists()
