"""Direct checks of the modules moved out of scripts/ (data/keys.py, data/precompute.py, training/cli.py,
training/compare.py, training/sampling.py, training/bucket_report.py, training/replay.py, training/load.py,
training/export.py) that their end-to-end tests (a script run in a subprocess, a whole training run) reach only in
passing. Each pins one rule a plausible slip would break (the hand-written mutator's pass over the moved modules
on 3bdb96c: results/mutation.md in git history); all run on the CPU, a few seconds at most each (two run
replay_plans.py --dry-run in a subprocess). training/cli.py's refusals (a full disk, a folder this user cannot write)
are here too.
"""
import errno
import glob
import hashlib
import os

import pytest
import torch

from data.keys import keyed_generator
from training import cli
from training.run_folder import NoSpaceLeft


# ------------------------------------------------------------------------------------------------- data/keys.py
@pytest.mark.parametrize("parts", [(0,), (1234, 3, "shard-00001/clip_17"), (7, "noise", 2, 5)])
def test_a_keyed_generator_is_seeded_with_the_low_63_bits_of_the_8_byte_blake2b_of_its_parts(parts):
    """The seed is part of every run's data and noise (a resumed run must draw what the first one drew): pinned to
    the formula of data/keys.py's docstring, computed here independently."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little") & (2 ** 63 - 1)
    g = keyed_generator(*parts)
    assert g.initial_seed() == seed
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=torch.Generator().manual_seed(seed)))


def test_a_keyed_generators_seed_is_stable_across_versions():
    """One literal value: a change of the hash (its size, its mask, the join) would change every run's draws."""
    assert keyed_generator(0, 1, "a").initial_seed() == 766401412018168743


