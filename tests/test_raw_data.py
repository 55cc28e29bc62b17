"""Raw corpora: make_corpus → index → buckets → plan → decode/encode → batches; bad inputs; precompute parity.

The corpora are generated here (tiny mp4/jpg samples, ~1 s to write) into pytest's tmp folders; the encoders are
the tiny VAE and UMT5 built from config, so everything runs on the CPU in seconds.
"""
import json
import logging
import os
import tarfile

import numpy as np
import pytest
import torch

from data.buckets import bucket_table
from data.config import DataConfig
from data.decode import clip_indices, decode_image, decode_video, probe_video, to_model_range, usable_frames
from data.encoders import EncoderConfig
from data.index import SampleIndex, load_npy, npy_bytes
from data.loader import Loader, open_corpus
from data.raw import RawConfig, assign_bucket, expand_urls, index_corpus
from scheduling.planner import advance, plan_step
from data.synthetic_raw import BAD_AT_INDEX, BAD_KINDS, encode_jpg, encode_mp4, write_raw_corpus
from data.precompute import precompute

TINY = bucket_table({"img_64": {"frames": 1, "height": 64, "width": 64},
                     "img_64x96": {"frames": 1, "height": 64, "width": 96},
                     "vid_64_9f": {"frames": 9, "height": 64, "width": 64},
                     "vid_64x96_17f": {"frames": 17, "height": 64, "width": 96}})
C, D, TEXT_LEN = 4, 32, 24
B_SIZES = [4, 3, 2, 1]  # per bucket, in table order (S 16, 24, 48, 120)
COST = lambda B, S: float(B * S)  # noqa: E731


def data_cfg(**kw) -> DataConfig:
    kw.setdefault("val_samples", 2)
    return DataConfig(buckets={}, encoders=EncoderConfig(device="cpu"), **kw)


def keyed_batches(loader, plan):
    return [(b.keys, b.latents, b.text, b.bucket) for b in loader.step(plan)]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("raw"))
    shards = write_raw_corpus(root, images=10, videos=14, seconds=(0.7, 2.0), samples_per_shard=6, seed=0)
    index_corpus(shards, root, TINY, RawConfig())
    return root


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bad"))
    shards = write_raw_corpus(root, images=4, videos=4, seconds=(1.2, 2.0), samples_per_shard=5, seed=3,
                              bad=BAD_KINDS)
    probed = []
    index_corpus(shards, root, TINY, RawConfig(), workers=2, progress=probed.append)
    assert len(probed) == len(shards)
    return root


# -- buckets and decoding ---------------------------------------------------------------------------------------------

def test_bucket_choice_by_aspect_and_duration():
    spec = {"i480": (1, 480, 832), "i480_p": (1, 832, 480), "i720": (1, 720, 1280)}
    for f in (17, 33, 49, 81):
        spec |= {f"v480_{f}f": (f, 480, 832), f"v480_{f}f_p": (f, 832, 480), f"v720_{f}f": (f, 720, 1280)}
    wan = bucket_table({n: {"frames": f, "height": h, "width": w} for n, (f, h, w) in spec.items()})
    cfg = RawConfig()  # 16 fps, upscale ≤ 1.5, crop ≤ 50 %

    def pick(kind, frames, fps, h, w):
        b, reason = assign_bucket(kind, frames, fps, h, w, wan, cfg)
        return b.name if b else reason

    assert usable_frames(150, 30, 16) == 80 and usable_frames(72, 24, 16) == 48 and usable_frames(40, 12, 16) == 40
    assert pick("video", 150, 30, 1080, 1920) == "v720_49f"     # 80 usable frames: the longest bucket that fits
    assert pick("video", 300, 30, 1080, 1920) == "v720_81f"
    assert pick("video", 72, 24, 480, 854) == "v480_33f"        # 48 usable < 49; 480p footage is not sent to 720p
    assert pick("video", 200, 25, 854, 480) == "v480_81f_p"     # portrait goes portrait
    assert pick("video", 120, 30, 360, 640) == "v480_49f"       # 1.33× enlargement allowed, 2× (720p) is not
    assert pick("video", 60, 30, 240, 426) == "too_small"
    assert pick("video", 16, 16, 480, 832) == "too_short"       # 16 frames < 17
    assert pick("video", 1, 16, 480, 832) == "too_short"
    assert pick("image", 1, 0, 480, 640) == "i480"              # 4:3 → nearest landscape bucket, 23 % cropped
    assert pick("image", 1, 0, 1500, 1000) == "i480_p"
    assert pick("image", 1, 0, 2160, 3840) == "i720"            # the largest bucket of the shape
    assert pick("image", 1, 0, 100, 100) == "too_small"
    assert pick("image", 1, 0, 500, 4000) == "extreme_aspect"


