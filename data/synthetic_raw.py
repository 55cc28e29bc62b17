"""A realistic synthetic raw corpus — mp4 (libx264) videos and jpg images with captions — in WebDataset shards
(the command line: scripts/make_corpus.py, which also indexes it).

Each sample is a scene: a background gradient between two named colours that drifts, a panning texture (the
"camera"), one to three coloured shapes moving in named directions, and film grain (so the encoder has real work,
as in footage). Its caption says so ("a large red circle moving left and a small blue square moving up over a
green to purple gradient, the camera panning right"). Aspect ratios, durations and frame rates vary per sample;
captions are `txt` or `json` (with fps/size metadata). Videos carry a keyframe every 2 s, as web video does.

`bad=(KIND, ...)` (BAD_KINDS for all) adds one broken sample of each kind, for tests of the skip paths:
    seen by the indexer: corrupt_mp4, zero_frame_video, one_frame_video, undecodable_image, missing_caption,
                         tiny_image, extreme_aspect_image, corrupt_member, truncated_shard, unreadable_shard
    seen at load:        truncated_mp4 (moov in front, data cut), truncated_image
"""
from __future__ import annotations

import io
import json
import math
import os
import tarfile
import tempfile

import numpy as np

COLOURS = {"red": (220, 40, 40), "orange": (240, 140, 30), "yellow": (235, 215, 50), "green": (50, 170, 70),
           "teal": (40, 160, 160), "blue": (40, 80, 210), "purple": (140, 60, 190), "pink": (235, 120, 170),
           "white": (240, 240, 240), "black": (20, 20, 20), "grey": (128, 128, 128), "brown": (130, 85, 45)}
SHAPES = ("circle", "square", "triangle", "ring")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1), "up and to the left": (-0.7, -0.7),
              "down and to the right": (0.7, 0.7)}
ASPECTS = ((16, 9), (9, 16), (4, 3), (3, 4), (1, 1), (3, 2), (2, 3), (2, 1))
SIZES = {"tiny": (64, 112), "480p": (480, 480), "720p": (720, 720), "1080p": (1080, 1080)}  # short side range
BAD_AT_INDEX = ("corrupt_mp4", "zero_frame_video", "one_frame_video", "undecodable_image", "missing_caption",
                "tiny_image", "extreme_aspect_image", "corrupt_member", "truncated_shard", "unreadable_shard")
BAD_AT_LOAD = ("truncated_mp4", "truncated_image")
BAD_KINDS = BAD_AT_INDEX + BAD_AT_LOAD


# -- scenes -----------------------------------------------------------------------------------------------------------

