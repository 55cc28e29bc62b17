"""Buckets: a named (frames, height, width) in pixels → latent shape → tokens S.

    latent frames  F' = 1 + (frames − 1) / stride_t        (Wan VAE: stride_t = 4, so frames = 1 + 4k)
    latent size    H' = height / stride_s, W' = width / stride_s   (stride_s = 8)
    tokens         S  = (F' / p_t) · (H' / p_h) · (W' / p_w)     (the model's patch: Wan 2.1 (1, 2, 2))

Buckets are a dict keyed by name in the config (`data.buckets.v480_33f.frames=33`), so one entry can be
overridden from the command line. The patch is the model's (`cfg.model.patch`, plain ints), so S is the sequence
length the model runs: a run builds its table with `bucket_table(cfg.data.buckets, patch=cfg.model.patch)`.
Batch sizes are not decided here: they come from `scheduling/`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

VAE_STRIDE_T = 4
VAE_STRIDE_S = 8
PATCH = (1, 2, 2)


@dataclass(frozen=True)
class Bucket:
    name: str
    frames: int
    height: int
    width: int
    stride_t: int = VAE_STRIDE_T
    stride_s: int = VAE_STRIDE_S
    patch: tuple[int, int, int] = PATCH

    def __post_init__(self):
        where = f"data.buckets.{self.name}"
        for field in ("frames", "height", "width"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:  # 33.5 frames is no shape: never truncated
                raise ValueError(f"{where}.{field} must be a positive integer, got {v!r}")
        for field in ("stride_t", "stride_s"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"the VAE's {field} must be a positive integer, got {v!r}")
        if len(self.patch) != 3 or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in self.patch):
            raise ValueError(f"model.patch_size must be three positive integers (t, h, w), got {self.patch!r}")
        if (self.frames - 1) % self.stride_t:
            raise ValueError(f"{where}.frames must be 1 + {self.stride_t}·k (the VAE's temporal stride), "
                             f"got {self.frames}; try {1 + (self.frames - 1) // self.stride_t * self.stride_t}")
        pt, ph, pw = self.patch
        for field, stride, p in (("height", self.stride_s, ph), ("width", self.stride_s, pw)):
            if getattr(self, field) % (stride * p):
                raise ValueError(f"{where}.{field} must be a multiple of {stride * p} (VAE stride × patch), "
                                 f"got {getattr(self, field)}")
        if self.latent_frames % pt:
            raise ValueError(f"{where}: {self.latent_frames} latent frames do not divide by the temporal patch {pt}")

    @property
    def is_image(self) -> bool:
        return self.frames == 1

    @property
    def latent_frames(self) -> int:
        return 1 + (self.frames - 1) // self.stride_t

    def latent_shape(self, channels: int) -> tuple[int, int, int, int]:
        """(C, F', H', W') of this bucket's latents."""
        return (channels, self.latent_frames, self.height // self.stride_s, self.width // self.stride_s)

    @property
    def patch_grid(self) -> tuple[int, int, int]:
        """(F'/p_t, H'/p_h, W'/p_w): patches along time, height and width."""
        _, f, h, w = self.latent_shape(1)
        pt, ph, pw = self.patch
        return (f // pt, h // ph, w // pw)

    @property
    def tokens(self) -> int:
        """S: the transformer's sequence length for one sample of this bucket."""
        f, h, w = self.patch_grid
        return f * h * w


def near_name(name: str, names) -> str | None:
    """The one name in `names` that `name` is likely a typo of: the same but for case, or one letter changed, added,
    dropped or two swapped (names of four letters or more); None where there is none, or more than one."""
    def one_edit(a: str, b: str) -> bool:
        if abs(len(a) - len(b)) > 1 or a == b:
            return False
        if len(a) == len(b):
            d = [i for i in range(len(a)) if a[i] != b[i]]
            return len(d) == 1 or (len(d) == 2 and d[1] == d[0] + 1 and a[d[0]] == b[d[1]] and a[d[1]] == b[d[0]])
        short, long_ = sorted((a, b), key=len)
        return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))
    hits = [n for n in names if n != name and (n.lower() == name.lower() or (len(name) >= 4 and one_edit(n, name)))]
    return hits[0] if len(hits) == 1 else None


def bucket_table(buckets: Mapping[str, Mapping], stride_t: int = VAE_STRIDE_T, stride_s: int = VAE_STRIDE_S,
                 patch: tuple[int, int, int] = PATCH) -> dict[str, Bucket]:
    """Config dict {name: {frames, height, width}} → {name: Bucket}, ordered by tokens S then name.

    `patch` is the model's (p_t, p_h, p_w) as plain ints (`cfg.model.patch`): S counts the model's tokens.
    """
    if not buckets:
        raise ValueError("data.buckets is empty: define at least one bucket {name: {frames, height, width}}")
    table = {}
    for name, spec in buckets.items():
        unknown = set(spec) - {"frames", "height", "width"}
        if unknown:
            raise ValueError(f"data.buckets.{name} has unknown keys {sorted(unknown)}; expected frames, height, width")
        missing = {"frames", "height", "width"} - set(spec)
        if missing:
            near = near_name(name, buckets)
            raise ValueError(f"data.buckets.{name} is missing {sorted(missing)}" + (
                f" (a typo for data.buckets.{near}? A new bucket needs frames, height and width)" if near else ""))
        table[name] = Bucket(name, spec["frames"], spec["height"], spec["width"], stride_t, stride_s, tuple(patch))
    return dict(sorted(table.items(), key=lambda kv: (kv[1].tokens, kv[0])))
