"""One bad file must not stop a corpus or a run: every bad sample is skipped and counted by its reason.

Each test writes the bad file itself (into pytest's tmp folders): a PNG that claims 400 M pixels, latents of the wrong
shape, a shard of random bytes, binary captions, a cut index, a missing empty prompt. Latent corpora come from
data/synthetic.py; raw ones are a few tiny jpg/png/mp4 samples written here.
"""
import io
import json
import logging
import os
import struct

import numpy as np
import pytest
import torch

from data.buckets import bucket_table
from data.config import DataConfig
from data.encoders import EncoderConfig
from data.index import SampleIndex, npy_bytes
from data.loader import Loader, open_corpus
from data.raw import RawConfig, index_corpus, select_raw
from data.synthetic import write_synthetic_corpus
from scheduling.planner import plan_step
from data.synthetic_raw import encode_jpg, encode_mp4
from tests.helpers import png_claiming, rewrite_members, write_tar

LAT = bucket_table({"img": {"frames": 1, "height": 32, "width": 32}, "vid": {"frames": 5, "height": 32, "width": 32}})
C, D, P = 3, 8, 6  # latent channels, text width, pooled width of the latent corpora
RAW = bucket_table({"img_64": {"frames": 1, "height": 64, "width": 64},
                    "vid_64_9f": {"frames": 9, "height": 64, "width": 64}})
RC, RD = 4, 32  # the tiny encoders' latent channels and text width
COST = lambda B, S: float(B * S)  # noqa: E731


# -- corpora ----------------------------------------------------------------------------------------------------------

def latent_corpus(root, mix=(0.5, 0.5), num_samples=24, num_val=4, pooled=False) -> SampleIndex:
    write_synthetic_corpus(str(root), LAT, dict(zip(LAT, mix)), num_samples=num_samples, num_val=num_val,
                           latent_channels=C, text_dim=D, seed=1, samples_per_shard=7,
                           pooled_dim=P if pooled else None)
    return SampleIndex.load(str(root))


def open_latent(root, pooled=False, **kw):
    return open_corpus(DataConfig(buckets={}, index=str(root), val_samples=2, **kw), LAT, C, D, seed=0,
                       pooled_dim=P if pooled else None)


def train_rows(index, bucket) -> list[int]:
    return [i for i, r in enumerate(index.records) if r["bucket"] == bucket and r["split"] == "train"]


def clobber(index, row, ext) -> None:
    """Zero a member's bytes in place (offsets stay valid; an .npy so zeroed no longer parses)."""
    off, size = index.records[row]["members"][ext]
    with open(os.path.join(index.root, index.records[row]["shard"]), "r+b") as f:
        f.seek(off)
        f.write(b"\0" * size)


