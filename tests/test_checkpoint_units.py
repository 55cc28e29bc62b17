"""Checkpoint rules pinned one at a time (each kills mutants of training/checkpoint.py that tests/test_checkpoint.py
let live; results/mutation.md): the text helpers, a checkpoint of a partly frozen model, what `fit_state` refuses
and what it names, the RNG file's and meta.json's checks, DCP metadata that is not DCP's, leftover folders and
links where a save goes, and the safe reads where the environment turns torch.load's default off."""
import json
import os
import pickle
import re

import pytest
import torch

from tests.test_checkpoint import CTX, _fresh, _model, _rehash, _save, _trained
from training.checkpoint import (MANIFEST, CheckpointError, StateMismatch, _SafeReader, _listed, latest_checkpoint,
                                 load_checkpoint, read_meta, read_metadata, save_checkpoint, tail, verify_checkpoint)
from training.dist import DistContext
from training.optim import EMA, OptimConfig, build_optimizer


# -- the text helpers -----------------------------------------------------------------------------------------------

def test_tail_keeps_the_last_eight_lines_and_at_most_1500_characters():
    text = "\n".join(f"line {i}" for i in range(20)) + "\n"
    assert tail(text) == "\n".join(f"line {i}" for i in range(12, 20))
    assert tail("a" * 1000 + "b" * 1000) == "a" * 500 + "b" * 1000


def test_listed_names_four_sorted_and_counts_the_rest():
    assert _listed(["d", "a", "c", "b"]) == "a, b, c, d"
    assert _listed(list("fedcba")) == "a, b, c, d (and 2 more)"


def test_latest_checkpoint_is_the_newest_or_none(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    model, opt, sched, ema = _trained()
    _save(tmp_path, 1, model, opt, sched, ema)
    _save(tmp_path, 3, model, opt, sched, ema)
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_3")


# -- a partly frozen model (LoRA): trainable_only ----------------------------------------------------------------------

def _partly_frozen(base_shift=0.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)  # the frozen base, which model.pretrained gives back
    with torch.no_grad():
        model[0].weight.add_(base_shift)
    opt, sched = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=3), 10)
    return model, opt, sched


def _meta(sched, step):
    return {"epoch": 0, "pos": step, "lr_scheduler": sched.state_dict(), "lineage": {}}


def test_a_trainable_only_checkpoint_holds_and_restores_the_trained_parameters_alone(tmp_path):
    model, opt, sched = _partly_frozen()
    for _ in range(2):
        model(torch.randn(3, 4)).square().sum().backward()
        opt.step(), sched.step(), opt.zero_grad()
    path = save_checkpoint(str(tmp_path / "lora"), 2, model, opt, None, _meta(sched, 2), "", CTX, 5,
                           trainable_only=True)
    assert {k for k in read_metadata(path).state_dict_metadata if k.startswith("model.")} == {"model.1.weight",
                                                                                             "model.1.bias"}
    m2, o2, _ = _partly_frozen(base_shift=1.0)  # another frozen base: the checkpoint must not replace it
    base = m2[0].weight.clone()
    load_checkpoint(path, m2, o2, None, CTX, trainable_only=True)
    assert torch.equal(m2[1].weight, model[1].weight) and torch.equal(m2[0].weight, base)
    # forced onto another optimizer type: only the model is set, still without the frozen base
    m3, _, _ = _partly_frozen(base_shift=1.0)
    sgd = torch.optim.SGD([p for p in m3.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    load_checkpoint(path, m3, sgd, None, CTX, trainable_only=True, force=True)
    assert torch.equal(m3[1].weight, model[1].weight) and torch.equal(m3[0].weight, base)
    # by default a checkpoint holds the whole model, frozen base included, and is a regular step_N
    full = save_checkpoint(str(tmp_path / "full"), 2, model, opt, None, _meta(sched, 2), "", CTX, 5)
    assert os.path.basename(full) == "step_2" and json.load(open(os.path.join(full, "meta.json")))["diverged"] is False
    assert {k for k in read_metadata(full).state_dict_metadata if k.startswith("model.")} == {
        "model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"}
    m4, o4, _ = _partly_frozen(base_shift=1.0)
    load_checkpoint(full, m4, o4, None, CTX)
    assert torch.equal(m4[0].weight, model[0].weight) and torch.equal(m4[1].weight, model[1].weight)


def test_a_loaded_optimizer_holds_the_saved_state_and_param_groups(tmp_path):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    m2, o2, _, e2 = _fresh()
    assert o2.param_groups[0]["lr"] != opt.param_groups[0]["lr"]  # warm-up: the saved LR is another one
    load_checkpoint(path, m2, o2, e2, CTX)
    assert o2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


# -- what fit_state refuses, and what it names -------------------------------------------------------------------------

def _save_model(run_dir, model, step=1):
    opt, sched = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=3), 10)
    model(torch.randn(3, 4)).square().sum().backward()
    opt.step(), sched.step(), opt.zero_grad()
    return save_checkpoint(str(run_dir), step, model, opt, EMA(model, 0.9), _meta(sched, step), "", CTX, 5)