def test_decoder_seeks_to_the_sampled_frames_and_crops_the_centre():
    n, fps = 150, 30  # keyframes every 2 s: a clip near the end needs a real seek
    levels = [(i * 37) % 200 + 20 for i in range(n)]  # frame i is flat grey at levels[i]
    mp4 = encode_mp4((np.full((48, 64, 3), v, np.uint8) for v in levels), fps, 48, 64, "ultrafast", crf=10)
    assert probe_video(mp4)["frames"] == n and probe_video(mp4)["fps"] == 30
    for start in (0.0, 0.6, 1.0):
        clip = decode_video(mp4, 9, 32, 32, 16, start)
        assert clip.shape == (9, 32, 32, 3)
        want = [levels[i] for i in clip_indices(n, fps, 9, 16, start)]
        np.testing.assert_allclose(clip.reshape(9, -1).mean(1), want, atol=3)
    img = np.zeros((100, 200, 3), np.uint8)
    img[:, :100, 0] = 255  # left half red, right half blue: the centre crop keeps both, split in the middle
    img[:, 100:, 2] = 255
    out = decode_image(encode_jpg(img, 95), 64, 64)
    assert out.shape == (1, 64, 64, 3)
    assert out[0, :, :28, 0].min() > 200 and out[0, :, 36:, 2].min() > 200 and out[0, :, 36:, 0].max() < 60
    x = to_model_range(out)
    assert x.shape == (3, 1, 64, 64) and -1 <= x.min() and x.max() <= 1


# -- index → plan → loader --------------------------------------------------------------------------------------------

def test_make_index_plan_load_gives_batches_of_the_right_shapes(clean):
    import webdataset as wds

    shards = expand_urls(os.path.join(clean, "shard-{00000..00003}.tar"))
    keys = [s["__key__"] for s in wds.WebDataset(shards, shardshuffle=False, empty_check=False)]
    assert len(keys) == 24  # the shards are plain WebDataset
    index = SampleIndex.load(clean)
    assert {r["kind"] for r in index.records} == {"image", "video"} and all(r["bucket"] for r in index.records)
    with tarfile.open(os.path.join(clean, index.records[1]["shard"])) as tar:  # the offsets point at the members
        r = index.records[1]
        assert index.read(1, r["media"]) == tar.extractfile(f"{r['key']}.{r['media']}").read()

    corpus = open_corpus(data_cfg(urls=os.path.join(clean, "*.tar")), TINY, C, D, seed=0)
    assert len(corpus.table) == 22 and len(corpus.val_ids) == 2 and not corpus.skipped
    assert {corpus.bucket_names[b] for b in corpus.table.bucket} == set(TINY)  # every bucket is used
    plan, _ = plan_step(corpus.table, 0, 0, 0, 1, "equal_token", 6, B_SIZES, COST)
    batches = list(Loader(corpus, TEXT_LEN, 0.0, seed=0, rank=0).step(plan))
    assert len(batches) == 6
    for mb, batch in zip(plan.ranks[0], batches):
        bucket = TINY[corpus.bucket_names[mb.bucket]]
        assert batch.bucket == bucket.name and batch.S == bucket.tokens
        assert batch.latents.shape == (mb.B, *bucket.latent_shape(C)) and torch.isfinite(batch.latents).all()
        assert batch.text.shape == (mb.B, TEXT_LEN, D) and batch.keys == [corpus.key(i) for i in mb.ids]
        for j, L in enumerate(batch.L_text):  # real tokens, then zeros
            assert L > 0 and batch.text[j, :L].abs().sum() > 0 and batch.text[j, L:].abs().sum() == 0
    val = Loader(corpus, TEXT_LEN, 0.5, seed=0, rank=0).val_batches()
    assert sum(b.B for b in val) == 2
    # weighted raw sources over shard subsets of one corpus: source s gives round(w_s · N) entries per epoch
    mixed = open_corpus(data_cfg(sources=[{"urls": os.path.join(clean, "shard-0000[01].tar"), "weight": 0.3},
                                          {"urls": os.path.join(clean, "shard-0000[23].tar"), "weight": 0.7}]),
                        TINY, C, D, seed=0)
    from_second = sum(mixed.key(i).startswith("1/") for i in mixed.table.ids)
    assert len(mixed.table) == 22 and from_second == round(0.7 * 22)


