"""Checkpoint files: no code runs from a crafted folder, damage is found before loading, resume rules hold."""
import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from training.checkpoint import (CheckpointError, MANIFEST, list_checkpoints, load_checkpoint, read_metadata,
                                 safe_load, save_checkpoint, verify_checkpoint, write_manifest)
from training.dist import DistContext
from training.optim import EMA, OptimConfig, build_optimizer
from training.resume import apply_optim_config, changes_plan, config_changes, optim_hyperparameters, resume

CTX = DistContext()


class Payload:
    """Unpickling this runs `touch <marker>`: what an attacker would put in a checkpoint file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def _trained(lr=1e-2, steps=2):
    model = _model()
    opt, sched = build_optimizer(model, OptimConfig(lr=lr, warmup_steps=3), 10)
    ema = EMA(model, 0.9)
    for _ in range(steps):
        model(torch.randn(3, 4)).square().sum().backward()
        opt.step(), sched.step(), opt.zero_grad()
        ema.update(model)
    return model, opt, sched, ema


def _save(run_dir, step, model, opt, sched, ema, keep_last=5, diverged=False):
    meta = {"epoch": 0, "pos": step, "lr_scheduler": sched.state_dict()}
    return save_checkpoint(str(run_dir), step, model, opt, ema, meta, "train: {}\n", CTX, keep_last,
                           diverged=diverged)


def _fresh():
    model = _model()
    opt, sched = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=3), 10)
    return model, opt, sched, EMA(model, 0.9)


def _rehash(path):
    os.remove(os.path.join(path, MANIFEST))
    write_manifest(path, CTX)


def test_save_load_round_trip_with_manifest(tmp_path):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    with open(os.path.join(path, MANIFEST)) as f:
        files = json.load(f)["files"]
    assert {".metadata", "meta.json", "config.yaml", "rng_rank0.pt"} <= set(files)
    assert all(files[n]["size"] == os.path.getsize(os.path.join(path, n)) for n in files)
    assert verify_checkpoint(path, CTX) is None
    m2, o2, s2, e2 = _fresh()
    meta = load_checkpoint(path, m2, o2, e2, CTX)
    assert meta["step"] == 2 and meta["diverged"] is False
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))
    assert o2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    assert o2.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    assert all(torch.equal(e2.shadow[n], ema.shadow[n]) for n in ema.shadow)


def test_the_payload_is_real_and_plain_loaders_would_run_it(tmp_path):
    """The attack the loaders below refuse: torch.load(weights_only=False) and DCP's own planner execute it."""
    marker = tmp_path / "ran"
    torch.save({"torch": Payload(marker)}, tmp_path / "rng.pt")
    torch.load(tmp_path / "rng.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": Payload(marker)}, checkpoint_id=str(tmp_path / "c"))  # pickling runs nothing
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"x": 0}, checkpoint_id=str(tmp_path / "c"))
    assert marker.exists()


@pytest.mark.parametrize("where", ["rng", "bytes", "metadata"])
def test_a_crafted_checkpoint_runs_no_code(tmp_path, where):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    marker = tmp_path / "ran"
    if where == "rng":
        torch.save({"torch": Payload(marker)}, os.path.join(path, "rng_rank0.pt"))
    elif where == "bytes":  # a non-tensor value (an optimizer hyper-parameter) replaced by the payload
        from torch.distributed.checkpoint.state_dict import get_state_dict

        _, osd = get_state_dict(model, opt)
        osd["param_groups"][0]["lr"] = Payload(marker)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for n in os.listdir(path):
                if n.endswith(".distcp") or n == ".metadata":
                    os.remove(os.path.join(path, n))
            dcp.save({"model": model.state_dict(), "optim": osd, "ema": ema.state_dict()}, checkpoint_id=path)
    else:
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(Payload(marker), f)
    assert not marker.exists()
    _rehash(path)  # the attacker rewrites the manifest too: it guards against accidents, the loaders against code
    assert verify_checkpoint(path, CTX) is None
    m2, o2, s2, e2 = _fresh()
    with pytest.raises(CheckpointError, match="refused|could not be read"):
        load_checkpoint(path, m2, o2, e2, CTX)
    assert not marker.exists()
    if where == "metadata":
        with pytest.raises(CheckpointError, match="posix.system|os.system|never holds"):
            read_metadata(path)


def test_safe_load_reads_what_dcp_writes(tmp_path):
    state = {"a": torch.arange(5.0), "b": {"lr": 0.5, "betas": (0.9, 0.99), "name": "x", "flag": True, "n": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path))
    out = {"a": torch.zeros(5), "b": {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "flag": False, "n": 1}}
    safe_load(out, str(tmp_path))
    assert torch.equal(out["a"], state["a"]) and out["b"] == state["b"]


