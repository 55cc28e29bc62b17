"""Print the bucket table of a config: each bucket's latent shape, tokens S, and batch size B per strategy.

    python scripts/show_buckets.py conf=wan21_8gpu [scheduling.m_tokens=...]
    python train.py +show_buckets=true            (the same, through train.py)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.buckets import bucket_table  # noqa: E402
from scheduling.batching import dual_constraint_batch_size, equal_token_batch_size  # noqa: E402


def print_buckets(cfg) -> None:
    table = bucket_table(cfg.data.buckets)
    sc = cfg.scheduling
    head = f"{'bucket':<16}{'frames':>7}{'H×W':>11}{'latent C×F×H×W':>18}{'S':>8}"
    cols = []
    if sc.m_tokens:
        cols.append((f"B equal_token(m_tokens={sc.m_tokens:g})", lambda S: equal_token_batch_size(S, sc.m_tokens)))
    if None not in (sc.m_mem, sc.m_comp, sc.p):
        cols.append((f"B dual_constraint(m_mem={sc.m_mem:g}, m_comp={sc.m_comp:g}, p={sc.p:g})",
                     lambda S: dual_constraint_batch_size(S, sc.m_mem, sc.m_comp, sc.p)))
    print(f"config {cfg.name}: strategy {sc.strategy}, {len(table)} buckets")
    print(head + "".join(f"  {name}" for name, _ in cols))
    for name, b in table.items():
        c, f, h, w = b.latent_shape(cfg.model.in_channels)
        row = f"{name:<16}{b.frames:>7}{f'{b.height}×{b.width}':>11}{f'{c}×{f}×{h}×{w}':>18}{b.tokens:>8}"
        print(row + "".join(f"  {fn(b.tokens):>{len(n)}}" for n, fn in cols))


if __name__ == "__main__":
    import hydra
    from omegaconf import OmegaConf

    from training.config import load_config

    @hydra.main(config_path="../conf", config_name="train", version_base=None)
    def _main(dcfg) -> None:
        raw = OmegaConf.to_container(dcfg, resolve=True)
        raw.pop("hydra", None)
        print_buckets(load_config(raw))

    sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=disabled"]
    _main()