# ----------------------------------------------------------------------------------------------- training/cli.py
def test_wants_trace_only_when_hydra_full_error_is_1(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert cli.wants_trace() is False
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    assert cli.wants_trace() is False
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    assert cli.wants_trace() is True


@pytest.mark.parametrize("error", [ValueError("bad value x"), FileNotFoundError("no file x")])
def test_a_user_error_prints_its_message_alone_and_exits_2(monkeypatch, capsys, error):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr("sys.argv", ["/somewhere/scripts/tool.py", "--flag"])

    def main():
        raise error

    with pytest.raises(SystemExit) as e:
        cli.run_main(main)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tool.py: error: {error}\n") and "HYDRA_FULL_ERROR=1" in err and "Traceback" not in err


def test_a_user_error_without_a_program_name_is_reported_as_script(monkeypatch, capsys):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr("sys.argv", [""])
    with pytest.raises(SystemExit) as e:
        cli.run_main(lambda: (_ for _ in ()).throw(ValueError("oops")))
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("script: error: oops")


def test_hydra_full_error_1_lets_a_user_error_raise(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="bad"):
        cli.run_main(lambda: (_ for _ in ()).throw(ValueError("bad")))


def test_another_error_is_raised_as_python_would(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(KeyError):
        cli.run_main(lambda: {}["missing"])


def _full_in_dcp(path):
    """A full disk as DCP raises it: wrapped, the OSError naming the file it was writing."""
    err = RuntimeError("checkpoint failed")
    err.__cause__ = OSError(errno.ENOSPC, "No space left on device", path)
    return err


@pytest.mark.parametrize("error, said", [
    (NoSpaceLeft(errno.ENOSPC, "no space left on /r/step_3.tmp while writing step_3: it was not written"),
     "no space left on /r/step_3.tmp while writing step_3: it was not written"),
    (_full_in_dcp("/r/step_3.tmp/__0_0.distcp"), "no space left on /r/step_3.tmp/__0_0.distcp"),
    (OSError(errno.EDQUOT, "Disk quota exceeded", "/r/metrics.jsonl"), "no space left on /r/metrics.jsonl"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/runs"), "/ro/runs: Read-only file system. This user cannot"),
    (PermissionError(errno.EACCES, "Permission denied", "/home/other/runs/a"), "/home/other/runs/a: Permission denied"),
])
def test_a_full_disk_or_a_folder_this_user_cannot_write_is_a_refusal_naming_the_path(monkeypatch, capsys, error,
                                                                                      said):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr("sys.argv", ["train.py"])
    with pytest.raises(SystemExit) as e:
        cli.run_main(lambda: (_ for _ in ()).throw(error))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"train.py: error: {said}") and "Traceback" not in err


@pytest.mark.parametrize("error", [PermissionError(errno.EACCES, "Permission denied"),  # no path: not the user's
                                   OSError(errno.EIO, "Input/output error", "/r/x"), RuntimeError("no cause")])
def test_an_os_error_that_names_no_path_or_is_no_refusal_is_raised_as_it_is(monkeypatch, error):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(type(error)):
        cli.run_main(lambda: (_ for _ in ()).throw(error))


@pytest.mark.parametrize("returned, status", [(None, 0), (0, 0), (3, 3), ("done", 0), (1, 1)])
def test_main_returning_an_int_is_the_exit_status_anything_else_is_0(returned, status):
    with pytest.raises(SystemExit) as e:
        cli.run_main(lambda: returned)
    assert e.value.code == status


# ------------------------------------------------------------------------------------------- training/compare.py
def test_summarize_takes_each_keys_last_mean_or_max_over_its_finite_values_and_the_last_val_loss():
    from training.compare import summarize

    rows = [{"step": 1, "perf/tokens_per_s": 10.0, "perf/mfu": 0.2, "memory/peak_gib": 3.0, "samples_seen": 8},
            {"step": 2, "perf/tokens_per_s": 30.0, "perf/mfu": 0.4, "memory/peak_gib": 5.0, "samples_seen": 16,
             "val/loss": 0.9},
            {"step": 3, "perf/tokens_per_s": float("nan"), "perf/mfu": 0.6, "memory/peak_gib": 4.0,
             "samples_seen": 24, "val/loss": 0.7},
            {"step": 4, "perf/tokens_per_s": 20.0, "samples_seen": 32}]
    s = summarize(rows)
    assert s["perf/tokens_per_s"] == 20.0  # last finite
    assert s["perf/mfu"] == pytest.approx(0.4)  # mean
    assert s["memory/peak_gib"] == 5.0  # max, not the last or the least
    assert s["val/loss"] == 0.7 and s["samples_seen"] == 24
    assert "perf/samples_per_s" not in s


def test_the_table_has_a_separator_cell_per_column_and_a_dash_for_a_missing_value():
    from training.compare import table

    md = table(["a", "b"], [{"perf/tokens_per_s": 12.345, "val/loss": 0.5}, {"perf/tokens_per_s": 7.0}])
    head, sep, a, b = md.splitlines()
    assert head == "| run | tokens/s | val/loss |"
    assert sep == "|---|---|---|"
    assert a == "| a | 12.35 | 0.5 |" and b == "| b | 7 | — |"


def test_compare_writes_the_table_and_the_plot(tmp_path):
    import json

    from training.compare import compare

    for name, tps in (("one", 10.0), ("two", 20.0)):
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for step in (1, 2):
                f.write(json.dumps({"step": step, "samples_seen": 8 * step, "perf/tokens_per_s": tps * step,
                                    "val/loss": 1.0 / step}) + "\n")
    md = compare([str(tmp_path / "one"), str(tmp_path / "two")], ["one", "two"], str(tmp_path / "out"))
    assert (tmp_path / "out" / "compare.md").read_text() == md + "\n"
    assert md.count("\n| ") == 2 and "| two | 40 | 0.5 |" in md
    assert os.path.getsize(tmp_path / "out" / "compare.png") > 10_000


# ------------------------------------------------------------------------------------------ training/sampling.py
@pytest.fixture(scope="module")
def default_cfg():
    from tests.helpers import compose_config

    return compose_config([])


def test_samples_are_drawn_at_the_named_bucket_or_the_video_bucket_with_the_fewest_tokens(default_cfg):
    """Default buckets: img_64 (16 tokens), img_64x96 (24), vid_64_9f (48), vid_64x96_17f (120)."""
    from training.sampling import pick_bucket

    assert pick_bucket(default_cfg, None).name == "vid_64_9f"  # a video, though an image has fewer tokens
    assert pick_bucket(default_cfg, "vid_64x96_17f").name == "vid_64x96_17f"
    assert pick_bucket(default_cfg, "img_64x96").name == "img_64x96"
    with pytest.raises(ValueError, match="not in data.buckets"):
        pick_bucket(default_cfg, "vid_1024")


def test_with_images_only_samples_are_drawn_at_the_image_bucket_with_the_fewest_tokens(default_cfg):
    from dataclasses import replace

    from training.sampling import pick_bucket

    images = {n: b for n, b in default_cfg.data.buckets.items() if b["frames"] == 1}
    cfg = replace(default_cfg, data=replace(default_cfg.data, buckets=images))
    assert pick_bucket(cfg, None).name == "img_64"


# ------------------------------------------------------------------------------------- training/bucket_report.py
def _bucket_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.startswith(("img_", "vid_"))]


def test_the_bucket_table_is_printed_as_configured_without_calibration_auto(capsys):
    from tests.helpers import compose_config
    from training.bucket_report import print_buckets

    print_buckets(compose_config(["scheduling.m_tokens=240"]))
    out = capsys.readouterr().out
    assert out.startswith("config default: strategy equal_token, 4 buckets") and "calibration=auto" not in out
    assert "B equal_token" not in out  # the equal-token column only beside another strategy
    rows = _bucket_rows(out)
    assert [r[0] for r in rows] == ["img_64", "img_64x96", "vid_64_9f", "vid_64x96_17f"]
    assert all(r[-2] == "240" for r in rows)  # B·S = m_tokens


@pytest.mark.parametrize("m_tokens, column", [("240", True), ("null", False)])
def test_another_strategy_shows_the_equal_token_batch_beside_it_when_m_tokens_is_set(capsys, m_tokens, column):
    from tests.helpers import compose_config
    from training.bucket_report import print_buckets

    print_buckets(compose_config(["scheduling=cost", f"scheduling.m_tokens={m_tokens}"]))
    out = capsys.readouterr().out
    assert "strategy cost" in out and ("B equal_token" in out) == column
    if column:
        assert [r[-1] for r in _bucket_rows(out)] == ["15", "10", "5", "2"]  # 240 // S


@pytest.mark.parametrize("found", [False, True])
def test_calibration_auto_takes_the_file_the_trainer_would_or_the_equal_token_table(monkeypatch, capsys, found):
    import training.shape_benchmark as sb
    from tests.helpers import ROOT, compose_config
    from training.bucket_report import print_buckets

    asked = []
    path = os.path.join(ROOT, "results", "calibration_cpu_tiny.json")

    def find_calibration(cfg, device, procs):
        asked.append(device)
        return (path, "how it was found") if found else (None, ["no file"])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sb, "find_calibration", find_calibration)
    print_buckets(compose_config(["scheduling=cost", "scheduling.calibration=auto", "scheduling.m_tokens=240"]))
    out = capsys.readouterr().out
    assert asked == [sb.device_name(torch.device("cpu"))]
    if found:
        assert out.startswith(f"scheduling.calibration=auto: {path} (how it was found)\n")
        assert "strategy cost" in out and "'m_mem': 960" in out
    else:
        assert out.startswith(f"scheduling.calibration=auto: no file fits this model on {asked[0]} (no file)")
        assert "strategy equal_token" in out and all(r[-2] == "240" for r in _bucket_rows(out))


