"""Direct checks of data/ units that the corpus-level tests reach only in passing: config ranges, bucket patches,
the index reader, video probing and stream durations, images resized to cover, the pixel range and its dtype, the
encoders' normalisation, seeding and dtype, mp4 files read back pixel by pixel, where a clip starts, raw indexes reused
only while valid, and ranks other than 0 waiting for rank 0's index.

Each test pins one rule a plausible slip would break (a boundary, a sign, a seed, a missing folder); all run on the
CPU in well under a second each, with media written here.
"""
import io
import json
import os

import numpy as np
import pytest
import torch

from data.buckets import Bucket, bucket_table
from data.config import DataConfig, SyntheticConfig
from data.decode import decode_video, probe_video
from data.encoders import EncoderConfig, build_llama_clip, build_umt5, build_vae
from data.index import CorruptIndex, read_jsonl, scan_tar
from data.raw import UnreadableCaption, expand_urls, parse_caption
from data.video_io import read_mp4, to_uint8, write_mp4
from tests.helpers import write_tar

CPU = torch.device("cpu")


# -- config ranges and bucket patches ---------------------------------------------------------------------------------

def test_synthetic_config_takes_one_sample_and_refuses_none():
    assert SyntheticConfig(num_samples=1).num_samples == 1
    with pytest.raises(ValueError, match="num_samples must be ≥ 1"):
        SyntheticConfig(num_samples=0)


@pytest.mark.parametrize("weight", [0, 0.0, -1, -0.5])
def test_a_source_weight_must_be_positive(weight):
    assert DataConfig(sources=[{"index": "a", "weight": 0.5}]).sources[0]["weight"] == 0.5
    with pytest.raises(ValueError, match=r"data\.sources\[0\]\.weight must be a finite number > 0"):
        DataConfig(sources=[{"index": "a", "weight": weight}])


@pytest.mark.parametrize("patch", [(1, 2), (1, 2, 2, 1), (1, 0, 2), (1, 2, -2), (1, 2.0, 2), (True, 2, 2)])
def test_a_patch_that_is_not_three_positive_integers_is_refused_by_name(patch):
    with pytest.raises(ValueError, match=r"model\.patch_size must be three positive integers"):
        Bucket("b", 1, 64, 64, patch=patch)


def test_patch_grid_and_tokens_are_integers():
    b = bucket_table({"v": {"frames": 9, "height": 64, "width": 96}}, patch=(1, 2, 2))["v"]
    assert b.patch_grid == (3, 4, 6) and b.tokens == 72
    assert all(type(n) is int for n in (*b.patch_grid, b.tokens))  # S sizes tensors and batch sizes: never 72.0


# -- the index reader -------------------------------------------------------------------------------------------------

def test_an_index_line_missing_a_field_is_refused_naming_its_line(tmp_path):
    path = tmp_path / "index.jsonl"
    good = {"key": "a", "shard": "s.tar", "members": {}, "kind": "latent", "bucket": "img"}
    path.write_text(json.dumps(good) + "\n" + json.dumps({k: v for k, v in good.items() if k != "bucket"}) + "\n")
    with pytest.raises(CorruptIndex, match=r"line 2 is not a record with fields"):
        read_jsonl(str(path), tuple(good))
    path.write_text(json.dumps(good) + "\n\n" + json.dumps([1, 2]) + "\n")
    with pytest.raises(CorruptIndex, match=r"line 3 is not a record"):
        read_jsonl(str(path), tuple(good))
    path.write_text(json.dumps(good) + "\n")
    assert read_jsonl(str(path), tuple(good)) == [good]


def test_a_shard_cut_after_a_members_data_marks_its_last_sample_truncated(tmp_path):
    """The cut falls in the padding after c.jpg's bytes: that member is whole, but the shard ends before the next
    header, so c (whose txt is gone) is the truncated sample."""
    path = tmp_path / "shard.tar"
    write_tar(str(path), [(k, {"jpg": b"x" * 700, "txt": b"a cat"}) for k in ("a", "b", "c")])
    data = path.read_bytes()
    c_jpg = scan_tar(str(path)).members["c"]["jpg"]
    assert c_jpg[1] == 700
    path.write_bytes(data[:c_jpg[0] + 700 + 68])  # 68 of the 324 padding bytes after c.jpg's data
    scan = scan_tar(str(path))
    assert scan.error is None and scan.broken == {"c": "truncated_shard"}
    assert scan.members["a"] == {"jpg": (512, 700), "txt": (2048, 5)} and set(scan.members["b"]) == {"jpg", "txt"}


