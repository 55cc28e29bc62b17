"""Every number the config holds is checked before any compute, and a bad one names its field.

The numeric fields are found by walking the dataclass tree that `load_config` builds from the composed default
config (and the MMDiT preset's `model:`), so a new field is covered without editing this file. Each one is set to
NaN, +Inf, −Inf, −1, a string, a bool and (integer fields) 2.5 in the plain composed dict, and `load_config` must
refuse it with a ValueError naming the field; −1 may instead be accepted by the fields in NEGATIVE_OK.
"""
import copy
import dataclasses
import math
import re
import typing
from typing import Any

import pytest

from data.buckets import bucket_table
from tests.helpers import compose_raw
from training.config import load_config

# Fields where a negative value is meaningful.
NEGATIVE_OK = {"objective.logit_mean"}  # the mean of the normal before the sigmoid: t is pulled towards 0
# kwargs handed as they are to a library constructor (diffusers' AutoencoderKLWan, transformers' UMT5): their numbers
# are checked finite here, their types and ranges by that constructor.
OPAQUE = ("data.encoders.tiny_vae", "data.encoders.tiny_text")
# Range checks that data/encoders.py (EncoderConfig) still lacks: −1 is accepted there. Each is expected to fail in
# test_pending_range_checks (strict): when its check lands that test fails, and the name leaves this set.
# Optional containers that are empty or null by default, given one entry so that the numbers inside are probed too.
SEEDED = {("data", "sources"): [{"index": "some/corpus", "weight": 1.0}],
          ("optim", "groups"): {"head": {"match": "proj_out", "lr": 1e-3, "weight_decay": 0.0}},
          ("metrics", "profile_steps"): [1, 2]}


def _name(keys) -> str:
    out = ""
    for k in keys:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else k)
    return out


def _numbers(hint, value, keys=()):
    """(keys, int | float | None) for every number field and every number inside a container of `value`."""
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else Any
    if dataclasses.is_dataclass(value):
        hints = typing.get_type_hints(type(value))
        for f in dataclasses.fields(value):
            yield from _numbers(hints[f.name], getattr(value, f.name), keys + (f.name,))
    elif hint in (int, float):
        yield keys, hint
    elif isinstance(value, dict):
        args = typing.get_args(hint)
        for k, v in value.items():
            yield from _numbers(args[1] if args else Any, v, keys + (k,))
    elif isinstance(value, (list, tuple)):
        args = typing.get_args(hint)
        fixed = args and args[-1] is not Ellipsis and len(args) == len(value)
        for i, v in enumerate(value):
            yield from _numbers(args[i] if fixed else (args[0] if args else Any), v, keys + (i,))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):  # inside an untyped container
        yield keys, None


def _lookup(obj, keys):
    for k in keys:
        obj = getattr(obj, k) if dataclasses.is_dataclass(obj) else obj[k]
    return obj


def _put(raw: dict, cfg, keys, value) -> dict:
    """A copy of `raw` with the value at `keys`; containers the composed dict lacks are taken from `cfg`."""
    raw = copy.deepcopy(raw)
    node = raw
    for j, k in enumerate(keys[:-1]):
        have = node[k] if isinstance(node, list) or k in node else None
        if have is None:
            default = _lookup(cfg, keys[:j + 1])
            have = {} if dataclasses.is_dataclass(default) else copy.deepcopy(
                list(default) if isinstance(default, tuple) else default)
            node[k] = have
        node = have
    node[keys[-1]] = value
    return raw


@pytest.fixture(scope="module")
def bases():
    """[(raw, cfg, numeric leaves)]: the default config with SEEDED entries, and the MMDiT preset's model fields."""
    out, seen = [], set()
    for overrides, under in (([], ()), (["conf=mmdit_tiny"], ("model",))):
        raw = compose_raw(overrides)
        for keys, value in SEEDED.items():
            raw = _put(raw, None, keys, value)
        cfg = load_config(raw)
        leaves = [(k, t) for k, t in _numbers(type(cfg), cfg) if k[:len(under)] == under and k not in seen]
        seen |= {k for k, _ in leaves}
        out.append((raw, cfg, leaves))
    return out