# --------------------------------------------------------------------------------------------- training/replay.py
@pytest.fixture(scope="module")
def replay_inputs(default_cfg):
    import dataclasses

    from data.buckets import bucket_table
    from models.build import build_model
    from scheduling.policy import ModelShape

    table = bucket_table(default_cfg.data.buckets, patch=default_cfg.model.patch)
    meta = build_model(dataclasses.replace(default_cfg.model, pretrained=None), "meta")
    return {n: b.tokens for n, b in table.items()}, ModelShape.of(default_cfg.model, meta.num_matmul_params())


@pytest.mark.parametrize("factor, m_tokens, sizes", [(2.0, 240, [15, 10, 5, 2]), (1.0, 120, [7, 5, 2, 1])])
def test_an_equal_token_factor_is_that_many_times_the_largest_buckets_tokens(default_cfg, replay_inputs, factor,
                                                                             m_tokens, sizes):
    """Default buckets: S = 16, 24, 48, 120 (S_max); factor f → m_tokens = f · S_max, as the simulator's sweep."""
    from training.replay import resolve_entry

    tokens, shape = replay_inputs
    got, sched = resolve_entry({"strategy": "equal_token", "factor": factor}, default_cfg, tokens, shape, 2, None,
                               100.0)
    assert got == sizes and sched.values["m_tokens"] == m_tokens
    assert sched.sources["m_tokens"] == f"factor {factor:g} × S_max"