@pytest.mark.slow
def test_each_rank_reads_exactly_its_planned_samples_and_workers_change_nothing(clean):
    corpus = open_corpus(data_cfg(index=clean), TINY, C, D, seed=0)
    plan, _ = plan_step(corpus.table, 0, 1, 0, 2, "equal_token", 2, B_SIZES, COST)
    real = corpus.load
    for rank in range(2):
        seen = []
        corpus.load = lambda gid, epoch=0: (seen.append(gid), real(gid, epoch))[1]
        loader = Loader(corpus, TEXT_LEN, 0.5, seed=0, rank=rank, num_workers=2)
        loader.prefetch(plan)  # decoded ahead by the workers
        with_workers = keyed_batches(loader, plan)
        loader.close()
        assert sorted(seen) == sorted(i for mb in plan.ranks[rank] for i in mb.ids)
        corpus.load = real
        inline = keyed_batches(Loader(corpus, TEXT_LEN, 0.5, seed=0, rank=rank), plan)
        for (k1, l1, t1, _), (k2, l2, t2, _) in zip(with_workers, inline):
            assert k1 == k2
            torch.testing.assert_close(l1, l2, rtol=0, atol=1e-5)
            torch.testing.assert_close(t1, t2, rtol=0, atol=1e-5)
    ranks = [set(i for mb in r for i in mb.ids) for r in plan.ranks]
    assert not ranks[0] & ranks[1]


@pytest.mark.slow
def test_mid_epoch_resume_continues_with_the_next_planned_sample(clean):
    def run(corpus, epoch, pos, steps):
        loader, out = Loader(corpus, TEXT_LEN, 0.3, seed=5, rank=0), []
        for _ in range(steps):
            plan, nxt = plan_step(corpus.table, 5, epoch, pos, 1, "equal_token", 2, B_SIZES, COST)
            out.append(((epoch, pos), keyed_batches(loader, plan)))
            epoch, pos = advance(epoch, nxt, corpus.table)
        return out

    straight = run(open_corpus(data_cfg(index=clean), TINY, C, D, seed=5), 0, 0, 4)
    (epoch, pos), expected = straight[2]
    assert 0 < pos < len(straight[0][1]) * 100  # mid-epoch
    resumed = run(open_corpus(data_cfg(index=clean), TINY, C, D, seed=5), epoch, pos, 2)  # a fresh process's view
    for (at_a, a), (at_b, b) in zip(straight[2:], resumed):
        assert at_a == at_b
        for (k1, l1, t1, _), (k2, l2, t2, _) in zip(a, b):
            assert k1 == k2
            torch.testing.assert_close(l1, l2, rtol=0, atol=1e-5)
            torch.testing.assert_close(t1, t2, rtol=0, atol=1e-5)
    seen = [k for _, step in straight for keys, *_ in step for k in keys]
    assert len(seen) == len(set(seen))  # within the epoch no sample comes twice


# -- bad input --------------------------------------------------------------------------------------------------------

