"""The demo (`conf=demo`): the PCA VAE, the moving-shapes corpus and its captions, the bag-of-words text encoder,
the contact sheet, and the log line (and warning) naming a run's encoders."""
from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.buckets import bucket_table
from data.pca_vae import PCAVAE, fit_pca_vae
from data.shapes import BACKGROUND, COLOURS, DIRECTIONS, SHAPES, draw, draw_sample, parse_caption
from tests.helpers import compose_config, run_training, tiny_overrides

BUCKETS = bucket_table({"clip": {"frames": 17, "height": 64, "width": 96}, "still": {"frames": 1, "height": 64,
                                                                                       "width": 64}})


def _draws(n: int, seed: int = 0):
    """n samples, two clips to each image, as the demo's mix roughly has them."""
    return [draw_sample(BUCKETS["still" if i % 3 == 0 else "clip"], np.random.default_rng([seed, i]))
            for i in range(n)]


def _x(u8):  # uint8 [F, H, W, 3] → [1, 3, F, H, W] in [−1, 1]
    return torch.from_numpy(u8).permute(3, 0, 1, 2)[None].float() / 127.5 - 1


@pytest.fixture(scope="module")
def fitted():
    train = [px for px, _ in _draws(96)]
    return fit_pca_vae(train, 16), fit_pca_vae(train, 16), fit_pca_vae(train, 4)


