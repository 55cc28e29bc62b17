"""Export a training checkpoint as a diffusers-format folder (config.json + safetensors), or its LoRA adapter.

    python scripts/export.py runs/NAME [--step N] [--ema] --out exported/NAME [--max-shard-size 5GB] [--adapter]

Reads the checkpoint's own resolved config and loads the (possibly sharded, possibly adapter-only) DCP checkpoint
into one full model in this process (training/load.py), optionally with the EMA weights. A LoRA model is
merged (W + scale·B A) and written as a full model that diffusers' `WanTransformer3DModel.from_pretrained` and our
`WanTransformer.from_pretrained` load; `--adapter` writes the adapter alone in diffusers' LoRA format instead
(`WanPipeline.load_lora_weights(out)`).

The export is written into a temporary folder beside --out and renamed into place once whole. Anything --out held
before (an earlier export) is moved aside to `<out>.old-<UTC time>`, with a warning, so an older weights file never
sits beside the new ones.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from training.cli import run_main  # noqa: E402
from training.export import export  # noqa: E402


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
    run_main(main)
