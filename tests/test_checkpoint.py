"""Checkpoint files: no code runs from a crafted folder, damage is found before loading, resume rules hold."""
import dataclasses
import json
import os
import pickle
import warnings

import yaml

import pytest
import torch
import torch.distributed.checkpoint as dcp

from training.checkpoint import (SAFE_GLOBALS, CheckpointError, MANIFEST, _MetadataUnpickler, list_checkpoints,
                                 load_checkpoint, read_metadata, safe_load, save_checkpoint, verify_checkpoint,
                                 write_manifest)
from training.dist import DistContext
from training.optim import EMA, OptimConfig, build_optimizer
from training.resume import (apply_optim_config, changes_plan, check_config, config_changes, optim_hyperparameters,
                             resume)
from training.run_folder import NoSpaceLeft

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


def _save(run_dir, step, model, opt, sched, ema, keep_last=5, diverged=False, lineage=None):
    meta = {"epoch": 0, "pos": step, "lr_scheduler": sched.state_dict(), "lineage": lineage or {}}
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


@pytest.mark.parametrize("env", [None, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
@pytest.mark.parametrize("where", ["rng", "bytes", "metadata"])
def test_a_crafted_checkpoint_runs_no_code(tmp_path, monkeypatch, where, env):
    """Also where the environment turns torch.load's default to full unpickling: the loaders ask for weights_only
    themselves, which the environment cannot override."""
    if env:
        monkeypatch.setenv(env, "1")
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


def test_a_checkpoint_whose_manifest_was_deleted_is_damaged_not_trusted(tmp_path):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    os.remove(os.path.join(path, MANIFEST))
    problem = verify_checkpoint(path, CTX)
    assert problem is not None and "no manifest.json: its files cannot be verified" in problem
    with pytest.raises(ValueError, match="no manifest.json"):
        resume(path, str(tmp_path), CTX, lambda p: {})


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
    ("model.attention_backend", False), ("model.keep_attention", False), ("model.text_len", True),
    ("model.pretrained", True),
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


# -- the guards, each fed the one input it exists to refuse ------------------------------------------------------------

class _Getattr:
    """Unpickling this calls builtins.getattr: the first half of any gadget chain (getattr(module, 'system'))."""

    def __reduce__(self):
        return getattr, ("a string", "upper")


@pytest.mark.parametrize("module, name", [("builtins", "getattr"), ("builtins", "eval"), ("torch", "load"),
                                          ("torch", "Tensor"), ("torch.serialization", "load"), ("os", "system")])
def test_the_metadata_unpickler_admits_nothing_but_its_allow_list(tmp_path, module, name):
    """The allow-list is pinned: one global more (builtins.getattr) or a dtype check loosened to "any attribute of
    torch" (torch.load, torch.Tensor) is refused here, through the file and through find_class."""
    with pytest.raises(pickle.UnpicklingError, match=f"names {module}.{name}"):
        _MetadataUnpickler(open(os.devnull, "rb")).find_class(module, name)
    assert ("builtins", "getattr") not in SAFE_GLOBALS and not any(m == "builtins" for m, _ in SAFE_GLOBALS)
    assert _MetadataUnpickler(open(os.devnull, "rb")).find_class("torch", "float32") is torch.float32
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Getattr(), f)
    with pytest.raises(CheckpointError, match="builtins.getattr"):
        read_metadata(path)


def test_dcp_metadata_naming_a_file_outside_the_folder_is_refused(tmp_path):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    md = read_metadata(path)
    info = next(iter(md.storage_data.values()))
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(open(os.path.join(path, info.relative_path), "rb").read())
    for k, v in md.storage_data.items():
        md.storage_data[k] = type(v)(relative_path="../outside.distcp", offset=v.offset, length=v.length)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    _rehash(path)
    assert verify_checkpoint(path, CTX) is None
    with pytest.raises(CheckpointError, match="names the file '../outside.distcp', not a file of this folder"):
        load_checkpoint(path, *_fresh_for_load(), CTX)


@pytest.mark.parametrize("entry, says", [("../outside", "not a file of this folder"),
                                         ("sub/inner", "not a file of this folder"),
                                         ("absent.bin", "absent.bin is missing")])
def test_a_manifest_entry_that_is_not_a_file_here_is_damage(tmp_path, entry, says):
    """The names check and the missing-file check: the entry's bytes and hash are right wherever it points, so only
    the check itself can refuse it."""
    import hashlib

    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    data = b"x" * 10
    if entry != "absent.bin":
        os.makedirs(os.path.join(path, "sub"), exist_ok=True)
        with open(os.path.normpath(os.path.join(path, entry)), "wb") as f:
            f.write(data)
    manifest = json.load(open(os.path.join(path, MANIFEST)))
    manifest["files"][entry] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    json.dump(manifest, open(os.path.join(path, MANIFEST), "w"))
    problem = verify_checkpoint(path, CTX)
    assert problem is not None and says in problem, problem


@pytest.mark.parametrize("what", ["shard", "meta.json"])
def test_a_checkpoint_file_replaced_by_a_link_is_never_read_through_it(tmp_path, what):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    name = next(n for n in os.listdir(path) if n.endswith(".distcp")) if what == "shard" else what
    target = tmp_path / "elsewhere"
    os.rename(os.path.join(path, name), target)  # the same bytes: size and hash still match
    os.symlink(target, os.path.join(path, name))
    problem = verify_checkpoint(path, CTX)
    assert problem == f"{name} is a link (never read through)", problem
    if what == "meta.json":
        with pytest.raises(CheckpointError, match="is a link"):
            load_checkpoint(path, *_fresh_for_load(), CTX)


def _loader(m, o, s, e):
    """train.py's load(): config check, DCP read, then the LR schedule from meta.json."""
    def load(p):
        check_config(p, _cfg(), True, False)  # (the saved config is a stub: every plan value "changed")
        meta = load_checkpoint(p, m, o, e, CTX)
        s.load_state_dict(meta["lr_scheduler"])
        return meta
    return load


def _cfg():
    from tests.helpers import compose_config
    return compose_config([])


@pytest.mark.parametrize("damage, says", [
    ("yaml_tag", "config.yaml does not parse"),
    ("no_lr_scheduler", "has no lr_scheduler state"),
    ("rng_size", "the torch RNG state is"),
])
def test_a_load_failure_after_the_check_falls_back_to_the_previous_checkpoint(tmp_path, caplog, damage, says):
    """Files that pass the manifest (rewritten with them) but fail to load: resume=auto says why and takes the
    previous checkpoint; named explicitly, the reason is the error. The model is left as the fallback made it."""
    model, opt, sched, ema = _trained(steps=1)
    _save(tmp_path, 1, model, opt, sched, ema)
    model, opt, sched, ema = _trained(steps=2)
    newest = _save(tmp_path, 2, model, opt, sched, ema)
    if damage == "yaml_tag":
        open(os.path.join(newest, "config.yaml"), "w").write("train: !!python/object/apply:os.system ['true']\n")
    elif damage == "no_lr_scheduler":
        meta = json.load(open(os.path.join(newest, "meta.json")))
        del meta["lr_scheduler"]
        json.dump(meta, open(os.path.join(newest, "meta.json"), "w"))
    else:
        torch.save({"torch": torch.zeros(7, dtype=torch.uint8)}, os.path.join(newest, "rng_rank0.pt"))
    _rehash(newest)
    assert verify_checkpoint(newest, CTX) is None
    m2, o2, s2, e2 = _fresh()
    with caplog.at_level("WARNING"):
        path, meta = resume("auto", str(tmp_path), CTX, _loader(m2, o2, s2, e2))
    assert path.endswith("step_1") and meta["step"] == 1 and s2.last_epoch == 1
    assert f"skipping {newest}" in caplog.text and says in caplog.text
    ref, *_ = _trained(steps=1)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), m2.state_dict().values()))
    with pytest.raises(ValueError, match=says):
        resume(newest, str(tmp_path), CTX, _loader(*_fresh()))


