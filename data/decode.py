"""Decoding raw samples into the pixels a bucket takes: PyAV for video, PIL for images.

Temporal sampling. A clip of F = 1 + 4k frames at the target fps r_t out of a video of n frames at r_s fps takes
source frames
    idx_i = s0 + round(i · step),   step = max(1, r_s / r_t),   i = 0 … F − 1,
    s0 ∈ [0, n − 1 − round((F − 1) · step)]   (chosen by `start` ∈ [0, 1], random per (seed, epoch, key) upstream)
so a source slower than r_t is sampled at its own rate (frames are never duplicated), and the longest clip a video
offers is `usable_frames(n, r_s, r_t) = ⌊(n − 1) / step⌋ + 1` — the same function bucket assignment uses.
The decoder seeks to the keyframe before idx_0 and decodes forward only as far as idx_{F−1}; frames in between are
decoded (h264 needs them) but only the sampled ones are converted to RGB.

Spatial: resize so the frame covers the bucket (scale s = max(H / h, W / w)), then centre-crop to H × W; pixels
are normalised to [−1, 1] as x = u8 / 127.5 − 1 (the Wan VAE's input range). A JPEG is decoded at the smallest DCT
scale (1/2, 1/4, 1/8) that still covers the bucket (`Image.draft`); other images are box-reduced by an integer factor
before the bicubic resample (`reducing_gap`), so a large source costs little more than a small one once decoded.

Size cap (`max_pixels`, data.raw.max_pixels): an image or video frame whose header claims more than max_pixels
pixels (width × height) raises TooLarge (data/skipped_too_large) before any pixel is decoded (a 10 KB PNG can claim
400 M pixels; a real one that large takes over 1 GB to decode). Images are opened through the JPEG, PNG and WebP
plugins' registered factories, not `Image.open`: no other PIL plugin parses the bytes (EPS, for one, runs
Ghostscript), and the cap is max_pixels alone rather than PIL's process-wide MAX_IMAGE_PIXELS, which this module
never changes (`Image.open` warns above it and raises DecompressionBombError above twice it; both are still caught
as TooLarge should a PIL version raise them elsewhere). Videos: the container's frame size is checked against the
cap, FFmpeg's decoder gets twice it as its `max_pixels` option (a stream whose frames are far larger than its header
said fails to decode), and only the mp4/mov and matroska/webm demuxers may open the bytes.

Decoders return uint8 arrays [F, H, W, 3] (what loader workers hand over: 4× smaller than float); `to_model_range`
makes the float tensor [3, F, H, W], on the encoder's device.
"""
from __future__ import annotations

import functools
import io
import math
from typing import Optional

import numpy as np

EXIF_ORIENTATION = 0x0112
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP")  # the PIL plugins that may parse an image member (jpg/jpeg, png, webp)
VIDEO_DEMUXERS = "mov,mp4,matroska,webm"  # FFmpeg's format_whitelist: mp4/mov and mkv/webm members
REDUCING_GAP = 3.0  # PIL: box-reduce first while the scale exceeds 3× (indistinguishable from a full resample)


class DecodeError(Exception):
    """The bytes of a sample cannot be decoded into the frames its bucket needs."""
    reason = "decode_error"  # the data/skipped_<reason> it counts as


class TooLarge(DecodeError):
    """An image or video frame claims more pixels than the cap (data.raw.max_pixels)."""
    reason = "too_large"


def check_pixels(width: int, height: int, max_pixels: Optional[int], what: str) -> None:
    """TooLarge when width × height exceeds max_pixels (None: no cap)."""
    if max_pixels is not None and width * height > max_pixels:
        raise TooLarge(f"{what} of {width}×{height} = {width * height / 1e6:.1f} M pixels exceeds "
                       f"data.raw.max_pixels={max_pixels}")


def sampling_step(native_fps: float, target_fps: float) -> float:
    return max(1.0, native_fps / target_fps) if native_fps > 0 else 1.0


def usable_frames(native_frames: int, native_fps: float, target_fps: float) -> int:
    """The longest clip (in frames at the target fps) that a video of `native_frames` frames offers."""
    if native_frames < 1:
        return 0
    return int(math.floor((native_frames - 1) / sampling_step(native_fps, target_fps) + 1e-9)) + 1


def clip_indices(native_frames: int, native_fps: float, frames: int, target_fps: float, start: float) -> list[int]:
    """Source frame indices of a `frames`-frame clip at the target fps; `start` ∈ [0, 1] places it in the video."""
    step = sampling_step(native_fps, target_fps)
    span = int(round((frames - 1) * step))
    if span > native_frames - 1:
        raise DecodeError(f"a {frames}-frame clip at {target_fps:g} fps spans {span + 1} source frames; "
                          f"the video has {native_frames}")
    s0 = min(int(start * (native_frames - span)), native_frames - 1 - span)
    return [s0 + int(round(i * step)) for i in range(frames)]


