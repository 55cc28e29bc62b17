"""The command-line tools as a user runs them (`python scripts/NAME.py` from the repo root, in a subprocess): every
script answers --help, and the long ones' quick modes say up front how long they take and stay within 1.5 min."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # each test runs a script as a command (a Python start-up; --quick: minutes)

SCRIPTS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "scripts", "**", "*.py"), recursive=True)
                 if "__main__" in open(p, encoding="utf-8").read())  # not scripts/bench/harness.py, a module


def run(*args, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, WANDB_MODE="disabled"))


def estimate_s(stdout: str) -> float:
    """The seconds of the 'estimated run time' a script prints first."""
    m = re.search(r"estimated run time[^(\n]*\((\d+) s|estimated run time about (\d+) s", stdout)
    assert m, stdout[:2000]
    return float(m.group(1) or m.group(2))


def test_every_script_is_found():
    assert len(SCRIPTS) >= 20
    assert {"scripts/sample.py", "scripts/bench/step.py", "scripts/bench/data.py"} <= set(SCRIPTS)
    assert not os.path.exists(os.path.join(ROOT, "scripts", "__init__.py"))  # scripts are not a package


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_answers_help(script):
    out = run(script, "--help")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage:" in out.stdout or f"python {script}" in out.stdout, out.stdout[:500]  # argparse's, or the doc


def test_simulate_cluster_quick_estimates_under_two_minutes_and_writes_the_paper_cell(tmp_path):
    """--quick: the batch rule × planner matrix and the strategy comparison at R = 8, g = 2·S_max, on a quarter of
    its micro-batches (--mbs 512 of 2048; the whole --quick takes minutes, README). The estimate scales with --mbs:
    a quarter's ≤ 30 s is --quick's ≤ 120 s."""
    out = run("scripts/simulate_cluster.py", "--calibration", "results/calibration_h200_graphs.json", "--quick",
              "--mbs", "512", "--out", str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    first = out.stdout.splitlines()[0]
    assert "estimated run time" in first and estimate_s(first) <= 30, first
    for name in ("simulation.md", "simulation.csv", "simulation_ratio.png", "simulation_matrix.csv"):
        assert (tmp_path / name).stat().st_size > 0
    md = (tmp_path / "simulation.md").read_text()
    assert "| 2·S_max | balanced |" in md  # R = 8, g = 2·S_max only
    assert "| dual_constraint | 1.00× (" in md and "### R = 8, g = 2·S_max" in md  # the paper's cell: itself


def test_compare_strategies_estimates_every_mode_up_front():
    """The quick run itself (89 s on the 2-core development machine) is left to the user; its plan and the others'
    are checked."""
    quick = run("scripts/compare_strategies.py", "--quick", "--plan")
    assert quick.returncode == 0, quick.stderr[-3000:]
    assert 30 <= estimate_s(quick.stdout) <= 90 and "2 processes" in quick.stdout and "quick" in quick.stdout
    tiny = run("scripts/compare_strategies.py", "--tiny", "--procs", "2", "--plan")
    assert estimate_s(tiny.stdout) > 300 and "calibration" in tiny.stdout  # the full tiny run measures its own
    gpu = run("scripts/compare_strategies.py", "--plan")
    assert estimate_s(gpu.stdout) > estimate_s(tiny.stdout) and "8 processes" in gpu.stdout


def test_show_buckets_prints_the_table_train_py_prints():
    """scripts/show_buckets.py and `train.py +show_buckets=true` print one table (training/bucket_report.py)."""
    script = run("scripts/show_buckets.py", "scheduling.m_tokens=240")
    trainer = run("train.py", "+show_buckets=true", "scheduling.m_tokens=240")
    assert script.returncode == 0 == trainer.returncode, script.stderr[-2000:] + trainer.stderr[-2000:]
    rows = [line for line in script.stdout.splitlines() if line.startswith(("img_", "vid_"))]
    assert len(rows) == 4 and rows == [line for line in trainer.stdout.splitlines() if line.startswith(("img_", "vid_"))]
    assert rows[0].split()[:2] == ["img_64", "1"] and rows[0].split()[-2] == "240"  # B·S = m_tokens for img_64


def test_a_user_mistake_in_a_script_prints_its_message_alone_and_exits_2(tmp_path):
    """training/cli.py: export of a folder that holds no checkpoint names the problem in one line, no traceback;
    HYDRA_FULL_ERROR=1 shows the trace."""
    args = [sys.executable, "scripts/export.py", str(tmp_path / "no_run"), "--out", str(tmp_path / "x")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stderr.startswith("export.py: error: "), done.stderr[-2000:]
    assert "no_run" in done.stderr
    done = subprocess.run(args, cwd=ROOT, env=dict(env, HYDRA_FULL_ERROR="1"), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "Traceback" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["train.py", "train.steps=0", "logging.wandb=disabled"], "train.py: error: train.steps must be ≥ 1, got 0"),
    (["scripts/calibrate.py", "+calibrate.bogus=1"], "calibrate.py: error: unknown config key(s) calibrate.bogus"),
    (["scripts/calibrate.py", "+calibrate.warmup=1.5"], "calibrate.py: error: calibrate.warmup must be an integer"),
    (["scripts/replay_plans.py", "--dry-run", "--steps", "0"], "replay_plans.py: error: --ranks and --steps must be ≥ 1")])
def test_the_hydra_entry_points_report_a_mistake_the_same_way(args, message):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert message in done.stderr


def test_mmdit_bench_with_varying_text_runs_both_passes_of_the_same_draws_on_a_cpu(tmp_path):
    """The GPU question 'what does a new text length cost' as a dry run (--device cpu --tiny): each impl runs the
    seeded draws twice, in order; the rows count the lengths new to the first pass, and a failing impl is a row."""
    import json

    out = run("scripts/bench/mmdit.py", "--vary-text", "5", "--device", "cpu", "--tiny", "--impls",
              "ours@flash,diffusers@default,diffusers@cudnn", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads((tmp_path / "bench_mmdit_vary_text.json").read_text())
    rows = {r["impl"]: r for r in got["rows"]}
    assert set(rows) == {"ours@flash", "diffusers@default", "diffusers@cudnn"}
    assert "error" in rows["diffusers@cudnn"]  # a CPU has no cuDNN attention: said, not fatal
    draws = rows["ours@flash"]["lengths"]
    assert len(draws) == 5 and all(16 <= r <= 256 for r in draws) and draws == rows["diffusers@default"]["lengths"]
    for impl in ("ours@flash", "diffusers@default"):
        r = rows[impl]
        assert len(r["first_ms"]) == len(r["second_ms"]) == 5 and min(r["first_ms"] + r["second_ms"]) > 0
        assert r["new_lengths"] == len({x for x in draws if x != 256})
    assert got["meta"]["tiny"] is True and got["meta"]["TORCH_CUDNN_SDPA_AVOID_RECOMPILE"] is None


def test_step_bench_times_the_graph_columns_and_keeps_one_table_line_per_micro_batch_shape(tmp_path):
    """scripts/bench/step.py's ours@graph (ours@policy's setting captured whole, as train.py runs small micro-batches)
    and diffusers@graph, as a dry run on the CPU (FakeGraphs replay by calling the step again): an eager warm-up, one
    capture, then the timed replays; ours@graph searches its recompute as ours@policy does (with no memory limit on a
    CPU both choose none). 1 × 16 and 4 × 16 tokens are
    two lines of the table: its lines are keyed by B and S."""
    import json

    out = run("scripts/bench/step.py", "--tiny", "--out", str(tmp_path), "--shapes", "0,3", "--fast-backend", "native",
              "--reps", "2", "--longest", "", "--peak-limit", "lowest",
              "--impls", "diffusers@fast,diffusers@graph,ours@policy,ours@graph")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "bench_step.jsonl").read_text().splitlines()]
    by = {(r["impl"], r["B"], r["S"]): r for r in rows}
    assert set(by) == {(i, B, 16) for i in ("diffusers@fast", "diffusers@graph", "ours@policy", "ours@graph")
                       for B in (4, 1)}
    for B in (4, 1):
        for impl in ("ours@graph", "diffusers@graph"):
            r = by[(impl, B, 16)]
            assert r["replays"] == 2 + 1 and r["graph_failed"] == 0 and r["ms"] > 0, r  # the capture's replay + 2
            assert r["compiled"] is False  # blocks are compiled for diffusers@graph on a GPU only
        assert by[("ours@graph", B, 16)]["recompute_blocks"] == by[("ours@policy", B, 16)]["recompute_blocks"]
        assert "limit_gib" in by[("ours@graph", B, 16)] and "limit_gib" in by[("ours@policy", B, 16)]
    lines = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in lines[1:]] == ["| 1 × 16", "| 4 × 16"], lines
    assert "diffusers@graph ms" in lines[0] and "ours@graph ms" in lines[0]
    retained = json.loads((tmp_path / "bench_step.json").read_text())["meta"]["retained_gib"]
    assert set(retained) == {f"{i} {B}x16" for i in ("ours@graph search", "ours@graph", "diffusers@graph")
                             for B in (4, 1)} and set(retained.values()) == {None}  # bytes are the GPU's


def test_step_bench_table_leaves_out_a_graph_column_that_ran_eagerly(monkeypatch):
    """A graph column whose capture failed timed eager steps (graph_failed > 0): its row stays in the file but not in
    the table, so it can be neither ours' best nor diffusers' best; a captured one counts within its limit."""
    import importlib.util

    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts", "bench"))  # step.py imports its sibling harness.py
    spec = importlib.util.spec_from_file_location("bench_step", os.path.join(ROOT, "scripts", "bench", "step.py"))
    step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step)

    def row(impl, B, ms, peak, **extra):
        return dict(impl=impl, B=B, S=1560, ms=ms, tokens_per_s=B * 1560 / ms * 1e3, peak_gib=peak, **extra)

    rows = [row("diffusers@fast", 1, 200.0, 5.6), row("diffusers@graph", 1, 50.0, 5.5, graph_failed=1),
            row("ours@graph", 1, 100.0, 5.5, graph_failed=0, fits=True, limit_gib=5.6),
            row("diffusers@fast", 4, 300.0, 6.2), row("ours@graph", 4, 100.0, 6.0, graph_failed=1, fits=True)]
    lines = step.table(rows).splitlines()
    assert "diffusers@graph" not in lines[0]  # its one row ran eagerly
    one, four = lines[2], lines[3]
    assert one.startswith("| 1 × 1560 |") and one.endswith("| nan× | 2.00× |")  # 200 / 100 ms, not 50 / 100
    assert four.startswith("| 4 × 1560 |") and four.endswith("| nan× | nan× |")  # no captured column of ours


def test_attention_layout_bench_times_each_variant_in_turns_and_checks_they_compute_the_same(tmp_path):
    """scripts/bench/attention.py --layouts as a CPU dry run (math kernel, the CPU flash op for `aten`): every
    variant is a row with its time against bshd's and its gradients' distance from bshd's; the layouts differ, the
    gradients must not."""
    import json

    out = run("scripts/bench/attention.py", "--layouts", "--tiny", "--reps", "2", "--rounds", "2", "--out",
              str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads((tmp_path / "attention_layouts.json").read_text())["rows"]}
    assert set(rows) == {"bhsd", "bshd", "sdpa()", "aten"}
    assert rows["bshd"]["vs_bshd"] == 1.0
    for r in rows.values():
        assert r["ms"] > 0 and r["spread_ms"][0] <= r["ms"] <= r["spread_ms"][1]
        # > 1: faster than bshd (from ms rounded to 1 µs, hence the tolerance; aten, the CPU flash op, is 2-3× faster)
        assert r["vs_bshd"] == pytest.approx(rows["bshd"]["ms"] / r["ms"], rel=0.02)
        assert r["grad_rel_diff_vs_bshd"] < 1e-5, r  # fp32 on a CPU: kernels differ by rounding only