def test_resume_auto_falls_back_when_loading_raises(tmp_path, caplog):
    """The fallback itself: the newest passes verification but `load` refuses it."""
    model, opt, sched, ema = _trained()
    _save(tmp_path, 1, model, opt, sched, ema)
    _save(tmp_path, 2, model, opt, sched, ema)

    def load(p):
        if p.endswith("step_2"):
            raise CheckpointError("step_2 refused by the loader")
        return {"step": 1}

    with caplog.at_level("WARNING"):
        assert resume("auto", str(tmp_path), CTX, load) == (str(tmp_path / "step_1"), {"step": 1})
    assert "skipping" in caplog.text and "step_2 refused by the loader" in caplog.text


def test_a_diverged_checkpoint_is_written_once_and_never_overwritten(tmp_path):
    model, opt, sched, ema = _trained(steps=1)
    first = _save(tmp_path, 3, model, opt, sched, ema, diverged=True)
    before = {n: open(os.path.join(first, n), "rb").read() for n in os.listdir(first)}
    model, opt, sched, ema = _trained(steps=2)
    assert _save(tmp_path, 3, model, opt, sched, ema, diverged=True) == first
    assert {n: open(os.path.join(first, n), "rb").read() for n in os.listdir(first)} == before
    assert not os.path.exists(first + ".tmp")