class Scene:
    """A deterministic scene from a seed; `frame(t)` renders it at time t seconds as uint8 [h, w, 3]."""

    def __init__(self, rng: np.random.Generator, height: int, width: int):
        self.h, self.w = height, width
        names = list(COLOURS)
        self.bg = rng.choice(names, 2, replace=False)
        self.angle = rng.uniform(0, 2 * math.pi)
        self.drift = rng.uniform(-0.3, 0.3)
        self.pan_dir = list(DIRECTIONS)[rng.integers(4)]
        self.pan_speed = rng.uniform(0.05, 0.2)  # frame widths per second
        tex = rng.normal(0, 1, (12, 12)).astype(np.float32)
        self.tex = np.kron(tex, np.ones((max(1, height // 6), max(1, width // 6)), np.float32))
        self.grain = rng.integers(1 << 31)
        self.shapes = []
        for _ in range(int(rng.integers(1, 4))):
            direction = list(DIRECTIONS)[rng.integers(len(DIRECTIONS))]
            self.shapes.append({"shape": SHAPES[rng.integers(len(SHAPES))], "colour": names[rng.integers(len(names))],
                                "r": rng.uniform(0.08, 0.22), "x": rng.uniform(0.25, 0.75), "y": rng.uniform(0.25, 0.75),
                                "dir": direction, "speed": rng.uniform(0.05, 0.25)})
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        self.yy, self.xx = yy / min(height, width), xx / min(height, width)

    def caption(self, video: bool) -> str:
        parts = []
        for s in self.shapes:
            size = "large" if s["r"] > 0.17 else ("small" if s["r"] < 0.12 else "medium")
            parts.append(f"a {size} {s['colour']} {s['shape']}" + (f" moving {s['dir']}" if video else ""))
        text = " and ".join(parts) + f" over a {self.bg[0]} to {self.bg[1]} gradient"
        if video:
            text += f", the camera panning {self.pan_dir}"
        return text if video else "a photo of " + text

    def frame(self, t: float) -> np.ndarray:
        c0, c1 = (np.array(COLOURS[c], np.float32) for c in self.bg)
        g = np.cos(self.angle) * self.xx + np.sin(self.angle) * self.yy
        g = 0.5 + 0.5 * np.sin(2.0 * g + self.drift * t * 2 * math.pi)
        img = c0 + (c1 - c0) * g[..., None]
        dx, dy = DIRECTIONS[self.pan_dir]
        th, tw = self.tex.shape
        oy, ox = int(dy * self.pan_speed * t * self.h) % th, int(dx * self.pan_speed * t * self.w) % tw
        tex = np.roll(self.tex, (-oy, -ox), axis=(0, 1))  # the texture is larger than the frame: a window pans
        img += 18 * tex[: self.h, : self.w, None]
        scale = min(self.h, self.w)
        for s in self.shapes:
            ddx, ddy = DIRECTIONS[s["dir"]]
            cx = (s["x"] * self.w / scale + ddx * s["speed"] * t) % (self.w / scale)
            cy = (s["y"] * self.h / scale + ddy * s["speed"] * t) % (self.h / scale)
            px, py = self.xx - cx, self.yy - cy
            if s["shape"] == "circle":
                m = px ** 2 + py ** 2 < s["r"] ** 2
            elif s["shape"] == "ring":
                d = np.sqrt(px ** 2 + py ** 2)
                m = (d < s["r"]) & (d > 0.6 * s["r"])
            elif s["shape"] == "square":
                m = (np.abs(px) < s["r"] * 0.8) & (np.abs(py) < s["r"] * 0.8)
            else:
                m = (py < s["r"] * 0.7) & (py > -s["r"] + 2 * np.abs(px))
            img[m] = COLOURS[s["colour"]]
        rng = np.random.default_rng([self.grain, int(t * 1000)])
        img += rng.normal(0, 4, (self.h, self.w, 1)).astype(np.float32)
        return np.clip(img, 0, 255).astype(np.uint8)


# -- encoding ---------------------------------------------------------------------------------------------------------

def encode_mp4(frames, fps: float, height: int, width: int, preset: str = "ultrafast", crf: int = 23,
               faststart: bool = True) -> bytes:
    """H.264 (libx264, yuv420p) mp4 bytes; `frames` yields uint8 [h, w, 3]. faststart puts the index in front."""
    import av

    fd, path = tempfile.mkstemp(suffix=".mp4")  # the mp4 muxer's faststart pass rewrites the file: no BytesIO
    os.close(fd)
    try:
        with av.open(path, "w", format="mp4", options={"movflags": "faststart"} if faststart else {}) as c:
            s = c.add_stream("libx264", rate=round(fps))
            s.width, s.height, s.pix_fmt = width, height, "yuv420p"
            s.codec_context.gop_size = max(1, int(round(2 * fps)))  # a keyframe every 2 s: seeking has work to skip
            s.options = {"preset": preset, "crf": str(crf)}
            c.start_encoding()
            for img in frames:
                for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.remove(path)


def encode_jpg(img: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _even(x: float) -> int:
    return max(2, int(round(x / 2)) * 2)


def _dims(rng, size, aspect=None) -> tuple[int, int]:
    lo, hi = SIZES[size] if isinstance(size, str) else size
    short = int(rng.integers(lo, hi + 1))
    a, b = aspect or ASPECTS[rng.integers(len(ASPECTS))]
    return (_even(short), _even(short * a / b)) if a >= b else (_even(short * b / a), _even(short))  # (h, w)


# -- samples ----------------------------------------------------------------------------------------------------------

def make_video(rng, size, seconds, fps_choices, preset, aspects=ASPECTS, **kw) -> tuple[dict, dict]:
    h, w = kw.get("dims") or _dims(rng, size, aspects[rng.integers(len(aspects))])
    fps = float(fps_choices[rng.integers(len(fps_choices))])
    n = kw.get("frames") or max(1, int(round(rng.uniform(*seconds) * fps)))
    scene = Scene(rng, h, w)
    data = encode_mp4((scene.frame(i / fps) for i in range(n)), fps, h, w, preset, faststart=kw.get("faststart", True))
    return {"mp4": data}, {"caption": scene.caption(True), "fps": fps, "width": w, "height": h, "frames": n}


def make_image(rng, size, aspects=ASPECTS, **kw) -> tuple[dict, dict]:
    h, w = kw.get("dims") or _dims(rng, size, aspects[rng.integers(len(aspects))])
    scene = Scene(rng, h, w)
    return {"jpg": encode_jpg(scene.frame(0.0))}, {"caption": scene.caption(False), "width": w, "height": h}


def _with_caption(members: dict, meta: dict, as_json: bool) -> dict:
    out = dict(members)
    if as_json:
        out["json"] = json.dumps(meta).encode()
    else:
        out["txt"] = meta["caption"].encode()
    return out


def bad_sample(kind: str, rng, size, preset) -> dict:
    """The members of one broken sample of `kind` (shard-level kinds are applied to the tar afterwards)."""
    lo = SIZES[size][0] if isinstance(size, str) else size[0]
    if kind in ("truncated_mp4", "corrupt_mp4"):
        # faststart: the index survives the cut, decoding fails later; without it the index is what is lost
        m, meta = make_video(rng, size, (1.5, 2.0), (16,), preset, faststart=kind == "truncated_mp4")
        return _with_caption({"mp4": m["mp4"][: len(m["mp4"]) * 2 // 5]}, meta, False)
    if kind == "zero_frame_video":
        import av

        fd, path = tempfile.mkstemp(suffix=".mp4")
        os.close(fd)
        with av.open(path, "w", format="mp4") as c:  # a header and no frame at all
            s = c.add_stream("libx264", rate=16)
            s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
            c.start_encoding()
        with open(path, "rb") as f:
            data = f.read()
        os.remove(path)
        return _with_caption({"mp4": data}, {"caption": "a video that holds no frame"}, False)
    if kind == "one_frame_video":
        m, meta = make_video(rng, size, (1, 1), (16,), preset, frames=1)
        return _with_caption(m, meta, True)
    if kind == "undecodable_image":
        return _with_caption({"jpg": rng.bytes(3000)}, {"caption": "noise that is not an image"}, False)
    if kind == "truncated_image":
        m, meta = make_image(rng, size)
        return _with_caption({"jpg": m["jpg"][: len(m["jpg"]) // 2]}, meta, False)
    if kind == "missing_caption":
        m, _ = make_image(rng, size)
        return m
    if kind == "tiny_image":
        m, meta = make_image(rng, size, dims=(12, 12))
        return _with_caption(m, meta, False)
    if kind == "extreme_aspect_image":
        m, meta = make_image(rng, size, dims=(_even(lo * 1.2), _even(lo * 1.2 * 8)))
        return _with_caption(m, meta, False)
    if kind in ("corrupt_member", "truncated_shard"):
        m, meta = make_image(rng, size)
        return _with_caption(m, meta, False)
    raise ValueError(f"unknown bad-sample kind {kind!r}; known: {', '.join(BAD_KINDS)}")


def _write_tar(path: str, samples: list[tuple[str, dict]]) -> dict[str, int]:
    """Write samples in order; returns {member name: header offset} for post-hoc damage."""
    offsets = {}
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
                offsets[info.name] = tar.offset
                tar.addfile(info, io.BytesIO(data))
    return offsets


def write_raw_corpus(out: str, images: int, videos: int, size="tiny", seconds=(0.6, 2.5),
                     fps=(12, 15, 24, 25, 30), samples_per_shard: int = 16, seed: int = 0, bad=(),
                     preset: str = "ultrafast", aspects=ASPECTS, progress=None) -> list[str]:
    """Write the shards into `out`; returns their paths (an unreadable shard, if asked for, among them)."""
    unknown = set(bad) - set(BAD_KINDS)
    if unknown:
        raise ValueError(f"unknown bad-sample kinds {sorted(unknown)}; known: {', '.join(BAD_KINDS)}")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    kinds = rng.permutation(["video"] * videos + ["image"] * images)
    samples = []
    for i, kind in enumerate(kinds):
        srng = np.random.default_rng([seed, i])
        members, meta = (make_video(srng, size, seconds, fps, preset, aspects) if kind == "video"
                         else make_image(srng, size, aspects))
        samples.append((f"{i:06d}", _with_caption(members, meta, as_json=i % 3 == 2)))
        if progress:
            progress(i + 1, len(kinds))
    in_tar = [k for k in bad if k not in ("truncated_shard", "unreadable_shard")]
    for k in in_tar:
        samples.append((f"bad_{k}", bad_sample(k, np.random.default_rng([seed, 7, BAD_KINDS.index(k)]), size, preset)))
    paths = []
    for j in range(0, len(samples), samples_per_shard):
        path = os.path.join(out, f"shard-{len(paths):05d}.tar")
        offsets = _write_tar(path, samples[j:j + samples_per_shard])
        paths.append(path)
        if "corrupt_member" in bad and "bad_corrupt_member.jpg" in offsets:
            with open(path, "r+b") as f:  # break the header checksum of the member: tarfile must resync past it
                f.seek(offsets["bad_corrupt_member.jpg"] + 148)
                f.write(b"0000000\0")
    if "truncated_shard" in bad:  # a last shard cut inside its last member
        path = os.path.join(out, f"shard-{len(paths):05d}.tar")
        good = make_image(np.random.default_rng([seed, 8]), size)
        offsets = _write_tar(path, [("ok_before_cut", _with_caption(*good, False)),
                                    ("bad_truncated_shard", bad_sample("truncated_shard", rng, size, preset))])
        with open(path, "r+b") as f:
            f.truncate(offsets["bad_truncated_shard.jpg"] + 512 + 100)
        paths.append(path)
    if "unreadable_shard" in bad:
        path = os.path.join(out, f"shard-{len(paths):05d}.tar")
        with open(path, "wb") as f:
            f.write(b"this is not a tar file\n" * 10)
        paths.append(path)
    return paths