def test_pca_vae_reconstructs_unseen_shapes_at_over_26_db_with_wan_strides_and_normalised_latents(fitted):
    vae, _, vae4 = fitted
    held_out = [px for px, _ in _draws(24, seed=1)]  # not fitted on
    mse, mse4, zs = [], [], []
    for px in held_out:
        x = _x(px)
        z = vae.encode(x)
        F, H, W = x.shape[2:]
        assert z.shape == (1, 16, 1 + (F - 1) // 4, H // 8, W // 8)  # Wan 2.1's VAE geometry
        mse.append(((vae.decode(z) - x) ** 2).mean().item())
        mse4.append(((vae4.decode(vae4.encode(x)) - x) ** 2).mean().item())
        zs.append(z.flatten(2))
    psnr = 10 * np.log10(4 / np.mean(mse))  # peak-to-peak of [−1, 1] is 2
    assert psnr > 26, psnr                  # measured 27.5 dB on 400 draws
    assert np.mean(mse4) > 1.5 * np.mean(mse)  # more principal axes reconstruct better: it is a real PCA
    z = torch.cat(zs, dim=2)[0]  # [C, positions]
    var = z.var(dim=1)
    assert z.mean(dim=1).abs().max() < 0.3 and 0.7 < var.mean() < 1.3  # normalised as a whole
    assert var[0] > 4 * var[-1]  # each channel keeps its share of the pixel variance (not whitened)


def test_pca_vae_fit_is_exactly_reproducible_and_round_trips_through_safetensors(fitted, tmp_path):
    a, b, _ = fitted
    for k in a.a:
        assert torch.equal(a.a[k], b.a[k]), k
    path = a.save(str(tmp_path / "vae"))
    assert path.endswith(".safetensors")
    c = PCAVAE.load(str(tmp_path / "vae"))
    x = _x(_draws(2, seed=3)[1][0])
    assert torch.equal(c.decode(c.encode(x)), a.decode(a.encode(x)))
    from safetensors.torch import load_file, save_file

    arrays = load_file(path)
    arrays["sigma1"][0] = 0.0
    save_file(arrays, path)
    with pytest.raises(ValueError, match="is not a PCA VAE"):
        PCAVAE.load(str(tmp_path / "vae"))


def test_decode_latents_takes_a_vae_that_decodes_normalised_latents(fitted):
    from models.sampler import decode_latents

    vae = fitted[0]
    z = vae.encode(_x(_draws(2)[1][0]))
    assert torch.equal(decode_latents(vae, z), vae.decode(z))


# what the words mean, independently of data/shapes.py: the dominant channels of each colour, and each direction's
# unit step in image coordinates (x right, y down)
HUES = {"red": (0,), "green": (1,), "blue": (2,), "yellow": (0, 1)}
STEPS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


def test_shapes_captions_say_the_colour_shape_and_direction_of_their_pixels():
    assert set(COLOURS) == set(HUES) and set(DIRECTIONS) == set(STEPS)  # every word of the corpus is checked
    bg = np.array(BACKGROUND, np.float32)
    seen = set()
    for px, cap in _draws(48, seed=5):
        seen.add(parse_caption(cap))
        colour, shape, direction = parse_caption(cap)
        centres = []
        for frame in (px[0], px[-1]):
            fg = np.abs(frame.astype(np.float32) - bg).sum(-1) > 60  # the shape's pixels
            mean = frame[fg].astype(np.float32).mean(0)
            assert set(np.nonzero(mean > 150)[0]) == set(HUES[colour]) and mean.min() < 80, (cap, mean)
            ys, xs = np.nonzero(fg)
            box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
            if ys.min() > 0 and xs.min() > 0 and ys.max() < frame.shape[0] - 1 and xs.max() < frame.shape[1] - 1:
                fill = fg.sum() / box  # a square fills its box, a triangle half of it
                assert (fill > 0.9) if shape == "square" else (0.4 < fill < 0.6), (cap, fill)
                top, bottom = fg[ys.min()].sum(), fg[ys.max()].sum()  # a triangle points up: a tip over a base
                assert (top > 0.8 * bottom) if shape == "square" else (top < 0.25 * bottom), (cap, top, bottom)
            centres.append(np.array([xs.mean(), ys.mean()]))
        if direction is None:
            assert len(px) == 1
        else:
            moved = centres[1] - centres[0]
            assert np.dot(moved, STEPS[direction]) > 0.35 * min(px.shape[1:3]), (cap, moved)
            dx, dy = STEPS[direction]
            assert abs(moved[0] * dy - moved[1] * dx) < 3, (cap, moved)  # no drift across the motion
    assert len({c for c, _, _ in seen}) == 4 and len({d for _, _, d in seen}) == 5  # each colour, direction, still


def test_square_and_triangle_keep_their_own_silhouettes_through_the_pca_vae(fitted):
    """The two shapes are told apart after the round trip the model's samples take (encode, decode): each decoded
    clip's foreground overlaps its own shape's true silhouette far more than the other shape's drawn at the same
    spot. (A circle would not pass: it overlaps the square of its diameter by π/4.)"""
    vae = fitted[0]
    bg = np.array(BACKGROUND, np.float32)
    own, other = [], []
    for i, (colour, direction) in enumerate([(c, d) for c in COLOURS for d in DIRECTIONS]):
        clips = {s: draw(colour, s, direction, 17, 64, 96, np.random.default_rng([7, i])) for s in SHAPES}
        for s, px in clips.items():  # the same generator seed: the same jitter, so the same spot for both shapes
            y = ((vae.decode(vae.encode(_x(px)))[0].permute(1, 2, 3, 0) + 1) * 127.5).numpy()
            seen = np.abs(y - bg).sum(-1) > 120  # [F, H, W] the decoded foreground: above half the faintest
            # colour's contrast with the background (green's, 230)
            for t, true in ((own, s), (other, next(o for o in SHAPES if o != s))):
                mask = np.abs(clips[true].astype(np.float32) - bg).sum(-1) > 120
                t.append((seen & mask).sum() / (seen | mask).sum())  # intersection over union, over the clip
    own, other = np.array(own), np.array(other)
    assert own.min() > 0.75, own  # measured ≥ 0.81 (triangles), ≥ 0.91 (squares)
    assert (own - other).min() > 0.2, own - other  # measured ≥ 0.29; squares and circles of radius 0.24·64: 0.06


def test_the_shapes_corpus_gives_a_bucket_the_mix_leaves_out_what_the_shares_leave_under_one():
    """As every synthetic corpus does (data.config.synthetic_mix): a bucket missing from data.synthetic.mix gets the
    remainder, not nothing."""
    from data.shapes import shapes_spec

    cfg = compose_config(["conf=demo"])
    names = list(cfg.data.buckets)[:2]
    buckets = {n: b for n, b in bucket_table(cfg.data.buckets, patch=cfg.model.patch).items() if n in names}
    data = SimpleNamespace(synthetic=SimpleNamespace(**{**vars(cfg.data.synthetic), "mix": {names[0]: 0.25}}),
                           encoders=cfg.data.encoders)
    assert shapes_spec(data, buckets, 16, cfg.model.text_dim)["mix"] == {names[0]: 0.25, names[1]: 0.75}


def test_words_text_encoder_is_deterministic_and_a_changed_word_changes_only_its_token():
    from data.encoders import EncoderConfig, build_words

    cfg = EncoderConfig(text="words", device="cpu")
    a, b = build_words(cfg, 32, torch.device("cpu")), build_words(cfg, 32, torch.device("cpu"))
    caps = ["a red square moving right", "a blue square moving right", ""]
    ea, eb = a.encode(caps), b.encode(caps)
    assert torch.equal(ea.embeds, eb.embeds) and ea.mask.tolist() == eb.mask.tolist()
    red, blue, empty = ea.per_sample()
    assert red.shape == (5, 32) and empty.shape == (1, 32) and not empty.any()
    differs = [(red[i] != blue[i]).any().item() for i in range(5)]
    assert differs == [False, True, False, False, False]
    other_seed = build_words(EncoderConfig(text="words", device="cpu", seed=1), 32, torch.device("cpu"))
    assert not torch.equal(other_seed.encode(caps[:1]).embeds, ea.embeds[:1])


def test_demo_preset_composes_to_the_shapes_corpus_a_16_channel_model_and_word_captions():
    cfg = compose_config(["conf=demo"])
    assert cfg.data.synthetic.kind == "shapes" and cfg.data.encoders.text == "words"
    assert cfg.model.in_channels == cfg.model.out_channels == 16
    assert cfg.train.sample_every == cfg.train.steps and cfg.sample.bucket in cfg.data.buckets
    assert cfg.sample.prompts and all(parse_caption(p)[2] in STEPS for p in cfg.sample.prompts)
    with pytest.raises(ValueError, match="data.synthetic.kind must be waves or shapes"):
        compose_config(["conf=demo", "data.synthetic.kind=cubes"])


def _corpus(kind: str, encoders=None):
    meta = {"kind": kind, **({"encoders": encoders} if encoders else {})}
    return SimpleNamespace(indexes=[SimpleNamespace(meta=meta)])


def test_encoders_are_named_and_random_ones_with_raw_media_or_a_large_model_warn(tmp_path, caplog):
    from training.sampling import describe_encoders, log_encoders

    default = compose_config([f"data.cache_dir={tmp_path}"])
    line, warning = describe_encoders(default, _corpus("latent"), 1e6)  # the default: synthetic latents, no sampling
    assert "tiny Wan VAE with random weights" in line and "unused" in line and warning is None
    _, warning = describe_encoders(default, _corpus("raw"), 1e6)
    assert warning.startswith("raw media are encoded by a random VAE and a random text encoder")
    with caplog.at_level(logging.INFO):
        log_encoders(default, _corpus("raw"), 1e6, logging.getLogger("t"))
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]
    assert caplog.records[1].getMessage().startswith("RANDOM ENCODERS: raw media")
    sampled = compose_config([f"data.cache_dir={tmp_path}", "train.sample_every=10"])
    assert describe_encoders(sampled, _corpus("latent"), 1e6)[1] is None          # tiny model: a test
    big = describe_encoders(sampled, _corpus("latent"), 1.3e9)[1]
    assert "1300M-parameter model is sampled with a random VAE" in big
    tiny_made = {"vae": {"tiny": {}, "z_dim": 4, "seed": 0}, "text_encoder": "/models/umt5"}
    made = describe_encoders(default, _corpus("latent", tiny_made), 1.3e9)[1]
    assert "latents that a random VAE or text encoder made" in made
    demo = compose_config(["conf=demo", f"data.cache_dir={tmp_path}"])
    line, warning = describe_encoders(demo, _corpus("latent"), 1.3e9)
    assert "PCA VAE fitted to the shapes corpus" in line and "bag of words" in line and warning is None


