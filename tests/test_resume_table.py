"""Resume's table of which keys may change, derived from the declarations beside the config fields.

EXPECTED is the table written out: every key of the default config and of every conf/ preset, with the class a
resume gives it (plan / trained: refused unless resume_force; execution / free: this run's value, logged; ignored:
not compared; "switch": its 0 / null turns a part of the trained state off). A key added later that is not listed
here is checked against its section's class (SECTIONS).
"""
import dataclasses
import os

import pytest

from tests.helpers import PRESETS, compose_config
from training.resume import config_changes, resume_rule, resume_table, schema_table, turned
from training.run_configs import flatten


def _keys(prefix: str, names: str, cls: str) -> dict:
    return {prefix + n: cls for n in names.split()}


EXPECTED = {
    **_keys("", "name run_dir resume resume_force show_buckets overwrite", "ignored"),  # overwrite: how a run starts
    **_keys("launch.", "num_processes device cpu_threads force debug_share_gpu", "ignored"),
    **_keys("train.", "steps micro_batches log_every val_every max_bad_steps progress sample_every gc_every "
                      "cuda_graphs graph_max_tokens", "free"),
    "train.seed": "plan",
    **_keys("model.", "precision adaln_backend fused_ops attention_backend glue_backend checkpointing "
                      "offload_checkpoints keep_attention compile", "execution"),
    **_keys("model.", "name text_len pretrained freeze patch_size num_attention_heads attention_head_dim in_channels "
                      "out_channels num_layers qk_norm", "trained"),
    **_keys("model.", "text_dim freq_dim ffn_dim cross_attn_norm eps rope_max_seq_len", "trained"),  # Wan's
    **_keys("model.", "num_single_layers num_refiner_layers mlp_ratio patch_size_t guidance_embeds text_embed_dim "
                      "pooled_projection_dim rope_theta rope_axes_dim image_condition_type guidance_scale",
            "trained"),  # the MMDiT's
    **_keys("model.lora.", "alpha targets dropout", "trained"),
    "model.lora.rank": "trained switch",
    **_keys("objective.", "t_sampling shift logit_mean logit_std", "free"),
    **_keys("data.", "index urls sources cache_dir val_samples", "plan"),
    "data.num_workers": "execution",
    "data.caption_dropout": "free",
    **_keys("data.raw.", "fps max_upscale max_crop aspect_tolerance clip decode_threads max_pixels", "plan"),
    **_keys("data.encoders.", "vae vae_dtype text text_encoder tokenizer text_encoder_2 tokenizer_2 pooled_dim "
                              "llama_skip_layers text_dtype max_text_len device batch_size seed", "plan"),
    **_keys("data.encoders.tiny_vae.", "base_dim dim_mult num_res_blocks", "plan"),
    **_keys("data.encoders.tiny_text.", "d_kv d_ff num_layers num_heads", "plan"),
    **_keys("data.synthetic.", "kind num_samples num_val num_classes seed samples_per_shard dtype", "plan"),
    **_keys("scheduling.", "strategy m_tokens m_mem mem_budget_gib m_comp p target_microbatch_ms window "
                           "calibration benchmark_points benchmark_time_s tokens_per_step", "plan"),
    **_keys("optim.", "name lr weight_decay betas eps warmup_steps schedule min_lr_ratio grad_clip", "free"),
    "optim.ema_decay": "free switch",
    "optim.groups": "trained",  # empty in every preset: one leaf
    **_keys("checkpoint.", "every keep_last at_end", "free"),
    **_keys("sample.", "steps guidance shift bucket prompts val_prompts seeds fps", "free"),
    **_keys("logging.", "wandb project entity group tags", "free"),
    **_keys("metrics.", "peak_tflops busy_every profile_steps", "free"),
}
UNDER = {"data.buckets.": "plan", "data.synthetic.mix.": "plan"}  # keys named by the presets' buckets
SECTIONS = {"data": "plan", "scheduling": "plan", "model": "trained", "launch": "ignored"}  # the rest: free


def _expected(key: str) -> str:
    if key in EXPECTED:
        return EXPECTED[key]
    under = next((cls for prefix, cls in UNDER.items() if key.startswith(prefix)), None)
    return under or SECTIONS.get(key.split(".")[0], "free")