def test_the_replay_reserves_and_narrows_the_cuda_graphs_as_train_py_does():
    """Where the replay's one process captures CUDA graphs (--cuda-graphs auto on a CUDA device), each setting is
    planned as train.py plans one: its memory budget beside the graphs' pool, the capture limit narrowed to its own
    largest planned micro-batch within train.graph_max_tokens (Runner.capture_up_to then captures up to that);
    given batch sizes keep the whole limit, whose reserve bounds any capture. Graphs off, blocked or on a CPU: 0.
    The 1.3B's measured three-policy calibration."""
    import dataclasses

    from data.buckets import bucket_table
    from models.build import build_model
    from scheduling.policy import ModelShape
    from tests.helpers import ROOT
    from training.config import compose_config
    from training.replay import graph_tokens_for, resolve_entry

    cfg = compose_config(["conf=wan21_1p3b", "model.checkpointing=auto", "model.keep_attention=auto"])
    assert graph_tokens_for(cfg, "auto", "cuda") == cfg.train.graph_max_tokens == 16384
    assert graph_tokens_for(cfg, "off", "cuda") == 0 == graph_tokens_for(cfg, "auto", "cpu")
    compiled = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compile=True))
    assert graph_tokens_for(compiled, "auto", "cuda") == 0
    tokens = {n: b.tokens for n, b in bucket_table(cfg.data.buckets, patch=cfg.model.patch).items()}
    shape = ModelShape.of(cfg.model, build_model(dataclasses.replace(cfg.model, pretrained=None),
                                                 "meta").num_matmul_params())
    path = os.path.join(ROOT, "results", "calibration_h200_policies.json")
    e = {"strategy": "equal_token", "m_tokens": 16000}
    sizes, sched = resolve_entry(e, cfg, tokens, shape, 1, path, 100.0, 16384)
    plain_sizes, plain = resolve_entry(e, cfg, tokens, shape, 1, path, 100.0, 0)
    planned = [b * S for b, S in zip(sizes, tokens.values())]
    assert sched.graph_tokens == max(t for t in planned if t <= 16384) < 16384 and plain.graph_tokens == 0
    assert sched.values["graph_pool_gib"] > 0 and "graph_pool_gib" not in plain.values
    assert sched.values["m_mem"] < plain.values["m_mem"]
    given = ",".join(f"{n}={b}" for n, b in zip(tokens, plain_sizes))
    _, kept = resolve_entry({"strategy": "balanced", "batch_sizes": given}, cfg, tokens, shape, 1, path, 100.0, 16384)
    assert kept.graph_tokens == 16384 and kept.values["graph_pool_gib"] >= sched.values["graph_pool_gib"]