def _adamw_for(model):
    return build_optimizer(model, OptimConfig(lr=1e-2), 10)[0]


def test_weights_of_other_shapes_under_the_same_names_are_refused_naming_both_shapes(tmp_path):
    path = _save_model(tmp_path, _model())
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))
    with pytest.raises(StateMismatch, match=re.escape(f"{path} holds weights of other shapes")) as err:
        load_checkpoint(path, m2, _adamw_for(m2), EMA(m2, 0.9), CTX)
    assert "0.weight (8, 4) here (16, 4); 0.bias (8,) here (16,); 1.weight (2, 8) here (2, 16)" in str(err.value)
    # other shapes and a layer more: the missing weights are what is named
    m3 = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2), torch.nn.Linear(2, 2))
    with pytest.raises(StateMismatch, match=re.escape(f"this model's 2.bias, 2.weight are not in it")) as err:
        load_checkpoint(path, m3, _adamw_for(m3), EMA(m3, 0.9), CTX)
    assert "other shapes" not in str(err.value)


def test_a_checkpoint_holding_weights_this_model_lacks_is_refused_naming_them(tmp_path):
    torch.manual_seed(0)
    path = _save_model(tmp_path, torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2),
                                                     torch.nn.Linear(2, 2)))
    m2 = _model()
    with pytest.raises(StateMismatch, match=re.escape(f"{path} holds other model weights than this run's model: it "
                                                      f"holds 2.bias, 2.weight, which this model lacks")):
        load_checkpoint(path, m2, _adamw_for(m2), EMA(m2, 0.9), CTX)


def test_an_optimizer_of_another_type_with_the_same_state_names_is_refused(tmp_path):
    path = _save_model(tmp_path, _model())
    m2 = _model()
    adam = torch.optim.Adam(m2.parameters(), lr=1e-2)  # exp_avg, exp_avg_sq, step: AdamW's names
    with pytest.raises(StateMismatch, match=re.escape(f"{path} holds AdamW's state (exp_avg, exp_avg_sq, step); this "
                                                      f"run's optimizer is Adam")):
        load_checkpoint(path, m2, adam, None, CTX)


def test_a_checkpoint_that_does_not_name_its_optimizer_is_judged_by_its_state_names(tmp_path):
    """meta.json from before the optimizer's name was saved: the same state names load, others are refused as
    another optimizer's."""
    path = _save_model(tmp_path, _model())
    meta = json.load(open(os.path.join(path, "meta.json")))
    del meta["optimizer"]
    json.dump(meta, open(os.path.join(path, "meta.json"), "w"))
    _rehash(path)
    m2 = _model()
    assert load_checkpoint(path, m2, _adamw_for(m2), None, CTX)["step"] == 1
    sgd = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(StateMismatch, match=re.escape(f"{path} holds another optimizer's state")):
        load_checkpoint(path, m2, sgd, None, CTX)


def test_an_ema_on_both_sides_is_loaded_without_a_word_about_dropping_or_starting_one(tmp_path, caplog):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    m2, o2, _, e2 = _fresh()
    with caplog.at_level("INFO"):
        load_checkpoint(path, m2, o2, e2, CTX)
    assert all(torch.equal(e2.shadow[n], ema.shadow[n]) for n in ema.shadow)
    assert "not loaded" not in caplog.text and "holds no EMA" not in caplog.text


