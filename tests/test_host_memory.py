"""A GPU preset forced onto CPUs: its estimated host memory is said first, and it is refused above the RAM."""
import os

import pytest

import training.host_memory as host_memory
from data.buckets import bucket_table
from tests.helpers import compose_config, compose_raw
from training.host_memory import GIB, estimate_host_memory


def test_the_estimate_is_the_documented_formula_on_the_real_parameter_count():
    from models.build import build_model

    cfg = compose_config(["optim.ema_decay=0.9"])
    P = sum(p.numel() for p in build_model(cfg.model).parameters())
    est = estimate_host_memory(cfg)
    m = cfg.model
    T = max(b.tokens for b in bucket_table(cfg.data.buckets, patch=m.patch).values())
    assert est.params == est.trainable == P and est.tokens == max(T, cfg.scheduling.m_tokens or 0)
    a = 4 * (16 * m.dim + 2 * m.ffn_dim)
    assert est.parts == {"weights": 4 * P, "gradients": 4 * P, "AdamW": 8 * P, "EMA": 4 * P,
                         "activations": est.tokens * m.attention_layers * a}
    # four processes on this machine: one more full copy of the weights (rank 0 shards it), activations each
    est4 = estimate_host_memory(cfg, world_size=4, local_processes=4)
    assert est4.parts["weights"] == 8 * P and est4.parts["AdamW"] == 8 * P
    assert est4.parts["activations"] == 4 * est.parts["activations"]


def _gpu_preset_on_cpu(tmp_path, monkeypatch, ram_gib, *extra):
    """train.run on conf=wan21_1p3b launch.device=cpu with the RAM reading set; the corpus (the first thing built
    after the guard) raises instead of opening, so nothing large is ever built."""
    import train
    from omegaconf import OmegaConf

    def past_the_guard(*a, **k):
        raise RuntimeError("past the host-memory guard")

    monkeypatch.setattr(host_memory, "host_ram_bytes", lambda: int(ram_gib * GIB))
    monkeypatch.setattr(train, "open_corpus", past_the_guard)
    raw = compose_raw(["conf=wan21_1p3b", "launch.device=cpu", f"run_dir={tmp_path / 'r'}", "logging.wandb=disabled",
                       *extra])
    return train.run(train.load_config(raw), OmegaConf.to_yaml(OmegaConf.create(raw)))


def test_a_gpu_preset_forced_onto_cpus_is_refused_above_the_ram_with_its_estimate(tmp_path, monkeypatch):
    with pytest.raises(ValueError) as err:
        _gpu_preset_on_cpu(tmp_path, monkeypatch, 64)
    text = str(err.value)
    assert text.startswith("host memory: about ") and "of 64.0 GiB of RAM" in text and "launch.force=true" in text
    assert "weights 5.3" in text and "AdamW 10.6" in text and "1.42 B parameters" in text  # 1.42 B fp32: 5.3 GiB
    assert not os.path.exists(tmp_path / "r")  # refused before the run folder is made


def test_launch_force_tries_anyway_and_a_large_machine_is_not_refused(tmp_path, monkeypatch, caplog):
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="past the host-memory guard"):
        _gpu_preset_on_cpu(tmp_path, monkeypatch, 64, "launch.force=true")
    assert "host memory: about" in caplog.text and "launch.force=true: trying anyway" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="past the host-memory guard"):
        _gpu_preset_on_cpu(tmp_path, monkeypatch, 16 * 1024)
    assert "host memory" not in caplog.text  # under a quarter of the RAM: nothing to say
