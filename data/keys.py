"""Keyed random streams: a generator seeded from a stable hash of its key parts (seed, epoch, sample key, ...).

Every random choice tied to a sample — which clip of a video, whether its caption drops, its noise and t — draws
from a generator keyed this way, so a resumed run, or the same sample on another rank or worker, draws the same
values whatever else ran before (contracts §5). The hash is BLAKE2b of the parts joined by "/"; changing it changes
every run's data and noise.
"""
from __future__ import annotations

import hashlib

import torch


def keyed_generator(*parts) -> torch.Generator:
    """A CPU generator seeded from a stable hash of `parts` (seed, epoch, sample key, ...)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
