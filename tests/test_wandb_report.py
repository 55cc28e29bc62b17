"""The wandb report's panels, offline: they plot keys a real run logs, against an x-axis logged in the same rows,
grouped by the config key the trainer hands wandb, filtered to the group it logs under; the Report object builds
without a server; the online-only steps refuse with the fix; the CLI's --help and --dry-run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, run_training, tiny_overrides
from training import wandb_report
from training.wandb_report import DEFAULT_METRICS, GROUP_BY, STRATEGY_KEY, panel_definitions

SCRIPT = os.path.join(ROOT, "scripts", "wandb_report.py")
GROUP = "cmp-sweep"


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A 5-step balanced run in group GROUP (wandb disabled; measured balance every 2 steps, so busy_cv is logged;
    throughput after 3 warm-up steps): its metrics.jsonl rows, and the config and group MetricsLogger was given
    (what wandb.init gets)."""
    import train
    from training.metrics import MetricsLogger, read_metrics

    seen = {}

    class Spy(MetricsLogger):
        def __init__(self, run_dir, cfg, name, config, **kw):
            seen.update(config=config, group=cfg.group)
            super().__init__(run_dir, cfg, name, config, **kw)

    tmp = tmp_path_factory.mktemp("wandb_report")
    run_dir = str(tmp / "run")
    mp = pytest.MonkeyPatch()
    mp.setattr(train, "MetricsLogger", Spy)
    try:
        run_training(tiny_overrides(run_dir, str(tmp / "cache"), "train.steps=5", "metrics.busy_every=2",
                                    "scheduling=balanced", f"logging.group={GROUP}", "train.val_every=5",
                                    "checkpoint.every=0", "checkpoint.at_end=false"))
    finally:
        mp.undo()
    return read_metrics(run_dir), seen


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@pytest.mark.slow  # the fixture trains 5 steps
def test_panels_are_throughput_balance_and_loss_of_keys_the_run_logs_against_samples_seen(logged):
    rows, _ = logged
    panels = panel_definitions("ent", "proj", GROUP)
    assert [p["section"] for p in panels] == ["throughput"] + ["balance"] * 4 + ["loss"] * 2
    assert [y for p in panels for y in p["y"]] == list(DEFAULT_METRICS)
    assert {y for p in panels if p["section"] == "loss" for y in p["y"]} == {"train/loss", "val/loss"}
    for p in panels:
        assert p["x"] == "samples_seen" and len(p["y"]) == 1
        (y,) = p["y"]
        # a point needs x and y in one wandb.log call: rows where the trainer logged y as a number carry the x too
        with_y = [r for r in rows if _number(r.get(y))]
        assert with_y, f"{y} never logged as a number in {sorted({k for r in rows for k in r})}"
        assert all(_number(r.get(x)) for r in with_y for x in ("samples_seen", "tokens_seen")), y
    assert [r["samples_seen"] for r in rows] == sorted(r["samples_seen"] for r in rows)  # an x-axis that grows


@pytest.mark.slow
def test_lines_are_grouped_by_the_strategy_in_the_logged_config_and_filtered_to_the_logged_group(logged):
    _, seen = logged
    panels = panel_definitions("ent", "proj", seen["group"], x="tokens_seen")
    assert seen["group"] == GROUP
    for p in panels:
        assert p["filters"] == {"group": GROUP} and (p["entity"], p["project"], p["x"]) == ("ent", "proj",
                                                                                           "tokens_seen")
        assert p["group_by"] == [GROUP_BY] == [f"config.{STRATEGY_KEY}"]  # the default without runs to compare
    value = seen["config"]
    for part in STRATEGY_KEY.split("."):  # the path must exist in the config wandb.init is given
        value = value[part]
    assert value == "balanced"