def test_a_full_disk_during_a_save_says_so_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    import errno

    from torch.distributed.checkpoint import filesystem

    model, opt, sched, ema = _trained()
    good = _save(tmp_path, 2, model, opt, sched, ema, keep_last=1)
    real = filesystem.FileSystem.create_stream

    class Full:
        def __init__(self, stream):
            self.stream = stream

        def __getattr__(self, k):
            return getattr(self.stream, k)

        def write(self, b):
            self.stream.write(bytes(b)[:100])
            raise OSError(errno.ENOSPC, "No space left on device")

    import contextlib

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as s:
            yield Full(s) if "w" in mode else s

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)
    with pytest.raises(NoSpaceLeft, match=r"no space left on .*step_3\.tmp while writing step_3.*step_2 is kept"):
        _save(tmp_path, 3, model, opt, sched, ema, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["step_2"]  # no step_3.tmp, nothing pruned
    assert verify_checkpoint(good, CTX) is None
    monkeypatch.undo()
    # torch's own zip writer (the RNG file) is not used on disk: its error would not say "no space"
    import training.run_folder as rf
    real_write = os.write
    monkeypatch.setattr(rf.os, "write", lambda fd, b: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(NoSpaceLeft, match="no space left on"):
        _save(tmp_path, 3, model, opt, sched, ema, keep_last=1)
    monkeypatch.setattr(rf.os, "write", real_write)
    assert sorted(os.listdir(tmp_path)) == ["step_2"]


def test_a_rollback_starts_a_branch_and_keep_last_keeps_its_rollback_point(tmp_path, caplog):
    """resume=<older step> moves the newer checkpoints aside (abandoned, kept), resume=auto then takes the
    branch's newest, and keep_last never prunes the rollback point."""
    model, opt, sched, ema = _trained()
    for step in (2, 4, 6):
        _save(tmp_path, step, model, opt, sched, ema, keep_last=3)
    with caplog.at_level("WARNING"):
        path, meta = resume(str(tmp_path / "step_2"), str(tmp_path), CTX, lambda p: {"step": 2, "lineage": {}})
    aside = [d for d in os.listdir(tmp_path) if d.startswith("abandoned-")]
    assert len(aside) == 1 and sorted(os.listdir(tmp_path / aside[0])) == ["step_4", "step_6"]
    assert meta["lineage"] == {"rollback_point": "step_2", "abandoned": [f"{aside[0]}/step_4", f"{aside[0]}/step_6"]}
    assert "starts a branch" in caplog.text and "step_4, step_6" in caplog.text
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [2]
    for step in (3, 5, 7):  # the branch, keep_last=1: the rollback point stays beside the newest
        _save(tmp_path, step, model, opt, sched, ema, keep_last=1, lineage=meta["lineage"])
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [2, 7]
    path, meta = resume("auto", str(tmp_path), CTX, lambda p: json.load(open(os.path.join(p, "meta.json"))))
    assert path.endswith("/step_7") and meta["lineage"]["rollback_point"] == "step_2"
    # resuming the newest explicitly abandons nothing: the lineage goes on as it was
    path, meta2 = resume(path, str(tmp_path), CTX, lambda p: json.load(open(os.path.join(p, "meta.json"))))
    assert meta2["lineage"] == meta["lineage"] and len([d for d in os.listdir(tmp_path) if "abandoned" in d]) == 1


# -- what a checkpoint cannot serve: handled or refused as a config matter, never called damaged -------------------

def test_turning_ema_on_at_resume_starts_a_fresh_ema_from_the_loaded_weights(tmp_path, caplog):
    model, opt, sched, _ = _trained(steps=2)
    _save(tmp_path, 2, model, opt, sched, None)  # a run without EMA
    m2, o2, s2, _ = _fresh()
    e2 = EMA(m2, 0.999)  # the fresh model's weights: what a wrong EMA would keep
    with caplog.at_level("INFO"):
        path, meta = resume("auto", str(tmp_path), CTX, lambda p: load_checkpoint(p, m2, o2, e2, CTX))
    assert path.endswith("step_2") and meta["step"] == 2
    assert all(torch.equal(e2.shadow[n], p.detach()) and torch.equal(p, dict(model.named_parameters())[n])
               for n, p in m2.named_parameters())
    assert "holds no EMA" in caplog.text and "a fresh EMA starts from the loaded weights" in caplog.text
    assert "skipping" not in caplog.text


def test_turning_ema_off_at_resume_drops_the_stored_one_and_says_so(tmp_path, caplog):
    model, opt, sched, ema = _trained(steps=2)
    _save(tmp_path, 2, model, opt, sched, ema)
    m2, o2, _, _ = _fresh()
    with caplog.at_level("INFO"):
        path, _ = resume("auto", str(tmp_path), CTX, lambda p: load_checkpoint(p, m2, o2, None, CTX))
    assert path.endswith("step_2") and torch.equal(m2[0].weight, model[0].weight)
    assert "optim.ema_decay is null: the EMA that" in caplog.text and "is not loaded (dropped)" in caplog.text


def test_another_optimizer_type_is_refused_as_a_config_change_and_forced_starts_it_fresh(tmp_path, caplog):
    model, opt, sched, ema = _trained(steps=2)
    path = _save(tmp_path, 2, model, opt, sched, ema)
    m2 = _model()
    sgd = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError) as err:  # resume=auto stops at once: the older ones would fail alike
        resume("auto", str(tmp_path), CTX, lambda p: load_checkpoint(p, m2, sgd, None, CTX))
    text = str(err.value)
    assert "AdamW's state" in text and "this run's optimizer is SGD" in text and "resume_force=true" in text
    assert "damaged" not in text and "move" not in text and "skipping" not in caplog.text
    assert os.path.isdir(path) and verify_checkpoint(path, CTX) is None
    assert not torch.equal(m2[0].weight, model[0].weight)  # refused before anything was read
    with caplog.at_level("WARNING"):
        load_checkpoint(path, m2, sgd, None, CTX, force=True)
    assert torch.equal(m2[0].weight, model[0].weight) and "the optimizer starts from a fresh state" in caplog.text
    buffers = [s.get("momentum_buffer") for s in sgd.state.values()]  # no AdamW moment read into SGD's momentum
    assert all(b is None or not b.any() for b in buffers)


def test_other_model_weights_are_refused_with_the_key_named_not_called_damaged(tmp_path):
    model, opt, sched, ema = _trained(steps=1)
    _save(tmp_path, 1, model, opt, sched, ema)
    torch.manual_seed(0)
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    m2.add_module("lora_A", torch.nn.Linear(4, 2))  # what LoRA turned on adds
    o2, _ = build_optimizer(m2, OptimConfig(lr=1e-2), 10)
    with pytest.raises(ValueError, match=r"(?s)lora_A.weight.*model.lora.rank.*scripts/export.py") as err:
        resume("auto", str(tmp_path), CTX, lambda p: load_checkpoint(p, m2, o2, EMA(m2, 0.9), CTX))
    assert "move" not in str(err.value)


def test_a_read_error_shows_the_end_of_its_cause_and_calls_verified_files_intact(tmp_path, caplog):
    """Files rewritten with their manifest that DCP cannot read: the error keeps the cause's last lines (where a
    traceback says what failed; its first 500 characters are frames), and resume=auto's advice keeps the folder."""
    model, opt, sched, ema = _trained(steps=1)
    path = _save(tmp_path, 1, model, opt, sched, ema)
    shard = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.truncate(64)
    _rehash(path)
    assert verify_checkpoint(path, CTX) is None
    m2, o2, _, e2 = _fresh()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, m2, o2, e2, CTX)
    cause = str(err.value.__cause__).strip().splitlines()
    assert len("\n".join(cause)) > 500 and cause[-1] in str(err.value)
    with caplog.at_level("WARNING"), pytest.raises(ValueError) as err:
        resume("auto", str(tmp_path), CTX, lambda p: load_checkpoint(p, m2, o2, e2, CTX))
    assert "intact" in str(err.value) and "Keep it" in str(err.value) and "move the damaged" not in str(err.value)


