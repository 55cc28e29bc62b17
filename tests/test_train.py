"""End-to-end training on the CPU: the default run learns, resume equals the uninterrupted run, SIGTERM checkpoints."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, run_training, tiny_overrides
from training.checkpoint import list_checkpoints
from training.metrics import read_metrics

pytestmark = pytest.mark.slow

EVERY_STEP_KEYS = {"step", "samples_seen", "train/loss", "train/grad_norm", "train/lr", "perf/tokens_per_s",
                   "perf/samples_per_s", "perf/mfu", "time/step_s", "time/data_wait_s", "time/fwd_s", "time/bwd_s",
                   "time/optim_s", "time/step_s_max", "balance/compute_cv_pred", "balance/idle_fraction_pred",
                   "balance/step_time_cv", "batch/S", "batch/B", "batch/bucket", "memory/peak_gib"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def test_default_run_learns_and_logs_the_contract_metrics(tmp_path, cache, monkeypatch):
    run_dir = str(tmp_path / "run")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    overrides = tiny_overrides(run_dir, cache, "train.steps=100", "train.val_every=50")
    run_training([o for o in overrides if not o.startswith("logging.wandb")] + ["logging.wandb=offline"])
    assert any(d.startswith("offline-run-") for d in os.listdir(os.path.join(run_dir, "wandb")))
    rows = read_metrics(run_dir)
    val = [(r["step"], r["val/loss"]) for r in rows if "val/loss" in r]
    assert [s for s, _ in val] == [0, 50, 100]
    assert val[-1][1] <= 0.8 * val[0][1], f"val/loss did not fall by 20 %: {val}"
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 100 and EVERY_STEP_KEYS <= set(steps[-1])
    last = steps[-1]
    assert last["perf/tokens_per_s"] > 0 and last["perf/mfu"] is None  # MFU is null on CPU
    assert last["samples_seen"] == sum(r["samples_seen"] - p["samples_seen"] for p, r in zip(rows, rows[1:])) > 0
    assert all(S in (16, 24, 48, 120) for S in last["batch/S"]) and len(last["batch/S"]) == 2
    assert 0 <= last["balance/idle_fraction_pred"] < 1 and last["memory/peak_gib"] > 0
    assert list_checkpoints(run_dir)[-1][0] == 100
    # train/lr is the rate each step's update used: warm-up starts at lr / warmup_steps (conf/optim/adamw.yaml)
    assert steps[0]["train/lr"] == pytest.approx(2e-3 / 10) and steps[9]["train/lr"] == pytest.approx(2e-3)
    with open(os.path.join(run_dir, "config.yaml")) as f:
        assert "num_layers: 2" in f.read()


def test_resume_reproduces_the_uninterrupted_run(tmp_path, cache):
    straight = str(tmp_path / "straight")
    common = ("train.steps=16", "train.val_every=8", "checkpoint.every=8", "checkpoint.keep_last=3",
              "optim.ema_decay=0.9")
    run_training(tiny_overrides(straight, cache, *common))
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(straight, "step_8"), os.path.join(resumed, "step_8"))
    # the resumed half recomputes every block around its kept attention: bit-identical numbers, through the trainer
    run_training(tiny_overrides(resumed, cache, *common, "resume=auto", "model.checkpointing=full",
                                "model.keep_attention=true"))
    a = {r["step"]: r for r in read_metrics(straight)}
    b = {r["step"]: r for r in read_metrics(resumed)}
    assert min(b) == 9 and max(b) == 16
    for s in range(9, 17):
        for k in ("train/loss", "train/grad_norm", "train/lr", "samples_seen", "batch/S"):
            assert a[s][k] == b[s][k], (s, k, a[s][k], b[s][k])
    assert a[16]["val/loss"] == b[16]["val/loss"]
    # throughput restarts its warm-up in the resumed process instead of staying null
    assert b[11]["perf/tokens_per_s"] is None and b[12]["perf/tokens_per_s"] > 0 and b[16]["perf/samples_per_s"] > 0


def test_sigterm_leaves_a_resumable_checkpoint(tmp_path, cache):
    run_dir = str(tmp_path / "sig")
    args = [sys.executable, "train.py", *tiny_overrides(run_dir, cache, "train.steps=100000", "checkpoint.every=0",
                                                          "train.val_every=100000")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.time() + 120
    while time.time() < deadline:
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= 4:
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    (step, path), = list_checkpoints(run_dir)
    assert step >= 3
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    assert meta["step"] == step and meta["samples_seen"] > 0 and "pos" in meta and "epoch" in meta
    run_training(tiny_overrides(run_dir, cache, f"train.steps={step + 2}", "resume=auto"))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows[-2:]] == [step + 1, step + 2]


def test_nan_losses_skip_the_update_then_stop_the_run_and_resume_goes_back_to_good(tmp_path, cache, monkeypatch):
    import torch

    from models.flow_matching import FlowMatching

    calls = {"n": 0}
    real = FlowMatching.per_sample_loss

    def poisoned(model, x0, text, t, noise):
        loss = real(model, x0, text, t, noise)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] > 4:  # training micro-batches 5.. (steps 3..) turn NaN; validation stays clean
                return loss * float("nan")
        return loss

    monkeypatch.setattr(FlowMatching, "per_sample_loss", staticmethod(poisoned))
    run_dir = str(tmp_path / "nan")
    common = ("train.steps=20", "train.max_bad_steps=3", "checkpoint.every=2", "checkpoint.keep_last=1",
              "train.val_every=1")
    with pytest.raises(RuntimeError, match=r"train.max_bad_steps=3.*diverged_step_5.*resume=auto.*optim.lr="):
        run_training(tiny_overrides(run_dir, cache, *common))
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    assert max(rows) == 5 and [rows[s]["train/skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 2, 3]
    # steps 3-5 left the weights as step 2 made them
    val = [rows[s]["val/loss"] for s in range(1, 6)]
    assert val[1] == val[2] == val[3] == val[4] != val[0]
    # the guard's checkpoint is kept for inspection beside the good one, which it did not evict (keep_last=1); the
    # checkpoint due at step 4, inside the streak of bad steps, was postponed, not written over step 2
    assert [s for s, _ in list_checkpoints(run_dir)] == [2]
    with open(os.path.join(run_dir, "diverged_step_5", "meta.json")) as f:
        assert json.load(f)["diverged"] is True
    # resume=auto goes back to the last good checkpoint, here with a lower rate (honoured: it is not a plan change)
    monkeypatch.setattr(FlowMatching, "per_sample_loss", staticmethod(real))
    run_training(tiny_overrides(run_dir, cache, *common, "resume=auto", "train.steps=6", "optim.lr=1e-3"))
    rows = [r for r in read_metrics(run_dir) if r["step"] > 5 or "train/lr" in r][-2:]
    assert [r["step"] for r in rows] == [5, 6] and rows[-1]["train/lr"] == pytest.approx(1e-3 * 6 / 10)


def test_keep_last_prunes_old_checkpoints(tmp_path, cache):
    run_dir = str(tmp_path / "keep")
    run_training(tiny_overrides(run_dir, cache, "train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=2",
                                "train.val_every=8"))
    assert [s for s, _ in list_checkpoints(run_dir)] == [6, 8]
    assert not [d for d in os.listdir(run_dir) if d.endswith(".tmp")]


def test_resume_from_a_missing_checkpoint_is_a_clear_error(tmp_path, cache):
    with pytest.raises(ValueError, match=r"step_7: no such folder, as given or in run_dir"):
        run_training(tiny_overrides(str(tmp_path / "r"), cache, "train.steps=1", f"resume={tmp_path}/step_7"))


def test_collector_every_pauses_python_gc_between_ticks_and_restores_it():
    """train.gc_every: no collection inside a step (a cycle made there lives until the tick of a multiple of N), old
    cycles freed by every tenth collection; the collector is back on afterwards, also after an error; 0 leaves
    Python's own schedule."""
    import gc
    import weakref

    from training.config import LoopConfig
    from training.step import collector_every

    class Node:
        pass

    assert gc.isenabled()
    with collector_every(3) as tick:
        assert not gc.isenabled()
        node = Node()
        node.me = node  # a reference cycle: only the collector frees it
        alive = weakref.ref(node)
        del node
        tick(1)
        tick(2)
        assert alive() is not None
        tick(3)
        assert alive() is None
    with collector_every(1) as tick:  # a cycle that lived through two collections (generation 2), then died
        node = Node()
        node.me = node
        alive, holder = weakref.ref(node), [node]
        del node
        tick(1)
        tick(2)
        holder.clear()
        for step in range(3, 10):
            tick(step)
            assert alive() is not None, step  # generations 0 and 1 only
        tick(10)  # the 10th collection sweeps all three
        assert alive() is None
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with collector_every(5):
            raise KeyError("a failing step")
    assert gc.isenabled()
    with collector_every(0):
        assert gc.isenabled()
    with pytest.raises(ValueError, match="train.gc_every"):
        LoopConfig(gc_every=-1)


