"""Model factory: ModelConfig → a model on one device (parallelism is applied from outside, models/parallelize.py)."""
from __future__ import annotations

from dataclasses import replace

import torch

from models.config import ModelConfig
from models.parallelize import FSDPOptions, materialize_from_rank0, parallelize


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The full model on `device`: random (under the caller's torch seed) or from `cfg.pretrained`."""
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
    model.glue_backend = cfg.glue_backend
    if cfg.offload_checkpoints:
        model.offload_checkpoints = True
    return apply_finetune(model, cfg)  # LoRA / frozen before parallelize


def build_parallel_model(cfg: ModelConfig, rank: int, world_size: int, device: torch.device,
                         fsdp: FSDPOptions | None = None) -> torch.nn.Module:
    """The model as training runs it: on one device, or sharded with FSDP2 from rank 0's full copy.

    Under FSDP2 only rank 0 builds the full model in host memory (random under the caller's seed — the same init
    a one-process run gets — or from cfg.pretrained); the others build on the meta device and receive their shards.
    """
    if world_size == 1:
        return parallelize(build_model(cfg, device), compile=cfg.compile)
    full_sd = build_model(cfg, "cpu").state_dict() if rank == 0 else {}
    model = build_model(replace(cfg, pretrained=None), "meta")
    parallelize(model, compile=cfg.compile, world_size=world_size, fsdp=fsdp)
    return materialize_from_rank0(model, full_sd, device, offload_params=bool(fsdp and fsdp.offload_params))


def model_inputs(cfg, batch) -> dict:
    """Keyword inputs beyond (x_t, 1000·t, text) that the model takes from the batch (MMDiT: mask, pooled text,
    embedded guidance). A corpus without pooled text gets the mean of its valid text tokens."""
    if cfg.name != "mmdit":
        return {}
    mask, pooled = batch.text_mask, batch.pooled
    if pooled is None:
        if cfg.pooled_projection_dim != cfg.text_embed_dim:
            raise ValueError(f"the corpus has no pooled text embedding and model.pooled_projection_dim="
                             f"{cfg.pooled_projection_dim} differs from model.text_embed_dim={cfg.text_embed_dim}: "
                             "precompute pooled embeddings or make the two equal")
        m = mask.float()[..., None]
        pooled = (batch.text * m).sum(1) / m.sum(1).clamp_min(1)
    guidance = (torch.full((batch.B,), 1000.0 * cfg.guidance_scale, device=batch.latents.device)
                if cfg.guidance_embeds else None)
    out = dict(encoder_attention_mask=mask, pooled_projections=pooled, guidance=guidance)
    if mask is not None and mask.device.type == "cpu":  # on the host: no sync inside the model's forward
        from models.mmdit import text_span

        out["text_span"] = text_span(mask)
    return out


def matmul_params(model: torch.nn.Module) -> int:
    return int(model.num_matmul_params())
