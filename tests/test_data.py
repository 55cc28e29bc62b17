"""Synthetic latent corpus, sample index (read by seek), buckets, Batch, loader and bad-sample handling."""
import io
import os
import tarfile

import numpy as np
import pytest
import torch

from data.buckets import Bucket, bucket_table
from data.config import DataConfig
from data.index import SampleIndex, load_npy
from data.loader import Loader, open_corpus
from data.synthetic import write_synthetic_corpus
from scheduling.planner import plan_step

BUCKETS = bucket_table({"img": {"frames": 1, "height": 32, "width": 48},
                        "vid": {"frames": 9, "height": 32, "width": 32}})


def test_bucket_shapes_and_tokens():
    b = Bucket("v480_33f", 33, 480, 832)
    assert b.latent_shape(16) == (16, 9, 60, 104) and b.tokens == 14040
    assert Bucket("i720", 1, 720, 1280).tokens == 3600
    assert Bucket("v720_81f", 81, 720, 1280).tokens == 75600
    with pytest.raises(ValueError, match="frames must be 1 \\+ 4·k"):
        Bucket("x", 10, 480, 832)
    with pytest.raises(ValueError, match="width must be a multiple of 16"):
        Bucket("x", 1, 480, 840)
    assert list(BUCKETS) == ["img", "vid"]  # ordered by S


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("corpus"))
    write_synthetic_corpus(root, BUCKETS, {"img": 0.5, "vid": 0.5}, num_samples=20, num_val=4, latent_channels=3,
                           text_dim=8, seed=1, samples_per_shard=7)
    return root


def test_index_records_point_at_the_tar_members(corpus_dir):
    index = SampleIndex.load(corpus_dir)
    assert len(index.records) == 24 and len(index.split("val")) == 4
    assert sum(r["bucket"] == "img" for r in index.records) == 12  # the mix is kept exactly
    for i, r in enumerate(index.records):
        with tarfile.open(os.path.join(corpus_dir, r["shard"])) as tar:
            ref = np.load(io.BytesIO(tar.extractfile(f"{r['key']}.latent.npy").read()))
        got = load_npy(index.read(i, "latent.npy"))
        np.testing.assert_array_equal(got, ref)
        assert list(got.shape) == r["latent"] == [3, *BUCKETS[r["bucket"]].latent_shape(3)[1:]]
        assert r["S"] == BUCKETS[r["bucket"]].tokens
        assert load_npy(index.read(i, "text.npy")).shape == (r["L_text"], 8)


def _corpus(root, **kw):
    cfg = DataConfig(buckets={}, index=root, val_samples=4, **kw)
    return open_corpus(cfg, BUCKETS, latent_channels=3, text_dim=8, seed=0)


def test_loader_batches_follow_the_plan(corpus_dir):
    corpus = _corpus(corpus_dir)
    assert len(corpus.table) == 20 and len(corpus.val_ids) == 4
    plan, _ = plan_step(corpus.table, 0, 0, 0, 2, "equal_token", 2, [3, 1], lambda B, S: B * S)
    for rank in range(2):
        loader = Loader(corpus, text_len=6, caption_dropout=0.0, seed=0, rank=rank)
        batches = list(loader.step(plan))
        assert len(batches) == plan.num_slots
        for mb, batch in zip(plan.ranks[rank], batches):
            name = corpus.bucket_names[mb.bucket]
            assert batch.bucket == name and batch.S == BUCKETS[name].tokens
            assert batch.latents.shape == (mb.B, *BUCKETS[name].latent_shape(3))
            assert batch.text.shape == (mb.B, 6, 8)
            assert batch.keys == [corpus.key(i) for i in mb.ids]
            for j, gid in enumerate(mb.ids):
                lat, txt = corpus.load(gid)
                torch.testing.assert_close(batch.latents[j], lat)
                L = min(6, txt.shape[0])
                torch.testing.assert_close(batch.text[j, :L], txt[:L])
                assert batch.text[j, L:].abs().sum() == 0  # zero padding


def test_caption_dropout_is_keyed_and_uses_the_empty_prompt(corpus_dir):
    corpus = _corpus(corpus_dir)
    plan, _ = plan_step(corpus.table, 0, 0, 0, 1, "equal_token", 8, [3, 1], lambda B, S: B * S)
    a = list(Loader(corpus, 6, 0.5, seed=0, rank=0).step(plan))
    b = list(Loader(corpus, 6, 0.5, seed=0, rank=0, num_workers=2).step(plan))
    dropped = 0
    for x, y in zip(a, b):
        torch.testing.assert_close(x.text, y.text)  # same decision with and without workers
        for j in range(x.B):
            if torch.equal(x.text[j, :1], corpus.empty_text[:1]):
                dropped += 1
    n = sum(x.B for x in a)
    assert 0 < dropped < n