def test_each_bad_input_kind_is_skipped_and_counted(bad, caplog):
    with open(os.path.join(bad, "skipped.jsonl")) as f:
        at_index = {json.loads(line)["reason"] for line in f}
    assert at_index == {"corrupt_video", "no_frames", "too_short", "corrupt_image", "missing_caption", "too_small",
                        "extreme_aspect", "corrupt_member", "truncated_shard", "unreadable_shard"}
    assert len(BAD_AT_INDEX) == len(at_index)
    # seed 1 holds out a sample outside the bucket of bad_truncated_mp4 (whose only good training mate seed 0 held
    # out: a replacement never comes from the held-out split)
    corpus = open_corpus(data_cfg(index=bad, val_samples=1), TINY, C, D, seed=1)
    assert dict(corpus.skipped) == {r: 1 for r in at_index}
    keys = {corpus.key(g): g for g in range(len(corpus.bucket_of))}
    assert "ok_before_cut" in keys  # the samples before the cut of a truncated shard survive
    with caplog.at_level(logging.WARNING, logger="data.loader"):
        for name in ("bad_truncated_mp4", "bad_truncated_image"):  # visible only when decoded
            gid = keys[name]
            for epoch in (0, 1):  # met again: replaced, neither counted nor logged again
                got, pixels, caption = corpus.load_checked(gid, epoch)
                assert got != gid and corpus.bucket_of[got] == corpus.bucket_of[gid] and caption
                assert pixels.shape[0] == TINY[corpus.bucket_names[corpus.bucket_of[gid]]].frames
    assert corpus.skipped["decode_error"] == 2
    logged = [r.getMessage() for r in caplog.records if "decode_error" in r.getMessage()]
    assert len(logged) == 2 and any("bad_truncated_mp4" in m for m in logged)
    # a whole epoch through the loader: the plan keeps its shape, the bad ones are replaced
    plan, _ = plan_step(corpus.table, 0, 0, 0, 1, "equal_token", 100, B_SIZES, COST)
    batches = list(Loader(corpus, TEXT_LEN, 0.0, seed=0, rank=0).step(plan))
    assert [b.B for b in batches] == [mb.B for mb in plan.ranks[0]]
    assert not {"bad_truncated_mp4", "bad_truncated_image"} & {k for b in batches for k in b.keys}


def test_nan_latents_and_a_truncated_latent_shard_are_skipped_at_load(bad, tmp_path):
    out = str(tmp_path / "latents")
    res = precompute(data_cfg(index=bad), TINY, C, D, 0, out, samples_per_shard=3)
    assert res["skipped"] == {"decode_error": 2}  # the two that only decoding shows
    index = SampleIndex.load(out)
    assert index.meta["skipped"]["decode_error"] == 2 and index.meta["skipped"]["corrupt_member"] == 1
    rows = [i for i, r in enumerate(index.records)  # victims whose bucket has others to replace them
            if sum(q["bucket"] == r["bucket"] for q in index.records) >= 3]
    last_of_shard = {r["shard"]: i for i, r in enumerate(index.records)}  # records follow shard order
    cut_row = next(i for i in rows if last_of_shard[index.records[i]["shard"]] == i)
    nan_row = next(i for i in rows if index.records[i]["shard"] != index.records[cut_row]["shard"])
    r = index.records[nan_row]
    arr = load_npy(index.read(nan_row, "latent.npy"))
    arr[0, 0, 0, 0] = np.inf
    with open(os.path.join(out, r["shard"]), "r+b") as f:  # Inf into the stored latents, in place
        f.seek(r["members"]["latent.npy"][0])
        f.write(npy_bytes(arr))
    r = index.records[cut_row]
    with open(os.path.join(out, r["shard"]), "r+b") as f:  # the shard is cut inside its last sample, after indexing
        f.truncate(r["members"]["latent.npy"][0] + 10)
    corpus = open_corpus(data_cfg(index=out, val_samples=1), TINY, C, D, seed=0)
    for row in (nan_row, cut_row):
        got, latent, _ = corpus.load_checked(row)
        assert got != row and corpus.bucket_of[got] == corpus.bucket_of[row] and torch.isfinite(latent).all()
    assert corpus.skipped["nonfinite"] == 1 and corpus.skipped["unreadable"] == 1