def cover_size(h: int, w: int, height: int, width: int) -> tuple[int, int]:
    """(h', w') of the image resized to cover height × width with its aspect kept."""
    s = max(height / h, width / w)
    return max(height, int(math.ceil(h * s - 1e-6))), max(width, int(math.ceil(w * s - 1e-6)))


def centre_crop(a: np.ndarray, height: int, width: int) -> np.ndarray:
    """[..., h, w, 3] → [..., height, width, 3]."""
    h, w = a.shape[-3:-1]
    top, left = (h - height) // 2, (w - width) // 2
    return a[..., top:top + height, left:left + width, :]


# -- video ------------------------------------------------------------------------------------------------------------

def _open(data: bytes):
    import av

    try:
        return av.open(io.BytesIO(data), mode="r", options={"format_whitelist": VIDEO_DEMUXERS})
    except Exception as e:  # FFmpeg's errors, and whatever PyAV raises on bytes it cannot make sense of
        raise DecodeError(f"not a readable video container: {e}") from None


def _stream_info(container) -> dict:
    if not container.streams.video:
        return {"frames": 0, "fps": 0.0, "height": 0, "width": 0, "duration": 0.0, "codec": None}
    s = container.streams.video[0]
    rate = s.average_rate or s.guessed_rate or s.base_rate
    fps = float(rate) if rate else 0.0
    if s.duration is not None and s.time_base is not None:
        duration = float(s.duration * s.time_base)
    else:
        duration = (container.duration or 0) / 1e6
    frames = int(s.frames or 0)
    if frames == 0 and duration > 0 and fps > 0:  # containers without a frame count (webm, mkv): estimate
        frames = int(math.floor(duration * fps + 1e-6))
    return {"frames": frames, "fps": fps, "height": int(s.codec_context.height), "width": int(s.codec_context.width),
            "duration": duration, "codec": s.codec_context.name}


def probe_video(data: bytes) -> dict:
    """{frames, fps, height, width, duration, codec} from the container header alone (nothing is decoded)."""
    with _open(data) as c:
        try:
            return _stream_info(c)
        except Exception as e:  # a header PyAV parsed but whose values make no sense
            raise DecodeError(f"unreadable video stream header: {e}") from None


def decode_video(data: bytes, frames: int, height: int, width: int, target_fps: float, start: float = 0.0,
                 threads: int = 1, max_pixels: Optional[int] = None) -> np.ndarray:
    """A `frames`-frame clip at `target_fps`, resized to cover height × width and centre-cropped: [F, H, W, 3] u8.

    TooLarge when the frame size exceeds max_pixels; DecodeError for anything else that stops the clip."""
    import av

    with _open(data) as c:
        info = _stream_info(c)
        if info["frames"] < 1:
            raise DecodeError("no video stream or no frames")
        check_pixels(info["width"], info["height"], max_pixels, "a video frame")
        s = c.streams.video[0]
        s.thread_type = "AUTO" if threads != 1 else "SLICE"
        s.thread_count = threads
        if max_pixels is not None:  # FFmpeg refuses frames far larger than the header said; it counts rows
            # padded to its SIMD alignment (≤ 64 pixels), hence the slack
            bound = 2 * max(max_pixels, (info["width"] + 63) * info["height"])
            s.codec_context.options = {"max_pixels": str(bound)}
        want = clip_indices(info["frames"], info["fps"], frames, target_fps, start)
        tb, fps = s.time_base, info["fps"]
        t0 = s.start_time or 0
        if want[0] > 0:  # to the keyframe at or before the first wanted frame
            c.seek(t0 + int(want[0] / fps / tb), stream=s, backward=True, any_frame=False)
        sh, sw = cover_size(info["height"], info["width"], height, width)
        out: list[np.ndarray] = []
        k = 0
        try:
            for f in c.decode(s):
                if f.pts is None:
                    continue
                i = int(round(float((f.pts - t0) * tb) * fps))
                if i < want[k]:
                    continue
                rgb = centre_crop(f.to_ndarray(format="rgb24", width=sw, height=sh,
                                               interpolation=av.video.reformatter.Interpolation.BICUBIC),
                                  height, width)
                while k < frames and i >= want[k]:  # a dropped source frame repeats the one after it
                    out.append(rgb)
                    k += 1
                if k == frames:
                    break
        except Exception as e:  # FFmpeg's errors, and PyAV's on frames it cannot convert
            raise DecodeError(f"decoding failed after {k} of {frames} frames: {e}") from None
    if k < frames:
        raise DecodeError(f"the video ended after {k} of {frames} frames (truncated?)")
    return np.stack(out)


