"""Execution applied from outside the model, in this fixed order (as torchtitan's parallelize and Liger's kernels):

    1. fused ops                 models/fused_wan.py apply_fused_ops (class swap of the blocks; models/build.py)
    2. activation checkpointing  a per-micro-batch hook, set_activation_checkpointing(bool | k blocks, keep_attention)
                                 (models/checkpointing.py; the policy below decides k), not a wrapper
    3. compile                   block.compile() per block (torch.compile(block) would rename keys to _orig_mod)
    4. FSDP2                     fully_shard per block, then the root

Fused ops come first because FSDP2 replaces each block's class (FSDP<Block>), which a later class swap would undo;
checkpointing and compile act on the blocks' forward whatever runs it; FSDP2 wraps last. No step renames a
state-dict key. The same code runs on gloo (CPU) and NCCL (GPU). This is the only file that imports FSDP2.

Checkpointing modes (model.checkpointing): none | full | auto — auto decides per micro-batch from the measured memory
models how many leading blocks recompute (none where B·S fits without, more as B·S grows: scheduling.policy
PartialRecompute), and falls back to full without them.

Precision: parameters stay fp32 (the master weights) and are all-gathered in fp32; matmuls run in bf16 under
autocast, while the modulation tables, time embedder and norms compute in fp32 as diffusers keeps them
(FSDP2's bf16 param policy would cast those too, so it is not used).

Large models (models/build.py build_parallel_model): every rank builds the model on the meta device and shards it; rank 0 alone holds
a full copy (random init or the pretrained folder) in host memory and broadcasts it shard by shard
(`set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`), so 14B on 8 ranks never holds
8 full copies.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)


@dataclass
class FSDPOptions:
    """FSDP2 options; train.py fills them from accelerate's FSDP config when one is given (plain values)."""
    reshard_after_forward: bool = True
    offload_params: bool = False


def checkpoint_policy(mode: str, recompute_blocks: Optional[Callable[[int, int], object]] = None,
                      keep_attention: bool | str = False, layers: int = 0) -> Callable[[int, int], object]:
    """(B, S) → which blocks this micro-batch recomputes in backward: True all, False none, k the first k, or
    (k, j): the last j of them keep their attention outputs (set_activation_checkpointing's arguments).
    recompute_blocks is the memory model's answer per micro-batch (scheduling/policy.py: checkpointing=auto, or
    keep_attention=auto); without one, full recomputes every block, and keep_attention=true keeps every block's
    attention (auto keeps none: it needs the memory model)."""
    if mode == "none":
        return lambda B, S: False
    if recompute_blocks is not None:
        return recompute_blocks
    if mode == "auto" or keep_attention == "auto":
        log.info("model.checkpointing=%s, keep_attention=%s: choosing per micro-batch needs a calibration with the "
                 "modes none, full and keep (python scripts/calibrate.py conf=... model.checkpointing=auto "
                 "model.keep_attention=auto scans them): until then every micro-batch recomputes every block%s",
                 mode, keep_attention, " and keeps its attention" if keep_attention is True else "")
    return (lambda B, S: (layers, layers)) if keep_attention is True else (lambda B, S: True)


def parallelize(model: torch.nn.Module, *, compile: bool = False, world_size: int = 1,
                fsdp: Optional[FSDPOptions] = None, shard: Optional[bool] = None) -> torch.nn.Module:
    """shard: apply FSDP2 (default: when world_size > 1; a test may shard over a one-process group)."""
    if compile:
        for block in model.blocks:
            block.compile()
    if world_size > 1 if shard is None else shard:
        if model.offload_checkpoints:
            raise ValueError("offload_checkpoints recomputes blocks inside backward (reentrant), which FSDP2's hooks "
                             "do not follow: use it in a single process, or turn it off to shard")
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        fsdp = fsdp or FSDPOptions()
        kw = {"offload_policy": CPUOffloadPolicy()} if fsdp.offload_params else {}
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=fsdp.reshard_after_forward, **kw)
        fully_shard(model, reshard_after_forward=fsdp.reshard_after_forward, **kw)
    return model


def materialize_from_rank0(model: torch.nn.Module, full_sd: dict, device: torch.device,
                           offload_params: bool = False) -> torch.nn.Module:
    """A model sharded on the meta device gets storage on `device` (the CPU when FSDP2 offloads parameters) and
    rank 0's full state dict, shard by shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device="cpu" if offload_params else device)
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model