@pytest.mark.parametrize("kwargs, named", [
    ({"x": "step"}, "x must be one of"),
    ({"group": "a=b"}, "group must not contain"),
    ({"group": " "}, "group must be a non-empty"),
    ({"entity": ""}, "entity must be a non-empty"),
    ({"metrics": []}, "metrics must be one or more"),
    ({"metrics": ["train/loss", "train/loss"]}, "distinct"),
    ({"metrics": ["samples_seen"]}, "must not repeat the x-axis"),
])
def test_bad_inputs_are_refused_naming_the_field(kwargs, named):
    args = {"entity": "ent", "project": "proj", "group": GROUP, **kwargs}
    with pytest.raises(ValueError, match=named):
        panel_definitions(**args)


@pytest.mark.slow
def test_report_builds_offline_with_one_grouped_filtered_runset_and_a_line_plot_per_panel(monkeypatch):
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    from wandb_workspaces import expr

    import wandb

    def no_network(*a, **k):
        raise AssertionError("build_report must not reach the wandb server")

    monkeypatch.setattr(wandb, "Api", no_network)
    panels = panel_definitions("ent", "proj", GROUP, x="tokens_seen")
    report = wandb_report.build_report(panels, title="t")
    assert isinstance(report, wr.Report) and (report.entity, report.project, report.title) == ("ent", "proj", "t")
    (grid,) = report.blocks
    (runset,) = grid.runsets
    assert (runset.entity, runset.project) == ("ent", "proj")
    leaf = expr.expr_to_filters(runset.filters)  # the parse save() sends
    assert (leaf.key.section, leaf.key.name, leaf.op, leaf.value) == ("run", "group", "=", GROUP)
    (by,) = runset.groupby
    assert expr.groupby_str_to_key(by) == expr.Key(section="config", name="scheduling.value.strategy")
    assert len(grid.panels) == len(panels)
    for plot, p in zip(grid.panels, panels):
        assert isinstance(plot, wr.LinePlot)
        assert (plot.title, plot.x, plot.y) == (p["title"], "tokens_seen", p["y"])
        assert plot.groupby == wr.Config(STRATEGY_KEY) and plot.groupby_aggfunc == "mean"
    with pytest.raises(ValueError, match="share entity, project, group"):
        wandb_report.build_report(panels + panel_definitions("ent", "proj", "other"))


def test_saving_refuses_offline_modes_and_a_missing_api_key_with_the_fix(monkeypatch, tmp_path):
    pytest.importorskip("wandb_workspaces.reports.v2")
    for mode in ("offline", "disabled"):
        monkeypatch.setenv("WANDB_MODE", mode)
        with pytest.raises(RuntimeError, match=r"WANDB_MODE=online.*wandb sync runs/\*/wandb/offline-run-\*"):
            wandb_report.check_ready()
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings: no key anywhere
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(RuntimeError, match="wandb login"):
        wandb_report.save_report(object())  # refused before the report is touched


def test_a_missing_package_names_the_pip_install(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "wandb_workspaces"] + ["wandb_workspaces"]:
        monkeypatch.setitem(sys.modules, name, None)  # import of wandb_workspaces now fails as if not installed
    with pytest.raises(RuntimeError, match="pip install wandb-workspaces"):
        wandb_report.build_report(panel_definitions("ent", "proj", GROUP))
    with pytest.raises(RuntimeError, match="pip install wandb-workspaces"):
        wandb_report.check_ready()


def _cli(*args, **env):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, **env})


@pytest.mark.slow
def test_cli_help_and_dry_run():
    from omegaconf import OmegaConf

    out = _cli("--help")
    assert out.returncode == 0 and "--dry-run" in out.stdout and "--entity E --group G" in out.stdout
    out = _cli("--entity", "ent", "--group", GROUP, "--x", "tokens_seen", "--dry-run")
    assert out.returncode == 0, out.stderr
    project = OmegaConf.load(os.path.join(ROOT, "conf", "logging", "online.yaml")).project  # where online runs go
    assert json.loads(out.stdout) == panel_definitions("ent", project, GROUP, x="tokens_seen")


