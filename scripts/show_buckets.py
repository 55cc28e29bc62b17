"""Print the bucket table of a config: each bucket's latent shape, tokens S, batch size B and predicted cost.

    python scripts/show_buckets.py conf=wan21_8gpu [scheduling.m_tokens=...]
    python train.py +show_buckets=true            (the same, through train.py)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from training.bucket_report import print_buckets  # noqa: E402
from training.cli import run_main  # noqa: E402
from training.config import compose_config  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides (conf=NAME picks a preset)")
    print_buckets(compose_config(ap.parse_args(argv).overrides))


if __name__ == "__main__":
    run_main(main)
