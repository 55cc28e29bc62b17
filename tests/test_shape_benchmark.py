"""training/shape_benchmark.py: which calibration a run may use (scheduling.calibration=auto), the benchmark on first
use and its cache in the run folder, where calibrate.py writes by default, and the warning on a poor fit."""
import json
import logging
import os

import pytest

from scheduling.calibrate import Calibration
from tests.helpers import ROOT, compose_config, run_training, tiny_overrides
from training.dist import DistContext
from training.metrics import read_metrics
from training.shape_benchmark import (CACHE, FIT_WARN, calibration_for_run, fit_warnings, mismatch, out_path)

CPU_TINY = os.path.join(ROOT, "results", "calibration_cpu_tiny.json")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("latents"))


def _cal(**changes) -> Calibration:
    cal = Calibration.load(CPU_TINY)
    for key, value in changes.items():
        if key == "model":
            cal.data["model"] = {**cal.data["model"], **value}
        else:
            cal.data[key] = value
    return cal


def test_a_calibration_fits_only_its_model_device_mode_and_world():
    cfg = compose_config()  # the tiny Wan the CPU file was measured on
    cpu = "CPU (x86_64, 1 threads)"
    assert mismatch(_cal(), cfg.model, cpu, 1) is None  # the thread count is not the device
    assert mismatch(_cal(), cfg.model, "NVIDIA H200", 1) == "measured on CPU (x86_64, 2 threads)"
    assert mismatch(_cal(model={"dim": 128}), cfg.model, cpu, 1) == "another model (dim 128)"
    assert "another model (num_layers 30, precision fp32)" == mismatch(
        _cal(model={"num_layers": 30, "precision": "fp32"}), cfg.model, cpu, 1)
    # LoRA trains an adapter: another backward and optimizer than the full model's the files measured (a file
    # without the key was measured without LoRA)
    lora = compose_config(["+model.lora.rank=8"])
    assert mismatch(_cal(), lora.model, cpu, 1) == "another model (LoRA rank 0 there, 8 here)"
    assert mismatch(_cal(model={"lora_rank": 8}), lora.model, cpu, 1) is None
    assert mismatch(_cal(model={"lora_rank": 8}), cfg.model, cpu, 1) == "another model (LoRA rank 8 there, 0 here)"
    full = compose_config(["model.checkpointing=full"])
    assert mismatch(_cal(), full.model, cpu, 1) == "checkpointing modes ['none'], not full"
    with_mem = _cal()
    with_mem.data["modes"]["none"]["memory_model"] = {"a": 1.0}
    assert "measured on 1 process(es) without an FSDP model" in mismatch(with_mem, cfg.model, cpu, 2)
    with_mem.data["modes"]["none"]["memory_model"] = {"kind": "fsdp", "ranks": 8}
    assert mismatch(with_mem, cfg.model, cpu, 2) is None  # an FSDP model rescales to any R


def test_a_calibration_fits_only_the_policies_and_execution_the_run_will_use():
    """A run that may keep attention needs the keep policy measured; and the micro-batches must have run as this
    run's will: the same attention kernel, CUDA graphs or not, fused ops, precision, compile."""
    import torch

    from training.shape_benchmark import execution, policies_to_measure

    cfg = compose_config()
    cpu = "CPU (x86_64, 1 threads)"
    want = execution(cfg, torch.device("cpu"), 1)
    assert want == {"attention": "flash", "fused_ops": "auto", "cuda_graphs": False, "precision": "bf16",
                    "compile": False, "shared_gpu": None}
    assert mismatch(_cal(), cfg.model, cpu, 1, want) is None
    assert mismatch(_cal(), cfg.model, cpu, 1, dict(want, attention="cudnn")) == \
        "another execution (attention flash there, cudnn here)"
    # ranks sharing one GPU (launch.debug_share_gpu) measure contended times on half its memory: never a file of
    # whole GPUs for them, nor theirs for a run on whole GPUs (a file without the key was measured on whole GPUs)
    assert mismatch(_cal(), cfg.model, cpu, 1, dict(want, shared_gpu="gloo")) == \
        "another execution (shared_gpu None there, gloo here)"
    assert mismatch(_cal(), cfg.model, cpu, 1, dict(want, cuda_graphs=True)) == \
        "another execution (cuda_graphs False there, True here)"
    assert "does not record how its micro-batches ran" in mismatch(_cal(execution=None), cfg.model, cpu, 1, want)
    auto = compose_config(["model.checkpointing=auto", "model.keep_attention=auto"])
    assert policies_to_measure(auto.model) == ["none", "full", "keep"]
    assert policies_to_measure(compose_config(["model.checkpointing=full"]).model) == ["full"]
    assert policies_to_measure(compose_config(["model.checkpointing=full", "model.keep_attention=auto"]).model) \
        == ["full", "keep"]
    both = _cal()
    both.data["modes"]["full"] = both.data["modes"]["none"]
    assert mismatch(both, auto.model, cpu, 1) == ("policies ['none', 'full'] measured, not ['keep'] "
                                                  "(model.checkpointing=auto, keep_attention=auto)")
    both.data["modes"]["keep"] = both.data["modes"]["none"]
    assert mismatch(both, auto.model, cpu, 1, want) is None