@pytest.mark.slow
def test_a_short_demo_run_writes_samples_before_and_after_and_their_contact_sheet(tmp_path):
    run = tmp_path / "run"
    _, last = run_training(tiny_overrides(str(run), str(tmp_path / "cache"), "conf=demo", "train.steps=2",
                                          "train.sample_every=2", "train.val_every=2", "sample.steps=2",
                                          "data.synthetic.num_samples=24", "data.synthetic.num_val=4",
                                          "data.val_samples=4"))
    sheet = run / "samples" / "contact_sheet.png"
    assert (run / "samples" / "step_000000" / "p0_s0.mp4").exists() and (run / "samples" / "step_000002").exists()
    from PIL import Image

    img = Image.open(sheet)
    cfg = compose_config(["conf=demo"])
    assert img.size[1] == 24 + len(cfg.sample.prompts) * (64 * 2 + 4)  # a header, a row per prompt (2×, 4 px apart)
    assert img.size[0] == 200 + 2 * (5 * (96 * 2 + 4) + 16)  # prompts, then 5 frames of each step
    assert os.path.getsize(sheet) < 500_000 and np.isfinite(last["val/loss"])
    assert (tmp_path / "cache").is_dir() and any(p.name.startswith("shapes-") for p in (tmp_path / "cache").iterdir())
