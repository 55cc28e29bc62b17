"""Export a training checkpoint as a diffusers-format folder (config.json + safetensors).

    python scripts/export.py runs/NAME [--step N] [--ema] --out exported/NAME [--max-shard-size 5GB]

Reads the checkpoint's own resolved config, loads the (possibly sharded) DCP checkpoint into one full model in
this process, optionally takes the EMA weights, and writes what diffusers' `WanTransformer3DModel.from_pretrained`
and our `WanTransformer.from_pretrained` load.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def export(checkpoint: str, out: str, ema: bool = False, max_shard_size: str | None = None) -> str:
    import torch
    import torch.distributed.checkpoint as dcp
    import yaml

    from models.build import build_model
    from training.checkpoint import latest_checkpoint
    from training.config import load_config

    if not os.path.exists(os.path.join(checkpoint, "meta.json")):
        found = latest_checkpoint(checkpoint)
        if found is None:
            raise FileNotFoundError(f"{checkpoint} is neither a checkpoint (step_N/) nor a run folder holding one")
        checkpoint = found
    with open(os.path.join(checkpoint, "config.yaml")) as f:
        cfg = load_config(yaml.safe_load(f))
    from dataclasses import replace

    model = build_model(replace(cfg.model, pretrained=None), "cpu")
    key = "ema" if ema else "model"
    state = {key: {n: p.detach().clone() for n, p in model.named_parameters()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dcp.load(state, checkpoint_id=checkpoint)
        except Exception as e:
            if ema:
                raise ValueError(f"{checkpoint} holds no EMA weights (train with optim.ema_decay set)") from e
            raise
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state[key][n])
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", help="a step_N checkpoint folder, or a run folder (its newest checkpoint)")
    ap.add_argument("--out", required=True, help="folder to write (config.json + safetensors)")
    ap.add_argument("--ema", action="store_true", help="export the EMA weights instead of the raw ones")
    ap.add_argument("--max-shard-size", default=None, help="e.g. 5GB: shard the safetensors with an index")
    args = ap.parse_args(argv)
    print(export(args.checkpoint, args.out, args.ema, args.max_shard_size))


if __name__ == "__main__":
    main()
