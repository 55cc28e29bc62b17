"""The data → model seam: the keyword inputs a model takes from a Batch beyond (x_t, 1000·t, text).

Wan takes none. The MMDiT takes the text mask, a pooled text embedding and the embedded guidance:

    pooled   = batch.pooled, or mean of the valid text tokens  Σ_l m_l · text_l / max(1, Σ_l m_l)   (no pooled text)
    guidance = 1000 · model.guidance_scale per sample          (guidance-distilled models only)
    text_span(mask), computed here when the mask is on the host, so the model's forward needs no host sync
"""
from __future__ import annotations

import torch


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