def test_every_key_of_the_default_config_and_of_every_preset_has_the_class_the_table_gives():
    seen = set()
    for preset in [None] + PRESETS:
        keys = flatten(dataclasses.asdict(compose_config([f"conf={preset}"] if preset else [])))
        wrong = {k: (str(resume_rule(k)), _expected(k)) for k in keys if str(resume_rule(k)) != _expected(k)}
        assert not wrong, f"conf={preset}: {{key: (declared, expected)}} {wrong}"
        seen |= set(keys)
    assert set(EXPECTED) <= seen, f"listed but in no config: {sorted(set(EXPECTED) - seen)}"
    assert any(k.startswith("data.buckets.") for k in seen) and any(k.startswith("data.synthetic.mix.") for k in seen)


@pytest.mark.parametrize("key, cls", [
    ("optim.groups.head.match", "trained"),  # which parameters a group holds shapes the optimizer state
    ("optim.groups.head.lr", "free"), ("optim.groups.head.weight_decay", "free"),
    ("data.buckets", "plan"), ("data.synthetic.mix", "plan"),  # a dict emptied: one leaf
    ("data.buckets.new.frames", "plan"),
    # Keys a checkpoint of another version holds (compared as written): classified by their section.
    ("data.gone", "plan"), ("data.raw.gone", "plan"), ("scheduling.gone", "plan"), ("model.gone", "trained"),
    ("model.lora.gone", "trained"), ("launch.gone", "ignored"), ("train.gone", "free"), ("optim.gone", "free"),
    ("gone", "free"),
])
def test_keys_beneath_a_dict_field_or_unknown_to_this_version_take_their_declared_or_section_class(key, cls):
    assert str(resume_rule(key)) == cls


def test_the_switches_are_the_fields_declared_so_and_turned_says_on_or_off():
    assert {k for k, r in schema_table().items() if r.switch} == {"optim.ema_decay", "model.lora.rank"}
    assert turned("optim.ema_decay", None, 0.9) == "on" and turned("optim.ema_decay", 0.9, None) == "off"
    assert turned("optim.ema_decay", 0.9, 0.99) is None
    assert turned("model.lora.rank", 0, 4) == "on" and turned("model.lora.rank", 4, 0) == "off"
    assert turned("model.lora.rank", 4, 8) is None and turned("optim.lr", 0, 1e-3) is None


def test_a_new_field_without_metadata_takes_its_sections_class():
    """A field added to a section is classified where the section declares RESUME_DEFAULT: a new scheduling knob
    changes the plan, a new model field what is trained, a new optimizer knob is free; a knob declared EXECUTION is
    execution; a nested config dataclass without RESUME_DEFAULT takes its enclosing section's."""
    from data.config import DataConfig
    from models.config import EXECUTION, ModelConfig
    from scheduling.config import SchedulingConfig
    from training.config import TrainConfig
    from training.optim import OptimConfig

    @dataclasses.dataclass
    class Scheduling(SchedulingConfig):
        new_rule_knob: str = "x"

    @dataclasses.dataclass
    class Model(ModelConfig):
        new_width: int = 8
        new_kernel: str = dataclasses.field(default="auto", metadata=EXECUTION)

    @dataclasses.dataclass
    class Optim(OptimConfig):
        new_knob: float = 0.5

    @dataclasses.dataclass
    class Extra:  # no RESUME_DEFAULT
        x: int = 1

    @dataclasses.dataclass
    class Data(DataConfig):
        extra: Extra = dataclasses.field(default_factory=Extra)

    table = resume_table(TrainConfig(scheduling=Scheduling(), model=Model(), optim=Optim(), data=Data()))
    got = {k: str(resume_rule(k, table)) for k in ("scheduling.new_rule_knob", "model.new_width", "model.new_kernel",
                                                    "optim.new_knob", "data.extra.x")}
    assert got == {"scheduling.new_rule_knob": "plan", "model.new_width": "trained", "model.new_kernel": "execution",
                   "optim.new_knob": "free", "data.extra.x": "plan"}
    new = ("scheduling.new_rule_knob", "model.new_width", "model.new_kernel", "optim.new_knob", "data.extra.x",
           "data.extra.*")
    assert {k: r for k, r in table.items() if k not in new} == resume_table(TrainConfig())  # nothing else moved


