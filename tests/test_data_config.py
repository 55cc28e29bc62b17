"""What a small or newly bucketed corpus does: the held-out share for val/loss, the synthetic mix's rule for a bucket it
does not name, the warning for a bucket that gets no sample, and the hint for a folder given as data.urls.

Corpora are written by data/synthetic.py into pytest's tmp folders on 32-pixel buckets (milliseconds each).
"""
import logging
import os
import re
import shlex
import tarfile

import numpy as np
import pytest

from data.buckets import bucket_table
from data.config import DataConfig
from data.loader import check_corpus, open_corpus
from data.synthetic import write_synthetic_corpus
from tests.helpers import ROOT, compose_config

BUCKETS = {"img": {"frames": 1, "height": 32, "width": 32}, "vid": {"frames": 5, "height": 32, "width": 32}}
LAT = bucket_table(BUCKETS)
C, D = 3, 8


def corpus(root, num_samples, num_val=0, mix=(0.5, 0.5)):
    write_synthetic_corpus(str(root), LAT, dict(zip(LAT, mix)), num_samples=num_samples, num_val=num_val,
                           latent_channels=C, text_dim=D, seed=1, samples_per_shard=16)
    return str(root)


def open_index(root, **kw):
    return open_corpus(DataConfig(buckets={}, index=root, **kw), LAT, C, D, seed=0)


# -- data.val_samples -------------------------------------------------------------------------------------------------

def test_val_samples_default_holds_out_a_capped_share_and_says_so(tmp_path, caplog):
    from data.config import auto_val_samples

    assert [auto_val_samples(m) for m in (2, 5, 19, 20, 35, 80, 10_000)] == [1, 1, 1, 2, 3, 8, 8]
    assert DataConfig(buckets={}).val_samples is None and compose_config([]).data.val_samples is None
    with caplog.at_level(logging.INFO, logger="data.loader"):
        small = open_index(corpus(tmp_path / "five", 5))
    assert len(small.val_ids) == 1 and small.is_train.sum() == 4  # 8 of 5 before: "no training samples"
    assert "held out 1 of 5 for val/loss" in caplog.text
    mid = open_index(corpus(tmp_path / "thirty", 30))
    assert len(mid.val_ids) == 3 and mid.is_train.sum() == 27
    assert not set(mid.val_ids) & set(np.flatnonzero(mid.is_train))  # a held-out sample never trains
    split = open_index(corpus(tmp_path / "split", 12, num_val=10))  # a val split: taken first, capped at 8
    assert len(split.val_ids) == 8 and split.is_train.sum() == 12
    assert len(open_index(corpus(tmp_path / "exact", 30), val_samples=5).val_ids) == 5  # a number is taken as is


@pytest.mark.parametrize("num_samples, val_samples", [(1, None), (4, 4), (4, 9)])
def test_too_few_samples_name_data_val_samples_and_the_fix(tmp_path, num_samples, val_samples):
    root = corpus(tmp_path / "c", num_samples)
    with pytest.raises(ValueError, match=r"data\.val_samples.*leaving none to train on: lower data\.val_samples"):
        open_index(root, val_samples=val_samples)


# -- data.synthetic.mix -----------------------------------------------------------------------------------------------

def test_a_bucket_the_mix_leaves_out_gets_the_remaining_share_or_is_refused():
    from data.config import synthetic_mix

    assert synthetic_mix({}, ["a", "b"]) == {"a": 1.0, "b": 1.0}
    assert synthetic_mix({"a": 0.5, "b": 0.0}, ["a", "b", "c", "d"]) == {"a": 0.5, "b": 0.0, "c": 0.25, "d": 0.25}
    with pytest.raises(ValueError, match=r"bucket\(s\) \['c'\].*'\+data\.synthetic\.mix\.c=<share>'"):
        synthetic_mix({"a": 0.4, "b": 0.6}, ["a", "b", "c"])
    # the default run with one bucket added: refused while the config is read, naming the key (it trained 0 before)
    with pytest.raises(ValueError, match=r"\+data\.synthetic\.mix\.img_32="):
        compose_config(["+data.buckets.img_32={frames: 1, height: 32, width: 32}"])
    cfg = compose_config(["+data.buckets.img_32={frames: 1, height: 32, width: 32}", "+data.synthetic.mix.img_32=0.25"])
    assert cfg.data.synthetic.mix["img_32"] == 0.25
    # a corpus named by data.index has its own samples: the synthetic mix is not asked
    compose_config(["+data.buckets.img_32={frames: 1, height: 32, width: 32}", "data.index=/nowhere"])