@pytest.mark.parametrize("damage, says", [
    ("truncate_shard", "bytes, the manifest says"),
    ("remove_shard", "is missing"),
    ("flip_metadata", "SHA-256"),
    ("manifest", "manifest.json is damaged"),
    ("meta", "no meta.json"),
])
def test_damage_is_found_before_loading(tmp_path, damage, says):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    shard = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))
    if damage == "truncate_shard":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    elif damage == "remove_shard":
        os.remove(shard)
    elif damage == "flip_metadata":
        p = os.path.join(path, ".metadata")
        data = bytearray(open(p, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(p, "wb").write(bytes(data))
    elif damage == "manifest":
        with open(os.path.join(path, MANIFEST), "w") as f:
            f.write('{"files": {".metadata": ')
    else:
        os.remove(os.path.join(path, "meta.json"))
    problem = verify_checkpoint(path, CTX)
    assert problem is not None and says in problem, problem


def test_resume_auto_falls_back_past_a_damaged_newest(tmp_path, caplog):
    model, opt, sched, ema = _trained(steps=1)
    _save(tmp_path, 1, model, opt, sched, ema)
    model, opt, sched, ema = _trained(steps=2)
    newest = _save(tmp_path, 2, model, opt, sched, ema)
    shard = next(os.path.join(newest, n) for n in os.listdir(newest) if n.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.truncate(10)
    m2, o2, s2, e2 = _fresh()
    with caplog.at_level("WARNING"):
        path, meta = resume("auto", str(tmp_path), CTX, lambda p: load_checkpoint(p, m2, o2, e2, CTX))
    assert path.endswith("step_1") and meta["step"] == 1
    assert "skipping" in caplog.text and "step_2" in caplog.text and ".distcp" in caplog.text
    with pytest.raises(ValueError, match="bytes, the manifest says"):  # named explicitly: no silent fallback
        resume(newest, str(tmp_path), CTX, lambda p: load_checkpoint(p, m2, o2, e2, CTX))


def test_resume_auto_without_any_loadable_checkpoint_is_an_error(tmp_path):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    os.remove(next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp")))
    with pytest.raises(ValueError, match="no checkpoint .* could be loaded"):
        resume("auto", str(tmp_path), CTX, lambda p: {})
    assert resume("auto", str(tmp_path / "empty"), CTX, lambda p: {}) == (None, None)


def test_a_legacy_checkpoint_without_manifest_still_loads(tmp_path):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    os.remove(os.path.join(path, MANIFEST))
    assert verify_checkpoint(path, CTX) is None
    m2, o2, s2, e2 = _fresh()
    assert load_checkpoint(path, m2, o2, e2, CTX)["step"] == 2


def test_a_diverged_checkpoint_never_evicts_a_good_one(tmp_path):
    model, opt, sched, ema = _trained()
    _save(tmp_path, 2, model, opt, sched, ema, keep_last=1)
    bad = _save(tmp_path, 3, model, opt, sched, ema, keep_last=1, diverged=True)
    assert os.path.basename(bad) == "diverged_step_3"
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [2]
    with open(os.path.join(bad, "meta.json")) as f:
        assert json.load(f)["diverged"] is True
    m2, o2, s2, e2 = _fresh()
    path, _ = resume("auto", str(tmp_path), CTX, lambda p: load_checkpoint(p, m2, o2, e2, CTX))
    assert path.endswith("/step_2")
    _save(tmp_path, 4, model, opt, sched, ema, keep_last=1)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [4] and os.path.isdir(bad)


def test_new_optimizer_values_are_applied_at_the_restored_step(tmp_path):
    model, opt, sched, ema = _trained(lr=1e-2, steps=2)  # warm-up 3: the factor at step 2 is 3/3
    path = _save(tmp_path, 2, model, opt, sched, ema)
    for lr, wd, betas in ((1e-2, 0.0, (0.9, 0.999)), (4e-3, 0.1, (0.8, 0.95))):
        m2 = _model()
        o2, s2 = build_optimizer(m2, OptimConfig(lr=lr, weight_decay=wd, betas=betas, warmup_steps=3), 10)
        fresh = optim_hyperparameters(o2)
        meta = load_checkpoint(path, m2, o2, None, CTX)
        s2.load_state_dict(meta["lr_scheduler"])
        apply_optim_config(o2, s2, fresh)
        assert s2.last_epoch == 2
        assert o2.param_groups[0]["lr"] == lr * 3 / 3 and s2.get_last_lr()[0] == lr
        assert o2.param_groups[0]["weight_decay"] == wd and o2.param_groups[1]["weight_decay"] == 0.0
        assert o2.param_groups[0]["betas"] == betas
        if lr == 1e-2:  # unchanged values: the same numbers the checkpoint held
            assert [g["lr"] for g in o2.param_groups] == [g["lr"] for g in opt.param_groups]
        s2.step()
        assert o2.param_groups[0]["lr"] == lr  # the schedule goes on from the new base


@pytest.mark.parametrize("key, plan", [
    ("optim.lr", False), ("optim.weight_decay", False), ("optim.groups.head.lr", False),
    ("optim.groups.head.match", True), ("train.steps", False), ("objective.shift", False),
    ("train.seed", True), ("train.micro_batches", False), ("data.buckets.img.height", True),
    ("data.num_workers", False), ("data.caption_dropout", False), ("scheduling.m_tokens", True),
    ("model.num_layers", True), ("model.lora.rank", True), ("model.checkpointing", False),
    ("model.glue_backend", False), ("checkpoint.every", False), ("logging.wandb", False),
])
def test_which_changes_change_the_plan(key, plan):
    assert changes_plan(key) is plan


def test_config_changes_split_plan_from_hyperparameters():
    saved = {"name": "a", "optim": {"lr": 1e-3}, "train": {"seed": 0, "steps": 10}, "data": {"buckets": {"a": 1}}}
    now = {"name": "b", "optim": {"lr": 5e-4}, "train": {"seed": 0, "steps": 20},
           "data": {"buckets": {"a": 1, "b": 2}}}
    plan, other = config_changes(saved, now)
    assert plan == {"data.buckets.b": (None, 2)}
    assert other == {"optim.lr": (1e-3, 5e-4), "train.steps": (10, 20)}


class _RankOfTwo(DistContext):
    """Rank `rank` of a two-process run, in one process: the other rank's all_gather_floats values are given."""

    def __init__(self, rank, other_flags):
        super().__init__(rank=rank, world_size=2)
        self.other = other_flags

    def all_gather_floats(self, values):
        rows = [torch.tensor(values, dtype=torch.float64), torch.tensor(self.other, dtype=torch.float64)]
        return torch.stack(rows if self.rank == 0 else rows[::-1])


def test_damage_found_by_another_rank_fails_the_check_on_every_rank(tmp_path):
    """verify_checkpoint's verdict is agreed: each rank hashes half the files, and a rank whose own half is clean
    still reports the damage another rank found (else the ranks would disagree on loading)."""
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    assert verify_checkpoint(path, _RankOfTwo(0, [0.0])) is None
    for rank in (0, 1):
        problem = verify_checkpoint(path, _RankOfTwo(rank, [1.0]))
        assert problem == f"rank {1 - rank} found a damaged or missing file (its log names it)", problem


def test_only_step_folders_holding_meta_json_are_listed_in_step_order(tmp_path):
    """A step_N folder without meta.json is a save cut short (meta.json is written last): never a checkpoint."""
    for step, complete in ((9, True), (10, True), (11, False), (2, True)):
        os.makedirs(tmp_path / f"step_{step}")
        if complete:
            (tmp_path / f"step_{step}" / "meta.json").write_text("{}")
    os.makedirs(tmp_path / "step_x")
    (tmp_path / "step_x" / "meta.json").write_text("{}")
    assert list_checkpoints(str(tmp_path)) == [(s, str(tmp_path / f"step_{s}")) for s in (2, 9, 10)]
    assert list_checkpoints(str(tmp_path / "missing")) == []


def test_rng_state_is_restored_only_at_the_world_size_it_was_saved_with(tmp_path):
    model, opt, sched, ema = _trained()
    torch.manual_seed(7)
    path = _save(tmp_path, 2, model, opt, sched, ema)
    after_save = torch.rand(4)
    fresh = _fresh_for_load()  # (builds a model: seeds the RNG itself)
    torch.manual_seed(99)
    load_checkpoint(path, *fresh, CTX)
    torch.testing.assert_close(torch.rand(4), after_save, rtol=0, atol=0)  # the stream goes on where it was saved

    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    meta["world_size"] = CTX.world_size + 1  # saved by another number of ranks: their streams are not this rank's
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)
    _rehash(path)
    torch.manual_seed(99)
    expected = torch.rand(4)
    fresh = _fresh_for_load()
    torch.manual_seed(99)
    load_checkpoint(path, *fresh, CTX)
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)  # left as it was
    assert not torch.equal(expected, after_save)


def _fresh_for_load():
    model, opt, _, ema = _fresh()
    return model, opt, ema
