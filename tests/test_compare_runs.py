"""Comparing the runs of a sweep offline: the table has a column for every config key that differs between the runs
(training/run_configs.py), and the figure a train/loss panel beside val/loss."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT
from training.compare import compare
from training.run_configs import columns, differing_keys, flatten, read_run_config


def write_run(folder, lr, losses, strategy="equal_token"):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "samples_seen": 8 * step, "train/loss": loss,
                                "perf/tokens_per_s": 100.0 * step, **({"val/loss": loss} if step == 2 else {})})
                    + "\n")
    with open(os.path.join(folder, "config.yaml"), "w") as f:
        yaml.safe_dump({"name": os.path.basename(folder), "run_dir": str(folder), "logging": {"group": "lr"},
                        "optim": {"lr": lr, "betas": [0.9, 0.99]}, "scheduling": {"strategy": strategy},
                        "train": {"steps": len(losses)}}, f)
    return str(folder)


def test_flatten_and_the_keys_that_differ():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [1, 2], "e": {}}
    one = {"optim": {"lr": 1}, "x": [1, 2], "name": "a", "_wandb": {"t": 1}}
    two = {"optim": {"lr": 2}, "x": [1, 2], "name": "b", "y": 0, "_wandb": {"t": 2}}
    assert differing_keys([one, two]) == ["optim.lr", "y"] and differing_keys([one]) == []


def test_the_table_has_a_column_per_differing_key_and_the_figure_a_train_loss_panel(tmp_path, monkeypatch):
    import matplotlib.figure

    a = write_run(tmp_path / "lr-optim.lr_0.001", 0.001, [1.0, 0.8, 0.7])
    b = write_run(tmp_path / "lr-optim.lr_0.003", 0.003, [1.0, 0.6, 0.4], strategy="balanced")
    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    cols = columns([read_run_config(a), read_run_config(b), None])
    assert cols == {"optim.lr": ["0.001", "0.003", "—"], "scheduling.strategy": ["equal_token", "balanced", "—"]}
    md = compare([a, b], ["slow", "fast"], str(tmp_path / "out"), {k: v[:2] for k, v in cols.items()})
    head, _, slow, fast = md.splitlines()
    assert head.startswith("| run | optim.lr | scheduling.strategy | tokens/s |")
    assert slow.startswith("| slow | 0.001 | equal_token | 300 |") and fast.endswith("| 0.6 |")
    (fig,) = figures
    (ax,) = [ax for ax in fig.axes if ax.get_title() == "train/loss vs samples seen"]
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
    assert lines == {"slow": ([8, 16, 24], [1.0, 0.8, 0.7]), "fast": ([8, 16, 24], [1.0, 0.6, 0.4])}


@pytest.mark.slow
def test_compare_runs_script_shows_the_swept_key(tmp_path):
    runs = [write_run(tmp_path / f"lr-optim.lr_{lr}", lr, [1.0, 0.5]) for lr in (0.001, 0.003)]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare_runs.py"), *runs, "--out",
                          str(tmp_path / "cmp")], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| run | optim.lr |" in out.stdout and "| lr-optim.lr_0.003 | 0.003 |" in out.stdout
    assert os.path.getsize(tmp_path / "cmp" / "compare.png") > 10_000
