"""Exporting a training checkpoint as a diffusers-format folder (config.json + safetensors), or its LoRA adapter
(the command line: scripts/export.py).

The checkpoint's own resolved config builds the model; the (possibly sharded, possibly adapter-only) DCP checkpoint
loads into one full model in this process (training/load.py), optionally with the EMA weights. A LoRA model is
merged (W + scale·B A) and written as a full model that diffusers' `WanTransformer3DModel.from_pretrained` and our
`WanTransformer.from_pretrained` load; `adapter=True` writes the adapter alone in diffusers' LoRA format instead
(`WanPipeline.load_lora_weights(out)`).
"""
from __future__ import annotations

from training.load import checkpoint_config, find_checkpoint, load_checkpoint_model


def export(checkpoint: str, out: str, ema: bool = False, max_shard_size: str | None = None,
           adapter: bool = False) -> str:
    from models.lora import has_lora, merge_lora, save_lora

    path = find_checkpoint(checkpoint)
    if path is None:
        raise FileNotFoundError(f"{checkpoint} is neither a checkpoint (step_N/) nor a run folder holding one")
    model = load_checkpoint_model(path, checkpoint_config(path), ema)
    if adapter:
        if not has_lora(model):
            raise ValueError(f"{path} was not trained with a LoRA adapter (model.lora.rank is 0): export it whole")
        save_lora(model, out)
        return out
    merge_lora(model).save_pretrained(out, max_shard_size=max_shard_size)
    return out
