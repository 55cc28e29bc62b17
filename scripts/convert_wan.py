"""Convert a Wan 2.1 text-to-video checkpoint in the original layout (Wan-AI's `WanModel`) to the diffusers layout
that models/wan.py, `model.pretrained` and diffusers' WanTransformer3DModel load — and back.

    python scripts/convert_wan.py /models/Wan2.1-T2V-14B --out /models/wan21_t2v_14b_diffusers [--dtype bfloat16]
                                  [--max-shard-size 10GB] [--num-heads 40]
    python scripts/convert_wan.py runs/NAME/export --out wan_original --to-original     (diffusers → original)

The source is a folder of `*.safetensors` shards, or one .safetensors / .pth file. The key map, the prefixes it
accepts, what it refuses and where the config comes from: models/convert_wan.py.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from models.convert_wan import convert, convert_to_original  # noqa: E402
from training.cli import run_main  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", help="original checkpoint folder or file (or, with --to-original, a diffusers folder)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="keep", choices=["keep", "float32", "bfloat16"],
                    help="bfloat16 keeps the fp32 modules (time embedder, modulation tables, norms) in fp32")
    ap.add_argument("--max-shard-size", default=None, help="e.g. 10GB: shard the safetensors with an index")
    ap.add_argument("--num-heads", type=int, default=None, help="without WanModel's config.json: dim / 128")
    ap.add_argument("--to-original", action="store_true", help="convert a diffusers folder to the original layout")
    args = ap.parse_args(argv)
    if args.to_original:
        print(convert_to_original(args.source, args.out))
    else:
        print(convert(args.source, args.out, args.dtype, args.max_shard_size, args.num_heads))


if __name__ == "__main__":
    run_main(main)