def test_a_pattern_matching_nothing_or_an_all_bad_corpus_stops_before_training(tmp_path):
    from tests.helpers import run_training, tiny_overrides

    with pytest.raises(ValueError, match="matches no file"):
        open_corpus(data_cfg(urls=str(tmp_path / "none-{000..003}.tar")), TINY, C, D, seed=0)
    root = str(tmp_path / "allbad")
    write_raw_corpus(root, images=0, videos=0, bad=("missing_caption", "tiny_image", "corrupt_mp4",
                                                    "undecodable_image"))
    run_dir = str(tmp_path / "run")
    with pytest.raises(ValueError, match="no usable sample .* every one was skipped"):
        run_training(tiny_overrides(run_dir, str(tmp_path / "cache"), f"data.urls='{root}/shard-*.tar'",
                                    "data.encoders.device=cpu"))
    assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl"))


# -- precomputed == on the fly ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def latents(clean, tmp_path_factory):
    """The clean corpus precomputed on two ranks, rank 1 first, with a killed shard redone on resume."""
    out = str(tmp_path_factory.mktemp("latents"))
    cfg = data_cfg(index=clean)
    first = precompute(cfg, TINY, C, D, 0, out, rank=1, world_size=2, samples_per_shard=4)
    parts = sorted(os.listdir(os.path.join(out, ".precompute_parts")))
    os.remove(os.path.join(out, ".precompute_parts", parts[-1]))  # as if killed before its part was written
    again = precompute(cfg, TINY, C, D, 0, out, rank=1, world_size=2, samples_per_shard=4)
    last = precompute(cfg, TINY, C, D, 0, out, rank=0, world_size=2, samples_per_shard=4, wait_s=5)
    return out, (first, again, last)