def test_resume_refuses_a_plan_change_unless_forced_and_logs_new_hyperparameters(tmp_path, cache, caplog):
    run_dir = str(tmp_path / "ovr")
    run_training(tiny_overrides(run_dir, cache, "train.steps=2", "train.val_every=2"))
    with pytest.raises(ValueError, match=r"(?s)train.seed: 0 → 1.*resume_force=true"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=3", "resume=auto", "train.seed=1"))
    with open(os.path.join(run_dir, "config.yaml")) as f:  # a refused resume leaves the run's config alone
        assert "seed: 0" in f.read()
    with caplog.at_level("INFO"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=3", "resume=auto", "optim.weight_decay=0.5"))
    assert "optim.weight_decay 0.0 → 0.5" in caplog.text
    run_training(tiny_overrides(run_dir, cache, "train.steps=4", "resume=auto", "train.seed=1", "resume_force=true"))
    assert max(r["step"] for r in read_metrics(run_dir)) == 4


def test_tokens_per_step_holds_the_global_batch(tmp_path, cache):
    """scheduling.tokens_per_step picks M for the configured m_tokens: the tokens a step trains on average g."""
    run_dir = str(tmp_path / "g")
    cfg, _ = run_training(tiny_overrides(run_dir, cache, "train.steps=24", "train.val_every=24",
                                         "scheduling.tokens_per_step=960"))
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    per_step = [sum(B * S for B, S in zip(r["batch/B"], r["batch/S"])) for r in rows]
    assert len(rows) == 24 and len(rows[0]["batch/S"]) == 4  # M = 960 / 240
    assert abs(sum(per_step) / len(per_step) - 960) <= 0.15 * 960


def test_a_fresh_run_never_writes_into_another_runs_folder(tmp_path, cache):
    run_dir = str(tmp_path / "taken")
    run_training(tiny_overrides(run_dir, cache, "train.steps=2", "train.val_every=2"))
    before = open(os.path.join(run_dir, "metrics.jsonl")).read()
    with pytest.raises(ValueError, match=r"already holds a run \(config.yaml, metrics.jsonl, step_2.*resume=auto"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=2"))
    assert open(os.path.join(run_dir, "metrics.jsonl")).read() == before  # refused before anything was written
    run_training(tiny_overrides(run_dir, cache, "train.steps=1", "train.val_every=1", "overwrite=true"))
    aside = [d for d in os.listdir(run_dir) if d.startswith("replaced-")]
    assert len(aside) == 1 and open(os.path.join(run_dir, aside[0], "metrics.jsonl")).read() == before
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]  # the new run's rows alone
    assert [s for s, _ in list_checkpoints(run_dir)] == [1]


def test_multirun_gives_every_job_its_own_folder_and_one_wandb_group(tmp_path, cache):
    args = [sys.executable, "train.py", "-m", "optim.lr=1e-3,2e-3", "name=sweep",
            f"hydra.sweep.dir={tmp_path}/sweeps", *tiny_overrides(str(tmp_path / "runs" / "sweep"), cache,
                                                                    "train.steps=2", "train.val_every=2")]
    done = subprocess.run(args, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for lr in ("0.001", "0.002"):  # each job named by its swept value
        folder = tmp_path / "runs" / f"sweep-optim.lr_{lr}"
        assert [r["step"] for r in read_metrics(str(folder))][-1] == 2
        text = (folder / "config.yaml").read_text()
        assert f"name: sweep-optim.lr_{lr}" in text and f"lr: {lr}" in text and "group: sweep" in text
    # one of them resumed alone with a new learning rate: the rate is used and logged, the wandb group kept
    folder = str(tmp_path / "runs" / "sweep-optim.lr_0.001")
    done = subprocess.run([sys.executable, "train.py", "resume=auto", "optim.lr=5e-4", "name=sweep-optim.lr_0.001",
                           *tiny_overrides(folder, cache, "train.steps=3", "train.val_every=3")], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"), capture_output=True,
                          text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-2000:]
    assert "resume: optim.lr 0.001 → 0.0005 (this run's value is used)" in out
    assert "resume: logging.group 'sweep' kept" in out and "logging.group 'sweep' → None" not in out
    rows = read_metrics(folder)
    assert rows[-1]["step"] == 3  # in linear warm-up: step 3 at half the base rate is 3/2 · ½ of step 2's rate
    assert rows[-1]["train/lr"] == pytest.approx(rows[2]["train/lr"] * 1.5 * 0.5, rel=1e-9)
    # resumed again without naming optim.lr: the run's 5e-4 goes on, not the config's default 2e-3
    done = subprocess.run([sys.executable, "train.py", "resume=auto", "name=sweep-optim.lr_0.001",
                           *tiny_overrides(folder, cache, "train.steps=4", "train.val_every=4")], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"), capture_output=True,
                          text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-2000:]
    assert "resume: optim.lr 0.0005 kept, the run's value (this command line does not set it; the config alone " \
           "gives 0.002)" in out and "optim.lr 0.0005 → 0.002" not in out
    rows = read_metrics(folder)
    assert rows[-1]["step"] == 4 and rows[-1]["train/lr"] == pytest.approx(rows[3]["train/lr"] * 4 / 3, rel=1e-9)


def test_reformed_trains_streams_samples_on_the_plans_plan_step_returns(tmp_path, cache, monkeypatch):
    """scheduling.planner=reformed on the tiny default, M = 6 on one rank (a step holds several micro-batches of a
    bucket, which re-forming merges up to the calibration's m_mem = 960 tokens): each step runs rank 0's
    micro-batches of the plan plan_step returns, slot by slot, and trains stream's samples, so samples_seen,
    tokens_seen and train/loss (t and noise are keyed by sample) match the stream run's to float rounding, in
    fewer micro-batches of B outside the batch table (15, 10, 5, 2)."""
    import train

    monkeypatch.chdir(ROOT)
    made, plan_step = {}, train.plan_step

    def recording(*args, **kw):
        plan, nxt = plan_step(*args, **kw)
        made[(args[2], args[3])] = (args, kw, plan)  # (epoch, pos)
        return plan, nxt

    monkeypatch.setattr(train, "plan_step", recording)
    common = ("train.steps=3", "train.val_every=3", "train.micro_batches=6",
              "scheduling.calibration=results/calibration_cpu_tiny.json")
    run_training(tiny_overrides(str(tmp_path / "stream"), cache, *common, "scheduling.planner=stream"))
    made.clear()
    run_training(tiny_overrides(str(tmp_path / "reformed"), cache, *common, "scheduling.planner=reformed"))
    a = [r for r in read_metrics(str(tmp_path / "stream")) if r["step"] > 0]
    b = [r for r in read_metrics(str(tmp_path / "reformed")) if r["step"] > 0]
    assert len(a) == len(b) == 3
    epoch, pos, merged = 0, 0, 0
    for ra, rb in zip(a, b):
        args, kw, plan = made[(epoch, pos)]
        assert (kw["planner"], kw["m_mem"]) == ("reformed", 960) and plan_step(*args, **kw)[0] == plan
        assert rb["batch/B"] == [mb.B for mb in plan.ranks[0]] and rb["batch/S"] == [mb.S for mb in plan.ranks[0]]
        assert all(B * S <= 960 for B, S in zip(rb["batch/B"], rb["batch/S"]))
        assert (rb["samples_seen"], rb["tokens_seen"]) == (ra["samples_seen"], ra["tokens_seen"])
        assert rb["train/loss"] == pytest.approx(ra["train/loss"], rel=1e-5)
        assert sum(B * S for B, S in zip(rb["batch/B"], rb["batch/S"])) == \
            sum(B * S for B, S in zip(ra["batch/B"], ra["batch/S"]))
        merged += len(rb["batch/B"]) < len(ra["batch/B"]) and not set(rb["batch/B"]) <= {15, 10, 5, 2}
        epoch, pos = plan.epoch, plan.next_pos
    assert merged >= 2
    assert rb["val/loss"] == pytest.approx(ra["val/loss"], rel=1e-4)


@pytest.mark.parametrize("preset", ["wan21_8gpu", "wan21_16gpu", "hunyuan_video", "wan21_1p3b_lora"])
def test_gpu_presets_run_the_balanced_planner_on_a_calibration_of_their_own(preset):
    from tests.helpers import compose_config

    cfg = compose_config([f"conf={preset}"])
    assert (cfg.scheduling.strategy, cfg.scheduling.calibration, cfg.launch.device) == ("balanced", "auto", "cuda")
    base = compose_config([f"conf={preset}", "scheduling=equal_token"])  # the paper's baseline, one word away
    assert base.scheduling.strategy == "equal_token" and base.scheduling.m_tokens == cfg.scheduling.m_tokens
    assert base.scheduling.planner is None  # its own default, stream: the multi-GPU presets' reformed leaves with
    # their group (balanced_reformed), and so does the paper's system
    assert compose_config([f"conf={preset}", "scheduling=dual_constraint"]).scheduling.planner is None
    assert cfg.scheduling.planner == ("reformed" if preset.startswith("wan21_") and "gpu" in preset else None)


def test_reformed_without_a_memory_bound_is_refused_before_any_process_starts():
    from tests.helpers import compose_config

    asked = ["conf=wan21_8gpu", "scheduling=equal_token", "scheduling.planner=reformed", "scheduling.calibration=null"]
    with pytest.raises(ValueError, match="planner=reformed re-forms .* set scheduling.m_mem"):
        compose_config(asked)  # the config's own check, as train.py loads it
    assert compose_config(asked + ["scheduling.m_mem=160000"]).scheduling.planner == "reformed"


def test_the_one_gpu_preset_runs_equal_token_batches_at_a_fixed_batch_and_balanced_is_one_word_away():
    """On one GPU nothing waits, so no planner gains: wan21_1p3b runs the matrix's best cell for one GPU
    (results/simulation_h200.md), equal-token batches of S_max tokens at 75,600 tokens a step."""
    from tests.helpers import compose_config

    cfg = compose_config(["conf=wan21_1p3b"])
    sc = cfg.scheduling
    assert (sc.strategy, sc.calibration, cfg.launch.device, cfg.launch.num_processes) == ("equal_token", "auto",
                                                                                         "cuda", 1)
    assert (sc.m_tokens, sc.tokens_per_step, sc.planner, sc.window) == (75600, 75600, None, 1)
    bal = compose_config(["conf=wan21_1p3b", "scheduling=balanced"]).scheduling
    assert bal.strategy == "balanced" and bal.tokens_per_step == 75600


def _train_cli(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, (done.stdout + done.stderr).splitlines()


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 8, reason="this machine has the preset's GPUs")
def test_a_gpu_preset_on_a_machine_without_its_gpus_stops_at_once_with_one_message(tmp_path):
    t0 = time.perf_counter()
    rc, lines = _train_cli("conf=wan21_8gpu", f"run_dir={tmp_path / 'r'}")
    assert rc != 0 and time.perf_counter() - t0 < 60 and len(lines) <= 3, lines
    assert any("wants 8 GPU process(es) (launch.device=cuda" in line and "launch.device=cpu" in line
               for line in lines)
    assert not any("Traceback" in line for line in lines)
    assert not os.path.exists(tmp_path / "r")  # a refused run makes no folder (Hydra's run.dir is not the run's)


def test_the_first_twenty_lines_say_what_ran(tmp_path, cache):
    rc, lines = _train_cli(*tiny_overrides(str(tmp_path / "r"), cache, "train.steps=1", "train.val_every=1",
                                           "train.progress=false", "logging=disabled", "scheduling=balanced"))
    assert rc == 0, lines[-20:]
    head = "\n".join(lines[:20])
    assert "1 process(es) (started by python (one process)), device cpu, backend none, 1 CPU thread(s)" in head
    assert "scheduling: strategy balanced, planner sorted, calibration results/calibration_cpu_tiny.json (config)" in head


def test_two_runs_started_together_into_one_folder_one_runs_the_other_is_refused_at_once(tmp_path, cache):
    """The real race: two train.py processes started at the same moment into one run folder. The folder's lock lets
    exactly one run; the other exits with status 2 within seconds, naming the holder, and leaves nothing behind.
    The winner's metrics hold each step once."""
    run_dir = str(tmp_path / "same")
    # long enough (~8 s of steps) that the winner still holds the folder whichever process starts first: with 6
    # steps an idle machine finished the first run before the second was up, which then met a finished run instead
    args = [sys.executable, "train.py", *tiny_overrides(run_dir, cache, "train.steps=200", "train.val_every=200")]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.pop("HYDRA_FULL_ERROR", None)
    procs = [subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    t0 = time.perf_counter()
    ended = {}
    while len(ended) < 2:
        for p in procs:
            if p.pid not in ended and p.poll() is not None:
                ended[p.pid] = time.perf_counter() - t0
        assert time.perf_counter() - t0 < 300
        time.sleep(0.05)
    outs = [p.communicate() for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [o[1][-2000:] for o in outs]
    (winner, _), = [(p, o) for p, o in zip(procs, outs) if p.returncode == 0]
    (loser, (_, err)), = [(p, o) for p, o in zip(procs, outs) if p.returncode == 2]
    assert f"is in use by another run (pid {winner.pid} on host " in err and "Traceback" not in err, err
    assert ended[loser.pid] < ended[winner.pid]  # refused at once, while the winner still ran
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(201)), steps  # each step once
    assert sorted(os.listdir(run_dir)) == ["config.yaml", "metrics.jsonl", "step_200", "train.log"]  # no lock left
    assert "in use by another run" not in open(os.path.join(run_dir, "train.log")).read()


def test_no_regular_checkpoint_is_written_inside_a_streak_of_bad_steps(tmp_path, cache, monkeypatch, caplog):
    """Steps 3-4 are bad and the run ends there: the checkpoint due at step 4 waits for a good step that never
    comes, and the run's end writes none either; step_2, from before the streak, is the last good one."""
    import torch

    from models.flow_matching import FlowMatching

    real, calls = FlowMatching.per_sample_loss, {"n": 0}

    def poisoned(model, x0, text, t, noise):
        loss = real(model, x0, text, t, noise)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] > 4:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(FlowMatching, "per_sample_loss", staticmethod(poisoned))
    run_dir = str(tmp_path / "streak")
    with caplog.at_level("WARNING"):
        run_training(tiny_overrides(run_dir, cache, "train.steps=4", "train.max_bad_steps=5", "checkpoint.every=2",
                                    "checkpoint.keep_last=2", "train.val_every=4"))
    assert [s for s, _ in list_checkpoints(run_dir)] == [2]
    assert "the run ends inside 2 bad step(s) in a row: no checkpoint at step 4" in caplog.text


def test_a_name_that_is_not_a_plain_folder_name_is_refused_before_anything_is_made(tmp_path):
    for name in ("..", ".", "a/b"):
        rc, lines = _train_cli(f"name={name}", f"hydra.sweep.dir={tmp_path}/s", "logging=disabled", timeout=120)
        assert rc == 2 and any("name must be a plain folder name" in line and repr(name) in line for line in lines)
    assert not os.path.exists(os.path.join(ROOT, "runs", "a"))
