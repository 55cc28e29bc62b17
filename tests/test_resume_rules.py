"""Resume rules through the trainer: EMA turned on at resume, and a resume with no step left to train."""
import os

import pytest
import torch

from tests.helpers import run_training, tiny_overrides
from training.checkpoint import list_checkpoints
from training.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _tensors(ckpt: str, tmp_path) -> dict:
    """A checkpoint's tensors by flat key ("model.x", "ema.x"), read through torch's own DCP → torch.save converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    out = str(tmp_path / (os.path.basename(ckpt) + ".pt"))
    dcp_to_torch_save(ckpt, out)
    flat = flatten_state_dict(torch.load(out, weights_only=False))[0]
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor) and k.startswith(("model.", "ema."))}


def test_ema_turned_on_at_resume_starts_from_the_loaded_weights_and_nothing_to_do_says_so(tmp_path, cache, caplog):
    run_dir = str(tmp_path / "run")
    run_training(tiny_overrides(run_dir, cache, "train.steps=2", "train.val_every=2"))  # no EMA
    with caplog.at_level("INFO"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=3", "train.val_every=3", "resume=auto",
                                    "optim.ema_decay=0.5"))
    assert "holds no EMA (optim.ema_decay was null): a fresh EMA starts from the loaded weights" in caplog.text
    assert "skipping" not in caplog.text and "optim.ema_decay None → 0.5 (this run's value" not in caplog.text
    assert [s for s, _ in list_checkpoints(run_dir)] == [2, 3] and max(r["step"] for r in read_metrics(run_dir)) == 3
    w2, w3 = (_tensors(os.path.join(run_dir, f"step_{s}"), tmp_path) for s in (2, 3))
    ema = {k[4:]: v for k, v in w3.items() if k.startswith("ema.")}
    assert ema and not any(k.startswith("ema.") for k in w2)
    for name, shadow in ema.items():  # one update of d = 0.5 from the loaded (step 2) weights: ½ w2 + ½ w3
        torch.testing.assert_close(shadow, 0.5 * w2["model." + name] + 0.5 * w3["model." + name])

    rows = read_metrics(run_dir)
    caplog.clear()
    with caplog.at_level("INFO"):
        out = run_training(tiny_overrides(run_dir, cache, "train.steps=3", "train.val_every=3", "resume=auto"))[1]
    assert out == {} and read_metrics(run_dir) == rows  # nothing trained, nothing written
    assert "nothing to do: " in caplog.text and "is at step 3 and train.steps=3" in caplog.text
    assert "raise train.steps" in caplog.text


def test_an_optimizer_registered_in_one_place_trains_and_resumes_like_the_uninterrupted_run(tmp_path, cache):
    """A new optimizer is one register_optimizer call: optim.name picks it, its state is checkpointed, a resume
    continues it bit for bit, and switching back to AdamW on resume is refused (its stored state is another's)."""
    from training import optim as optim_module
    from training.optim import register_optimizer

    register_optimizer("sgd_momentum", lambda groups, cfg: torch.optim.SGD(groups, lr=cfg.lr, momentum=0.9))
    try:
        common = ("optim.name=sgd_momentum", "train.val_every=4")
        whole = str(tmp_path / "whole")
        run_training(tiny_overrides(whole, cache, "train.steps=4", *common))
        split = str(tmp_path / "split")
        run_training(tiny_overrides(split, cache, "train.steps=2", *common))
        run_training(tiny_overrides(split, cache, "train.steps=4", "resume=auto", *common))
        loss = lambda d: [(r["step"], r["train/loss"]) for r in read_metrics(d) if "train/loss" in r]  # noqa: E731
        assert loss(split) == loss(whole) and len(loss(whole)) == 4
        state = _optimizer_state_keys(os.path.join(whole, "step_4"), tmp_path)
        assert any(k.endswith("momentum_buffer") for k in state) and not any(k.endswith("exp_avg") for k in state)
        from training.checkpoint import StateMismatch

        with pytest.raises(StateMismatch, match="holds SGD's state .* this run's optimizer is AdamW"):
            run_training(tiny_overrides(split, cache, "train.steps=6", "resume=auto", "train.val_every=4"))
    finally:
        optim_module.OPTIMIZERS.pop("sgd_momentum", None)


def _optimizer_state_keys(ckpt: str, tmp_path) -> list:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    out = str(tmp_path / "opt.pt")
    dcp_to_torch_save(ckpt, out)
    return [k for k in flatten_state_dict(torch.load(out, weights_only=False))[0] if k.startswith("optim")]


def test_a_resume_whose_batch_table_changed_is_refused_unless_forced_then_starts_a_new_epoch(tmp_path, cache,
                                                                                            caplog):
    """The calibration the run planned with, edited in place (a refit, the simulator's --write-chosen), sets other
    batch sizes: the stored position counts samples in the run's table, so resuming under another would repeat or
    skip samples. Before, nothing compared the file's content (only its path, a config key) and the run went on
    silently with img_64 at B 7 → 25."""
    import json
    import logging
    import shutil

    cal = str(tmp_path / "cal.json")
    shutil.copy("results/calibration_cpu_tiny.json", cal)
    run_dir = str(tmp_path / "run")
    common = ("scheduling=balanced", f"scheduling.calibration={cal}", "checkpoint.every=2", "train.val_every=100")
    run_training(tiny_overrides(run_dir, cache, "train.steps=4", *common))
    with open(os.path.join(run_dir, "step_4", "meta.json")) as f:
        saved = json.load(f)
    assert saved["plan"]["calibration"] == cal and len(saved["plan"]["calibration_sha256"]) == 64
    d = json.load(open(cal))
    d["chosen"]["m_mem"] = 400
    d["modes"]["none"]["cost_model"]["params"]["b2"] = 0.001
    json.dump(d, open(cal, "w"))
    with pytest.raises(ValueError, match=r"resume refused: the batch table is not the run's "
                                         r"\(.*img_64 \d+ → \d+.*\): the calibration it planned with, .*cal\.json, "
                                         r"changed since .*Restore that calibration file"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=6", *common, "resume=auto"))
    with pytest.raises(ValueError, match=r"resume refused: the batch table is not the run's"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=6", *common, "resume=step_2"))
    # refused before the rollback to step_2 would move step_4 aside
    assert "step_4" in os.listdir(run_dir) and not any(d.startswith("abandoned-") for d in os.listdir(run_dir))
    assert max(r["step"] for r in read_metrics(run_dir)) == 4  # nothing trained under the other table
    with caplog.at_level(logging.WARNING, logger="training.resume"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=6", *common, "resume=auto", "resume_force=true"))
    assert any("starting a new epoch under this table" in r.getMessage() for r in caplog.records)
    rows = {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}
    assert rows[5]["epoch"] == saved["epoch"] + 1
    with open(os.path.join(run_dir, "step_6", "meta.json")) as f:
        assert json.load(f)["plan"]["batch_sizes"] != saved["plan"]["batch_sizes"]
