"""Export a training checkpoint as a diffusers-format folder (config.json + safetensors), or its LoRA adapter.

    python scripts/export.py runs/NAME [--step N] [--ema] --out exported/NAME [--max-shard-size 5GB] [--adapter]

Reads the checkpoint's own resolved config and loads the (possibly sharded, possibly adapter-only) DCP checkpoint
into one full model in this process (scripts/sample.py's loader), optionally with the EMA weights. A LoRA model is
merged (W + scale·B A) and written as a full model that diffusers' `WanTransformer3DModel.from_pretrained` and our
`WanTransformer.from_pretrained` load; `--adapter` writes the adapter alone in diffusers' LoRA format instead
(`WanPipeline.load_lora_weights(out)`).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def export(checkpoint: str, out: str, ema: bool = False, max_shard_size: str | None = None,
           adapter: bool = False) -> str:
    from models.lora import has_lora, merge_lora, save_lora
    from scripts.sample import checkpoint_config, find_checkpoint, load_checkpoint_model

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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", help="a step_N checkpoint folder, or a run folder (its newest checkpoint)")
    ap.add_argument("--out", required=True, help="folder to write (config.json + safetensors)")
    ap.add_argument("--ema", action="store_true", help="export the EMA weights instead of the raw ones")
    ap.add_argument("--max-shard-size", default=None, help="e.g. 5GB: shard the safetensors with an index")
    ap.add_argument("--adapter", action="store_true", help="write only the LoRA adapter (diffusers' LoRA format)")
    args = ap.parse_args(argv)
    print(export(args.checkpoint, args.out, args.ema, args.max_shard_size, args.adapter))


if __name__ == "__main__":
    main()