# -- shard patterns and captions --------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", ["", 5, None, ["a.tar"]])
def test_a_shard_pattern_that_is_not_a_non_empty_string_is_refused_by_name(tmp_path, pattern):
    with pytest.raises(ValueError, match=r"data\.sources\[0\]\.urls entries must be non-empty strings"):
        expand_urls([pattern], "data.sources[0].urls")


def test_a_caption_is_binary_past_one_control_character_in_ten():
    def caption(n_ctrl):  # 20 characters, n_ctrl of them control characters inside the text
        return ("a" * 9 + "\x0b" * n_ctrl + "a" * (11 - n_ctrl)).encode()

    assert parse_caption(caption(2), "txt")[0] == caption(2).decode()  # 2 of 20: text
    for n_ctrl in (3, 4):  # 3 and 4 of 20: binary bytes that happen to decode
        with pytest.raises(UnreadableCaption, match=f"{n_ctrl} of the caption's 20 characters"):
            parse_caption(caption(n_ctrl), "txt")


# -- video probing ----------------------------------------------------------------------------------------------------

def _mkv(frames: int, fps: int = 16, h: int = 48, w: int = 64) -> bytes:
    """A Matroska clip: its stream has no duration and no frame count, only the container's duration."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            for p in s.encode(av.VideoFrame.from_ndarray(np.full((h, w, 3), 10 * i, np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def test_a_matroska_clip_without_a_frame_count_is_counted_from_the_containers_duration():
    info = probe_video(_mkv(20))
    assert info["fps"] == 16.0 and (info["height"], info["width"]) == (48, 64)
    assert 1.2 <= info["duration"] <= 1.3  # 20 frames at 16 fps (+ the last frame's length)
    assert info["frames"] == 20  # floor(duration · fps): none without the container's duration
    assert decode_video(_mkv(20), 9, 32, 32, 16.0).shape == (9, 32, 32, 3)


def _growing_mkv() -> bytes:
    """8 frames of 64×48, then 8 of 192×144 in the same H.264 stream (new in-band headers): the container's header
    says 64×48, the later frames hold 9× its pixels."""
    import fractions

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as c:
        s = c.add_stream("libx264", rate=16)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.options = {"x264-params": "repeat-headers=1"}
        for _ in range(8):
            for p in s.encode(av.VideoFrame.from_ndarray(np.full((48, 64, 3), 100, np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
        big = av.CodecContext.create("libx264", "w")
        big.width, big.height, big.pix_fmt = 192, 144, "yuv420p"
        big.time_base, big.framerate = s.codec_context.time_base, fractions.Fraction(16)
        big.options, big.flags = {"x264-params": "repeat-headers=1"}, s.codec_context.flags
        for i in range(9):
            frame = av.VideoFrame.from_ndarray(np.full((144, 192, 3), 200, np.uint8), format="rgb24") if i < 8 else None
            if frame is not None:
                frame.pts, frame.time_base = 8 + i, big.time_base
            for p in big.encode(frame):
                p.stream = s
                c.mux(p)
    return buf.getvalue()


def test_frames_that_outgrow_the_header_are_capped_by_max_pixels_not_by_the_headers_size():
    """FFmpeg's own guard is set from max_pixels (with 2× slack for its row padding), so frames larger than the
    header said but under the cap still decode; far past the cap, decoding stops."""
    from data.decode import DecodeError

    data = _growing_mkv()
    assert (probe_video(data)["width"], probe_video(data)["height"]) == (64, 48)
    clip = decode_video(data, 16, 32, 32, 16.0, max_pixels=30_000)  # 192·144 = 27 648 ≤ 30 000
    assert clip.shape == (16, 32, 32, 3)
    assert abs(int(clip[0].mean()) - 100) <= 3 and abs(int(clip[-1].mean()) - 200) <= 3
    with pytest.raises(DecodeError, match="decoding failed after"):
        decode_video(data, 16, 32, 32, 16.0, max_pixels=6_144)  # the header's 3 072 pixels pass; 27 648 > 2 · 6 144


# -- encoders ---------------------------------------------------------------------------------------------------------

def test_vae_latents_are_the_posterior_mode_normalised_by_the_vaes_own_statistics():
    vae = build_vae(EncoderConfig(device="cpu"), 4, CPU)
    x = torch.rand(2, 3, 1, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    z = vae.encode(x)
    mean = torch.tensor(vae.model.config.latents_mean).view(1, 4, 1, 1, 1)
    std = torch.tensor(vae.model.config.latents_std).view(1, 4, 1, 1, 1)
    assert not torch.allclose(std, torch.ones_like(std), atol=0.1)  # else a slip in the division would not show
    with torch.no_grad():
        mode = vae.model.encode(x).latent_dist.mode()
    torch.testing.assert_close(z, (mode - mean) / std)
    assert z.shape == (2, 4, 1, 2, 2)


def test_tiny_encoders_are_seeded_so_two_processes_build_the_same_ones():
    """The precompute script and a training run build the tiny encoders apart: equal seeds, equal weights."""
    def weights(model):
        return [p.detach().clone() for p in model.parameters()]

    cfg, other = EncoderConfig(device="cpu", text="llama_clip", pooled_dim=8), EncoderConfig(
        device="cpu", text="llama_clip", pooled_dim=8, seed=1)
    torch.manual_seed(123)  # whatever the global RNG holds, the builds are the same
    a = build_llama_clip(cfg, 16, CPU)
    torch.manual_seed(456)
    b = build_llama_clip(cfg, 16, CPU)
    c = build_llama_clip(other, 16, CPU)
    for m in ("llama", "clip"):
        wa, wb, wc = weights(getattr(a, m)), weights(getattr(b, m)), weights(getattr(c, m))
        assert all(torch.equal(x, y) for x, y in zip(wa, wb)), m
        assert not all(torch.equal(x, y) for x, y in zip(wa, wc)), m  # the seed is the config's, not a constant
    out_a, out_b = a.encode(["a red ball"]), b.encode(["a red ball"])
    assert torch.equal(out_a.embeds, out_b.embeds) and torch.equal(out_a.pooled, out_b.pooled)
    for build, dim in ((build_vae, 4), (build_umt5, 16)):
        torch.manual_seed(1)
        x = weights(getattr(build(EncoderConfig(device="cpu"), dim, CPU), "model"))
        torch.manual_seed(2)
        y = weights(getattr(build(EncoderConfig(device="cpu"), dim, CPU), "model"))
        assert all(torch.equal(p, q) for p, q in zip(x, y)), build.__name__


@pytest.mark.parametrize("skip", [0, 2])
def test_llama_text_is_the_hidden_state_skip_layers_before_the_last(skip):
    """HunyuanVideo takes LLaMA's hidden state `llama_skip_layers` before the last (2), not the last layer's."""
    enc = build_llama_clip(EncoderConfig(device="cpu", text="llama_clip", pooled_dim=8, llama_skip_layers=skip), 16,
                           CPU)
    assert enc.llama.config.num_hidden_layers == max(skip + 1, 2)
    captions = ["a red ball", "two blue squares drifting left"]
    out = enc.encode(captions)
    tok = enc.llama_tok(captions, padding="longest", return_tensors="pt")
    with torch.no_grad():
        hidden = enc.llama(tok.input_ids, attention_mask=tok.attention_mask, output_hidden_states=True).hidden_states
    assert torch.equal(out.mask, tok.attention_mask.bool())
    torch.testing.assert_close(out.embeds, hidden[-(skip + 1)])
    for other in range(1, len(hidden) + 1):
        if other != skip + 1:
            assert not torch.allclose(out.embeds, hidden[-other]), other


# -- mp4 files --------------------------------------------------------------------------------------------------------

def test_to_uint8_maps_minus_one_to_zero_and_one_to_255():
    x = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0]).view(1, 1, 1, 7).expand(3, 1, 1, 7)
    u8 = to_uint8(x)
    assert u8.shape == (1, 1, 7, 3) and u8.dtype == np.uint8
    assert u8[0, 0, :, 0].tolist() == [0, 0, 64, 128, 191, 255, 255]  # round((x + 1) · 127.5), clipped
    with pytest.raises(ValueError, match=r"\[3, F, H, W\]"):
        to_uint8(torch.zeros(4, 1, 2, 2))


@pytest.mark.parametrize("h, w", [(32, 48), (33, 48), (32, 45), (35, 45)])  # odd multiples of 3 too
def test_an_mp4_reads_back_its_pixels_in_a_new_folder_with_odd_sides_padded(tmp_path, h, w):
    levels = [-1.0, -0.5, 0.0, 0.5, 1.0]  # one grey level per frame: u8 0, 64, 128, 191, 255
    x = torch.stack([torch.full((3, h, w), v) for v in levels], dim=1)  # [3, F, H, W]
    path = str(tmp_path / "new" / "sub" / "clip.mp4")
    assert write_mp4(path, x, fps=8, crf=0) == path
    frames, fps = read_mp4(path)
    assert fps == 8.0 and frames.shape == (5, h + h % 2, w + w % 2, 3)
    means = frames.reshape(5, -1).astype(np.float64).mean(1)
    np.testing.assert_allclose(means, [0, 64, 128, 191, 255], atol=3)


# -- config edges, clip placement, pixel ranges (survivors of an earlier mutation pass) ------------------------------

@pytest.mark.parametrize("p", [0.0, 1.0])
def test_caption_dropout_takes_both_ends_of_zero_to_one(p):
    assert DataConfig(caption_dropout=p).caption_dropout == p  # 1.0: every caption dropped (unconditional training)
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError, match=r"data\.caption_dropout must lie in \[0, 1\]"):
            DataConfig(caption_dropout=bad)


@pytest.mark.parametrize("source", [["a"], {"weight": 1.0}, {"index": "a", "wieght": 1.0},
                                    {"urls": "s-{0..1}.tar", "index": "a", "shards": 2}])
def test_a_source_that_is_not_a_dict_lacks_index_and_urls_or_has_an_unknown_key_is_refused(source):
    """Each of the three faults alone is enough: a misspelt key must not pass because the rest looks right."""
    good = [{"index": "a", "weight": 1.0}, {"urls": "s-{0..1}.tar"}, {"urls": "s.tar", "index": "b", "weight": 2}]
    assert DataConfig(sources=good).sources == good
    with pytest.raises(ValueError, match=r"data\.sources\[1\] must be"):
        DataConfig(sources=[good[0], source])


def test_clip_start_is_the_fraction_of_the_free_room_each_mode_names():
    from data.raw import RawConfig, clip_start

    assert clip_start(RawConfig(clip="centre"), 0.9) == 0.5
    assert clip_start(RawConfig(clip="start"), 0.9) == 0.0
    assert clip_start(RawConfig(clip="random"), 0.25) == 0.25


def test_to_model_range_maps_0_and_255_to_minus_one_and_one_in_the_dtype_asked():
    from data.decode import to_model_range

    u8 = np.array([0, 51, 255], np.uint8).reshape(1, 1, 1, 3).repeat(2, axis=2)  # [F=1, H=1, W=2, 3]
    x = to_model_range(u8)
    assert x.shape == (3, 1, 1, 2) and x.dtype == torch.float32
    torch.testing.assert_close(x[:, 0, 0, 0], torch.tensor([-1.0, 51 / 127.5 - 1, 1.0]))
    for dtype in (torch.bfloat16, torch.float16):
        y = to_model_range(u8, dtype=dtype)
        assert y.dtype == dtype
        assert y[0].min().item() == -1.0 and y[2].max().item() == 1.0


def test_an_encoder_built_in_fp32_is_cast_to_the_configured_dtype():
    vae = build_vae(EncoderConfig(device="cpu", vae_dtype="bfloat16"), 4, CPU)
    assert {p.dtype for p in vae.model.parameters()} == {torch.bfloat16}
    z = vae.encode(torch.zeros(1, 3, 1, 16, 16))
    assert z.dtype == torch.float32 and z.shape == (1, 4, 1, 2, 2) and torch.isfinite(z).all()
    text = build_umt5(EncoderConfig(device="cpu", text_dtype="float16"), 16, CPU)
    assert {p.dtype for p in text.model.parameters()} == {torch.float16}


def _png(h: int, w: int) -> bytes:
    """Thirds across: red | green | blue."""
    from PIL import Image

    a = np.zeros((h, w, 3), np.uint8)
    a[:, : w // 3, 0] = 255
    a[:, w // 3: 2 * w // 3, 1] = 255
    a[:, 2 * w // 3:, 2] = 255
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def test_an_image_is_resized_to_cover_the_bucket_then_centre_cropped():
    """A 300×100 image into 32×32: scaled by 32/100 to cover (96×32), the middle 32 columns kept — the green third
    only. Resized to fit (scaled by 32/300) it would be squashed, red and blue at its sides."""
    from data.decode import decode_image

    out = decode_image(_png(100, 300), 32, 32)
    assert out.shape == (1, 32, 32, 3) and out.dtype == np.uint8
    mean = out[0, :, 2:-2].reshape(-1, 3).astype(float).mean(0)  # away from the resampling edge
    assert mean[1] > 240 and mean[0] < 15 and mean[2] < 15, mean


# -- raw indexes: reuse only what is still valid, and ranks other than 0 wait for rank 0's index ----------------------

RAW64 = bucket_table({"img_64": {"frames": 1, "height": 64, "width": 64}})


def _square_png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _shard(path, n: int) -> str:
    write_tar(str(path), [(f"k{i}", {"png": _square_png(i), "txt": b"a photo"}) for i in range(n)])
    return str(path)


def test_a_shard_rewritten_since_it_was_indexed_is_probed_again(tmp_path):
    """The index covers every shard by name, but one changed since (size and mtime): its saved probe is stale, so
    the index is extended afresh, not reused."""
    from data.raw import RawConfig, ensure_raw_index

    shards = [_shard(tmp_path / "a.tar", 2), _shard(tmp_path / "b.tar", 1)]
    assert len(ensure_raw_index(shards, str(tmp_path), RAW64, RawConfig()).records) == 3
    assert len(ensure_raw_index(shards, str(tmp_path), RAW64, RawConfig()).records) == 3  # reused as it is
    _shard(tmp_path / "b.tar", 4)
    index = ensure_raw_index(shards, str(tmp_path), RAW64, RawConfig())
    assert sorted((os.path.basename(r["shard"]), r["key"]) for r in index.records) == [
        ("a.tar", "k0"), ("a.tar", "k1"), ("b.tar", "k0"), ("b.tar", "k1"), ("b.tar", "k2"), ("b.tar", "k3")]


def test_a_rank_other_than_0_reads_the_raw_index_only_after_the_barrier(tmp_path):
    """Rank 0 indexes the shards, then meets the others at the barrier: another rank must neither index them itself
    nor read the index before the barrier (it would find none, or half of one)."""
    from data.loader import open_corpus
    from data.raw import RawConfig, ensure_raw_index

    shard = _shard(tmp_path / "s.tar", 3)
    seen = []

    def barrier():  # what rank 0 does meanwhile
        seen.append(os.path.exists(tmp_path / "index.jsonl"))
        ensure_raw_index([shard], str(tmp_path), RAW64, RawConfig())

    cfg = DataConfig(buckets={}, urls=shard, val_samples=1, encoders=EncoderConfig(device="cpu"))
    corpus = open_corpus(cfg, RAW64, 4, 32, seed=0, is_main=False, barrier=barrier)
    assert seen == [False]  # the barrier came once, and before this rank had written anything
    assert sum(len(ix.records) for ix in corpus.indexes) == 3


def test_a_streams_duration_is_its_ticks_times_its_time_base_and_the_containers_only_without_them():
    """The video stream's own duration (in time_base units) wins over the container's (which spans every stream,
    audio too); the container's (in µs) is the fallback when the stream has none."""
    from fractions import Fraction
    from types import SimpleNamespace

    from data.decode import _stream_info

    def container(duration, time_base, frames=0):
        cc = SimpleNamespace(height=48, width=64, name="h264")
        s = SimpleNamespace(average_rate=Fraction(16), guessed_rate=None, base_rate=None, duration=duration,
                            time_base=time_base, frames=frames, codec_context=cc)
        return SimpleNamespace(streams=SimpleNamespace(video=[s]), duration=5_000_000)  # 5 s with the audio

    info = _stream_info(container(2560, Fraction(1, 1280)))  # 2 s of video
    assert info["duration"] == 2.0 and info["frames"] == 32 and info["fps"] == 16.0
    assert _stream_info(container(None, Fraction(1, 1280)))["duration"] == 5.0
    assert _stream_info(container(2560, None))["duration"] == 5.0
    assert _stream_info(container(2560, Fraction(1, 1280), frames=30))["frames"] == 30  # a count given is kept


def test_synthetic_shares_are_the_generators_mix_and_none_for_a_named_corpus(tmp_path):
    """The bucket report's shares for scheduling.tokens_per_step: the synthetic mix (buckets outside the table
    dropped), uniform for an empty mix, and None once the config names a corpus (only the run can count it)."""
    from data.loader import synthetic_shares
    from tests.helpers import compose_config

    cfg = compose_config(["conf=wan21_8gpu"])
    names = list(cfg.data.buckets)
    shares = synthetic_shares(cfg.data, names)
    assert shares == {n: float(v) for n, v in cfg.data.synthetic.mix.items()} and shares["v720_81f"] == 0.08
    assert synthetic_shares(cfg.data, ["i480", "v720_81f"]) == {"i480": 0.25, "v720_81f": 0.08}
    import dataclasses

    empty = dataclasses.replace(cfg.data, synthetic=dataclasses.replace(cfg.data.synthetic, mix={}))
    assert synthetic_shares(empty, names[:3]) == {n: 1.0 for n in names[:3]}
    assert synthetic_shares(compose_config(["conf=wan21_8gpu", f"data.index={tmp_path}"]).data, names) is None