def image(seed=0, h=64, w=64) -> bytes:
    return encode_jpg(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def raw_cfg(**kw) -> DataConfig:
    kw.setdefault("val_samples", 1)
    return DataConfig(buckets={}, encoders=EncoderConfig(device="cpu"), **kw)


# -- 1. decompression bombs and oversized media -----------------------------------------------------------------------

def test_a_png_bomb_is_skipped_as_too_large_at_indexing_without_touching_pils_limit(tmp_path):
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    bomb = png_claiming(20000, 20000)   # 400 M pixels claimed in a few hundred bytes: PIL's open raises on it
    big = png_claiming(9000, 9000, rows=9000)  # a real 81 M-pixel image (under PIL's limit, over the default cap)
    assert len(bomb) < 1000 and len(big) < 200_000
    samples = [(f"ok{i}", {"jpg": image(i), "txt": b"a photo"}) for i in range(3)]
    samples += [("bomb", {"png": bomb, "txt": b"a bomb"}), ("big", {"png": big, "txt": b"a large image"})]
    write_tar(str(tmp_path / "shard-00000.tar"), samples)
    index = index_corpus([str(tmp_path / "shard-00000.tar")], str(tmp_path), RAW, RawConfig())
    with open(tmp_path / "skipped.jsonl") as f:
        skipped = {k["key"]: k["reason"] for k in map(json.loads, f)}
    assert skipped == {"bomb": "too_large", "big": "too_large"}
    _, counts = select_raw(index, RAW, RawConfig())
    assert counts == {"too_large": 2}
    # the cap is a bucket rule: another cap re-buckets from the stored header sizes, without probing again
    kept, counts = select_raw(index, RAW, RawConfig(max_pixels=100_000_000))
    assert counts == {"too_large": 1} and "big" in {r["key"] for r in kept.records}
    assert Image.MAX_IMAGE_PIXELS == limit


def test_an_image_that_grew_past_the_cap_after_indexing_is_too_large_at_load(tmp_path):
    samples = [(f"ok{i}", {"png": png_claiming(64, 64, rows=64), "txt": b"a grey square"}) for i in range(3)]
    write_tar(str(tmp_path / "shard-00000.tar"), samples)
    index_corpus([str(tmp_path / "shard-00000.tar")], str(tmp_path), RAW, RawConfig())
    rewrite_members(str(tmp_path), {("ok1", "png"): png_claiming(20000, 20000)})  # the index still says 64×64
    corpus = open_corpus(raw_cfg(index=str(tmp_path)), RAW, RC, RD, seed=0)
    gid = next(g for g in range(3) if corpus.key(g) == "ok1")
    got, pixels, _ = corpus.load_checked(gid)
    assert got != gid and pixels.shape == (1, 64, 64, 3)
    assert corpus.skipped == {"too_large": 1}


def test_video_frames_over_the_cap_are_too_large_at_indexing_and_at_load():
    from data.decode import TooLarge, decode_video, probe_video
    from data.raw import assign_bucket

    mp4 = encode_mp4((np.full((64, 96, 3), 90, np.uint8) for _ in range(12)), 16, 64, 96)
    info = probe_video(mp4)
    cap = RawConfig(max_pixels=96 * 64 - 1)
    assert assign_bucket("video", info["frames"], info["fps"], 64, 96, RAW, cap) == (None, "too_large")
    assert assign_bucket("video", info["frames"], info["fps"], 64, 96, RAW, RawConfig(max_pixels=96 * 64))[0]
    with pytest.raises(TooLarge, match="max_pixels=6143"):
        decode_video(mp4, 9, 64, 64, 16, max_pixels=cap.max_pixels)
    assert decode_video(mp4, 9, 64, 64, 16, max_pixels=96 * 64).shape == (9, 64, 64, 3)


def test_large_images_are_decoded_small_and_probing_decodes_nothing(monkeypatch):
    from PIL import Image, JpegImagePlugin, PngImagePlugin

    from data.decode import decode_image, probe_image

    # a 1200×800 photo stored sideways (EXIF orientation 6: rotate 90° clockwise to show it); shown upright it is
    # 800 wide and 1200 high, its top half red and its bottom half blue
    upright = np.zeros((1200, 800, 3), np.uint8)
    upright[:600, :, 0] = 255
    upright[600:, :, 2] = 255
    stored = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)  # what orientation 6 turns back
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    stored.save(buf, "JPEG", quality=95, exif=exif)
    drafts = []
    real_draft = JpegImagePlugin.JpegImageFile.draft
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft",
                        lambda self, mode, size: (drafts.append(size), real_draft(self, mode, size))[1])
    assert probe_image(buf.getvalue())["height"] == 1200
    out = decode_image(buf.getvalue(), 64, 32)[0]
    # shown upright, 64 × 43 covers the 64 × 32 bucket; PIL is asked (width, height) of the stored, sideways image
    assert drafts == [(64, 43)]
    assert out.shape == (64, 32, 3)
    assert out[:28, :, 0].min() > 200 and out[36:, :, 2].min() > 200 and out[36:, :, 0].max() < 60
    loads = []
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", lambda self: loads.append(1))
    assert probe_image(png_claiming(4000, 3000, rows=3000))["width"] == 4000
    assert not loads  # the header said it all: no pixel of the PNG was decoded to read its size


# -- 2. latents that do not match their record ------------------------------------------------------------------------

def test_stored_arrays_that_do_not_match_their_record_are_skipped_by_reason(tmp_path):
    index = latent_corpus(tmp_path, pooled=True)
    img, vid = train_rows(index, "img"), train_rows(index, "vid")
    rec = index.records
    lat = lambda row: np.zeros([C, *LAT[rec[row]["bucket"]].latent_shape(C)[1:]], np.float32)  # noqa: E731
    txt = lambda row, width=D: np.zeros((rec[row]["L_text"], width), np.float32)  # noqa: E731
    nan_text = txt(vid[2])
    nan_text[0, 0] = np.nan
    garbage = io.BytesIO()
    np.save(garbage, np.array([{"pickled": True}], dtype=object), allow_pickle=True)
    planted = {  # (row, member): (bytes, the reason it must count as)
        (img[0], "latent.npy"): (npy_bytes(np.zeros([C + 1, 1, 4, 4], np.float32)), "bad_shape"),
        (img[2], "latent.npy"): (npy_bytes(lat(img[2]).astype(np.int32)), "bad_shape"),
        (img[6], "latent.npy"): (npy_bytes(lat(img[6]).astype(np.longdouble)), "bad_shape"),  # a float, not 16/32/64
        (img[4], "text.npy"): (npy_bytes(txt(img[4], D + 1)), "bad_shape"),
        (vid[0], "pooled.npy"): (npy_bytes(np.zeros(P + 1, np.float32)), "bad_shape"),
        (vid[2], "text.npy"): (npy_bytes(nan_text), "nonfinite"),  # finite latents: only a text screen finds it
        (vid[4], "latent.npy"): (b"not an npy file at all", "unreadable"),
        (vid[6], "latent.npy"): (garbage.getvalue(), "unreadable"),  # an object array: never unpickled
    }
    rewrite_members(str(tmp_path), {(rec[row]["key"], ext): data for (row, ext), (data, _) in planted.items()})
    corpus = open_latent(tmp_path, pooled=True)
    for (row, _), (_, reason) in planted.items():
        got, latent, text = corpus.load_checked(row)
        assert got != row, (rec[row]["key"], reason)
        assert latent.shape == LAT[rec[row]["bucket"]].latent_shape(C) and text.shape[1] == D
        assert corpus.bucket_of[got] == corpus.bucket_of[row]
    assert corpus.skipped == {"bad_shape": 5, "nonfinite": 1, "unreadable": 2}
    # a whole epoch through the loader: every batch collates, with pooled text, and no planted sample is in it
    plan, _ = plan_step(corpus.table, 0, 0, 0, 1, "equal_token", 100, [4, 3], COST)
    batches = list(Loader(corpus, 6, 0.3, seed=0, rank=0).step(plan))
    assert [b.B for b in batches] == [mb.B for mb in plan.ranks[0]]
    assert all(b.pooled is not None and b.pooled.shape == (b.B, P) for b in batches)
    assert not {rec[row]["key"] for row, _ in planted} & {k for b in batches for k in b.keys}
    assert corpus.skipped == {"bad_shape": 5, "nonfinite": 1, "unreadable": 2}  # met again: not counted again