def test_fit_warnings_name_the_mode_the_error_and_what_to_do():
    cal = _cal()
    rec = cal.data["modes"]["none"]
    form = rec["cost_model"]["form"]
    rec["fit_errors"][form]["rel_rmse"] = FIT_WARN - 0.01
    assert fit_warnings(cal) == []
    rec["fit_errors"][form]["rel_rmse"] = 0.57
    (w,) = fit_warnings(cal)
    assert f"checkpointing=none: the {form} cost model misses the measured times by 57 %" in w
    assert "calibrate.repeats" in w and "launch.cpu_threads=1" in w


def test_calibrate_writes_under_runs_by_default_never_over_the_configured_file():
    assert out_path(None, "wan21_1p3b") == os.path.join("runs", "calibrate", "wan21_1p3b", "calibration.json")
    assert out_path("some/dir", "x") == os.path.join("some/dir", "calibration.json")
    assert out_path("mine.json", "x") == "mine.json"


def test_auto_takes_the_run_folders_file_then_a_matching_one_skipping_unreadable(tmp_path):
    cfg = compose_config([f"run_dir={tmp_path / 'run'}"])
    ctx = DistContext(0, 1, 0, __import__("torch").device("cpu"))
    search = tmp_path / "results"
    search.mkdir()
    (search / "calibration_a_broken.json").write_text("{not json")
    _cal(model={"dim": 128}).save(str(search / "calibration_b_other.json"))
    _cal().save(str(search / "calibration_c_good.json"))
    said = []
    path, how = calibration_for_run(cfg, ctx, said.append, search=str(search))
    assert path == str(search / "calibration_c_good.json") and how.startswith("measured on this model and CPU")
    os.makedirs(cfg.run_dir)
    _cal().save(os.path.join(cfg.run_dir, CACHE))
    path, how = calibration_for_run(cfg, ctx, said.append, search=str(search))
    assert path == os.path.join(cfg.run_dir, CACHE) and how == "cached in the run folder"
    assert said == []  # a match says nothing of the files passed over


@pytest.mark.slow
def test_auto_benchmarks_on_first_use_caches_it_and_resume_reuses_it(tmp_path, cache, caplog):
    run_dir = str(tmp_path / "auto")
    # a width no committed file was measured on: the benchmark runs, its file lands in the run folder
    common = ["model.attention_head_dim=12", "scheduling=balanced", "scheduling.calibration=auto",
              "scheduling.benchmark_points=4", "scheduling.benchmark_time_s=60", "train.val_every=2"]
    with caplog.at_level(logging.INFO, logger="train"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=2", *common))
    cached = os.path.join(run_dir, CACHE)
    d = json.load(open(cached))
    assert d["model"]["dim"] == 48 and d["device"].startswith("CPU")
    assert len([p for p in d["modes"]["none"]["points"] if p["feasible"]]) == 4
    first = caplog.text
    assert "running the shape benchmark on CPU" in first
    assert f"strategy balanced, planner sorted, calibration {cached} (measured now (" in first
    assert "calibration_cpu_tiny.json: another model (dim 64)" in first  # why the committed file was passed over
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="train"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=4", "resume=auto", *common))
    assert "running the shape benchmark" not in caplog.text
    assert f"calibration {cached} (cached in the run folder)" in caplog.text
    assert json.load(open(cached)) == d  # the cache was read, not measured again
    assert max(r["step"] for r in read_metrics(run_dir)) == 4


def test_a_named_calibration_that_auto_would_pass_over_is_used_with_a_warning_saying_why():
    from training.shape_benchmark import check_named_calibration

    ctx = DistContext(0, 1, 0, __import__("torch").device("cpu"))
    lora = compose_config(["conf=tiny_lora", "model.precision=fp32", "run_dir=/tmp/unused",
                           "scheduling.calibration=results/calibration_cpu_tiny.json"])
    assert check_named_calibration(lora, ctx) == (
        "scheduling.calibration=results/calibration_cpu_tiny.json: another model (precision bf16, LoRA rank 0 there, "
        "8 here), so its times and memory may not be this run's (scheduling.calibration=auto would pass it over)")
    tiny = compose_config(["run_dir=/tmp/unused", "scheduling.calibration=results/calibration_cpu_tiny.json"])
    assert check_named_calibration(tiny, ctx) is None
