"""The metrics path: what wandb is told (group, tags, x-axes), which wandb mode wins, and balance/step_time_cv."""
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from scheduling.planner import SampleTable, plan_step
from scheduling.policy import ModelShape
from training.dist import DistContext
from training.metrics import LoggingConfig, MetricsLogger, StepMetrics
from training.step import StepStats


class FakeWandb(types.ModuleType):
    """Records what the logger asks of wandb."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kw):
        self.calls.append(("init", kw))
        return self

    def define_metric(self, name, **kw):
        self.calls.append(("define_metric", name, kw))

    def log(self, row, step=None):
        self.calls.append(("log", row, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_gets_the_config_group_tags_and_samples_seen_as_x_axis(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = LoggingConfig(wandb="offline", group="lr-sweep", tags=["mine"])
    log = MetricsLogger(str(tmp_path), cfg, "run-a", {"optim": {"lr": 1e-3}}, tags=("strategy:balanced", "world:8"))
    log.log_metrics(3, {"samples_seen": 96, "tokens_seen": 4096, "train/loss": 0.5, "batch/S": [16, 48]})
    log.close()
    (_, init), *rest = fake.calls
    assert init["group"] == "lr-sweep" and init["tags"] == ["mine", "strategy:balanced", "world:8"]
    assert init["config"] == {"optim": {"lr": 1e-3}} and init["name"] == "run-a" and init["mode"] == "offline"
    defined = {c[1]: c[2] for c in rest if c[0] == "define_metric"}
    assert defined["samples_seen"] == {} and defined["tokens_seen"] == {}
    assert defined["train/*"] == {"step_metric": "samples_seen"} and defined["balance/*"] == {"step_metric": "samples_seen"}
    logged = next(c for c in rest if c[0] == "log")
    assert logged[1]["train/loss"] == 0.5 and logged[1]["batch/S"] == 32 and logged[2] == 3


@pytest.mark.slow
def test_the_command_line_beats_wandb_mode_in_the_environment(tmp_path):
    from tests.helpers import ROOT

    run_dir = tmp_path / "r"
    args = [sys.executable, "train.py", f"run_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=1",
            "train.progress=false", "logging=disabled"]
    done = subprocess.run(args, cwd=ROOT, env=dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run_dir / "metrics.jsonl").exists() and not (run_dir / "wandb").exists()


def test_step_time_cv_is_what_the_plan_does_not_explain():
    """Steps of different plans whose times follow their predictions: CV 0, though their times vary 4×; a
    straggler (one step 50 % slow) shows."""
    table = SampleTable(np.arange(400), np.repeat([0, 1], 200), np.repeat([16, 64], 200))
    cost = lambda B, S: float(B * S * S)  # noqa: E731
    plans, pos = [], 0
    for _ in range(12):
        plan, pos = plan_step(table, 0, 0, pos, 1, "balanced", 2, [4, 1], cost)
        plans.append(plan)
    preds = [float(p.pred_ms().max(axis=0).sum()) / 1e3 for p in plans]
    assert max(preds) / min(preds) > 2  # the plans differ

    def cv_of(slow_at):
        m = StepMetrics(DistContext(), ModelShape(10, 2, 64, 8), None)
        for i, (plan, pred) in enumerate(zip(plans, preds)):
            row = m.row(i + 1, plan, StepStats(), pred * (1.5 if i == slow_at else 1.0), None)
        return row["balance/step_time_cv"]

    assert cv_of(None) == pytest.approx(0.0, abs=1e-12)
    straggled = cv_of(5)
    assert straggled == pytest.approx(np.std([1.0] * 11 + [1.5]) / np.mean([1.0] * 11 + [1.5]), rel=1e-9)


def test_each_model_counts_its_training_flops_by_the_contract_formula():
    """MFU's numerator (docs/contracts.md §9): Wan's train_flops is 6·P·S + 12·layers·D·(S² + S·L), term for term;
    the MMDiT's ffn_dim is the width its blocks build (dim · mlp_ratio)."""
    import torch

    from models.config import MMDiTConfig
    from models.mmdit import MMDiT
    from models.wan import WanTransformer
    from scheduling.efficiency import model_flops

    torch.manual_seed(0)
    wan = WanTransformer(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                         out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3)
    P, D = wan.num_matmul_params(), 24
    for S, L in ((16, 8), (120, 32), (7, 0)):
        assert wan.train_flops(S, L) == model_flops(1, S, L, P, 3, D)
    assert wan.train_flops(16, 8) - wan.train_flops(16, 0) == 12 * 3 * D * 16 * 8  # the cross-attention term
    cfg = MMDiTConfig(num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=1,
                      num_refiner_layers=1, mlp_ratio=3.0, text_embed_dim=8, pooled_projection_dim=8,
                      rope_axes_dim=(4, 6, 6), in_channels=4, out_channels=4)
    mmdit = MMDiT(**cfg.diffusers_kwargs())
    assert cfg.ffn_dim == 96 == mmdit.transformer_blocks[0].ff.net[0].proj.out_features
    assert cfg.pooled_dim == 8 and cfg.rope_max_seq_len is None


def test_the_allocators_retries_and_reserved_peak_are_read_on_cuda_only(monkeypatch):
    """memory/alloc_retries (cudaMalloc retries after freeing the cache: each synchronises the device) and
    memory/reserved_peak_gib come from the CUDA allocator's counters; a CPU run has neither."""
    import torch

    from training.metrics import allocator_stats

    assert allocator_stats(torch.device("cpu")) == {}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"num_alloc_retries": 3, "num_ooms": 0})
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 6 * 2**30)
    assert allocator_stats(torch.device("cuda", 0)) == {"memory/reserved_peak_gib": 6.0, "memory/alloc_retries": 3.0}
