"""The bucket table of a config as a user reads it before a run: each bucket's latent shape, tokens S, batch size
B and predicted cost (`python train.py +show_buckets=true`, scripts/show_buckets.py).

It builds the model on the meta device (parameter counts, no memory) and takes the calibration the trainer would
take, without measuring anything; with none yet, the equal-token table at scheduling.m_tokens.
"""
from __future__ import annotations

from data.buckets import bucket_table
from data.loader import synthetic_shares
from scheduling.batching import equal_token_batch_size


def print_buckets(cfg) -> None:
    """Every bucket's latent shape and S; B, B·S and predicted ms under the configured strategy (with values from
    the calibration where the config leaves them null); the equal-token B beside it when m_tokens is set."""
    from dataclasses import replace

    import torch

    from models.build import build_model
    from scheduling.policy import ModelShape, schedule_for
    from training.cuda_graphs import graph_blockers, graphs_off_because

    table = bucket_table(cfg.data.buckets, patch=cfg.model.patch)
    sc = cfg.scheduling
    if sc.calibration == "auto":  # what the trainer would take, without measuring anything here
        from training.shape_benchmark import device_name, find_calibration

        device = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        path, how = find_calibration(cfg, device, cfg.launch.num_processes)
        if path is None:
            print(f"scheduling.calibration=auto: no file fits this model on {device} ({'; '.join(how) or 'none'}); "
                  "the run measures one on first use. Until then, the equal-token table at scheduling.m_tokens:")
            sc = replace(sc, strategy="equal_token", calibration=None, planner=None)  # reformed needs m_mem
        else:
            print(f"scheduling.calibration=auto: {path} ({how})")
            sc = replace(sc, calibration=path)
        cfg = replace(cfg, scheduling=sc)
    shares = None
    if sc.tokens_per_step is not None:  # the trainer counts the corpus' samples; here: the synthetic mix
        shares = synthetic_shares(cfg.data, list(table))
        if shares is None:
            print(f"scheduling.tokens_per_step={sc.tokens_per_step:g} is held with the corpus' own bucket shares, "
                  "counted when the run opens it; the table below is the configured knobs' without it")
            cfg = replace(cfg, scheduling=replace(sc, tokens_per_step=None))
    meta = build_model(replace(cfg.model, pretrained=None), "meta")  # parameter counts without memory
    shape = ModelShape.of(cfg.model, meta.num_matmul_params())
    # the device the run would take (a GPU preset shown on a CPU machine is planned for its GPU), for the graphs' pool
    device = torch.device("cpu" if cfg.launch.device == "cpu" or (cfg.launch.device == "auto"
                                                                  and not torch.cuda.is_available()) else "cuda")
    graphs = not graphs_off_because(cfg.train.cuda_graphs, device, cfg.launch.num_processes, graph_blockers(cfg.model))
    schedule = schedule_for(cfg, {n: b.tokens for n, b in table.items()}, shape, cfg.launch.num_processes, shares,
                            graph_tokens=cfg.train.graph_max_tokens if graphs else 0)
    print(f"config {cfg.name}: strategy {schedule.strategy}, {len(table)} buckets, values {schedule.values}")
    print(f"sources: {schedule.sources}")
    for note in schedule.notes:
        print(f"note: {note}")
    extra = sc.strategy != "equal_token" and sc.m_tokens
    print(f"{'bucket':<16}{'frames':>7}{'H×W':>11}{'latent C×F×H×W':>18}{'S':>8}{'B':>6}{'B·S':>9}{'pred ms':>10}"
          + (f"{'B equal_token':>15}" if extra else ""))
    for name, b in table.items():
        c, f, h, w = b.latent_shape(cfg.model.in_channels)
        B = schedule.batch_sizes[name]
        row = (f"{name:<16}{b.frames:>7}{f'{b.height}×{b.width}':>11}{f'{c}×{f}×{h}×{w}':>18}{b.tokens:>8}"
               f"{B:>6}{B * b.tokens:>9}{schedule.cost_fn(B, b.tokens):>10.4g}")
        print(row + (f"{equal_token_batch_size(b.tokens, sc.m_tokens):>15}" if extra else ""))