def test_a_class_that_is_not_one_of_the_five_is_refused_naming_the_field():
    from training.optim import OptimConfig

    @dataclasses.dataclass
    class Optim(OptimConfig):
        typo: float = dataclasses.field(default=0.0, metadata={"resume": "fre"})

    with pytest.raises(ValueError, match=r"Optim.typo declares resume class 'fre': use one of \['execution', 'free'"):
        resume_table(Optim())


def test_config_changes_sorts_each_difference_by_its_class():
    saved = dataclasses.asdict(compose_config([]))
    now = dataclasses.asdict(compose_config(["name=other", "launch.num_processes=2", "train.seed=3", "optim.lr=0.0007",
                                             "model.compile=true", "data.num_workers=2", "scheduling.window=2",
                                             "model.num_layers=3", "optim.ema_decay=0.9"]))
    plan, other = config_changes(saved, now)
    assert sorted(plan) == ["model.num_layers", "scheduling.window", "train.seed"]
    assert sorted(other) == ["data.num_workers", "model.compile", "optim.ema_decay", "optim.lr"]


def test_a_resume_keeps_the_runs_values_where_the_command_line_names_none():
    """keep_run_values: a changeable key the command line does not name keeps the run's value (a swept rate, an
    execution knob); one it names, itself or through its group, is this run's; refused and ignored keys are left to
    check_config (refused there, or not compared)."""
    import copy

    from training.config import TrainConfig
    from training.resume import keep_run_values

    raw = dataclasses.asdict(TrainConfig())
    saved = copy.deepcopy(raw)
    saved["optim"]["lr"], saved["optim"]["weight_decay"] = 1.0e-3, 0.05     # free
    saved["model"]["checkpointing"] = "full"                                 # execution
    saved["train"]["steps"], saved["train"]["seed"] = 40, 7                  # free (named below), plan
    saved["name"], saved["data"]["num_workers"] = "other", 3                 # ignored, execution (named below)
    now = copy.deepcopy(raw)
    kept = keep_run_values(now, saved, given={"train.steps", "data", "resume"})
    assert {k for k, _, _ in kept} == {"optim.lr", "optim.weight_decay", "model.checkpointing"}
    assert (now["optim"]["lr"], now["optim"]["weight_decay"], now["model"]["checkpointing"]) == (1e-3, 0.05, "full")
    assert now["train"]["steps"] == raw["train"]["steps"] and now["data"]["num_workers"] == raw["data"]["num_workers"]
    assert now["train"]["seed"] == raw["train"]["seed"] and now["name"] == raw["name"]  # check_config's to judge
    assert dict((k, (a, b)) for k, a, b in kept)["optim.lr"] == (raw["optim"]["lr"], 1e-3)


def test_resume_table_itself_gives_each_section_its_pattern_each_switch_and_each_dicts_keys():
    """resume_table built afresh (schema_table caches it): the root and section patterns, the two switches, a dict
    field's `key.*` and its `resume_under` patterns, and a dict field declared apart from its section."""
    from training.config import TrainConfig
    from training.optim import OptimConfig
    from training.resume import Rule

    table = resume_table(TrainConfig())
    assert table["*"] == Rule("free") and table["data.*"] == Rule("plan") and table["launch.*"] == Rule("ignored")
    assert table["model.*"] == Rule("trained") and table["data.raw.*"] == Rule("plan")
    assert {k for k, r in table.items() if r.switch} == {"optim.ema_decay", "model.lora.rank"}
    assert str(table["optim.ema_decay"]) == "free switch" and str(table["model.lora.rank"]) == "trained switch"
    assert table["optim.groups"] == Rule("trained")
    assert table["optim.groups.*"] == Rule("free") and table["optim.groups.*.match"] == Rule("trained")
    assert table["data.buckets.*"] == Rule("plan")

    @dataclasses.dataclass
    class Optim(OptimConfig):  # a dict field of another class than its section, with no resume_under
        frozen: dict = dataclasses.field(default_factory=lambda: {"a": 1}, metadata={"resume": "trained"})

    table = resume_table(Optim(), "optim.")
    assert table["optim.frozen"] == table["optim.frozen.*"] == Rule("trained")
    assert str(resume_rule("optim.frozen.b.c", table)) == "trained" and str(resume_rule("optim.lr", table)) == "free"