def test_lora_turned_on_at_resume_is_refused_up_front_forced_or_not(tmp_path):
    from tests.helpers import compose_config

    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(compose_config([]))))
    now = compose_config(["+model.lora.rank=4"])
    for force in (False, True):
        with pytest.raises(ValueError, match=r"model.lora.rank 0 → 4 turns LoRA on.*model.pretrained=exported/NAME"):
            check_config(str(ckpt), now, force, False)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["rng", "manifest"])
def test_one_ranks_full_disk_ends_the_save_on_every_rank_instead_of_a_hang(tmp_path, fault):
    """A rank whose own file (its RNG state; rank 0's manifest) meets a full disk used to leave while its peer
    waited for it in the next barrier (gloo: 30 minutes). Every rank now agrees on the local writes first, so both
    raise NoSpaceLeft at once and step_3.tmp is gone."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT

    out = str(tmp_path / "run" / "outcome")
    os.makedirs(os.path.dirname(out))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "tests/save_worker.py", out, fault], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [json.load(open(f"{out}.rank{r}.json")) for r in (0, 1)]
    for g in got:  # the rank that met the full disk and its peer alike
        assert g["raised"] == "NoSpaceLeft", g
        assert "no space left on" in g["message"] and "step_3" in g["message"], g
    assert not any(n.startswith("step_3") for n in os.listdir(tmp_path / "run"))
