"""Write generated clips as H.264 mp4 files (PyAV, libx264) and read them back.

Pixels in the model's range x ∈ [−1, 1] (what the Wan VAE decodes) become u8 = round((x + 1) · 127.5), clipped to
[0, 255]; frames are [3, F, H, W] (one clip of a decoded batch). H.264 in yuv420p needs even sides, so an odd
height or width is padded by repeating the last row or column (and the stored size says so). Reading returns
uint8 [F, H, W, 3], the layout `data/decode.py` hands over for training clips.
"""
from __future__ import annotations

import os
from typing import Union

import numpy as np
import torch

ArrayLike = Union[torch.Tensor, np.ndarray]


def to_uint8(frames_3FHW: ArrayLike) -> np.ndarray:
    """[3, F, H, W] floats in [−1, 1] → uint8 [F, H, W, 3]."""
    x = torch.as_tensor(frames_3FHW).detach().float().cpu()
    if x.ndim != 4 or x.shape[0] != 3:
        raise ValueError(f"frames must be [3, F, H, W] in [-1, 1], got shape {tuple(x.shape)}")
    u8 = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return u8.permute(1, 2, 3, 0).contiguous().numpy()


def write_mp4(path: str, frames_3FHW: ArrayLike, fps: float = 16.0, crf: int = 18, preset: str = "medium") -> str:
    """Encode one clip ([3, F, H, W] in [−1, 1]) to an H.264 mp4 that browsers and wandb play; returns `path`."""
    import av

    u8 = to_uint8(frames_3FHW)
    F_, H, W, _ = u8.shape
    if H % 2 or W % 2:  # yuv420p subsamples chroma 2×2
        u8 = np.pad(u8, ((0, 0), (0, H % 2), (0, W % 2), (0, 0)), mode="edge")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.mp4"  # a reader (wandb, a browser) never sees a half-written file
    with av.open(tmp, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=max(1, int(round(fps))))
        stream.width, stream.height, stream.pix_fmt = u8.shape[2], u8.shape[1], "yuv420p"
        stream.options = {"crf": str(crf), "preset": preset}
        for img in u8:
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)
    return path


def read_mp4(path: str) -> tuple[np.ndarray, float]:
    """(uint8 frames [F, H, W, 3], fps) of every frame of the first video stream."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate or 0)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    if not frames:
        raise ValueError(f"{path} holds no decodable video frames")
    return np.stack(frames), fps