def _refusal(raw, cfg, keys, value):
    """The ValueError's message, or None when load_config accepts the value."""
    try:
        load_config(_put(raw, cfg, keys, value))
    except ValueError as e:
        return str(e)
    return None


def test_the_walk_finds_every_kind_of_number(bases):
    names = {_name(k) for _, _, leaves in bases for k, _ in leaves}
    for name in ("train.steps", "train.seed", "optim.lr", "optim.eps", "optim.betas[1]", "optim.grad_clip",
                 "optim.ema_decay", "objective.shift", "scheduling.m_mem", "scheduling.window",
                 "data.buckets.vid_64_9f.frames", "data.synthetic.mix.img_64", "data.sources[0].weight",
                 "optim.groups.head.lr", "data.raw.fps", "data.encoders.max_text_len", "model.patch_size[2]",
                 "model.lora.alpha", "model.mlp_ratio", "model.rope_axes_dim[0]", "sample.seeds[0]",
                 "metrics.profile_steps[0]", "metrics.peak_tflops", "data.encoders.tiny_vae.dim_mult[0]"):
        assert name in names, name
    assert len(names) > 100


def test_every_number_is_checked_naming_its_field(bases):
    bad = []
    for raw, cfg, leaves in bases:
        for keys, kind in leaves:
            name = _name(keys)
            field = re.sub(r"(\[\d+\])+$", "", name)  # an element of a list field: the list is named
            opaque = name.startswith(OPAQUE)
            probes = [math.nan, math.inf, -math.inf]
            if not opaque:
                probes += ["abc", True] + ([-1] if name not in NEGATIVE_OK else [])
                probes += [2.5] if kind is int else []
            for value in probes:
                msg = _refusal(raw, cfg, keys, value)
                if msg is None or field not in msg:
                    bad.append(f"{name}={value!r}: " + ("accepted" if msg is None else f"message {msg!r}"))
            if name in NEGATIVE_OK and (msg := _refusal(raw, cfg, keys, -1)) is not None:
                bad.append(f"{name}=-1 is in NEGATIVE_OK but refused: {msg!r}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("override, field", [
    ("data.buckets.vid_64_9f.frames=9.5", "data.buckets.vid_64_9f.frames"),
    ("data.buckets.img_64.height=64.5", "data.buckets.img_64.height"),
    ("train.steps=inf", "train.steps"),
    ("train.steps=nan", "train.steps"),
    ("train.seed=-1", "train.seed"),
    ("optim.eps=-1", "optim.eps"),
    ("optim.grad_clip=nan", "optim.grad_clip"),
    ("optim.weight_decay=nan", "optim.weight_decay"),
    ("optim.lr=inf", "optim.lr"),
    ("objective.shift=inf", "objective.shift"),
    ("model.text_len=513", "model.text_len"),  # data.encoders.max_text_len is 512
    ("model.rope_max_seq_len=5", "model.rope_max_seq_len"),  # img_64x96 is a 1×4×6 patch grid
    ("data.synthetic.mix.img_64=-0.1", "data.synthetic.mix.img_64"),
    ("+metrics.profile_steps=[5,2]", "metrics.profile_steps"),
])
def test_bad_overrides_are_refused_naming_the_field(override, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        load_config(compose_raw([override]))


def test_non_integer_bucket_sizes_are_never_truncated():
    with pytest.raises(ValueError, match=r"data\.buckets\.v\.frames"):
        bucket_table({"v": {"frames": 33.5, "height": 480, "width": 832}})
    with pytest.raises(ValueError, match=r"data\.buckets\.v\.width"):
        bucket_table({"v": {"frames": 33, "height": 480, "width": True}})


def test_text_len_is_bounded_by_the_text_encoders_length():
    assert load_config(compose_raw(["model.text_len=512"])).model.text_len == 512
    assert load_config(compose_raw(["model.text_len=600", "data.encoders.max_text_len=600"])).model.text_len == 600
    with pytest.raises(ValueError, match=r"model\.text_len=513 exceeds data\.encoders\.max_text_len=512"):
        load_config(compose_raw(["model.text_len=513"]))


def test_the_bucket_table_counts_the_models_patches():
    base = load_config(compose_raw())
    coarse = load_config(compose_raw(["model.patch_size=[1,4,4]"]))
    assert base.model.patch == (1, 2, 2) and coarse.model.patch == (1, 4, 4)
    S2 = {n: b.tokens for n, b in bucket_table(base.data.buckets, patch=base.model.patch).items()}
    S4 = {n: b.tokens for n, b in bucket_table(coarse.data.buckets, patch=coarse.model.patch).items()}
    assert S2 == {"img_64": 16, "img_64x96": 24, "vid_64_9f": 48, "vid_64x96_17f": 120}
    assert S4 == {n: S // 4 for n, S in S2.items()}
    mmdit = load_config(compose_raw(["conf=mmdit_tiny", "model.patch_size=4"]))
    assert mmdit.model.patch == (1, 4, 4)
    assert {n: b.tokens for n, b in bucket_table(mmdit.data.buckets, patch=mmdit.model.patch).items()} == S4
    # The run's checks use the model's patch: 48 px is 6 latents, whole 2×2 patches but not 4×4 ones.
    odd = ["+data.buckets.img_48={frames: 1, height: 48, width: 48}", "+data.synthetic.mix.img_48=0.1"]
    assert "img_48" in load_config(compose_raw(odd)).data.buckets
    with pytest.raises(ValueError, match=r"data\.buckets\.img_48\.height must be a multiple of 32"):
        load_config(compose_raw([*odd, "model.patch_size=[1,4,4]"]))
    with pytest.raises(ValueError, match=r"data\.buckets\.\w+: \d+ latent frames do not divide"):
        load_config(compose_raw(["model.patch_size=[2,2,2]"]))


def test_null_is_refused_by_number_string_and_bool_fields_and_containers_take_only_their_kind():
    """null is a value for Optional fields only: a number, string or bool field refuses it naming the field (not a
    TypeError from a range check), and a bare dict/list field takes nothing but its container."""
    raw = compose_raw()
    assert load_config(_put(raw, None, ("scheduling", "m_mem"), None)).scheduling.m_mem is None
    for keys, value in ((("train", "steps"), None), (("optim", "lr"), None), (("name",), None),
                        (("train", "progress"), None), (("sample", "prompts"), "a red ball"),
                        (("data", "encoders", "tiny_vae"), [1, 2])):
        with pytest.raises(ValueError, match=re.escape(_name(keys))):
            load_config(_put(raw, None, keys, value))


def test_checkpoint_keep_last_must_keep_one():
    assert load_config(compose_raw(["checkpoint.keep_last=1"])).checkpoint.keep_last == 1
    with pytest.raises(ValueError, match=r"checkpoint\.keep_last must be ≥ 1, got 0"):
        load_config(compose_raw(["checkpoint.keep_last=0"]))


def test_equal_token_needs_m_tokens_or_a_calibration_and_the_others_do_not_need_m_tokens(tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text("{}")  # only named here: load_config does not read it
    with pytest.raises(ValueError, match=r"scheduling\.m_tokens must be set for the equal_token strategy"):
        load_config(compose_raw(["scheduling=equal_token", "scheduling.m_tokens=null"]))
    assert load_config(compose_raw(["scheduling=equal_token", "scheduling.m_tokens=96"])).scheduling.m_tokens == 96
    cfg = load_config(compose_raw(["scheduling=equal_token", "scheduling.m_tokens=null",
                                   f"scheduling.calibration={calibration}"]))
    assert cfg.scheduling.m_tokens is None and cfg.scheduling.calibration == str(calibration)
    for strategy in ("dual_constraint", "cost", "balanced"):  # their knobs are others: m_tokens stays unset
        cfg = load_config(compose_raw([f"scheduling={strategy}", "scheduling.m_tokens=null",
                                       f"scheduling.calibration={calibration}"]))
        assert cfg.scheduling.strategy == strategy and cfg.scheduling.m_tokens is None