@pytest.mark.parametrize("error", [struct.error("unpack requires 8 bytes"), EOFError("ran out"), MemoryError(),
                                   KeyError("latent.npy"), UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")])
def test_any_exception_while_reading_a_sample_is_a_counted_skip(tmp_path, error):
    latent_corpus(tmp_path)
    corpus = open_latent(tmp_path)
    victim = int(corpus.table.ids[0])
    real = corpus.load

    def load(gid, epoch=0):
        if gid == victim:
            raise error
        return real(gid, epoch)

    corpus.load = load
    got, _, _ = corpus.load_checked(victim)
    assert got != victim and corpus.skipped == {"unreadable": 1}  # not a reason read off the exception's attributes


# -- 3. buckets whose samples are all bad -----------------------------------------------------------------------------

def test_a_small_bucket_with_no_readable_sample_is_left_out_of_the_plan(tmp_path, caplog):
    index = latent_corpus(tmp_path, mix=(0.75, 0.25), num_samples=24, num_val=2)
    vid = train_rows(index, "vid")
    assert 1 <= len(vid) <= 8
    for row in vid:
        clobber(index, row, "latent.npy")
    with caplog.at_level(logging.WARNING, logger="data.loader"):
        corpus = open_latent(tmp_path)
    assert corpus.dropped_buckets == ["vid"]
    assert any("bucket vid is left out of the plan" in r.getMessage() for r in caplog.records)
    assert corpus.skipped == {"unreadable": len(vid), "empty_bucket": 1}
    names = {corpus.bucket_names[b] for b in corpus.table.bucket}
    assert names == {"img"} and len(corpus.table) == len(train_rows(index, "img"))
    plan, _ = plan_step(corpus.table, 0, 0, 0, 1, "equal_token", 3, [4, 2], COST)
    assert all(b.bucket == "img" for b in Loader(corpus, 6, 0.0, seed=0, rank=0).step(plan))


def test_a_corpus_whose_buckets_all_prove_unreadable_stops_before_training(tmp_path):
    index = latent_corpus(tmp_path, num_samples=8, num_val=2)
    for row in train_rows(index, "img") + train_rows(index, "vid"):
        clobber(index, row, "text.npy")
    with pytest.raises(ValueError, match=r"no bucket has a readable training sample: \['img', 'vid'\]"):
        open_latent(tmp_path)


def test_a_bucket_that_goes_bad_mid_run_trains_zero_weight_placeholders_on_every_rank_alike(tmp_path):
    index = latent_corpus(tmp_path)
    ranks = [open_latent(tmp_path), open_latent(tmp_path)]  # two processes' views of one plan
    vid = train_rows(index, "vid")
    for row in vid:  # after open: every training sample of the bucket turns unreadable
        clobber(index, row, "latent.npy")
    plan, _ = plan_step(ranks[0].table, 0, 0, 0, 1, "equal_token", 4, [3, 2], COST)
    runs = [list(Loader(corpus, 6, 0.5, seed=0, rank=0).step(plan)) for corpus in ranks]
    n_vid = sum(mb.B for mb in plan.ranks[0] if ranks[0].bucket_names[mb.bucket] == "vid")
    assert n_vid > 0
    for a, b in zip(*runs):
        assert a.keys == b.keys and torch.equal(a.latents, b.latents) and torch.equal(a.loss_weight, b.loss_weight)
        if a.bucket == "vid":
            assert a.latents.shape == (a.B, *LAT["vid"].latent_shape(C)) and not a.latents.any()
            assert not a.loss_weight.any()
        else:
            assert a.loss_weight.all()
    for corpus in ranks:
        assert corpus.skipped == {"unreadable": len(vid), "placeholder": n_vid}


# -- 4. the bad set across a resume -----------------------------------------------------------------------------------

def test_bad_state_round_trips_so_a_resumed_run_neither_recounts_nor_retries(tmp_path):
    index = latent_corpus(tmp_path)
    bad = train_rows(index, "img")[:2] + train_rows(index, "vid")[:1]
    for row in bad[:2]:
        clobber(index, row, "latent.npy")
    clobber(index, bad[2], "text.npy")
    first = open_latent(tmp_path)
    for row in bad:
        first.load_checked(row)
    first.placeholder(bad[0])
    state = json.loads(json.dumps(first.bad_state()))  # what meta.json holds
    assert state["bad"] == sorted([0, index.records[row]["shard"], index.records[row]["key"], "unreadable"]
                                  for row in bad)
    assert state["skipped"] == {"unreadable": 3, "placeholder": 1}

    resumed = open_latent(tmp_path)
    resumed.restore_bad(state)
    assert resumed.skipped == first.skipped
    tried = []
    real = resumed.load
    resumed.load = lambda gid, epoch=0: (tried.append(gid), real(gid, epoch))[1]
    for row in bad:
        got, _, _ = resumed.load_checked(row)
        assert got == first.load_checked(row)[0]  # the same replacement as before the resume
    assert not set(bad) & set(tried) and resumed.skipped == first.skipped
    resumed.restore_bad({"bad": [["no-such-key", "unreadable"], [0, "x.tar", "k", "unreadable"]], "skipped": {}})
    assert resumed.skipped == {"unreadable": 3, "placeholder": 1}  # another corpus' samples: ignored
    older = open_latent(tmp_path)  # a checkpoint written before samples were named by shard: [key, reason]
    older.restore_bad({"bad": [[index.records[row]["key"], "unreadable"] for row in bad], "skipped": {}})
    assert older.skipped == {"unreadable": 3}


def twin_corpus(root, write=latent_corpus):
    """A latent corpus (`write(root)`) whose first shard is also in the folder under another name, with the same keys
    (two corpora made into one folder); one training sample of the original shard is made unreadable.
    (index, bad row, its twin's row)"""
    import shutil

    index = write(root)
    first = index.records[0]["shard"]
    shutil.copy(os.path.join(root, first), os.path.join(root, "twin.tar"))
    rows = [i for i, r in enumerate(index.records) if r["shard"] == first]
    index.records += [{**index.records[i], "shard": "twin.tar"} for i in rows]
    index.save()
    bad = next(i for i in rows if index.records[i]["split"] == "train")
    clobber(index, bad, "latent.npy")
    twin = len(index.records) - len(rows) + rows.index(bad)
    assert index.records[twin]["key"] == index.records[bad]["key"]
    return index, bad, twin


def test_a_bad_sample_and_its_good_twin_of_the_same_key_stay_apart_across_a_resume(tmp_path):
    index, bad, twin = twin_corpus(tmp_path)
    first = open_latent(tmp_path)
    assert first.read_checked(twin).gid == twin and first.read_checked(bad).gid != bad
    state = json.loads(json.dumps(first.bad_state()))
    assert state["bad"] == [[0, index.records[bad]["shard"], index.records[bad]["key"], "unreadable"]]
    resumed = open_latent(tmp_path)
    resumed.restore_bad(state)
    tried = []
    real = resumed.load
    resumed.load = lambda gid, epoch=0: (tried.append(gid), real(gid, epoch))[1]
    assert resumed.read_checked(twin).gid == twin  # the good twin is not banned
    assert resumed.read_checked(bad).gid != bad and bad not in tried  # the bad one is not retried
    assert resumed.skipped == {"unreadable": 1}  # nor counted twice


# -- 5. other silent gaps ---------------------------------------------------------------------------------------------

def test_shards_that_are_not_tars_are_counted_and_named(tmp_path, caplog):
    write_tar(str(tmp_path / "shard-00000.tar"), [(f"ok{i}", {"jpg": image(i), "txt": b"a photo"}) for i in range(2)])
    (tmp_path / "shard-00001.tar").write_bytes(np.random.default_rng(0).bytes(20_000))
    (tmp_path / "shard-00002.tar").write_bytes(b"")
    (tmp_path / "shard-00003.tar").write_bytes(b"\0" * 10_240)  # an empty archive: two end blocks and nothing
    shards = [str(tmp_path / f"shard-0000{i}.tar") for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="data.raw"):
        index = index_corpus(shards, str(tmp_path), RAW, RawConfig())
    assert len(index.records) == 2
    _, counts = select_raw(index, RAW, RawConfig())
    assert counts == {"unreadable_shard": 3}  # counts shards
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(path in logged for path in shards[1:])


def test_a_probe_failure_no_reason_names_skips_the_sample_not_the_corpus(tmp_path, monkeypatch):
    import data.raw

    write_tar(str(tmp_path / "shard-00000.tar"), [(f"ok{i}", {"jpg": image(i), "txt": b"a photo"}) for i in range(3)])
    real = data.raw.probe_image
    monkeypatch.setattr(data.raw, "probe_image", lambda b: real(b) if b != image(1) else {}["no such field"])
    index = index_corpus([str(tmp_path / "shard-00000.tar")], str(tmp_path), RAW, RawConfig())
    assert [r["key"] for r in index.records] == ["ok0", "ok2"]
    with open(tmp_path / "skipped.jsonl") as f:
        assert [(k["key"], k["reason"]) for k in map(json.loads, f)] == [("ok1", "unreadable")]


def test_captions_that_are_not_text_are_skipped_as_unreadable(tmp_path):
    from data.raw import UnreadableCaption, parse_caption

    captions = {  # key: (member, bytes, reason or "" when the sample is kept)
        "plain": ("txt", b"a red square", ""),
        "bom": ("txt", b"\xef\xbb\xbfa cat\ton a mat\n", ""),
        "one_control": ("txt", b"a cat \x0b on a mat of green grass", ""),  # 1 of 32 characters
        "latin1": ("txt", "café crème".encode("latin-1"), "unreadable_caption"),
        "nul": ("txt", b"a cat\x00on a mat", "unreadable_caption"),
        "controls": ("txt", bytes(range(1, 32)) * 2 + b"ab", "unreadable_caption"),
        "json_number": ("json", b'{"caption": 123}', "unreadable_caption"),
        "json_list": ("json", b"[1, 2]", "unreadable_caption"),
        "json_cut": ("json", b'{"caption": "a cat', "unreadable_caption"),
        "json_none": ("json", b'{"fps": 3}', "missing_caption"),
        "json_fps_list": ("json", b'{"caption": "a dog", "fps": [1]}', ""),
    }
    samples = [(k, {"jpg": image(i), ext: data}) for i, (k, (ext, data, _)) in enumerate(captions.items())]
    write_tar(str(tmp_path / "shard-00000.tar"), samples)
    index = index_corpus([str(tmp_path / "shard-00000.tar")], str(tmp_path), RAW, RawConfig())
    with open(tmp_path / "skipped.jsonl") as f:
        skipped = {k["key"]: k["reason"] for k in map(json.loads, f)}
    assert skipped == {k: reason for k, (_, _, reason) in captions.items() if reason}
    assert {r["key"] for r in index.records} == {k for k, (_, _, reason) in captions.items() if not reason}
    assert parse_caption(b"\xef\xbb\xbfa cat\ton a mat\n", "txt")[0] == "a cat\ton a mat"
    with pytest.raises(UnreadableCaption, match="control characters"):
        parse_caption(b"\x01\x02ab", "txt")
    # a caption that turns to binary after indexing is found at load
    rewrite_members(str(tmp_path), {("plain", "txt"): b"\xff\xfe\x00\x01"})
    corpus = open_corpus(raw_cfg(index=str(tmp_path)), RAW, RC, RD, seed=0)
    gid = next(g for g in range(len(corpus.bucket_of)) if corpus.key(g) == "plain")
    got, _, caption = corpus.load_checked(gid)
    assert got != gid and caption
    assert corpus.skipped["unreadable_caption"] == 7 and corpus.skipped["missing_caption"] == 1


def test_a_cut_or_corrupt_index_names_its_file_and_line(tmp_path):
    latent_corpus(tmp_path)
    path = tmp_path / "index.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2]) + lines[2][:30])  # cut inside line 3
    with pytest.raises(ValueError, match=r"index\.jsonl line 3 is not valid JSON .*truncated or corrupt"):
        open_latent(tmp_path)
    path.write_bytes(b"".join(lines[:5]))  # cut at a line break: only the count shows it
    with pytest.raises(ValueError, match="holds 5 records but corpus.json counts 28"):
        open_latent(tmp_path)
    path.write_bytes(b"".join(lines))
    (tmp_path / "corpus.json").write_text('{"format": ')
    with pytest.raises(ValueError, match=r"corpus\.json is not valid JSON"):
        open_latent(tmp_path)


def test_a_corrupt_index_of_raw_shards_is_rebuilt(tmp_path, caplog):
    from data.raw import ensure_raw_index

    write_tar(str(tmp_path / "shard-00000.tar"), [(f"ok{i}", {"jpg": image(i), "txt": b"a photo"}) for i in range(3)])
    shards = [str(tmp_path / "shard-00000.tar")]
    ensure_raw_index(shards, str(tmp_path), RAW, RawConfig())
    path = tmp_path / "index.jsonl"
    path.write_bytes(path.read_bytes()[:-40])
    with caplog.at_level(logging.WARNING, logger="data.raw"):
        index = ensure_raw_index(shards, str(tmp_path), RAW, RawConfig())
    assert any("re-indexing" in r.getMessage() and "index.jsonl line 3" in r.getMessage() for r in caplog.records)
    assert len(index.records) == 3 and len(SampleIndex.load(str(tmp_path)).records) == 3


class Tripwire:
    """Unpickling this runs code: a loader that unpickles data files would set `fired`."""
    fired = False

    def __reduce__(self):
        return (setattr, (Tripwire, "fired", True))


def test_the_empty_prompt_is_checked_before_anything_heavy(tmp_path):
    from data.loader import check_corpus

    latent_corpus(tmp_path)
    cfg = DataConfig(buckets={}, index=str(tmp_path))
    check_corpus(cfg, C, D)
    empty = tmp_path / "empty_text.pt"
    good = empty.read_bytes()
    os.remove(empty)
    with pytest.raises(ValueError, match=r"empty_text\.pt is missing.*scripts/precompute_latents\.py"):
        check_corpus(cfg)
    with pytest.raises(ValueError, match=r"empty_text\.pt is missing"):
        open_latent(tmp_path)
    for bad, match in ((torch.zeros(1, D + 1), f"width {D}"), (torch.full((1, D), float("nan")), "NaN"),
                       (torch.zeros(1, D, dtype=torch.int64), "expected a float tensor"),
                       ({"not": "a tensor"}, "holds dict"), (Tripwire(), "cannot be read as a tensor")):
        torch.save(bad, empty)
        with pytest.raises(ValueError, match=match):
            check_corpus(cfg, C, D)
    assert not Tripwire.fired
    empty.write_bytes(good)
    with pytest.raises(ValueError, match="in_channels=4"):  # the model's shape, when given, is checked too
        check_corpus(cfg, 4, D)


def test_source_weights_are_normalised(tmp_path):
    latent_corpus(tmp_path / "a")
    latent_corpus(tmp_path / "b", mix=(1.0, 0.0), num_samples=6, num_val=0)
    tables = []
    for w in ((1, 3), (0.25, 0.75)):
        cfg = DataConfig(buckets={}, val_samples=2, sources=[{"index": str(tmp_path / "a"), "weight": w[0]},
                                                             {"index": str(tmp_path / "b"), "weight": w[1]}])
        tables.append(open_corpus(cfg, LAT, C, D, seed=0).table)
    assert len(tables[0]) == round(0.25 * 30) + round(0.75 * 30)
    np.testing.assert_array_equal(tables[0].ids, tables[1].ids)


# -- 7. loading encoder folders ---------------------------------------------------------------------------------------

def test_an_encoder_folder_without_safetensors_is_refused_unread(tmp_path):
    from data.encoders import build_umt5, build_vae

    for name in ("vae", "text_encoder"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        torch.save(Tripwire(), tmp_path / name / "pytorch_model.bin")
    cfg = EncoderConfig(vae=str(tmp_path), text_encoder=str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match=r"data\.encoders\.vae=.* holds no \.safetensors weights"):
        build_vae(cfg, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"data\.encoders\.text_encoder=.* holds no \.safetensors weights"):
        build_umt5(cfg, 32, torch.device("cpu"))
    assert not Tripwire.fired


def test_merged_bad_states_are_a_union_and_count_placeholders_once_per_rank():
    from data.loader import merge_bad_states

    a = {"skipped": {"corrupt_image": 1, "placeholder": 2},
         "bad": [[0, "a.tar", "k1", "corrupt_image"], [0, "a.tar", "k2", "bad_shape"]]}
    b = {"skipped": {"bad_shape": 1, "placeholder": 1},
         "bad": [[0, "a.tar", "k2", "bad_shape"], [0, "b.tar", "k2", "nonfinite"]]}  # k2 of another shard: another
    merged = merge_bad_states([a, b])
    assert merged["bad"] == [[0, "a.tar", "k1", "corrupt_image"], [0, "a.tar", "k2", "bad_shape"],
                             [0, "b.tar", "k2", "nonfinite"]]
    assert merged["skipped"] == {"placeholder": 3}
    assert merge_bad_states([{}, {}]) == {"skipped": {}, "bad": []}


# -- 8. links and special files among the inputs ----------------------------------------------------------------------

SECRET = b"aws_secret_access_key=AKIAEXAMPLESECRET"


def test_shards_that_link_out_of_their_folder_or_are_not_files_are_skipped_unread(tmp_path, caplog):
    import signal

    from data.index import InputRefused
    from data.raw import expand_urls

    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    corpus.mkdir()
    elsewhere.mkdir()
    write_tar(str(corpus / "shard-00000.tar"), [(f"ok{i}", {"jpg": image(i), "txt": b"a photo"}) for i in range(2)])
    write_tar(str(elsewhere / "private.tar"), [("secret", {"jpg": image(5), "txt": SECRET})])
    os.symlink(elsewhere / "private.tar", corpus / "shard-00001.tar")  # link_outside: a tar, but not this folder's
    os.symlink("/dev/zero", corpus / "shard-00002.tar")                 # link_outside: reading it never ends
    os.mkfifo(corpus / "shard-00003.tar")                               # not_regular: opening it blocks
    shards = expand_urls(str(corpus / "shard-*.tar"))
    assert len(shards) == 4
    victim = elsewhere / "victim.txt"  # links planted where the indexer writes: replaced, never written through
    victim.write_text("keep me")
    for name in ("skipped.jsonl", "corpus.json", "index.jsonl.tmp"):
        os.symlink(victim, corpus / name)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("indexing hung on a device or fifo shard"))
    signal.alarm(60)
    try:
        with caplog.at_level(logging.WARNING, logger="data.raw"):
            index = index_corpus(shards, str(corpus), RAW, RawConfig())
    finally:
        signal.alarm(0)
    assert [r["key"] for r in index.records] == ["ok0", "ok1"]
    assert victim.read_text() == "keep me" and not any(os.path.islink(corpus / n) for n in ("skipped.jsonl",
                                                                                           "corpus.json"))
    _, counts = select_raw(index, RAW, RawConfig())
    assert counts == {"link_outside": 2, "not_regular": 1}  # counts shards
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(os.path.basename(p) in logged for p in shards[1:])
    for name in os.listdir(corpus):  # the target's bytes are in no file the indexer wrote, nor in its log
        if os.path.isfile(corpus / name) and not name.startswith("shard-"):
            assert b"AKIAEXAMPLE" not in (corpus / name).read_bytes(), name
    assert "AKIAEXAMPLE" not in logged
    # a shard swapped for a link out of its folder after indexing is refused at load, unread (a counted skip)
    os.replace(corpus / "shard-00000.tar", elsewhere / "moved.tar")
    os.symlink(elsewhere / "moved.tar", corpus / "shard-00000.tar")
    from concurrent.futures import ThreadPoolExecutor

    from data.loader import skip_reason

    with ThreadPoolExecutor(1) as pool, pytest.raises(InputRefused, match="leads out of") as refused:  # fresh fds
        pool.submit(index.read, 0, "txt").result()
    assert skip_reason(refused.value) == "link_outside"  # what training and precompute count it as


def test_a_key_that_comes_back_inside_one_tar_is_counted_not_merged(tmp_path):
    write_tar(str(tmp_path / "shard-00000.tar"), [
        ("a", {"jpg": image(0), "txt": b"the first a"}),
        ("b", {"jpg": image(1), "txt": b"b"}),
        ("a", {"jpg": image(2), "txt": b"a second sample with a's key"}),  # after another key
        ("c", {"jpg": image(3), "txt": b"c"}),
        ("c", {"jpg": image(4), "txt": b"c again, right after"}),           # the same extensions twice in a row
    ])
    index = index_corpus([str(tmp_path / "shard-00000.tar")], str(tmp_path), RAW, RawConfig())
    assert [r["key"] for r in index.records] == ["a", "b", "c"]
    from data.raw import read_caption
    assert read_caption(index, 0) == "the first a" and read_caption(index, 2) == "c"
    _, counts = select_raw(index, RAW, RawConfig())
    assert counts == {"duplicate_key": 2}


def test_a_resume_on_a_corpus_with_twin_keys_trains_as_the_uninterrupted_run(tmp_path):
    import shutil

    from tests.helpers import compose_config, run_training, tiny_overrides
    from training.metrics import read_metrics

    cfg = compose_config([])
    index, bad, twin = twin_corpus(tmp_path / "corpus", lambda root: write_synthetic_corpus(
        str(root), bucket_table(cfg.data.buckets), {n: 1.0 for n in cfg.data.buckets}, num_samples=32, num_val=4,
        latent_channels=cfg.model.in_channels, text_dim=cfg.model.text_dim, seed=1, samples_per_shard=8))
    common = ("train.steps=16", "train.val_every=8", "checkpoint.every=8", f"data.index={index.root}")
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    run_training(tiny_overrides(straight, str(tmp_path / "cache"), *common))
    os.makedirs(resumed)
    shutil.copytree(os.path.join(straight, "step_8"), os.path.join(resumed, "step_8"))
    with open(os.path.join(resumed, "step_8", "meta.json")) as f:
        assert json.load(f)["data"]["bad"] == [[0, index.records[bad]["shard"], index.records[bad]["key"],
                                                "unreadable"]]  # found before the checkpoint
    run_training(tiny_overrides(resumed, str(tmp_path / "cache"), *common, "resume=auto"))
    a = {r["step"]: r for r in read_metrics(straight)}
    b = {r["step"]: r for r in read_metrics(resumed)}
    assert min(b) == 9
    for step in range(9, 17):
        assert a[step]["train/loss"] == b[step]["train/loss"], step
    assert a[16]["data/skipped_unreadable"] == b[16]["data/skipped_unreadable"] == 1
    assert a[16]["val/loss"] == b[16]["val/loss"]


# -- 9. validation that cannot lie ------------------------------------------------------------------------------------

def test_a_held_out_bucket_with_no_readable_sample_is_counted_and_none_at_all_logs_no_val_loss(tmp_path, caplog):
    from tests.helpers import compose_config, run_training, tiny_overrides
    from training.metrics import read_metrics

    index = latent_corpus(tmp_path / "small")
    val = [i for i, r in enumerate(index.records) if r["split"] == "val"]
    img = [i for i in val if index.records[i]["bucket"] == "img"]
    assert img and len(img) < len(val)
    for row in img:
        clobber(index, row, "latent.npy")
    corpus = open_corpus(DataConfig(buckets={}, index=str(tmp_path / "small"), val_samples=len(val)), LAT, C, D,
                         seed=0)
    batches = Loader(corpus, 6, 0.0, seed=0, rank=0).val_batches()
    assert [b.bucket for b in batches] == ["vid"]
    assert corpus.skipped == {"unreadable": len(img), "empty_val_bucket": 1}  # no placeholder: nothing is trained

    cfg = compose_config([])
    root = tmp_path / "corpus"
    index = write_synthetic_corpus(str(root), bucket_table(cfg.data.buckets), {n: 1.0 for n in cfg.data.buckets},
                                   num_samples=24, num_val=4, latent_channels=cfg.model.in_channels,
                                   text_dim=cfg.model.text_dim, seed=1, samples_per_shard=8)
    for row, r in enumerate(index.records):
        if r["split"] == "val":
            clobber(index, row, "latent.npy")
    run_dir = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="data.loader"):
        run_training(tiny_overrides(run_dir, str(tmp_path / "cache"), "train.steps=4", "train.val_every=2",
                                    f"data.index={root}"))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    assert not any("val/loss" in r for r in rows)  # never a 0.0 that reads as a perfect model
    n_buckets = len({r["bucket"] for r in index.records if r["split"] == "val"})
    assert rows[-1]["data/skipped_empty_val_bucket"] == n_buckets and rows[-1]["data/skipped_unreadable"] == 4
    assert any("val/loss is not logged" in r.getMessage() for r in caplog.records)


# -- 10. the corpus is part of the resume contract --------------------------------------------------------------------

def test_the_corpus_hash_follows_the_records_not_the_folder(tmp_path):
    import shutil

    latent_corpus(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    a, b = open_latent(tmp_path / "a"), open_latent(tmp_path / "b")
    assert a.content_hash == b.content_hash and a.bad_state()["corpus"] == a.content_hash
    twin_corpus(tmp_path / "b", lambda root: SampleIndex.load(str(root)))  # a shard added to the folder
    assert open_latent(tmp_path / "b").content_hash != a.content_hash


def test_a_resume_on_a_grown_index_is_refused_unless_forced_then_starts_a_new_epoch(tmp_path, caplog):
    from tests.helpers import compose_config, run_training, tiny_overrides
    from training.metrics import read_metrics

    cfg = compose_config([])
    root = tmp_path / "corpus"
    write_synthetic_corpus(str(root), bucket_table(cfg.data.buckets), {n: 1.0 for n in cfg.data.buckets},
                           num_samples=24, num_val=4, latent_channels=cfg.model.in_channels,
                           text_dim=cfg.model.text_dim, seed=1, samples_per_shard=8)
    run_dir, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    common = ("train.val_every=100", "checkpoint.every=3", f"data.index={root}")
    run_training(tiny_overrides(run_dir, cache, "train.steps=3", *common))
    with open(os.path.join(run_dir, "step_3", "meta.json")) as f:
        saved = json.load(f)
    twin_corpus(root, lambda r: SampleIndex.load(str(r)))  # more shards in the same folder, the same config
    with pytest.raises(ValueError, match="resume refused: the checkpoint was trained on a corpus whose index"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=5", *common, "resume=auto"))
    assert max(r["step"] for r in read_metrics(run_dir)) == 3  # nothing trained on the other corpus
    with caplog.at_level(logging.WARNING, logger="data.loader"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=6", *common, "resume=auto", "resume_force=true"))
    assert any("starting a new epoch" in r.getMessage() for r in caplog.records)
    rows = {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}
    assert rows[4]["epoch"] == saved["epoch"] + 1
    with open(os.path.join(run_dir, "step_6", "meta.json")) as f:  # later checkpoints name the corpus they read
        assert json.load(f)["data"]["corpus"] == open_corpus(
            DataConfig(buckets={}, index=str(root)), bucket_table(cfg.data.buckets), cfg.model.in_channels,
            cfg.model.text_dim, seed=0).content_hash != saved["data"]["corpus"]


@pytest.mark.serial  # asserts the skipped read's wall time
def test_a_huge_caption_is_skipped_unread_at_indexing_and_at_load(tmp_path):
    import time

    from data.raw import MAX_CAPTION_BYTES

    big = b"a long caption " * (2 * MAX_CAPTION_BYTES // 15)
    samples = [(f"ok{i}", {"jpg": image(i), "txt": b"a photo"}) for i in range(3)]
    write_tar(str(tmp_path / "shard-00000.tar"), samples + [("huge", {"jpg": image(9), "txt": big})])
    index = index_corpus([str(tmp_path / "shard-00000.tar")], str(tmp_path), RAW, RawConfig())
    assert [r["key"] for r in index.records] == ["ok0", "ok1", "ok2"]
    assert select_raw(index, RAW, RawConfig())[1] == {"caption_too_large": 1}
    rewrite_members(str(tmp_path), {("ok1", "txt"): big})  # a caption that grew after indexing
    corpus = open_corpus(raw_cfg(index=str(tmp_path)), RAW, RC, RD, seed=0)
    gid = next(g for g in range(len(corpus.bucket_of)) if corpus.key(g) == "ok1")
    t0 = time.perf_counter()
    item = corpus.read_checked(gid)
    assert time.perf_counter() - t0 < 0.5 and item.gid != gid and item.b == "a photo"
    assert corpus.skipped["caption_too_large"] == 2  # one at indexing, one at load


def test_validation_keeps_every_caption_and_each_batch_its_buckets_s_and_a_served_step_is_let_go(tmp_path):
    """caption_dropout=1 drops every training caption but no held-out one; a val batch carries its bucket's token
    count; the reads a step prefetched are dropped once the step is served (none kept for the next)."""
    from data.batch import pad_text

    latent_corpus(tmp_path)
    corpus = open_latent(tmp_path)
    loader = Loader(corpus, 6, 1.0, seed=0, rank=0)
    empty = pad_text(corpus.empty_text, 6)[0]
    val = loader.val_batches()
    assert val and all(not torch.equal(t, empty) for b in val for t in b.text)
    assert all(b.S == LAT[b.bucket].tokens for b in val)
    plan, _ = plan_step(corpus.table, 0, 0, 0, 1, "equal_token", 100, [4, 3], COST)
    batches = list(loader.step(plan))
    assert batches and all(torch.equal(t, empty) for b in batches for t in b.text)
    assert loader._ahead == {}