def test_a_replayed_steps_micro_batch_times_are_in_ms_and_fit_in_its_wall_time(default_cfg):
    """Runner.step: the trainer's per-micro-batch seconds, as ms; together no more than the step's wall ms."""
    from types import SimpleNamespace

    from data.buckets import bucket_table
    from training.replay import Runner

    runner = Runner(default_cfg, default_cfg.model.num_layers, "off")
    b = bucket_table(default_cfg.data.buckets, patch=default_cfg.model.patch)["img_64"]
    mb = SimpleNamespace(B=2, ids=[0, 1], S=b.tokens, weights=[1.0, 1.0])
    batches = [runner.inputs.batch(mb, "img_64", b.latent_shape(default_cfg.model.in_channels)) for _ in range(2)]
    ms, wall_ms, st = runner.step(batches, 4, lambda B, S: 0, 0)
    assert len(ms) == 2 and ms == pytest.approx([s * 1000 for s in st.mb_s])
    assert 0 < sum(ms) <= wall_ms
    # each setting captures up to its own Schedule.graph_tokens, none at 0; without graphs it stays eager
    from training.cuda_graphs import FakeGraphs

    assert runner.capture_up_to(16384) == "eager" and runner.graphs is None
    runner.all_graphs = FakeGraphs(torch.device("cpu"), max_tokens=16384)
    assert runner.capture_up_to(2 * b.tokens) == f"CUDA graphs up to {2 * b.tokens:,} tokens"
    assert runner.graphs is runner.all_graphs and runner.graphs.max_tokens == 2 * b.tokens
    runner.step(batches, 4, lambda B, S: 0, 0)  # the key's first run is eager, its second captured and replayed
    assert (runner.graphs.stats.eager, runner.graphs.stats.captured, runner.graphs.stats.replays) == (1, 1, 1)
    assert runner.capture_up_to(b.tokens).startswith("CUDA graphs") and runner.step(batches, 4, lambda B, S: 0, 0)
    assert runner.graphs.stats.replays == 1 and runner.graphs.stats.eager == 3  # over the narrower cap: eager
    assert runner.capture_up_to(0).startswith("eager") and runner.graphs is None


