"""Two CPU ranks (torchrun, gloo, FSDP2 through models/parallelize.py) against one process."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, run_training, tiny_overrides
from training.checkpoint import list_checkpoints
from training.metrics import read_metrics

pytestmark = pytest.mark.slow
STEPS = ("train.steps=10", "train.val_every=5", "checkpoint.every=5", "checkpoint.keep_last=2")


def torchrun(*args, timeout=300, **env_extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.serial  # the busy-time ratio between the ranks blurs when another test shares the CPU
@pytest.mark.parametrize("glue", ["torch", "triton", "staged"])
def test_unequal_work_per_rank_gives_single_process_gradients_and_high_busy_cv(tmp_path, glue):
    """glue "triton": the fused ops (their own autograd functions reading the block's weights) under FSDP2's
    per-block gathers, against the one-process reference glue; the interpreter runs them on CPU. "staged": every
    collective FSDP2 calls runs on host copies (launch.debug_share_gpu=host's path for CUDA tensors)."""
    if glue == "triton" and (torch.cuda.is_available() or not importlib.util.find_spec("triton")):
        pytest.skip("the fused glue on CPU ranks (gloo) needs the interpreter and triton")
    out = str(tmp_path / "worker.json")
    torchrun("tests/dist_worker.py", out, glue, **({"TRITON_INTERPRET": "1"} if glue == "triton" else {}))
    with open(out) as f:
        r = json.load(f)
    assert r["num_params"] > 50
    assert (r["staged_tensors"] > 2 * r["num_params"] // 10) == (glue == "staged")  # gathers and reductions staged
    assert r["max_rel_grad_diff"] < 1e-5  # FSDP2 with padding slots == one process over the same samples
    if glue == "staged":
        return  # the host copies count as busy time, which blurs the busy check below
    busy = r["busy"]
    assert sum(busy[0]) > 2 * sum(busy[1])  # rank 0 was given far more work, and the profiler sees it
    assert r["busy_cv"] >= 0.3 and 0 < r["idle_fraction"] < 1


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("dist")
    run_dir, cache = str(base / "two"), str(base / "cache")
    # train.py starts its own 2 processes (torch's launcher) when launch.num_processes asks for more than run
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # every block recomputed around its kept attention (selective checkpointing under FSDP2): the one-process run
    # below recomputes nothing and must still match
    args = tiny_overrides(run_dir, cache, *STEPS, "metrics.busy_every=5", "optim.ema_decay=0.9",
                          "launch.num_processes=2", "model.checkpointing=full", "model.keep_attention=true")
    out = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return base, run_dir, cache


def _losses(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir)}


def test_two_rank_metrics_are_present_and_plausible(two_rank_run):
    _, run_dir, _ = two_rank_run
    rows = _losses(run_dir)
    assert sorted(rows) == list(range(11))
    for s in (5, 10):
        r = rows[s]
        assert 0 <= r["balance/busy_cv"] < 5 and 0 <= r["balance/idle_fraction"] < 1
        assert r["val/loss"] < rows[0]["val/loss"]
    r = rows[10]
    for k in ("step_s", "fwd_s", "bwd_s", "optim_s", "data_wait_s"):
        assert r[f"time/{k}_max"] >= r[f"time/{k}"] >= 0
    assert r["time/fwd_s"] + r["time/bwd_s"] <= r["time/step_s"]
    assert r["perf/tokens_per_s"] > 0 and r["memory/peak_gib"] > 0
    assert len(r["batch/S"]) == 2  # rank 0's micro-batches
    assert [s for s, _ in list_checkpoints(run_dir)] == [5, 10]
    assert {f for f in os.listdir(os.path.join(run_dir, "step_10")) if f.startswith("rng")} == {"rng_rank0.pt",
                                                                                                  "rng_rank1.pt"}


def test_one_rank_matches_two_ranks_at_the_same_global_batch(two_rank_run):
    base, run_dir, cache = two_rank_run
    one = str(base / "one")
    run_training(tiny_overrides(one, cache, *STEPS, "optim.ema_decay=0.9", "train.micro_batches=4"))
    a, b = _losses(one), _losses(run_dir)
    for s in range(1, 11):
        assert a[s]["samples_seen"] == b[s]["samples_seen"]
        assert a[s]["train/loss"] == pytest.approx(b[s]["train/loss"], rel=1e-5)
    for s in (0, 5, 10):
        assert a[s]["val/loss"] == pytest.approx(b[s]["val/loss"], rel=1e-5)


def test_resume_two_ranks_on_one(two_rank_run):
    base, run_dir, cache = two_rank_run
    resumed = str(base / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(run_dir, "step_5"), os.path.join(resumed, "step_5"))
    run_training(tiny_overrides(resumed, cache, *STEPS, "optim.ema_decay=0.9", "train.micro_batches=4",
                                "resume=auto"))
    a, b = _losses(resumed), _losses(run_dir)
    assert min(a) == 6
    for s in range(6, 11):
        assert a[s]["samples_seen"] == b[s]["samples_seen"]
        assert a[s]["train/loss"] == pytest.approx(b[s]["train/loss"], rel=1e-5)
    assert a[10]["val/loss"] == pytest.approx(b[10]["val/loss"], rel=1e-5)


def test_export_of_a_sharded_checkpoint_loads_in_diffusers(two_rank_run, tmp_path):
    from diffusers import WanTransformer3DModel

    from models.wan import WanTransformer
    from training.export import export

    _, run_dir, _ = two_rank_run
    for ema in (False, True):
        out = export(run_dir, str(tmp_path / f"export_ema{ema}"), ema=ema)
        ours = WanTransformer.from_pretrained(out)
        theirs = WanTransformer3DModel.from_pretrained(out)
        g = torch.Generator().manual_seed(0)
        x, t, txt = torch.randn(1, 4, 3, 8, 8, generator=g), torch.tensor([700.0]), torch.randn(1, 6, 32, generator=g)
        with torch.no_grad():
            torch.testing.assert_close(ours(x, t, txt), theirs(hidden_states=x, timestep=t, encoder_hidden_states=txt,
                                                               return_dict=False)[0], atol=1e-5, rtol=1e-5)
    raw, ema = WanTransformer.from_pretrained(str(tmp_path / "export_emaFalse")), ours
    assert any(not torch.equal(p, q) for p, q in zip(raw.parameters(), ema.parameters()))  # EMA differs from raw


def test_compare_runs_reports_both_runs(two_rank_run, tmp_path):
    from training.compare import compare, read_rows, summarize

    base, run_dir, _ = two_rank_run
    rows = read_rows(run_dir)
    s = summarize(rows)
    assert s["val/loss"] == rows[-1]["val/loss"] and s["samples_seen"] == rows[-1]["samples_seen"]
    assert s["memory/peak_gib"] == max(r["memory/peak_gib"] for r in rows if "memory/peak_gib" in r)
    md = compare([run_dir, str(base / "one")], ["two", "one"], str(tmp_path))
    assert md.count("\n| ") == 2 and os.path.getsize(tmp_path / "compare.png") > 10_000


# the tiny default re-formed on two ranks: a 64-sample corpus rolls over into epoch 1 within the 4 steps, M = 4
# (8 micro-batches a step) leaves the re-forming planner room (tests/test_planner_axis.py), the tiny CPU calibration
# gives m_mem = 960 tokens a micro-batch, and every step's busy time per slot is gathered across ranks
REFORMED = ("train.steps=4", "train.val_every=4", "train.micro_batches=4", "data.synthetic.num_samples=64",
            "scheduling.calibration=results/calibration_cpu_tiny.json", "metrics.busy_every=1")
TABLE_B = {16: 15, 24: 10, 48: 5, 120: 2}  # equal_token's B per S at m_tokens = 240 (the tiny default's table)


def test_reformed_on_two_ranks_trains_streams_samples_in_micro_batches_and_slots_of_its_own(tmp_path):
    """scheduling.planner=reformed on two gloo ranks under FSDP2: every rank computes the same plan and trains its
    own row of it, slot by slot, in steps whose slot count (sorted keeps stream's micro-batches and their count) and
    micro-batch sizes re-forming changed, one with a padding micro-batch; the samples are stream's, so train/loss
    equals the stream run's step by step (t and noise are keyed by sample)."""
    runs = {}
    for planner in ("stream", "reformed"):
        out = tmp_path / planner
        out.mkdir()
        torchrun("tests/train_worker.py", str(out),
                 *tiny_overrides(str(tmp_path / f"run_{planner}"), str(tmp_path / "cache"), *REFORMED,
                                 f"scheduling.planner={planner}"), timeout=120)
        runs[planner] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for ranks in runs.values():
        assert len(ranks[0]["plans"]) == 4 and ranks[0]["plans"] == ranks[1]["plans"]  # no communication, one plan
        assert [r.get("train/loss") for r in ranks[0]["rows"]] == [r.get("train/loss") for r in ranks[1]["rows"]]
        for rank, rec in enumerate(ranks):
            for plan, st in zip(rec["plans"], rec["trained"], strict=True):
                assert (st["B"], st["S"]) == ([mb["B"] for mb in plan[rank]], [mb["S"] for mb in plan[rank]])

    def real_ids(plan):
        return sorted(i for row in plan for mb in row for i, w in zip(mb["ids"], mb["weights"]) if w > 0)

    stream, reformed = runs["stream"][0], runs["reformed"][0]
    slots_changed = resized = padded = 0
    for a, b in zip(stream["plans"], reformed["plans"], strict=True):
        assert real_ids(b) == real_ids(a)
        assert all(mb["B"] * mb["S"] <= 960 for row in b for mb in row)  # the calibration's m_mem
        slots_changed += len(b[0]) != len(a[0])
        resized += any(mb["B"] > TABLE_B[mb["S"]] for row in b for mb in row)  # merged beyond the batch table
        padded += any(not any(mb["weights"]) for row in b for mb in row)
    assert slots_changed >= 1 and resized >= 2 and padded >= 1, (slots_changed, resized, padded)
    rows_a, rows_b = ({r["step"]: r for r in run["rows"]} for run in (stream, reformed))
    assert sorted(rows_b) == list(range(5))
    for s in range(1, 5):
        assert rows_b[s]["samples_seen"] == rows_a[s]["samples_seen"]
        assert rows_b[s]["train/loss"] == pytest.approx(rows_a[s]["train/loss"], rel=1e-5)
        assert 0 <= rows_b[s]["balance/idle_fraction"] < 1
    assert rows_b[2]["epoch"] == 0 and rows_b[3]["epoch"] == 1
    assert rows_b[4]["val/loss"] == pytest.approx(rows_a[4]["val/loss"], rel=1e-5)
