"""Resume rules pinned one at a time (each kills mutants of training/resume.py that tests/test_checkpoint.py let
live; results/mutation.md): what turns EMA or LoRA on or off, the wandb group a resumed run keeps, a checkpoint
without its config.yaml, the hyper-parameters a resume re-applies, the stop message, and a branch's lineage."""
import dataclasses
import os
import re

import pytest
import torch
import yaml

from tests.helpers import compose_config
from tests.test_checkpoint import CTX, _save, _trained
from training.optim import OptimConfig, build_optimizer
from training.resume import changes_plan, check_config, nothing_to_do, optim_hyperparameters, resume, turned


@pytest.mark.parametrize("key, a, b, said", [
    ("optim.ema_decay", None, 0.999, "on"), ("optim.ema_decay", 0.999, None, "off"),
    ("optim.ema_decay", 0.99, 0.999, None), ("model.lora.rank", 0, 8, "on"), ("model.lora.rank", 8, 0, "off"),
    ("model.lora.rank", 4, 8, None), ("optim.lr", 0.0, 1.0, None),
])
def test_turned_says_on_or_off_only_where_ema_or_lora_switches(key, a, b, said):
    assert turned(key, a, b) == said


def test_the_whole_optim_groups_list_changes_the_plan():
    assert changes_plan("optim.groups") is True


def test_a_resumed_run_without_a_wandb_group_keeps_the_checkpoints(tmp_path):
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    saved = compose_config(["logging.group=sweep-a"])
    (ckpt / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(saved)))
    now = compose_config([])
    assert now.logging.group is None
    check_config(str(ckpt), now, False, True)
    assert now.logging.group == "sweep-a"
    given = compose_config(["logging.group=mine"])
    check_config(str(ckpt), given, False, True)
    assert given.logging.group == "mine"


def test_a_checkpoint_without_config_yaml_is_not_compared(tmp_path):
    (tmp_path / "step_1").mkdir()
    now = compose_config(["train.seed=7"])  # a plan value: refused against any saved config
    assert check_config(str(tmp_path / "step_1"), now, False, True) is None


def test_the_hyperparameters_a_resume_reapplies_are_the_configs_own():
    model = torch.nn.Linear(4, 2)
    opt, _ = build_optimizer(model, OptimConfig(lr=1e-2, eps=1e-6), 10)
    groups = optim_hyperparameters(opt)
    assert len(groups) == len(opt.param_groups) and all(g["eps"] == 1e-6 and g["initial_lr"] == 1e-2 for g in groups)
    assert all(set(g) == {"initial_lr", "weight_decay", "betas", "eps", "foreach", "fused"} for g in groups)


@pytest.mark.parametrize("steps, asked", [(5, 10), (0, 6), (3, 8)])
def test_nothing_to_do_names_the_step_and_a_train_steps_that_goes_on(steps, asked):
    text = nothing_to_do("runs/a/step_5", 5, steps)
    assert text.startswith(f"nothing to do: runs/a/step_5 is at step 5 and train.steps={steps}")
    assert f"(e.g. train.steps={asked})" in text


def test_a_second_rollback_carries_the_first_ones_abandoned_checkpoints(tmp_path, monkeypatch):
    """Both rollbacks fall in one second here (one `abandoned-` folder): the second adds to it."""
    import training.resume as resume_module

    monkeypatch.setattr(resume_module.time, "strftime", lambda fmt: "abandoned-20261202-101010")
    model, opt, sched, ema = _trained()
    for step in (2, 4):
        _save(tmp_path, step, model, opt, sched, ema, keep_last=5)
    _, meta = resume(str(tmp_path / "step_2"), str(tmp_path), CTX, lambda p: {"step": 2, "lineage": {}})
    _save(tmp_path, 3, model, opt, sched, ema, keep_last=5, lineage=meta["lineage"])
    _, meta = resume(str(tmp_path / "step_2"), str(tmp_path), CTX,
                     lambda p: {"step": 2, "lineage": meta["lineage"]})
    assert meta["lineage"] == {"rollback_point": "step_2", "abandoned": ["abandoned-20261202-101010/step_4",
                                                                         "abandoned-20261202-101010/step_3"]}
    assert sorted(os.listdir(tmp_path / "abandoned-20261202-101010")) == ["step_3", "step_4"]


def test_a_rollback_to_another_folders_checkpoint_has_no_rollback_point_here(tmp_path):
    """The checkpoint resumed from lives in another run's folder: this run's newer checkpoints are abandoned, and
    keep_last has nothing of this folder to keep for it."""
    model, opt, sched, ema = _trained()
    other = _save(tmp_path / "other", 2, model, opt, sched, ema)
    run = tmp_path / "run"
    _save(run, 4, model, opt, sched, ema)
    _, meta = resume(other, str(run), CTX, lambda p: {"step": 2, "lineage": {}})
    (aside,) = [d for d in os.listdir(run) if d.startswith("abandoned-")]
    assert re.fullmatch(r"abandoned-\d{8}-\d{6}", aside)
    assert meta["lineage"] == {"rollback_point": None, "abandoned": [f"{aside}/step_4"]}