def test_the_remaining_share_reaches_the_generated_corpus(tmp_path):
    cfg = DataConfig(buckets=BUCKETS, cache_dir=str(tmp_path), val_samples=2)
    cfg.synthetic.num_samples, cfg.synthetic.num_val, cfg.synthetic.mix = 40, 0, {"img": 0.5}
    c = open_corpus(cfg, LAT, C, D, seed=0)
    counts = np.bincount(c.bucket_of, minlength=2)
    assert counts.tolist() == [20, 20]  # vid, unnamed, gets the remaining 0.5 (it got none before)


def test_a_bucket_with_no_sample_in_the_first_epoch_is_reported(tmp_path, caplog):
    root = corpus(tmp_path / "c", 12, mix=(1.0, 0.0))
    with caplog.at_level(logging.WARNING, logger="data.loader"):
        open_index(root, val_samples=2)
    assert re.search(r"bucket\(s\) \['vid'\] get no sample in the first epoch's plan \(of 10\)", caplog.text)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data.loader"):
        open_index(corpus(tmp_path / "both", 12), val_samples=2)
    assert "no sample in the first epoch" not in caplog.text


def test_the_docs_bucket_examples_compose():
    """docs/data.md's `python train.py ... +show_buckets=true` lines are read as the user would paste them."""
    text = open(os.path.join(ROOT, "docs", "data.md")).read().replace("\\\n", " ")
    lines = [ln for ln in text.splitlines() if ln.startswith("python train.py") and "+show_buckets" in ln]
    assert len(lines) >= 2
    for ln in lines:
        args = shlex.split(ln.split("#")[0])[2:]
        cfg = compose_config([a for a in args if not a.startswith("+show_buckets")])
        assert all(n in cfg.data.synthetic.mix for n in cfg.data.buckets), ln


# -- data.urls naming a folder ----------------------------------------------------------------------------------------

def test_a_folder_as_data_urls_suggests_its_shard_pattern(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        tarfile.open(shards / f"shard-{i:05d}.tar", "w").close()
    with pytest.raises(ValueError, match=re.escape(f"use data.urls='{shards}/shard-*.tar'")):
        check_corpus(DataConfig(buckets={}, urls=str(shards)))
    (shards / "other.tar").touch()
    with pytest.raises(ValueError, match=re.escape(f"use data.sources[0].urls='{shards}/*.tar'")):
        check_corpus(DataConfig(buckets={}, sources=[{"urls": str(shards) + "/"}]))
    index = corpus(tmp_path / "latents", 4)
    with pytest.raises(ValueError, match=re.escape(f"use data.index={index}")):
        check_corpus(DataConfig(buckets={}, urls=index))


def test_a_bucket_name_one_letter_off_is_called_a_likely_typo():
    """`data.buckets.vid_64_9F.frames=13` (a capital F) made a new bucket: the errors it then meets name the bucket
    it was probably meant to be."""
    from data.buckets import bucket_table
    from data.config import synthetic_mix

    with pytest.raises(ValueError, match=r"is vid_64_9F a typo for vid_64_9f\?"):
        synthetic_mix({"img_64": 0.5, "vid_64_9f": 0.5}, ["img_64", "vid_64_9f", "vid_64_9F"])
    spec = {"frames": 9, "height": 64, "width": 64}
    with pytest.raises(ValueError, match=r"data\.buckets\.vid_64_9F is missing \['height', 'width'\] \(a typo for "
                                         r"data\.buckets\.vid_64_9f\?"):
        bucket_table({"vid_64_9f": spec, "vid_64_9F": {"frames": 13}})
    with pytest.raises(ValueError, match=r"is missing \['height', 'width'\]$"):
        bucket_table({"vid_64_9f": spec, "zzz": {"frames": 13}})
    from data.buckets import near_name

    # case, one letter changed, two swapped; a deliberate new name (three letters apart) is none's typo
    assert [near_name(n, ["vid_64_9f", "img_64", "vid_64x96_17f"]) for n in
            ("vid_64_9F", "img_65", "img_46", "vid_64_17f", "img")] == ["vid_64_9f", "img_64", "img_64", None, None]
    with pytest.raises(ValueError) as e:
        synthetic_mix({"img_64": 1.0}, ["img_64", "vid_64x96_17f", "vid_64_17f"])
    assert "typo" not in str(e.value)
