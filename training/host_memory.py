"""Host memory a CPU run will need, estimated before anything is built, and the refusal above the machine's RAM.

A GPU preset forced onto CPUs (`launch.device=cpu`) would otherwise grow until the kernel kills it. The estimate is
rough (within a factor of about two), in bytes, summed over this machine's processes (`n` of them, `W` in all):

    weights      4·P               fp32 master weights (CPU runs in fp32), P parameters; under FSDP sharded over
                                   the W processes, plus rank 0's full copy while it shards (4·P more when W > 1)
    gradients    4·P_t             P_t trainable parameters (LoRA / model.freeze leave the rest out)
    AdamW        8·P_t             exp_avg and exp_avg_sq
    EMA          4·P_t             when optim.ema_decay is set
    activations  n · L · T · a     each process's largest micro-batch: T tokens (the largest of scheduling.m_tokens,
                                   scheduling.m_mem and the longest bucket's S) through L blocks, keeping
                                   a = 4·(16·D + 2·F) bytes a token a block (fp32 values: the block's normed inputs,
                                   q, k, v, attention output, projections and residuals ≈ 16·D, the MLP's two F-wide
                                   tensors); model.checkpointing=full keeps 4·D a block plus one block's a

P and P_t are counted on the meta device (no memory). The machine's RAM is MemTotal (os.sysconf).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)
GIB = 2**30


@dataclass
class HostMemory:
    params: int
    trainable: int
    tokens: int
    parts: dict  # name → bytes

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        return (f"about {self.total / GIB:.1f} GiB (" + ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.parts.items())
                + f" GiB; {self.params / 1e9:.2f} B parameters, {self.trainable / 1e9:.2f} B trained, "
                f"{self.tokens} tokens in the largest micro-batch)")


def host_ram_bytes() -> int:
    """This machine's physical memory (MemTotal)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def estimate_host_memory(cfg, world_size: int = 1, local_processes: int = 1) -> HostMemory:
    """The module docstring's estimate for TrainConfig `cfg`."""
    import torch

    from data.buckets import bucket_table
    from models.build import build_model

    with torch.random.fork_rng():  # a meta build draws no numbers, but the run's seed stays untouched regardless
        model = build_model(replace(cfg.model, pretrained=None, compile=False), "meta")
    P = sum(p.numel() for p in model.parameters())
    Pt = sum(p.numel() for p in model.parameters() if p.requires_grad)
    m, sc = cfg.model, cfg.scheduling
    longest = max(b.tokens for b in bucket_table(cfg.data.buckets, patch=m.patch).values())
    T = int(max(longest, sc.m_tokens or 0, sc.m_mem or 0))
    D, L = m.dim, m.attention_layers
    a = 4 * (16 * D + 2 * getattr(m, "ffn_dim", 4 * D))
    per_token = 4 * D * L + a if m.checkpointing == "full" else a * L
    parts = {"weights": 4 * P * (1 + (world_size > 1)), "gradients": 4 * Pt, "AdamW": 8 * Pt}
    if cfg.optim.ema_decay:
        parts["EMA"] = 4 * Pt
    parts = {k: v * local_processes / world_size for k, v in parts.items()}
    parts["activations"] = local_processes * T * per_token
    return HostMemory(P, Pt, T, parts)


def check_host_memory(cfg, world_size: int, is_main: bool, ram: int | None = None) -> None:
    """On CPUs: log the estimate where it is a sizeable share of RAM (over a quarter), and refuse one above RAM
    unless launch.force=true."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    need = estimate_host_memory(cfg, world_size, local)
    ram = host_ram_bytes() if ram is None else ram
    if need.total <= ram / 4:
        return
    line = f"host memory: {need.describe()} estimated, of {ram / GIB:.1f} GiB of RAM"
    if need.total > ram and not cfg.launch.force:
        raise ValueError(f"{line}: this run would grow until the kernel kills it. Run it on its GPUs "
                         f"(launch.device=cuda), or shrink it for CPUs (the default tiny model, fewer and shorter "
                         f"data.buckets, model.checkpointing=full), or set launch.force=true to try "
                         f"anyway")
    if is_main:
        log.warning("%s%s", line, " (launch.force=true: trying anyway)" if need.total > ram else "")