def test_offline_mode_is_refused_with_the_fix(monkeypatch):
    pytest.importorskip("wandb_workspaces.reports.v2")
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(RuntimeError) as e:
        wandb_report.check_ready()  # the script prints this message as `error: ...` (exit 1), not a traceback
    assert str(e.value).startswith("WANDB_MODE=offline") and "wandb sync" in str(e.value)


# -- --group-by: the keys that differ, or the ones named -------------------------------------------------------------

def test_the_default_group_by_is_the_config_keys_that_differ_between_the_runs():
    from training.wandb_report import default_group_by

    base = {"name": "lr-optim.lr_0.001", "run_dir": "runs/lr-optim.lr_0.001", "logging": {"group": "lr"},
            "optim": {"lr": 0.001, "betas": [0.9, 0.99]}, "scheduling": {"strategy": "equal_token"}}
    other = {**base, "name": "lr-optim.lr_0.003", "run_dir": "runs/lr-optim.lr_0.003",
             "optim": {"lr": 0.003, "betas": [0.9, 0.99]}}
    assert default_group_by([base, other]) == ["optim.lr"]  # name and run_dir differ in any sweep: left out
    both = {**other, "scheduling": {"strategy": "balanced"}}
    assert default_group_by([base, both]) == ["optim.lr", "scheduling.strategy"]
    assert default_group_by([base, dict(base)]) == [STRATEGY_KEY] == default_group_by([])


@pytest.mark.slow
def test_report_groups_by_the_keys_given():
    wr = pytest.importorskip("wandb_workspaces.reports.v2")
    from wandb_workspaces import expr

    panels = panel_definitions("ent", "proj", GROUP, group_by=["optim.lr"])
    assert all(p["group_by"] == ["config.optim.lr"] for p in panels)
    (grid,) = wandb_report.build_report(panels).blocks
    (by,) = grid.runsets[0].groupby
    assert expr.groupby_str_to_key(by) == expr.Key(section="config", name="optim.value.lr")
    assert all(plot.groupby == wr.Config("optim.lr") for plot in grid.panels)
    two = wandb_report.build_report(panel_definitions("ent", "proj", GROUP, group_by=["optim.lr", "train.seed"]))
    (grid,) = two.blocks
    assert len(grid.runsets[0].groupby) == 2 and all(plot.groupby is None for plot in grid.panels)
    assert two.title == f"{GROUP}: by optim.lr × train.seed"
    for bad in ([], ["a=b"], ["optim.lr", "optim.lr"]):
        with pytest.raises(ValueError, match="group_by must be one or more distinct config keys"):
            panel_definitions("ent", "proj", GROUP, group_by=bad)


@pytest.mark.slow
def test_cli_dry_run_groups_a_sweep_by_its_swept_key(tmp_path):
    """The script (a subprocess) reads the sweep's folders: --runs, or runs/*/ of the group under its cwd."""
    import yaml

    for lr in (0.001, 0.003):
        folder = tmp_path / "runs" / f"lr-optim.lr_{lr}"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump({"name": folder.name, "logging": {"group": "lr"},
                                                            "optim": {"lr": lr}, "train": {"steps": 20}}))
    out = subprocess.run([sys.executable, SCRIPT, "--entity", "ent", "--project", "p", "--group", "lr", "--dry-run"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert {tuple(p["group_by"]) for p in json.loads(out.stdout)} == {("config.optim.lr",)}
    assert "group-by: optim.lr (the keys that differ between the runs of group lr found in 2 run folder(s))" \
        in out.stderr
    out = _cli("--entity", "ent", "--group", "lr", "--group-by", "train.steps", "optim.lr", "--dry-run")
    assert out.returncode == 0 and json.loads(out.stdout)[0]["group_by"] == ["config.train.steps", "config.optim.lr"]
