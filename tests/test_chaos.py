"""Chaos: the tiny default trained on a corpus of good and bad samples of every kind the data tests know, killed with
SIGKILL during a step and during a checkpoint write, its newest checkpoint then damaged, and resumed each time; and
the tiny default run through a disk that fills during a checkpoint, a kill, a rollback to an older checkpoint and
another kill.

The per-step losses after every resume are bit-identical to the same run left alone, every bad sample is counted
as it is there, and no step is lost. The faults are injected from outside (a wrapper that patches the trainer in its
own process), the way a crash would come, not through any switch in the library.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, png_claiming, rewrite_members, run_training, tiny_overrides, write_tar
from training.metrics import read_metrics

pytestmark = pytest.mark.slow

WRAPPER = '''
import os, runpy, signal, sys
sys.path.insert(0, {root!r})
import torch
import training.checkpoint as ck
from models.flow_matching import FlowMatching

mode, at = os.environ["CHAOS"].split(":")
at = int(at)
if mode == "step":  # SIGKILL inside training micro-batch number `at` (after its forward, before its backward)
    real, n = FlowMatching.per_sample_loss, [0]
    def loss(*a, **k):
        out = real(*a, **k)
        if torch.is_grad_enabled():
            n[0] += 1
            if n[0] == at:
                os.kill(os.getpid(), signal.SIGKILL)
        return out
    FlowMatching.per_sample_loss = staticmethod(loss)
elif mode == "checkpoint":  # SIGKILL while step_<at> is being written: its shards are there, its manifest is not
    real_manifest = ck.write_manifest
    def manifest(path, ctx):
        if path.endswith(f"step_{{at}}.tmp"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_manifest(path, ctx)
    ck.write_manifest = manifest
elif mode == "enospc":  # the disk fills while step_<at>'s shards are written: a write fails part-way with ENOSPC
    import contextlib, errno
    from torch.distributed.checkpoint import filesystem
    real_stream = filesystem.FileSystem.create_stream

    class Full:
        def __init__(self, stream):
            self.stream = stream
        def __getattr__(self, k):
            return getattr(self.stream, k)
        def write(self, b):
            self.stream.write(bytes(b)[:100])
            raise OSError(errno.ENOSPC, "No space left on device")

    @contextlib.contextmanager
    def create_stream(self, path, m):
        with real_stream(self, path, m) as s:
            yield Full(s) if "w" in m and f"step_{{at}}.tmp" in str(path) else s
    filesystem.FileSystem.create_stream = create_stream
sys.argv = [os.path.join({root!r}, "train.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def bad_corpora(root: str) -> list[dict]:
    """A raw corpus (good images and clips, every bad kind make_corpus writes, a PNG bomb and a binary caption) and
    a latent corpus (good samples, one latent of the wrong shape, one NaN text embedding), as data.sources."""
    from data.buckets import bucket_table
    from data.index import SampleIndex, load_npy, npy_bytes
    from data.synthetic import write_synthetic_corpus
    from data.synthetic_raw import BAD_KINDS, encode_jpg, write_raw_corpus
    from tests.helpers import compose_config

    raw = os.path.join(root, "raw")
    write_raw_corpus(raw, images=6, videos=6, seconds=(1.2, 2.0), samples_per_shard=5, seed=3, bad=BAD_KINDS)
    rng = np.random.default_rng(0)
    extra = [(f"ok_extra{i}", {"jpg": encode_jpg(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)),
                               "txt": b"a square photo"}) for i in range(2)]
    extra += [("bad_bomb", {"png": png_claiming(20000, 20000), "txt": b"a bomb"}),
              ("bad_binary_caption", {"jpg": encode_jpg(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)),
                                      "txt": bytes(range(256))})]
    write_tar(os.path.join(raw, "shard-09999.tar"), extra)
    cfg = compose_config([])
    lat = os.path.join(root, "latent")
    write_synthetic_corpus(lat, bucket_table(cfg.data.buckets), {"img_64": 0.5, "vid_64_9f": 0.5}, num_samples=24,
                           num_val=2, latent_channels=cfg.model.in_channels, text_dim=cfg.model.text_dim, seed=5,
                           samples_per_shard=8)
    index = SampleIndex.load(lat)
    train = [r for r in index.records if r["split"] == "train"]
    C = cfg.model.in_channels
    nan_text = np.full_like(load_npy(index.read(index.records.index(train[1]), "text.npy")), np.nan)
    rewrite_members(lat, {(train[0]["key"], "latent.npy"): npy_bytes(np.zeros((C, 1, 4, 4), np.float32)),
                          (train[1]["key"], "text.npy"): npy_bytes(nan_text)})
    return [{"urls": os.path.join(raw, "*.tar"), "weight": 0.5}, {"index": lat, "weight": 0.5}]


def last_rows(run_dir) -> dict:
    """The last row logged for each step (a resumed run logs again the steps it repeats)."""
    return {r["step"]: r for r in read_metrics(run_dir)}


def test_kills_and_a_damaged_checkpoint_lose_nothing_and_change_no_loss(tmp_path):
    sources = bad_corpora(str(tmp_path))
    cache = str(tmp_path / "cache")
    common = ["train.steps=12", "checkpoint.every=3", "checkpoint.keep_last=4", "train.val_every=6",
              "data.caption_dropout=0.0",
              "data.sources=[" + ", ".join("{" + ", ".join(f"{k}: '{v}'" if isinstance(v, str) else f"{k}: {v}"
                                                         for k, v in src.items()) + "}" for src in sources) + "]"]

    straight = str(tmp_path / "straight")
    run_training(tiny_overrides(straight, cache, *common))
    a = last_rows(straight)
    skipped = {k: v for k, v in a[12].items() if k.startswith("data/skipped_")}
    # every kind is there: at indexing, at load (decode, shape, NaN), and the bomb and binary caption
    assert {"data/skipped_too_large", "data/skipped_unreadable_caption", "data/skipped_bad_shape",
            "data/skipped_nonfinite", "data/skipped_corrupt_image"} <= set(skipped), skipped

    run = str(tmp_path / "chaos")
    wrapper = tmp_path / "chaos_train.py"
    wrapper.write_text(WRAPPER.format(root=ROOT))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")

    def killed(fault: str, *extra) -> bool:
        args = [sys.executable, str(wrapper), *tiny_overrides(run, cache, *common, *extra)]
        done = subprocess.run(args, cwd=ROOT, env=dict(env, CHAOS=fault), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == -9, done.stdout[-3000:] + done.stderr[-3000:]
        return True

    # 1. killed in step 5's second micro-batch (M = 2): step_3 is the newest checkpoint
    assert killed("step:10")
    assert "step_3" in os.listdir(run) and "step_6" not in os.listdir(run)
    # 2. resumed from step_3, killed while step_9 is written: step_6 complete, step_9 only a .tmp
    assert killed("checkpoint:9", "resume=auto")
    assert {"step_3", "step_6", "step_9.tmp"} <= set(os.listdir(run)) and "step_9" not in os.listdir(run)
    # 3. step_6's shard is damaged on disk: resume=auto skips it (named in the log) and goes back to step_3
    shard = next(os.path.join(run, "step_6", n) for n in os.listdir(os.path.join(run, "step_6"))
                 if n.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 7)
    cfg, _ = run_training(tiny_overrides(run, cache, *common, "resume=auto"))

    b = last_rows(run)
    assert sorted(b) == sorted(a) == list(range(13))  # no step lost (0: the first val/loss)
    counts = lambda row: {k: v for k, v in row.items() if k.startswith("data/skipped_")}  # noqa: E731
    for s in range(1, 13):
        assert b[s]["train/loss"] == a[s]["train/loss"], (s, a[s]["train/loss"], b[s]["train/loss"])
        assert b[s]["samples_seen"] == a[s]["samples_seen"]
        # counted once each, whether found before the resume (restored from the checkpoint) or after it
        assert counts(b[s]) == counts(a[s]), (s, counts(a[s]), counts(b[s]))
    assert b[12]["val/loss"] == a[12]["val/loss"] and counts(b[12]) == skipped
    assert not [d for d in os.listdir(run) if d.endswith(".tmp") and d != "step_9.tmp"]
    assert os.path.isdir(os.path.join(run, "step_12"))


def test_a_full_disk_a_rollback_and_kills_lose_nothing_and_change_no_loss(tmp_path):
    """A disk that fills while step_6 is written (the run stops saying so; step_4 stays, no step_6.tmp), a kill, a
    rollback to step_8 that abandons step_10, a kill after the branch wrote its own step_10: resume=auto takes the
    branch's step_10 (not the abandoned one), keep_last=1 keeps the rollback point, and every step's loss equals the
    run left alone, bit for bit."""
    cache = str(tmp_path / "cache")
    common = ["train.steps=12", "checkpoint.every=2", "checkpoint.keep_last=2", "train.val_every=6"]
    straight = str(tmp_path / "straight")
    run_training(tiny_overrides(straight, cache, *common))
    a = last_rows(straight)

    run = str(tmp_path / "chaos")
    wrapper = tmp_path / "chaos_train.py"
    wrapper.write_text(WRAPPER.format(root=ROOT))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")

    def chaos(fault: str, *extra, trace="1"):
        args = [sys.executable, str(wrapper), *tiny_overrides(run, cache, *common, *extra)]
        return subprocess.run(args, cwd=ROOT, env=dict(env, CHAOS=fault, HYDRA_FULL_ERROR=trace), capture_output=True,
                              text=True, timeout=300)

    # 1. the disk fills during step_6's write: the run stops naming it (a refusal: exit status 2, no traceback, as a
    # user sees it without HYDRA_FULL_ERROR), step_4 (and step_2) stay, no step_6.tmp
    done = chaos("enospc:6", trace="0")
    assert done.returncode == 2 and f"error: no space left on {run}/step_6.tmp while writing step_6" in done.stderr \
        and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "the last good checkpoint" in done.stderr and f"{run}/step_4 is kept" in done.stderr
    assert sorted(d for d in os.listdir(run) if d.startswith("step_")) == ["step_2", "step_4"]
    # 2. resumed, killed in step 11 (its first micro-batch; M = 2, from step 5): step_8 and step_10 are there
    done = chaos("step:13", "resume=auto")
    assert done.returncode == -9, done.stderr[-3000:]
    assert sorted(d for d in os.listdir(run) if d.startswith("step_")) == ["step_10", "step_8"]
    # 3. rolled back to step_8 (keep_last=1 now), killed in step 12 after the branch wrote its own step_10
    done = chaos("step:7", f"resume={run}/step_8", "checkpoint.keep_last=1")
    assert done.returncode == -9, done.stderr[-3000:]
    (aside,) = [d for d in os.listdir(run) if d.startswith("abandoned-")]
    assert os.listdir(os.path.join(run, aside)) == ["step_10"]
    assert sorted(d for d in os.listdir(run) if d.startswith("step_")) == ["step_10", "step_8"]  # step_8: kept
    # 4. resume=auto: the branch's step_10, to the end
    run_training(tiny_overrides(run, cache, *common, "resume=auto", "checkpoint.keep_last=1"))
    b = last_rows(run)
    assert sorted(b) == sorted(a) == list(range(13))
    for s in range(1, 13):
        assert b[s]["train/loss"] == a[s]["train/loss"], (s, a[s]["train/loss"], b[s]["train/loss"])
        assert b[s]["samples_seen"] == a[s]["samples_seen"]
    assert b[12]["val/loss"] == a[12]["val/loss"]
    assert sorted(d for d in os.listdir(run) if d.startswith("step_")) == ["step_12", "step_8"]
    assert not [d for d in os.listdir(run) if d.endswith(".tmp")]