def test_how_a_run_is_named_started_and_launched_is_never_compared():
    saved = {"name": "a", "run_dir": "runs/a", "resume": None, "resume_force": False, "show_buckets": False,
             "launch": {"num_processes": 1}, "optim": {"lr": 1.0}}
    now = {"name": "b", "run_dir": "runs/b", "resume": "auto", "resume_force": True, "show_buckets": True,
           "launch": {"num_processes": 8}, "optim": {"lr": 1.0}}
    from training.resume import config_changes

    assert config_changes(saved, now) == ({}, {})


def test_a_named_folder_without_meta_json_is_refused_before_anything_is_checked(tmp_path):
    (tmp_path / "step_3").mkdir()
    with pytest.raises(ValueError, match=r"step_3 holds no meta\.json, so it is no complete checkpoint"):
        resume(str(tmp_path / "step_3"), str(tmp_path), CTX, lambda p: {"step": 3})
    with pytest.raises(ValueError, match=r"resume=step_4: no such folder, as given or in run_dir"):
        resume("step_4", str(tmp_path), CTX, lambda p: {"step": 4})


def test_resume_takes_a_checkpoints_name_inside_run_dir_and_auto_says_when_it_finds_none(tmp_path, caplog,
                                                                                        monkeypatch):
    """resume=step_200 is runs/NAME/step_200 (before: "not a complete checkpoint" for a folder that was one); a
    resume=auto whose run_dir holds no checkpoint (a mistyped name=) starts from scratch with a warning naming it."""
    import logging

    import training.resume as tr

    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_3" / "meta.json").write_text("{}")
    monkeypatch.setattr(tr, "verify_checkpoint", lambda path, ctx: None)
    monkeypatch.setattr(tr, "branch", lambda run_dir, path, meta, ctx: {})
    (tmp_path / "cwd" / "step_3").mkdir(parents=True)  # a folder of that name where the command runs: not it
    monkeypatch.chdir(tmp_path / "cwd")
    assert resume("step_3", str(tmp_path), CTX, lambda p: {"step": 3})[0] == str(tmp_path / "step_3")
    with caplog.at_level(logging.WARNING, logger="training.resume"):
        assert resume("auto", str(tmp_path / "nosuch"), CTX, lambda p: {}) == (None, None)
    assert f"resume=auto: {tmp_path / 'nosuch'} holds no checkpoint, so this run starts from scratch" in caplog.text


def test_a_plan_change_is_refused_with_each_key_on_its_own_line(tmp_path):
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    saved = compose_config([])
    (ckpt / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(saved)))
    now = compose_config(["train.seed=7", f"model.num_layers={saved.model.num_layers + 1}"])
    with pytest.raises(ValueError) as err:
        check_config(str(ckpt), now, False, True)
    assert (f"the trained state:\n  model.num_layers: {saved.model.num_layers} → {saved.model.num_layers + 1}\n"
            f"  train.seed: {saved.train.seed} → 7\nThe stored plan") in str(err.value)


def test_a_changed_batch_table_is_refused_only_where_the_calibration_changed_behind_the_run(caplog):
    """An edited calibration under the same path is refused (forced: a new epoch); a table this resume changes itself
    (another number of processes, another file, an execution setting) goes on from a new epoch, the cause named."""
    import logging

    from training.resume import plan_changed

    saved = {"batch_sizes": {"a": 4, "b": 1}, "calibration": "c.json", "calibration_sha256": "1" * 64, "world_size": 8}
    assert plan_changed(None, dict(saved), False) is False and plan_changed(saved, dict(saved), False) is False
    assert plan_changed({"step": 3}, dict(saved), False) is False  # a checkpoint from before the check
    edited = {**saved, "batch_sizes": {"a": 4, "b": 2}, "calibration_sha256": "2" * 64}
    with pytest.raises(ValueError, match=r"\(b 1 → 2\): the calibration it planned with, c\.json, changed since"):
        plan_changed(saved, edited, False)
    assert plan_changed(saved, edited, True) is True
    causes = [({**saved, "batch_sizes": {"a": 6, "b": 1}, "world_size": 16},
               "the number of processes changed (8 → 16)"),
              ({**saved, "batch_sizes": {"a": 6, "b": 1}, "calibration": "d.json", "calibration_sha256": "3" * 64},
               "the run planned with c.json, this resume with d.json"),
              ({**saved, "batch_sizes": {"a": 3, "b": 1}}, "a setting this resume changes")]
    for now, cause in causes:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="training.resume"):
            assert plan_changed(saved, now, False) is True
        assert cause in caplog.text and "starts a new epoch" in caplog.text