# -- images -----------------------------------------------------------------------------------------------------------

# EXIF orientation → the transpose that shows the image upright (what ImageOps.exif_transpose applies)
_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
              7: "TRANSVERSE", 8: "ROTATE_90"}


def _open_image(data: bytes, max_pixels: Optional[int]):
    """The PIL image of `data` (JPEG, PNG or WebP), its header read and no pixel decoded; TooLarge over the cap.

    Through the format's registered factory, not Image.open: see the module docstring."""
    from PIL import Image, JpegImagePlugin, PngImagePlugin, WebPImagePlugin  # noqa: F401 (registers the formats)

    prefix = data[:16]
    for fmt in IMAGE_FORMATS:
        factory, accept = Image.OPEN[fmt]
        ok = accept(prefix) if accept else True
        if ok and not isinstance(ok, str):  # a str is PIL's "looks like it, but cannot be read"
            im = factory(io.BytesIO(data), "")
            check_pixels(im.size[0], im.size[1], max_pixels, "an image")
            return im
    raise DecodeError(f"not a JPEG, PNG or WebP image (starts {prefix[:8]!r})")


def _orientation(im) -> int:
    """The EXIF orientation (1: upright) from what the header holds: a PNG's eXIf chunk after its pixel data is not
    read, because PIL would decode the whole image to reach it."""
    if im.format == "PNG" and "exif" not in im.info:
        return 1
    try:
        return int(im.getexif().get(EXIF_ORIENTATION, 1))
    except Exception:  # a damaged EXIF block: the image itself may be fine
        return 1


def _image_errors(fn):
    """Any failure of PIL on a sample's bytes as DecodeError (TooLarge for PIL's own bomb check)."""
    @functools.wraps(fn)
    def wrapped(data: bytes, *args, **kw):
        from PIL import Image

        try:
            return fn(data, *args, **kw)
        except DecodeError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # the warning: under -W error
            raise TooLarge(str(e)) from None
        except Exception as e:  # OSError, SyntaxError, struct.error, ValueError, EOFError …: the bytes are bad
            raise DecodeError(f"image decoding failed: {type(e).__name__}: {e}") from None
    return wrapped


@_image_errors
def probe_image(data: bytes) -> dict:
    """{height, width, format} from the image header (EXIF rotation applied); nothing is decoded, nothing capped."""
    with _open_image(data, None) as im:
        w, h = im.size
        if _orientation(im) in (5, 6, 7, 8):
            h, w = w, h
        return {"frames": 1, "fps": 0.0, "height": h, "width": w, "format": im.format}


@_image_errors
def decode_image(data: bytes, height: int, width: int, max_pixels: Optional[int] = None) -> np.ndarray:
    """The image resized to cover height × width and centre-cropped: [1, H, W, 3] u8; TooLarge over max_pixels."""
    from PIL import Image

    with _open_image(data, max_pixels) as im:
        turn = _orientation(im)
        if im.format in ("JPEG", "MPO"):  # DCT-domain downscale: much less to decode; asked as stored (sideways)
            w, h = im.size
            swap = turn in (5, 6, 7, 8)
            ch, cw = cover_size(*((w, h) if swap else (h, w)), height, width)
            im.draft("RGB", (ch, cw) if swap else (cw, ch))
        im = im.convert("RGB")
        if turn in _TRANSPOSE:
            im = im.transpose(getattr(Image.Transpose, _TRANSPOSE[turn]))
        w, h = im.size
        # the centred crop box in source pixels, so that one resample does resize and crop together
        s = max(height / h, width / w)
        cw, ch = min(w, width / s), min(h, height / s)  # min: rounding must not leave the image
        left, top = (w - cw) / 2, (h - ch) / 2
        box = (left, top, left + cw, top + ch)
        rgb = np.array(im.resize((width, height), Image.BICUBIC, box=box, reducing_gap=REDUCING_GAP))
    return rgb[None]


def to_model_range(u8_FHWC, device=None, dtype=None):
    """uint8 [..., F, H, W, 3] (numpy or torch) → [..., 3, F, H, W] in [−1, 1] (float32 unless `dtype`).

    The cast happens on `device`: moving uint8 moves 4× fewer bytes than float, and on a GPU the cast is free.
    """
    import torch

    x = torch.as_tensor(np.ascontiguousarray(u8_FHWC) if isinstance(u8_FHWC, np.ndarray) else u8_FHWC)
    x = x.to(device, non_blocking=True) if device is not None else x
    x = x.float().div_(127.5).sub_(1.0)
    return x.movedim(-1, -4).to(dtype or torch.float32)
