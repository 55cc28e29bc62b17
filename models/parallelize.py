"""Parallelism applied from outside the model, in this order: activation-checkpointing policy, compile, FSDP2.

The same code runs on gloo (CPU) and NCCL (GPU). The model itself only exposes
`set_activation_checkpointing(bool)` (a per-step hook, not a wrapper, so state-dict keys never change) and its
`blocks`; compile uses `block.compile()` for the same reason.

Checkpointing modes (model.checkpointing): none | full | auto — auto decides per micro-batch from the memory
model of a calibration (B·S above the budget's no-recompute limit), and falls back to full without one.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)


def checkpoint_policy(mode: str, no_recompute_tokens: Optional[float] = None) -> Callable[[int, int], bool]:
    """(B, S) → whether this micro-batch recomputes activations in backward."""
    if mode == "none":
        return lambda B, S: False
    if mode == "full" or no_recompute_tokens is None:
        if mode == "auto":
            log.info("model.checkpointing=auto without a memory model: checkpointing every micro-batch")
        return lambda B, S: True
    return lambda B, S: B * S > no_recompute_tokens


def parallelize(model: torch.nn.Module, *, compile: bool = False, world_size: int = 1,
                mixed_precision: bool = False) -> torch.nn.Module:
    if compile:
        for block in model.blocks:
            block.compile()
    if world_size > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
        kw = {"mp_policy": mp} if mp is not None else {}
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
    return model