def test_bad_samples_are_replaced_and_counted(tmp_path, corpus_dir):
    import shutil

    root = str(tmp_path / "bad")
    shutil.copytree(corpus_dir, root)
    index = SampleIndex.load(root)
    # the bucket's last training sample: the next ones in id order are held-out samples, never a replacement
    victim = [i for i, r in enumerate(index.records) if r["split"] == "train" and r["bucket"] == "vid"][-1]
    assert any(r["split"] == "val" and r["bucket"] == "vid" for r in index.records[victim:])
    r = index.records[victim]
    off, size = r["members"]["latent.npy"]
    with open(os.path.join(root, r["shard"]), "r+b") as f:  # NaNs into the stored latents
        arr = load_npy(index.read(victim, "latent.npy"))
        arr[0, 0, 0, 0] = np.nan
        from data.index import npy_bytes

        payload = npy_bytes(arr)
        assert len(payload) == size
        f.seek(off)
        f.write(payload)
    corpus = _corpus(root)
    gid, latent, _ = corpus.load_checked(victim)
    assert gid != victim and corpus.record(gid)["bucket"] == "vid" and torch.isfinite(latent).all()
    assert corpus.is_train[gid] and gid not in corpus.val_ids
    assert corpus.skipped["nonfinite"] == 1


def test_missing_index_and_mismatched_corpus_are_clear_errors(tmp_path, corpus_dir):
    with pytest.raises(FileNotFoundError, match="no sample index"):
        SampleIndex.load(str(tmp_path))
    with pytest.raises(ValueError, match="in_channels=4"):
        open_corpus(DataConfig(buckets={}, index=corpus_dir), BUCKETS, latent_channels=4, text_dim=8, seed=0)


def test_weighted_sources_define_the_epoch(tmp_path, corpus_dir):
    other = str(tmp_path / "other")
    write_synthetic_corpus(other, BUCKETS, {"img": 1.0}, num_samples=5, num_val=0, latent_channels=3, text_dim=8)
    cfg = DataConfig(buckets={}, sources=[{"index": corpus_dir, "weight": 0.25}, {"index": other, "weight": 0.75}],
                     val_samples=4)
    corpus = open_corpus(cfg, BUCKETS, 3, 8, seed=0)
    total = 20 + 5  # training samples over both sources
    n_other = sum(corpus.key(i).startswith("1/") for i in corpus.table.ids)
    assert len(corpus.table) == round(0.25 * total) + round(0.75 * total)
    assert n_other == round(0.75 * total)  # the 5-sample source is cycled
    assert len(set(i for i in corpus.table.ids if corpus.key(i).startswith("1/"))) == 5


# -- what the corpus itself declares, and the synthetic corpora open_corpus makes -------------------------------------

def test_channels_and_text_width_come_from_the_corpus_meta_when_neither_config_nor_encoders_give_them(corpus_dir):
    from data.loader import LatentCorpus

    index = SampleIndex.load(corpus_dir)
    corpus = LatentCorpus([index], [1.0], BUCKETS, val_samples=4, seed=0)
    assert (corpus.latent_channels, corpus.text_dim) == (3, 8)  # corpus.json's, as write_synthetic_corpus wrote them
    latent, text = corpus.load(0)
    assert latent.shape[0] == 3 and text.shape[1] == 8
    assert corpus.empty_text.shape == (1, 8)


def test_an_empty_prompt_of_another_width_than_the_text_encoders_is_refused(corpus_dir):
    from data.loader import LatentCorpus

    index = SampleIndex.load(corpus_dir)
    with pytest.raises(ValueError, match=r"empty_text\.pt holds .* expected a float tensor \[L, text_dim\] with "
                                         r"width 6"):
        LatentCorpus([index], [1.0], BUCKETS, val_samples=4, seed=0, latent_channels=3, text_dim=6)


def test_the_latent_dtype_a_corpus_declares_is_enforced_at_load(corpus_dir):
    from data.loader import BadSample, LatentCorpus

    index = SampleIndex.load(corpus_dir)  # its latents are float32
    for declared, ok in (("float32", True), ("float16", False)):
        index.meta["dtype"] = declared
        corpus = LatentCorpus([index], [1.0], BUCKETS, val_samples=4, seed=0, latent_channels=3, text_dim=8)
        if ok:
            assert corpus.load(0)[0].dtype == torch.float32
        else:
            with pytest.raises(BadSample, match="latent.npy holds float32, expected float16") as e:
                corpus.load(0)
            assert e.value.reason == "bad_shape"
            item = corpus.read_checked(0)  # every latent is float32: none of the bucket reads, a placeholder goes in
            assert item.placeholder and corpus.skipped["bad_shape"] > 0