# -- the RNG file and meta.json ----------------------------------------------------------------------------------------

def _with_rng(tmp_path, rng):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    if rng is None:
        os.remove(os.path.join(path, "rng_rank0.pt"))
    else:
        torch.save(rng, os.path.join(path, "rng_rank0.pt"))
    _rehash(path)
    return path


def test_a_checkpoint_without_its_rng_file_loads_and_leaves_the_generator_as_it_was(tmp_path):
    path = _with_rng(tmp_path, None)
    m2, o2, _, e2 = _fresh()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    assert load_checkpoint(path, m2, o2, e2, CTX)["step"] == 2
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rule of a machine without CUDA")
def test_a_checkpoint_written_with_cuda_loads_on_a_machine_without_it(tmp_path):
    saved = torch.get_rng_state()
    path = _with_rng(tmp_path, {"torch": saved, "cuda": torch.zeros(16, dtype=torch.uint8)})
    m2, o2, _, e2 = _fresh()
    load_checkpoint(path, m2, o2, e2, CTX)
    assert torch.equal(torch.get_rng_state(), saved)


@pytest.mark.parametrize("rng, shown", [
    (torch.zeros(3), "is NoneType"),  # not a dict of states at all
    ({"torch": [1, 2]}, "is list"),
    ({"torch": torch.get_rng_state().to(torch.int8)}, f"is (torch.int8, ({torch.get_rng_state().numel()},))"),
])
def test_an_rng_file_that_is_not_this_generators_state_is_refused_before_loading(tmp_path, rng, shown):
    path = _with_rng(tmp_path, rng)
    m2, o2, _, e2 = _fresh()
    before = m2[0].weight.clone()
    with pytest.raises(CheckpointError, match=re.escape(f"rng_rank0.pt: the torch RNG state {shown}, this")):
        load_checkpoint(path, m2, o2, e2, CTX)
    assert torch.equal(m2[0].weight, before)


@pytest.mark.parametrize("meta", [{"step": 1}, [1, 2, 3], {"step": 1, "epoch": 0, "pos": "3"}])
def test_meta_json_without_the_loop_state_is_refused(tmp_path, meta):
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"meta.json lacks the loop state \(step, epoch, pos\)"):
        read_meta(str(tmp_path))


# -- DCP metadata and the manifest: the names and types they may hold --------------------------------------------------

