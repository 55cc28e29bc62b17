"""Typed configuration of the data side (the `data:` group).

Numbers reach these dataclasses already checked finite and of their declared type (training/config.py; the
entries of `buckets` and `mix` are typed, so theirs are too); the range of each is checked here, and the bucket
shapes by data/buckets.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from data.buckets import near_name
from data.encoders import EncoderConfig
from data.raw import RawConfig


VAL_SHARE, VAL_CAP = 0.1, 8  # data.val_samples=null holds out this share of a corpus, at most this many


def auto_val_samples(num_samples: int) -> int:
    """Held-out samples for val/loss when data.val_samples is null: min(VAL_CAP, ⌊VAL_SHARE · M⌋), at least 1, so a
    corpus of 5 samples trains on 4 and a large one gives up only 8."""
    return max(1, min(VAL_CAP, int(VAL_SHARE * num_samples)))


@dataclass
class SyntheticConfig:
    """The embedded corpus, generated on first use into `data.cache_dir` when no index or urls are given."""
    kind: str = "waves"                      # waves: latents of per-class travelling waves (data/synthetic.py);
                                             # shapes: moving shapes with captions, PCA VAE (data/shapes.py)
    num_samples: int = 192
    num_val: int = 8
    num_classes: int = 8
    seed: int = 0                            # in [0, 2^64)
    mix: dict[str, float] = field(default_factory=dict)  # bucket name → share ≥ 0 (0: none); empty: equal shares
    samples_per_shard: int = 64
    dtype: str = "float32"

    def __post_init__(self):
        if self.kind not in ("waves", "shapes"):
            raise ValueError(f"data.synthetic.kind must be waves or shapes, got {self.kind!r}")
        if self.num_samples < 1:
            raise ValueError(f"data.synthetic.num_samples must be ≥ 1, got {self.num_samples}")
        if self.num_val < 0:
            raise ValueError(f"data.synthetic.num_val must be ≥ 0, got {self.num_val}")
        for name in ("num_classes", "samples_per_shard"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.synthetic.{name} must be ≥ 1, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**64:  # torch.manual_seed's range; numpy's default_rng refuses negative seeds
            raise ValueError(f"data.synthetic.seed must lie in [0, 2^64), got {self.seed}")
        # A share of 0 leaves that bucket out of the corpus while it stays in the bucket table.
        for name, share in self.mix.items():
            if not (math.isfinite(share) and share >= 0):
                raise ValueError(f"data.synthetic.mix.{name} must be a finite share ≥ 0, got {share}")
        if self.mix and not any(self.mix.values()):
            raise ValueError(f"data.synthetic.mix gives every bucket a zero share: {dict(self.mix)}")
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"data.synthetic.dtype must be float32 or float16, got {self.dtype!r}")


def synthetic_mix(mix: dict[str, float], bucket_names: list[str]) -> dict[str, float]:
    """Each bucket's share of the synthetic corpus (renormalised by its writer): `data.synthetic.mix`, or every bucket
    alike when it is empty. A bucket the mix does not name gets what its shares leave under 1, split equally among
    such buckets; when they leave nothing (they sum to 1 or more) the bucket would silently get no samples, so that
    is a ValueError naming the key to set (0 keeps the bucket in the table with no synthetic samples)."""
    if not mix:
        return {n: 1.0 for n in bucket_names}
    unnamed = [n for n in bucket_names if n not in mix]
    if not unnamed:
        return dict(mix)
    rest = 1.0 - sum(mix.values())
    if rest <= 1e-9:
        raise ValueError(
            f"data.synthetic.mix gives no share to bucket(s) {unnamed}, and the shares it gives sum to "
            f"{sum(mix.values()):g}, leaving none: such a bucket would get no samples. Set "
            + " ".join(f"'+data.synthetic.mix.{n}=<share>'" for n in unnamed)
            + " (shares are renormalised; 0 keeps the bucket with no synthetic samples)"
            + "".join(f"; is {n} a typo for {near}?" for n in unnamed if (near := near_name(n, bucket_names))))
    return dict(mix) | {n: rest / len(unnamed) for n in unnamed}


@dataclass
class DataConfig:
    RESUME_DEFAULT = "plan"  # the corpus and its buckets; data.raw/encoders/synthetic too (training/resume.py)
    buckets: dict[str, dict[str, int]] = field(default_factory=dict)  # name → {frames, height, width} in pixels
    index: Optional[str] = None                  # a corpus folder holding index.jsonl (latent or raw); with urls:
                                                 # where their index goes (default: beside the shards)
    urls: Optional[Any] = None                   # raw WebDataset shards: brace pattern, glob, list file, or a list
    sources: Optional[list] = None               # [{index: folder | urls: pattern, weight: w}, ...]: weighted mix
    raw: RawConfig = field(default_factory=RawConfig)            # raw samples → bucket-sized pixels
    encoders: EncoderConfig = field(default_factory=EncoderConfig)  # VAE + text encoder for raw corpora
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    cache_dir: str = ".cache"
    num_workers: int = field(default=0, metadata={"resume": "execution"})  # threads decoding this and the next
                                                 # step's micro-batches ahead
    caption_dropout: float = field(default=0.1, metadata={"resume": "free"})
    val_samples: Optional[int] = None            # held-out samples for val/loss; null: auto_val_samples(M)

    def __post_init__(self):
        if not 0 <= self.caption_dropout <= 1:
            raise ValueError(f"data.caption_dropout must lie in [0, 1], got {self.caption_dropout}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be ≥ 0, got {self.num_workers}")
        if self.val_samples is not None and self.val_samples < 1:
            raise ValueError(f"data.val_samples must be ≥ 1 (or null: {VAL_SHARE:.0%} of the corpus, at most "
                             f"{VAL_CAP}), got {self.val_samples}")
        if self.sources is not None:
            for i, s in enumerate(self.sources):
                if not isinstance(s, dict) or not ({"index", "urls"} & set(s)) or set(s) - {"index", "urls", "weight"}:
                    raise ValueError(f"data.sources[{i}] must be {{index: <corpus folder>, weight: <w>}} or "
                                     f"{{urls: <shards>, weight: <w>}} (index then says where their index goes), "
                                     f"got {s!r}")
                w = s.get("weight", 1.0)
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w > 0):
                    raise ValueError(f"data.sources[{i}].weight must be a finite number > 0, got {w!r}")
        if self.index is None and self.urls is None and self.sources is None:
            synthetic_mix(self.synthetic.mix, list(self.buckets))  # refuses a bucket the synthetic mix leaves out
        if self.urls is not None:
            if self.sources is not None:
                raise ValueError("set data.urls or data.sources, not both: a source takes {urls: ..., weight: ...}")
            if not (isinstance(self.urls, str) and self.urls) and not (
                    isinstance(self.urls, (list, tuple)) and self.urls and all(isinstance(u, str) for u in self.urls)):
                raise ValueError(f"data.urls must be a shard pattern, a list file or a list of them, got {self.urls!r}")