@pytest.mark.slow
def test_precomputed_latents_give_the_batches_of_on_the_fly_encoding(clean, latents):
    out, (first, again, last) = latents
    assert first["written"] == 12 and 0 < again["written"] < 12 and last["written"] == 12 and last["index"] == 24
    index = SampleIndex.load(out)
    assert sorted(r["key"] for r in index.records) == sorted(r["key"] for r in SampleIndex.load(clean).records)
    lat_corpus = open_corpus(data_cfg(index=out), TINY, C, D, seed=0)
    raw_corpus = open_corpus(data_cfg(index=clean), TINY, C, D, seed=0)
    assert [lat_corpus.key(i) for i in lat_corpus.table.ids] == [raw_corpus.key(i) for i in raw_corpus.table.ids]
    assert lat_corpus.val_ids == raw_corpus.val_ids
    torch.testing.assert_close(lat_corpus.empty_text, raw_corpus.empty_text)
    plan, _ = plan_step(raw_corpus.table, 0, 0, 0, 1, "equal_token", 6, B_SIZES, COST)
    a = keyed_batches(Loader(lat_corpus, TEXT_LEN, 0.5, seed=0, rank=0), plan)
    b = keyed_batches(Loader(raw_corpus, TEXT_LEN, 0.5, seed=0, rank=0), plan)
    assert {x[3] for x in a} == set(TINY)
    for (k1, l1, t1, _), (k2, l2, t2, _) in zip(a, b):
        assert k1 == k2
        torch.testing.assert_close(l1, l2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(t1, t2, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_training_on_raw_shards_equals_training_on_their_precomputed_latents(clean, latents, tmp_path):
    from tests.helpers import run_training, tiny_overrides
    from training.metrics import read_metrics

    losses = {}
    for name, source in (("raw", f"data.urls='{clean}/shard-*.tar'"), ("latent", f"data.index={latents[0]}")):
        run_dir = str(tmp_path / name)
        run_training(tiny_overrides(run_dir, str(tmp_path / "cache"), source, "train.steps=3", "train.val_every=3",
                                    "data.val_samples=2", "data.encoders.device=cpu", "checkpoint.at_end=false"))
        losses[name] = [(r["step"], r.get("train/loss"), r.get("val/loss")) for r in read_metrics(run_dir)]
    assert len(losses["raw"]) == 4
    for (s1, l1, v1), (s2, l2, v2) in zip(losses["raw"], losses["latent"]):
        assert s1 == s2 and (l1 is None) == (l2 is None) and (v1 is None) == (v2 is None)
        assert l1 is None or l1 == pytest.approx(l2, rel=1e-4)
        assert v1 is None or v1 == pytest.approx(v2, rel=1e-4)


def test_precompute_names_members_safely_and_keeps_twins_of_one_key_apart(tmp_path):
    """Member names are paths another tool wrote: `../../x` must not become a member that climbs out of the folder a
    latent shard is extracted into, and the same key in two raw shards stays two samples."""
    root, out = tmp_path / "raw", str(tmp_path / "latents")
    root.mkdir()
    jpg = lambda seed: encode_jpg(np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8))  # noqa
    from tests.helpers import write_tar

    write_tar(str(root / "a.tar"), [("../../evil", {"jpg": jpg(0), "txt": b"climbs out"}),
                                    ("/abs/olute", {"jpg": jpg(1), "txt": b"absolute"}),
                                    ("twin", {"jpg": jpg(2), "txt": b"twin in a"})])
    write_tar(str(root / "b.tar"), [("twin", {"jpg": jpg(3), "txt": b"twin in b"})])
    index_corpus([str(root / "a.tar"), str(root / "b.tar")], str(root), TINY, RawConfig())
    res = precompute(data_cfg(index=str(root)), TINY, C, D, 0, out, samples_per_shard=8)
    assert res["written"] == 4
    names = []
    for shard in sorted(p for p in os.listdir(out) if p.endswith(".tar")):
        with tarfile.open(os.path.join(out, shard)) as tar:
            names += tar.getnames()
    assert len(names) == len(set(names)) == 4 * 3  # latent, text, json of each sample: none overwritten
    assert all(not n.startswith("/") and ".." not in n.split("/") for n in names), names
    index = SampleIndex.load(out)
    sources = sorted(json.loads(index.read(i, "json"))["source"] for i in range(len(index.records)))
    assert sources == ["a.tar:../../evil", "a.tar:/abs/olute", "a.tar:twin", "b.tar:twin"]
    captions = {json.loads(index.read(i, "json"))["caption"] for i in range(len(index.records))}
    assert captions == {"climbs out", "absolute", "twin in a", "twin in b"}


# -- where a random clip starts, what encodes to NaN, where the empty prompt comes from -------------------------------

def test_a_random_clip_is_placed_by_seed_epoch_and_key_and_a_held_out_one_as_in_epoch_0(clean):
    corpus = open_corpus(data_cfg(urls=os.path.join(clean, "*.tar")), TINY, C, D, seed=0)
    assert corpus.raw.clip == "random"  # the default
    videos = [g for g in range(len(corpus.bucket_of)) if corpus.record(g)["kind"] == "video"]
    torch.manual_seed(1)
    pix = {(g, e): corpus.load(g, e)[0] for g in videos for e in range(3)}
    torch.manual_seed(2)  # torch's global generator places no clip: the same pixels again
    assert all(np.array_equal(corpus.load(g, e)[0], a) for (g, e), a in pix.items())
    moving = [g for g in videos if not np.array_equal(pix[g, 0], pix[g, 1])
              and not np.array_equal(pix[g, 0], pix[g, 2]) and not np.array_equal(pix[g, 1], pix[g, 2])]
    assert len(moving) >= len(videos) // 2  # another epoch, another start (where the video is longer than the clip)
    for g in moving[:3]:
        item = corpus.find_readable(g)  # validation's call: epoch 0
        assert item.gid == g and np.array_equal(item.a, pix[g, 0])
        item = corpus.find_readable(g, 2)
        assert item.gid == g and np.array_equal(item.a, pix[g, 2])


def test_a_raw_sample_that_encodes_to_nan_is_skipped_as_nonfinite_and_goes_in_with_loss_weight_0(clean):
    corpus = open_corpus(data_cfg(urls=os.path.join(clean, "*.tar")), TINY, C, D, seed=0)
    plan, _ = plan_step(corpus.table, 0, 0, 0, 1, "equal_token", 6, B_SIZES, COST)
    encode = corpus.encoders.encode_pixels
    corpus.encoders.encode_pixels = lambda x: encode(x) * float("nan")
    batch = next(iter(Loader(corpus, TEXT_LEN, 0.0, seed=0, rank=0).step(plan)))
    assert corpus.skipped == {"nonfinite": batch.B, "placeholder": batch.B}  # each known bad, each replaced by zeros
    assert batch.loss_weight.tolist() == [0.0] * batch.B and not batch.latents.abs().any()


def test_the_empty_prompt_file_is_checked_only_where_no_raw_source_gives_the_empty_prompt(clean, tmp_path):
    from data.loader import check_corpus
    from data.synthetic import write_synthetic_corpus

    latent = str(tmp_path / "latent")
    write_synthetic_corpus(latent, TINY, {"img_64": 1.0}, num_samples=3, num_val=0, latent_channels=C, text_dim=D)
    os.remove(os.path.join(latent, "empty_text.pt"))
    with pytest.raises(ValueError, match=r"empty_text\.pt is missing"):
        check_corpus(data_cfg(index=latent), C, D)
    for raw in ({"urls": os.path.join(clean, "*.tar")}, {"index": clean}):  # shards, or their raw index
        check_corpus(data_cfg(sources=[raw, {"index": latent}]), C, D)  # the encoders give the empty prompt
        check_corpus(data_cfg(sources=[raw]), C, D)


def test_a_raw_corpus_takes_its_channels_and_text_width_from_the_encoders(clean):
    from data.loader import LatentCorpus

    opened = open_corpus(data_cfg(urls=os.path.join(clean, "*.tar")), TINY, C, D, seed=0)
    corpus = LatentCorpus(opened.indexes, [1.0], TINY, 2, 0, RawConfig(), opened.encoders)
    assert (corpus.latent_channels, corpus.text_dim) == (opened.encoders.vae.latent_channels, D) == (C, D)
    assert corpus.placeholder(0).a.shape == TINY[corpus.bucket_names[corpus.bucket_of[0]]].latent_shape(C)


def test_the_raw_config_given_is_the_one_used_and_the_index_goes_where_data_index_says(clean, tmp_path):
    start = open_corpus(data_cfg(urls=os.path.join(clean, "*.tar"), raw=RawConfig(clip="start")), TINY, C, D, seed=0)
    assert start.raw.clip == "start"
    video = next(g for g in range(len(start.bucket_of)) if start.record(g)["kind"] == "video")
    assert all(np.array_equal(start.load(video, e)[0], start.load(video, 0)[0]) for e in (1, 2, 3))
    elsewhere = str(tmp_path / "index")
    corpus = open_corpus(data_cfg(urls=os.path.join(clean, "shard-00000.tar"), index=elsewhere), TINY, C, D, seed=0)
    assert corpus.indexes[0].root == elsewhere and os.path.isfile(os.path.join(elsewhere, "index.jsonl"))


def test_load_checked_places_a_random_clip_at_the_epoch_it_is_given(clean):
    corpus = open_corpus(data_cfg(urls=os.path.join(clean, "*.tar")), TINY, C, D, seed=0)
    videos = [g for g in range(len(corpus.bucket_of)) if corpus.record(g)["kind"] == "video"]
    moved = [g for g in videos if not np.array_equal(corpus.load(g, 0)[0], corpus.load(g, 2)[0])]
    assert moved
    for g in moved[:2]:
        gid, pixels, caption = corpus.load_checked(g, 2)
        assert gid == g and np.array_equal(pixels, corpus.load(g, 2)[0]) and caption == corpus.load(g, 2)[1]
