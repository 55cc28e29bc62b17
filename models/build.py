"""Model factory: ModelConfig → the model as training runs it, built in the fixed order

    1. the reference model (models/wan.py, models/mmdit.py) on one device, random or from `model.pretrained`
    2. fused ops (models/fused_wan.py apply_fused_ops, `model.fused_ops`) and the activation-checkpointing knobs
       (`model.offload_checkpoints`; which blocks recompute is set per micro-batch: models/checkpointing.py)
    3. fine-tuning: LoRA adapters / frozen parameters (models/lora.py)
    4. compile and FSDP2 (models/parallelize.py), in build_parallel_model

None of the steps renames a state-dict key. The conditioning a model takes beyond (x_t, 1000·t, text) is built from
the batch at the data → model seam (training/inputs.py).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from models.config import ModelConfig
from models.parallelize import FSDPOptions, materialize_from_rank0, parallelize


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The full model on `device`: random (under the caller's torch seed) or from `cfg.pretrained`, with its fused ops
    and fine-tuning applied (steps 1–3 of the module docstring)."""
    from models.fused_wan import apply_fused_ops
    from models.layers import apply_attention_backend
    from models.lora import apply_finetune

    if cfg.name == "mmdit":
        from models.mmdit import MMDiT as Model
    else:
        from models.wan import WanTransformer as Model

    if cfg.pretrained:
        model = Model.from_pretrained(cfg.pretrained, adaln_backend=cfg.adaln_backend)
        theirs = {k: v for k, v in model.config.items() if k in cfg.diffusers_kwargs()}
        ours = {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.diffusers_kwargs().items()}
        diff = {k: (ours[k], list(v) if isinstance(v, tuple) else v) for k, v in theirs.items()
                if (list(v) if isinstance(v, tuple) else v) != ours[k]}
        if diff:
            raise ValueError(f"model.pretrained={cfg.pretrained} has a config that differs from model.*: "
                             + ", ".join(f"model.{k}={a} but the checkpoint has {b}" for k, (a, b) in diff.items()))
        model = model.to(device=device, dtype=torch.float32)
    else:
        with torch.device(device):
            model = Model(**cfg.diffusers_kwargs(), adaln_backend=cfg.adaln_backend)
    apply_fused_ops(model, cfg.fused_ops)
    apply_attention_backend(model, cfg.attention_backend)
    if cfg.offload_checkpoints:
        model.offload_checkpoints = True
    return apply_finetune(model, cfg)  # LoRA / frozen before parallelize


def build_parallel_model(cfg: ModelConfig, rank: int, world_size: int, device: torch.device,
                         fsdp: FSDPOptions | None = None) -> torch.nn.Module:
    """The model as training runs it: on one device, or sharded with FSDP2 from rank 0's full copy.

    The random init is always drawn in host memory (torch's CPU generator, under the caller's seed), then moved: a
    one-process run on a GPU starts from the same weights as rank 0 of a sharded run, on any GPU (the CUDA
    generator would draw other numbers). Under FSDP2 only rank 0 builds the full model (random, or from
    cfg.pretrained); the others build on the meta device and receive their shards.
    """
    if world_size == 1:
        return parallelize(build_model(cfg, "cpu").to(device), compile=cfg.compile)
    full_sd = build_model(cfg, "cpu").state_dict() if rank == 0 else {}
    model = build_model(replace(cfg, pretrained=None), "meta")
    parallelize(model, compile=cfg.compile, world_size=world_size, fsdp=fsdp)
    return materialize_from_rank0(model, full_sd, device, offload_params=bool(fsdp and fsdp.offload_params))


def matmul_params(model: torch.nn.Module) -> int:
    return int(model.num_matmul_params())