def test_resume_rule_takes_the_longest_matching_pattern_not_the_last_in_order():
    from training.resume import Rule

    table = {"*": Rule("free"), "a.*": Rule("plan"), "a.*.z": Rule("trained"), "a.b*": Rule("execution")}
    assert resume_rule("a.b.z", table) == Rule("trained")  # a.*.z (5) over a.b* (4), though "a.b*" sorts after it
    assert resume_rule("a.bc", table) == Rule("execution") and resume_rule("a.x", table) == Rule("plan")
    assert resume_rule("q", table) == Rule("free") and resume_rule("a.*.z", {"a.*.z": Rule("plan")}) == Rule("plan")


def test_a_wrong_section_default_or_resume_under_class_is_refused_naming_where():
    from training.optim import OptimConfig

    @dataclasses.dataclass
    class Knobs:
        RESUME_DEFAULT = "planned"
        x: int = 1

    with pytest.raises(ValueError, match=r"^Knobs.RESUME_DEFAULT declares resume class 'planned': use one of "):
        resume_table(Knobs())

    @dataclasses.dataclass
    class Optim(OptimConfig):
        more: dict = dataclasses.field(default_factory=dict, metadata={"resume_under": {"*.w": "fre"}})

    with pytest.raises(ValueError, match=r"^Optim.more\['\*.w'\] declares resume class 'fre'"):
        resume_table(Optim())


def test_keep_run_values_passes_over_keys_that_only_one_side_has():
    """A checkpoint of another version holds keys this one lacks, and this one has new keys: neither is kept or
    looked up (check_config judges them)."""
    from training.resume import keep_run_values

    saved = {"optim": {"lr": 1e-3, "gone": 5}, "train": {"steps": 10}}
    raw = {"optim": {"lr": 2e-4, "new": 1}, "train": {"steps": 10}}
    assert keep_run_values(raw, saved, set()) == [("optim.lr", 2e-4, 1e-3)]
    assert raw == {"optim": {"lr": 1e-3, "new": 1}, "train": {"steps": 10}}


def _manifest(ckpt) -> None:
    """The manifest a save writes (checkpoint.write_manifest), of the folder's files as they are now."""
    import hashlib
    import json

    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in sorted(ckpt.iterdir()) if p.name != "manifest.json"}
    (ckpt / "manifest.json").write_text(json.dumps({"files": files}))


def test_saved_run_config_reads_the_named_or_the_newest_intact_checkpoints_config_or_gives_none(tmp_path):
    """The config a resumed run continues: the named checkpoint's config.yaml; for auto the newest complete
    checkpoint's (by step, not by name) whose config.yaml and meta.json match its manifest, as resume=auto skips a
    damaged one; None where there is no such checkpoint, or its config.yaml is not a mapping or not YAML."""
    from training.resume import saved_run_config

    run = tmp_path / "run"
    for step in (1, 2, 10, 30):
        ckpt = run / f"step_{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "config.yaml").write_text(f"train:\n  steps: {step}\n")
        if step != 30:
            (ckpt / "meta.json").write_text("{}")  # step_30 has none: not complete, not listed
        _manifest(ckpt)
    assert saved_run_config("auto", str(run)) == {"train": {"steps": 10}}
    assert saved_run_config(str(run / "step_2"), str(tmp_path / "elsewhere")) == {"train": {"steps": 2}}
    assert saved_run_config("auto", str(tmp_path / "empty")) is None
    # the newest one damaged: its config is not the run's (resume=auto loads step_2), whatever it says
    (run / "step_10" / "config.yaml").write_text("train:\n  steps: 99\n")
    assert saved_run_config("auto", str(run)) == {"train": {"steps": 2}}
    os.remove(run / "step_2" / "manifest.json")  # no manifest: nothing says its files are whole
    assert saved_run_config("auto", str(run)) == {"train": {"steps": 1}}
    (run / "step_1" / "meta.json").write_text('{"step": 5}')
    assert saved_run_config("auto", str(run)) is None
    for text in ("- a list\n", "a: [\n"):  # intact, yet no mapping: None, and the resume says why
        (run / "step_10" / "config.yaml").write_text(text)
        _manifest(run / "step_10")
        assert saved_run_config("auto", str(run)) is None
    os.remove(run / "step_10" / "config.yaml")
    assert saved_run_config("auto", str(run)) is None
    assert saved_run_config(str(run / "step_1"), str(run)) == {"train": {"steps": 1}}
