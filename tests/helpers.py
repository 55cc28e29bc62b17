"""Shared test helpers: compose the Hydra config as train.py does, and run training in-process."""
from __future__ import annotations

import os

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")
PRESETS = sorted(f[:-5] for f in os.listdir(os.path.join(CONF, "conf")) if f.endswith(".yaml"))


def compose_raw(overrides=()) -> dict:
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return OmegaConf.to_container(compose(config_name="train", overrides=list(overrides)), resolve=True)


def compose_config(overrides=()):
    from training.config import load_config

    return load_config(compose_raw(overrides))


def tiny_overrides(run_dir, cache_dir, *extra) -> list[str]:
    return [f"run_dir={run_dir}", f"data.cache_dir={cache_dir}", "logging.wandb=disabled", "train.progress=false",
            *extra]


def run_training(overrides):
    import train

    raw = compose_raw(overrides)
    cfg = train.load_config(raw)
    return cfg, train.run(cfg, OmegaConf.to_yaml(OmegaConf.create(raw)))


def check_checkpointing_and_compile(model, forward, weight, keys, ignore_grad=lambda name: False):
    """The CUDA checks both backbones share: bf16-autocast training steps with checkpointing off, on, and with
    compiled blocks. Parameters and gradients stay fp32 and finite; recompute leaves the output bit-identical and
    the gradients within bf16 noise; block.compile() keeps the state-dict keys and stays within compile's
    fp32-vs-bf16 fusion noise. ignore_grad(name): parameters whose exact gradient is zero (noise over noise)."""
    import torch

    def step():
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = forward()
        (y.float() * weight).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def rel(a, b):  # max deviation as a fraction of the tensor's scale: bf16 kernels may pick other algorithms
        return ((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-12)).item()

    y_off, g_off = step()
    assert all(p.dtype == torch.float32 and g_off[n].dtype == torch.float32 and torch.isfinite(g_off[n]).all()
               for n, p in model.named_parameters())
    model.set_activation_checkpointing(True)
    y_on, g_on = step()
    assert torch.equal(y_on, y_off)
    worst = max((rel(g_on[n], g_off[n]), n) for n in g_off)
    print(f"checkpointing: worst grad rel diff {worst}")
    assert worst[0] <= 1e-2, worst

    for block in model.blocks:
        block.compile()
    y_c, g_c = step()
    assert list(model.state_dict()) == keys
    worst = max((rel(g_c[n], g_off[n]), n) for n in g_off if not ignore_grad(n))
    print(f"compiled blocks: output rel diff {rel(y_c, y_off):.2e}, worst grad rel diff {worst}")
    assert rel(y_c, y_off) <= 2e-2
    assert worst[0] <= 0.1, worst  # inductor fuses in fp32 where eager rounds to bf16: 3.7e-2 seen on the H200


# -- data robustness: files tests write to plant bad samples -----------------------------------------------------------

def write_tar(path: str, samples) -> None:
    """A WebDataset tar of [(key, {ext: bytes})], members in the order given."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def rewrite_members(root: str, changes: dict) -> None:
    """Replace members of a corpus' samples ({(key, ext): bytes}) by rewriting their shards, and point index.jsonl at
    the new offsets (the other records of those shards move too)."""
    import tarfile

    from data.index import SampleIndex, tar_members

    index = SampleIndex.load(root)
    shards = {r["shard"] for r in index.records if any((r["key"], ext) in changes for ext in r["members"])}
    for shard in shards:
        path = os.path.join(root, shard)
        samples: dict = {}
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                key, _, ext = m.name.partition(".")
                samples.setdefault(key, {})[ext] = changes.get((key, ext), tar.extractfile(m).read())
        write_tar(path, samples.items())
        offsets = tar_members(path)
        for r in index.records:
            if r["shard"] == shard:
                r["members"] = {e: list(v) for e, v in offsets[r["key"]].items()}
    index.save()


def png_claiming(width: int, height: int, rows: int = 1) -> bytes:
    """A 1-bit greyscale PNG whose header says width × height; its pixel data holds `rows` rows of zeros (all of
    them: a real image, which compresses to a few bytes per row; fewer: a bomb that is cut short)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    z = zlib.compressobj(9)
    row = b"\0" * (1 + (width + 7) // 8)
    idat = b"".join(z.compress(row) for _ in range(rows)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