@pytest.mark.parametrize("blocks, refused", [(None, False), ("1", True)])
@pytest.mark.slow
def test_replay_refuses_k_of_the_blocks_only_with_checkpointing_auto_not_the_whole_model(tmp_path, blocks, refused):
    """--blocks k < model.num_layers with checkpointing=auto is refused (the recompute rule counts the full depth);
    the whole model (no --blocks) with checkpointing=auto plans as any other (--dry-run: no model is built)."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    args = [sys.executable, "scripts/replay_plans.py", "--dry-run", "--steps", "1", "--warmup", "0", "--ranks", "2",
            "--m-tokens", "120", "--out", str(tmp_path), "model.checkpointing=auto"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    done = subprocess.run(args + (["--blocks", blocks] if blocks else []), cwd=ROOT, capture_output=True, text=True,
                          env=env)
    if refused:
        assert done.returncode == 2 and "the recompute rule counts the full depth" in done.stderr, done.stderr[-2000:]
    else:
        assert done.returncode == 0 and (tmp_path / "replay.json").exists(), done.stderr[-2000:]


# -------------------------------------------------------------------------------------------- data/precompute.py
def test_precomputed_shards_hold_samples_per_shard_samples_each_but_the_last(tmp_path):
    from collections import Counter

    from data.index import SampleIndex
    from data.precompute import precompute
    from data.raw import RawConfig, index_corpus
    from data.synthetic_raw import write_raw_corpus
    from tests.test_raw_data import C, D, TINY, data_cfg

    root, out = str(tmp_path / "raw"), str(tmp_path / "latents")
    index_corpus(write_raw_corpus(root, images=7, videos=0, samples_per_shard=16, seed=0), root, TINY, RawConfig())
    res = precompute(data_cfg(index=root), TINY, C, D, 0, out, samples_per_shard=3)
    assert res["written"] == 7 and res["index"] == 7
    per_shard = Counter(r["shard"] for r in SampleIndex.load(out).records)
    assert [per_shard[s] for s in sorted(per_shard)] == [3, 3, 1]
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.tar"))) == sorted(per_shard)


def test_a_diffusers_folder_loads_as_is_and_refuses_ema(tmp_path, default_cfg):
    from models.build import build_model
    from training.sampling import load_source

    model = build_model(default_cfg.model)
    model.save_pretrained(str(tmp_path / "pre"))
    loaded, cfg = load_source(str(tmp_path / "pre"))
    assert not loaded.training and cfg.model.name == default_cfg.model.name
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="--ema needs a training checkpoint"):
        load_source(str(tmp_path / "pre"), ema=True)
    with pytest.raises(FileNotFoundError, match="neither a checkpoint"):
        load_source(str(tmp_path / "nothing_here"))


# ------------------------------------------------------------------------------------------------ training/load.py
def test_a_checkpoints_config_takes_overrides_that_refer_to_other_keys_and_refuses_a_preset(tmp_path):
    from omegaconf import OmegaConf

    from tests.helpers import compose_raw
    from training.load import checkpoint_config

    with open(tmp_path / "config.yaml", "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(compose_raw(["train.steps=37"]))))
    cfg = checkpoint_config(str(tmp_path), ["train.val_every=${train.steps}", "+train.seed=5"])
    assert cfg.train.steps == 37 and cfg.train.val_every == 37 and cfg.train.seed == 5
    with pytest.raises(ValueError, match="brings its own config"):
        checkpoint_config(str(tmp_path), ["conf=tiny_lora"])


# ---------------------------------------------------------------------------------------------- training/export.py
def _saved_run(run_dir, *overrides) -> str:
    """A run folder with one checkpoint (step_1) of the tiny model, LoRA where the overrides ask."""
    from omegaconf import OmegaConf

    from models.build import build_model
    from models.lora import apply_finetune
    from tests.helpers import compose_config, compose_raw
    from training.checkpoint import save_checkpoint
    from training.dist import DistContext
    from training.optim import build_optimizer

    cfg = compose_config([f"run_dir={run_dir}", *overrides])
    torch.manual_seed(0)
    model = apply_finetune(build_model(cfg.model), cfg.model)
    opt, _ = build_optimizer(model, cfg.optim, 1)
    yaml = OmegaConf.to_yaml(OmegaConf.create(compose_raw([f"run_dir={run_dir}", *overrides])))
    save_checkpoint(str(run_dir), 1, model, opt, None, {}, yaml, DistContext(), 1)
    return str(run_dir)


@pytest.mark.slow
def test_an_adapter_exports_only_from_a_lora_run_and_a_whole_model_from_any(tmp_path):
    from models.lora import LORA_WEIGHT_NAME
    from training.export import export

    lora = _saved_run(tmp_path / "lora", "conf=tiny_lora", "model.lora.rank=2")
    plain = _saved_run(tmp_path / "plain")
    assert export(lora, str(tmp_path / "adapter"), adapter=True) == str(tmp_path / "adapter")
    assert os.listdir(tmp_path / "adapter") == [LORA_WEIGHT_NAME]
    with pytest.raises(ValueError, match="was not trained with a LoRA adapter"):
        export(plain, str(tmp_path / "no_adapter"), adapter=True)
    assert not (tmp_path / "no_adapter").exists()
    export(plain, str(tmp_path / "whole"))
    assert (tmp_path / "whole" / "config.json").exists()