def test_what_indexing_skipped_in_a_latent_corpus_is_counted_by_open_corpus(tmp_path, corpus_dir):
    import shutil

    root = str(tmp_path / "c")
    shutil.copytree(corpus_dir, root)
    index = SampleIndex.load(root)
    index.meta["skipped"] = {"too_small": 2, "unreadable": 1}  # as precompute records what it left out
    index.save()
    corpus = _corpus(root)
    assert corpus.skipped == {"too_small": 2, "unreadable": 1}


def test_open_corpus_makes_the_synthetic_corpus_its_kind_names_and_only_that_one(tmp_path):
    from data.config import SyntheticConfig
    from data.encoders import EncoderConfig

    for kind, writer in (("waves", "data/synthetic.py"), ("shapes", "data/shapes.py")):
        cache = tmp_path / kind
        cfg = DataConfig(buckets={}, cache_dir=str(cache), val_samples=2, encoders=EncoderConfig(text="words",
                         device="cpu"), synthetic=SyntheticConfig(kind=kind, num_samples=8, num_val=2,
                                                                  samples_per_shard=8))
        corpus = open_corpus(cfg, BUCKETS, latent_channels=4, text_dim=16, seed=0)
        assert corpus.indexes[0].meta["writer"] == writer
        assert (corpus.indexes[0].meta["latent_channels"], corpus.indexes[0].meta["text_dim"]) == (4, 16)
        assert len(os.listdir(cache)) == 1  # one corpus, at the config's widths
        assert len(corpus.table) == 8 and len(corpus.val_ids) == 2
        latent, text = corpus.load(int(corpus.table.ids[0]))
        assert latent.shape[0] == 4 and text.shape[1] == 16


def test_a_text_embedding_of_another_length_than_its_record_says_is_a_bad_shape(corpus_dir):
    from data.loader import BadSample, LatentCorpus

    index = SampleIndex.load(corpus_dir)
    index.records[0] = dict(index.records[0], L_text=index.records[0]["L_text"] + 1)
    corpus = LatentCorpus([index], [1.0], BUCKETS, val_samples=4, seed=0, latent_channels=3, text_dim=8)
    with pytest.raises(BadSample, match=r"text\.npy has shape") as e:
        corpus.load(0)
    assert e.value.reason == "bad_shape" and corpus.load(1)[1].shape[1] == 8


def test_the_synthetic_corpus_follows_its_seed_and_carries_pooled_text_where_the_model_takes_it(tmp_path):
    from data.config import SyntheticConfig

    def corpus(seed, **kw):
        cfg = DataConfig(buckets={}, cache_dir=str(tmp_path), val_samples=2,
                         synthetic=SyntheticConfig(num_samples=6, num_val=2, samples_per_shard=8, seed=seed))
        return open_corpus(cfg, BUCKETS, latent_channels=4, text_dim=16, seed=0, **kw)

    a, b = corpus(0), corpus(5)
    assert a.indexes[0].root != b.indexes[0].root
    assert not torch.equal(a.load(0)[0], b.load(0)[0]) and torch.equal(a.load(0)[0], corpus(0).load(0)[0])
    assert a.empty_pooled is None
    pooled = corpus(0, pooled_dim=12)
    assert pooled.empty_pooled.shape == (12,) and pooled.pooled(int(pooled.table.ids[0])).shape == (12,)


def test_prefetch_reads_a_plan_ahead_and_none_is_no_plan(corpus_dir):
    corpus = _corpus(corpus_dir)
    plan, _ = plan_step(corpus.table, 0, 0, 0, 1, "equal_token", 3, [3, 1], lambda B, S: B * S)
    loader = Loader(corpus, 6, 0.0, seed=0, rank=0, num_workers=2)
    loader.prefetch(None)
    loader.prefetch(plan)
    assert len(loader._ahead) == 1
    ahead = [b.latents for b in loader.step(plan)]
    plain = [b.latents for b in Loader(corpus, 6, 0.0, seed=0, rank=0).step(plan)]
    assert len(ahead) == 3 and all(torch.equal(x, y) for x, y in zip(ahead, plain)) and not loader._ahead
    loader.close()