def _metadata_rewritten(tmp_path, change):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    md = read_metadata(path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(change(md), f)
    return path


@pytest.mark.parametrize("name", ["sub/x.distcp", "..", "/etc/passwd", "a b", None])
def test_dcp_metadata_naming_anything_but_a_plain_file_of_the_folder_is_refused(tmp_path, name):
    def change(md):
        for k, v in md.storage_data.items():  # None: an admitted class that is no storage entry at all
            md.storage_data[k] = torch.Size([1]) if name is None else type(v)(relative_path=name, offset=v.offset,
                                                                               length=v.length)
        return md

    path = _metadata_rewritten(tmp_path, change)
    with pytest.raises(CheckpointError, match=re.escape(f"names the file {name!r}, not a file of this folder")):
        read_metadata(path)


def test_dcp_metadata_that_unpickles_to_plain_data_is_damage(tmp_path):
    path = _metadata_rewritten(tmp_path, lambda md: {"state_dict_metadata": {}, "storage_data": {}})
    with pytest.raises(CheckpointError, match=r"\.metadata holds a dict, not DCP's Metadata"):
        read_metadata(path)


def test_the_reader_keeps_dcps_storage_meta_and_gives_one_to_metadata_without_it(tmp_path):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    written = read_metadata(path).storage_meta
    reader = _SafeReader(path)
    md = reader.read_metadata()
    assert written.save_id is not None and md.storage_meta.save_id == written.save_id
    assert md.storage_meta.load_id == reader.load_id
    path = _metadata_rewritten(tmp_path / "old", lambda md: (setattr(md, "storage_meta", None), md)[1])
    reader = _SafeReader(path)
    md = reader.read_metadata()
    assert md.storage_meta.save_id is None and md.storage_meta.load_id == reader.load_id is not None


def _manifest_entry(path, name, size, sha="0" * 64):
    manifest = json.load(open(os.path.join(path, MANIFEST)))
    manifest["files"][name] = {"size": size, "sha256": sha}
    json.dump(manifest, open(os.path.join(path, MANIFEST), "w"))


def test_a_manifest_entry_that_is_a_folder_or_dot_dot_is_never_read_through(tmp_path):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    os.mkdir(os.path.join(path, "sub"))
    _manifest_entry(path, "sub", os.path.getsize(os.path.join(path, "sub")))
    assert verify_checkpoint(path, CTX) == "sub is not a regular file (never read through)"
    path = _save(tmp_path / "b", 2, model, opt, sched, ema)
    _manifest_entry(path, "..", os.path.getsize(tmp_path / "b"))
    assert verify_checkpoint(path, CTX) == "manifest names '..', which is not a file of this folder"


def test_a_truncated_file_is_named_with_both_sizes_and_a_missing_meta_json_as_incomplete(tmp_path):
    model, opt, sched, ema = _trained()
    path = _save(tmp_path, 2, model, opt, sched, ema)
    name = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    full = os.path.getsize(os.path.join(path, name))
    with open(os.path.join(path, name), "r+b") as f:
        f.truncate(10)
    assert verify_checkpoint(path, CTX) == f"{name} has 10 bytes, the manifest says {full}"
    with open(os.path.join(path, MANIFEST), "w") as f:
        f.write("[")
    assert verify_checkpoint(path, CTX).startswith(f"{MANIFEST} is damaged (JSONDecodeError: ")
    os.remove(os.path.join(path, "meta.json"))
    assert verify_checkpoint(path, CTX) == "no meta.json (not a complete checkpoint)"


# -- where a save goes: leftovers of a crashed save, and links ---------------------------------------------------------

def test_a_leftover_tmp_folder_file_or_link_is_replaced_and_a_links_target_untouched(tmp_path):
    model, opt, sched, ema = _trained()
    run = tmp_path / "run"
    run.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    (run / "step_1.tmp").mkdir()
    (run / "step_1.tmp" / "junk").write_text("a crashed save's")
    (run / "step_2.tmp").write_text("a file where the folder goes")
    os.symlink(outside, run / "step_3.tmp")
    os.symlink(outside, run / "step_4")  # the final name, a link: replaced, never written through
    for step in (1, 2, 3, 4):
        path = _save(run, step, model, opt, sched, ema)
        assert not os.path.islink(path) and "junk" not in os.listdir(path) and verify_checkpoint(path, CTX) is None
    assert sorted(os.listdir(run)) == ["step_1", "step_2", "step_3", "step_4"]
    assert os.listdir(outside) == ["keep"] and (outside / "keep").read_text() == "mine"


# -- a local write that fails: the save fails, on every rank, and nothing half-written is left as a checkpoint -------

@pytest.mark.parametrize("where", ["tmp folder", "rng_rank0.pt", "config.yaml", "meta.json", MANIFEST, "rename"])
def test_a_failed_local_write_fails_the_save_with_its_own_error_and_keeps_the_last_checkpoint(tmp_path, monkeypatch,
                                                                                                where):
    """Each local write of a save (the tmp folder, the RNG file, config.yaml, meta.json, the manifest, the final
    rename) is gathered and raised: a save that lost one of its files never becomes step_N."""
    import training.checkpoint as ck

    model, opt, sched, ema = _trained()
    good = _save(tmp_path, 2, model, opt, sched, ema, keep_last=5)

    def refuse(*a, **k):
        raise PermissionError(f"refused: {where}")

    if where == "tmp folder":
        real = os.makedirs
        monkeypatch.setattr(ck.os, "makedirs", lambda p, *a, **k: refuse() if p.endswith(".tmp") else real(p, *a, **k))
    elif where == "rename":
        real = os.rename
        monkeypatch.setattr(ck.os, "rename", lambda a, b, *r, **k: refuse() if str(b).endswith("step_3")
                            else real(a, b, *r, **k))
    else:
        real = ck.write_whole
        monkeypatch.setattr(ck, "write_whole", lambda folder, name, data: refuse() if name == where
                            else real(folder, name, data))
    with pytest.raises(PermissionError, match=f"^refused: {re.escape(where)}$"):
        _save(tmp_path, 3, model, opt, sched, ema, keep_last=5)
    monkeypatch.undo()
    assert "step_3" not in os.listdir(tmp_path) and latest_checkpoint(str(tmp_path)) == good
    assert verify_checkpoint(good, CTX) is None


def test_a_checkpoint_that_cannot_be_pruned_or_a_tmp_that_cannot_be_removed_changes_no_outcome(tmp_path, monkeypatch):
    """Removal is best effort: an old checkpoint that keep_last cannot delete leaves the new save done, and a
    step_N.tmp that cannot be removed after a full disk still ends in NoSpaceLeft (not in the removal's error)."""
    import errno

    import training.run_folder as rf

    model, opt, sched, ema = _trained()
    _save(tmp_path, 1, model, opt, sched, ema, keep_last=1)
    real_rmdir = os.rmdir

    def rmdir(path, *a, **k):  # a folder that will not go (e.g. held by another user's file)
        if str(path).endswith(("step_1", "step_3.tmp")):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_rmdir(path, *a, **k)

    monkeypatch.setattr(os, "rmdir", rmdir)
    path = _save(tmp_path, 2, model, opt, sched, ema, keep_last=1)
    assert path == str(tmp_path / "step_2") and verify_checkpoint(path, CTX) is None
    monkeypatch.setattr(rf.os, "write", lambda fd, b: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(rf.NoSpaceLeft, match=r"no space left on .*step_3\.tmp while writing step_3"):
        _save(tmp_path, 3, model, opt, sched, ema, keep_last=1)
    monkeypatch.undo()
    assert latest_checkpoint(str(tmp_path)) == path


class _Peers(DistContext):
    """Rank `rank` of a 2+-rank run whose gather returns what the other ranks said (`others`, by rank; this rank's
    own entry is what it passes)."""

    def __init__(self, rank, others):
        super().__init__(rank=rank, world_size=len(others))
        self.others, self.sent = others, "nothing"

    def gather_objects(self, obj):
        self.sent = obj
        return [obj if r == self.rank else o for r, o in enumerate(self.others)]


@pytest.mark.parametrize("others, errno_, named", [
    ([None, (True, "OSError: [Errno 28] full"), None], 28, r"rank 1 could not write its part of the checkpoint "
                                                          r"\(OSError: \[Errno 28\] full\)"),
    ([None, (False, "PermissionError: no"), (True, "OSError: full")], 5, r"rank 1 could not write its part of the "
                                                                          r"checkpoint \(PermissionError: no\)"),
    ([(False, "a"), None, (True, "OSError: b")], 5, r"rank 0 .*\(a\)"),
    ([None, None, (True, "OSError: b")], 28, r"rank 2 .*\(OSError: b\)"),
])
def test_agreed_raises_a_peers_failure_on_a_rank_that_wrote_its_part(others, errno_, named):
    """A rank whose own writes went well learns of the first peer that failed: an OSError naming it, ENOSPC where
    that peer's disk was full (so that every rank says no space), EIO otherwise."""
    from training.checkpoint import _agreed

    me = next(r for r, o in enumerate(others) if o is None)
    ctx = _Peers(me, others)
    with pytest.raises(OSError) as got:
        _agreed(None, ctx)
    assert re.fullmatch(named, got.value.strerror) and got.value.errno == errno_ and ctx.sent is None


def test_agreed_raises_a_ranks_own_error_and_tells_its_peers_whether_it_was_a_full_disk():
    import errno

    from training.checkpoint import _agreed

    for error, full in [(OSError(errno.ENOSPC, "No space left on device"), True),
                        (PermissionError(errno.EACCES, "Permission denied"), False)]:
        ctx = _Peers(1, [None, "mine", None])
        with pytest.raises(type(error)) as got:
            _agreed(error, ctx)
        assert got.value is error
        assert ctx.sent == (full, f"{type(error).__name__}: {error}")
    ctx = _Peers(0, ["mine", None])
    _agreed(None, ctx)  # nobody failed: nothing raised
    assert ctx.sent is None
    _agreed(None, CTX)  # one process: no gather
    with pytest.raises(KeyError):
        _agreed(KeyError("x"), CTX)
