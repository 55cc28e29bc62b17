"""Fine-tuning: pretrained start, LoRA (zero start, adapter-only training, diffusers' loaders), merged
export, frozen parameters and LR groups, the Euler sampler, mp4 samples, checkpoint sampling, Wan key conversion.

Everything runs on tiny models on the CPU in fp32; numbers are compared against diffusers where diffusers has them.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel  # slow import (~4 s): once per module

from data.video_io import read_mp4
from models.build import build_parallel_model
from models.config import LoRAConfig, ModelConfig
from models.flow_matching import FlowMatching, ObjectiveConfig
from models.lora import LORA_WEIGHT_NAME, apply_finetune, has_lora, load_lora, lora_state_dict, merge_lora, save_lora
from models.sampler import SampleConfig, decode_latents, sample_latents, sampling_times
from models.wan import WanTransformer
from tests.helpers import compose_config, compose_raw, tiny_overrides
from training.optim import EMA, OptimConfig, build_optimizer
from training.step import draw_t_noise

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2)


def diffusers_model(cfg=TINY, seed=0):
    """A diffusers Wan with every parameter moved off its init, so each term shows in the output."""
    torch.manual_seed(seed)
    ref = WanTransformer3DModel(**cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return ref.eval()


def inputs(cfg=TINY, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, cfg["in_channels"], 3, 4, 6, generator=g), torch.tensor([120.0, 870.0]),
            torch.randn(2, 5, cfg["text_dim"], generator=g))


def ref_out(ref, x, t, ctx):
    with torch.no_grad():
        return ref(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]


def lora_model(ref, rank=4, alpha=8.0, targets=None):
    model = WanTransformer(**TINY)
    model.load_state_dict(ref.state_dict(), strict=True)
    cfg = ModelConfig(**{k: v for k, v in TINY.items()},
                      lora=LoRAConfig(rank=rank, alpha=alpha, **({"targets": targets} if targets else {})))
    return apply_finetune(model, cfg)


def train_steps(model, optim_cfg=OptimConfig(lr=1e-2), steps=2):
    """A couple of flow-matching AdamW steps on random data; returns the optimizer."""
    opt, _ = build_optimizer(model, optim_cfg, steps)
    fm = FlowMatching(ObjectiveConfig())
    x0, _, ctx = inputs(seed=3)
    for s in range(steps):
        t, noise = draw_t_noise(fm, ["a", "b"], x0.shape[1:], seed=0, epoch=s)
        fm.per_sample_loss(model, x0, ctx, t, noise).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


# ------------------------------------------------------------------------------------------------ pretrained
def test_diffusers_folder_is_the_pretrained_start(tmp_path):
    cfg = compose_config(tiny_overrides(tmp_path / "run", tmp_path / "cache"))
    ref = diffusers_model(cfg.model.diffusers_kwargs())
    ref.save_pretrained(tmp_path / "pre")
    model = build_parallel_model(ModelConfig(**{**vars(cfg.model), "pretrained": str(tmp_path / "pre")}), 0, 1,
                                 torch.device("cpu"))
    x = torch.randn(2, 4, 3, 4, 6)
    ctx = torch.randn(2, 7, cfg.model.text_dim)
    t = torch.tensor([10.0, 990.0])
    with torch.no_grad():
        assert (model(x, t, ctx) - ref_out(ref, x, t, ctx)).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="model.ffn_dim"):
        build_parallel_model(ModelConfig(**{**vars(cfg.model), "pretrained": str(tmp_path / "pre"), "ffn_dim": 64}),
                             0, 1, torch.device("cpu"))


# ------------------------------------------------------------------------------------------------------ LoRA
def test_lora_starts_equal_and_trains_only_the_adapters():
    ref = diffusers_model()
    model = lora_model(ref)
    x, t, ctx = inputs()
    with torch.no_grad():
        base = WanTransformer(**TINY)
        base.load_state_dict(ref.state_dict())
        assert torch.equal(model(x, t, ctx), base(x, t, ctx))  # B = 0: the adapter adds exactly nothing
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2 * 10  # 2 blocks × 10 Linears (attn1/attn2 q,k,v,out + ffn in/out) × (A, B)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = train_steps(model)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == trainable  # every A and B moved (B from zero), no base weight did


@pytest.mark.slow
def test_saved_adapter_loads_into_diffusers_with_the_same_output(tmp_path):
    ref = diffusers_model()
    model = lora_model(ref, rank=4, alpha=8.0)  # alpha ≠ rank: the scale must travel in the file's metadata
    train_steps(model)
    path = save_lora(model, str(tmp_path / "lora"))
    assert os.path.basename(path) == LORA_WEIGHT_NAME
    assert all(k.startswith("transformer.blocks.") and (".lora_A.weight" in k or ".lora_B.weight" in k)
               for k in lora_state_dict(model))
    x, t, ctx = inputs()
    with torch.no_grad():
        ours = model(x, t, ctx)
    # the pipeline's loader (WanPipeline.load_lora_weights = lora_state_dict + load_lora_into_transformer)
    state, meta = WanPipeline.lora_state_dict(str(tmp_path / "lora"), return_lora_metadata=True)
    WanPipeline.load_lora_into_transformer(state, ref, metadata=meta)
    assert (ref_out(ref, x, t, ctx) - ours).abs().max() <= 1e-5
    # and the model's own loader
    ref2 = diffusers_model()
    ref2.load_lora_adapter(str(tmp_path / "lora"), weight_name=LORA_WEIGHT_NAME)
    assert (ref_out(ref2, x, t, ctx) - ours).abs().max() <= 1e-5
    # ours reads it back exactly
    again = WanTransformer(**TINY)
    again.load_state_dict(diffusers_model().state_dict())
    load_lora(again, str(tmp_path / "lora"))
    with torch.no_grad():
        assert torch.equal(again(x, t, ctx), ours)
    # merged export: plain diffusers keys, read by diffusers' from_pretrained, same output
    merged = merge_lora(model)
    assert not has_lora(merged) and list(merged.state_dict()) == list(diffusers_model().state_dict())
    merged.save_pretrained(str(tmp_path / "merged"))
    full = WanTransformer3DModel.from_pretrained(str(tmp_path / "merged")).eval()
    assert (ref_out(full, x, t, ctx) - ours).abs().max() <= 1e-5


def test_freeze_and_lr_groups_by_name():
    ref = diffusers_model()
    model = WanTransformer(**TINY)
    model.load_state_dict(ref.state_dict())
    apply_finetune(model, ModelConfig(**TINY, freeze=[r"^condition_embedder\.", r"patch_embedding"]))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.named_parameters() if n.startswith(("condition_embedder.", "patch_emb"))}
    cfg = OptimConfig(lr=1e-3, groups={"ffn": {"match": r"\.ffn\.", "lr": 5e-3, "weight_decay": 0.1}})
    opt, sched = build_optimizer(model, cfg, 10)
    by_name = {id(p): n for n, p in model.named_parameters()}
    for g in opt.param_groups:
        names = [by_name[id(p)] for p in g["params"]]
        assert all((".ffn." in n) == g["name"].startswith("ffn") for n in names)
        assert g["lr"] == (5e-3 if g["name"].startswith("ffn") else 1e-3)
    assert not any(id(p) in {id(q) for g in opt.param_groups for q in g["params"]}
                   for n, p in model.named_parameters() if n in frozen)
    with pytest.raises(ValueError, match="model.freeze"):
        apply_finetune(WanTransformer(**TINY), ModelConfig(**TINY, freeze=["no_such_module"]))
    with pytest.raises(ValueError, match="optim.groups.x.lr"):
        OptimConfig(groups={"x": {"match": "a", "lr": -1}})


# --------------------------------------------------------------------------------------------------- sampler
class Oracle(torch.nn.Module):
    """The exact velocity field toward a fixed x0 for the conditional text and x0_empty for the empty one:
    v(x, t) = (x − x0) / t. Euler on a straight path is exact, so the sampler must land on x0."""

    def __init__(self, x0, x0_empty):
        super().__init__()
        self.x0, self.x0_empty = x0, x0_empty

    def forward(self, x, timestep, ctx):
        t = (timestep / 1000.0).view(-1, 1, 1, 1, 1)
        target = torch.where(ctx[:, :1, :1, None, None] != 0, self.x0, self.x0_empty)
        return (x - target) / t


def test_euler_sampler_lands_on_x0_and_applies_guidance():
    times = sampling_times(4, 3.0)
    assert times[0] == 1 and times[-1] == 0 and torch.allclose(times, torch.tensor([1, 0.9, 0.75, 0.5, 0],
                                                                                 dtype=torch.float64))
    x0, x0_e = torch.randn(4, 2, 4, 4), torch.randn(4, 2, 4, 4)
    text, empty = torch.ones(1, 3, 8), torch.zeros(3, 8)
    z = sample_latents(Oracle(x0, x0_e), text, empty, x0.shape, [7], steps=5, guidance=1.0, shift=3.0)
    assert (z[0] - x0).abs().max() <= 1e-5
    # With guidance g the update direction is v_∅ + g(v_c − v_∅): the result is x0_∅ + g(x0_c − x0_∅) exactly.
    z = sample_latents(Oracle(x0, x0_e), text, empty, x0.shape, [7], steps=5, guidance=3.0, shift=3.0)
    assert (z[0] - (x0_e + 3.0 * (x0 - x0_e))).abs().max() <= 1e-4


def tiny_vae():
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            latents_mean=[0.1, -0.2, 0.0, 0.3], latents_std=[1.0, 2.0, 0.5, 1.5]).eval()


def test_sampler_and_tiny_vae_write_a_playable_mp4(tmp_path):
    from training.sampling import render

    model = WanTransformer(**TINY)
    text, empty = torch.randn(2, 5, 16), torch.zeros(5, 16)
    scfg = SampleConfig(steps=3, guidance=4.0, seeds=[0, 5], fps=8)
    paths = render(model, tiny_vae(), text, empty, scfg, (4, 3, 4, 4), str(tmp_path / "out"))
    assert sorted(paths) == ["p0_s0", "p0_s5", "p1_s0", "p1_s5"]
    frames, fps = read_mp4(paths["p1_s5"])
    assert frames.shape == (1 + 4 * (3 - 1), 32, 32, 3) and fps == 8  # 3 latent frames → 9 frames, 8× space
    # The file holds this clip: the sampler is deterministic by seed, and H.264 keeps luma close (chroma is
    # subsampled 2×2, which random-weight noise suffers from), much closer than to the clip of another seed.
    z = sample_latents(model, text[1:].expand(2, -1, -1), empty, (4, 3, 4, 4), [5, 0], steps=3, guidance=4.0)
    luma = lambda u8: u8.astype(float).mean(-1)  # noqa: E731
    errors = [abs(luma(frames) - luma(((px + 1) * 127.5).permute(1, 2, 3, 0).numpy())).mean()
              for px in decode_latents(tiny_vae(), z)]
    assert errors[0] < 6 and errors[0] < 0.6 * errors[1]  # (measured 3.8 vs 8.2 grey levels)
    assert json.load(open(tmp_path / "out" / "samples.json"))["clips"]["p1_s5"]["seed"] == 5


@pytest.mark.slow
def test_validation_sampler_and_cli_sample_a_lora_checkpoint(tmp_path):
    from omegaconf import OmegaConf

    from data.buckets import bucket_table
    from data.loader import Loader, open_corpus
    from models.build import build_model
    from training.sampling import ValidationSampler, load_source
    from training.checkpoint import save_checkpoint
    from training.dist import DistContext

    overrides = tiny_overrides(tmp_path / "run", tmp_path / "cache", "conf=tiny_lora", "model.lora.rank=2")
    cfg = compose_config(overrides)
    torch.manual_seed(0)
    model = apply_finetune(build_model(cfg.model), cfg.model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)
    ctx = DistContext()
    opt, _ = build_optimizer(model, cfg.optim, 1)
    ema = EMA(model, 0.5)  # shadows the adapter only (the trainable parameters)
    ema.shadow = {n: t + 1 for n, t in ema.shadow.items()}
    save_checkpoint(cfg.run_dir, 1, model, opt, ema, {}, OmegaConf.to_yaml(OmegaConf.create(compose_raw(overrides))),
                    ctx, 1)
    # the loop's hook: held-out texts, the smallest video bucket, the tiny VAE of data.encoders
    corpus = open_corpus(cfg.data, bucket_table(cfg.data.buckets, patch=cfg.model.patch), cfg.model.in_channels, cfg.model.text_dim, 0)
    val = Loader(corpus, cfg.model.text_len, 0.0, 0, 0).val_batches()
    hook = ValidationSampler(cfg, ctx, val, corpus.empty_text, SampleConfig(steps=2, val_prompts=1, seeds=[1]))
    videos = hook(model, 1)
    assert list(videos) == ["samples/p0_s1"] and videos["samples/p0_s1"].endswith("samples/step_000001/p0_s1.mp4")
    assert read_mp4(videos["samples/p0_s1"])[0].shape == (9, 64, 64, 3)  # vid_64_9f
    # the checkpoint loads back with its adapter and gives the same output
    loaded, _ = load_source(cfg.run_dir)
    x, t, text = torch.randn(1, 4, 3, 8, 8), torch.tensor([500.0]), torch.randn(1, 6, cfg.model.text_dim)
    with torch.no_grad():
        assert has_lora(loaded) and torch.equal(loaded(x, t, text), model.eval()(x, t, text))
    with_ema = dict(load_source(cfg.run_dir, ema=True)[0].named_parameters())
    assert all(torch.equal(with_ema[n], ema.shadow[n] if n in ema.shadow else p) for n, p in model.named_parameters())
    # the command line, from the run folder, with a caption through the tiny text encoder
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cli = subprocess.run([sys.executable, "scripts/sample.py", cfg.run_dir, "--out", str(tmp_path / "cli"), "--steps",
                          "2", "--seeds", "3", "--prompt", "a red fox", "--device", "cpu"], cwd=root,
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert read_mp4(str(tmp_path / "cli" / "p0_s3.mp4"))[0].shape == (9, 64, 64, 3)


# ------------------------------------------------------------------------------------------------ conversion
def original_layout(dim=24, heads=2, ffn=32, layers=2, text_dim=16, freq_dim=16, c_in=4, c_out=4, seed=0):
    """A synthetic state dict in Wan-AI's original WanModel layout (written from its module names, not ours)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    sd = {"patch_embedding.weight": r(dim, c_in, 1, 2, 2), "patch_embedding.bias": r(dim),
          "text_embedding.0.weight": r(dim, text_dim), "text_embedding.0.bias": r(dim),
          "text_embedding.2.weight": r(dim, dim), "text_embedding.2.bias": r(dim),
          "time_embedding.0.weight": r(dim, freq_dim), "time_embedding.0.bias": r(dim),
          "time_embedding.2.weight": r(dim, dim), "time_embedding.2.bias": r(dim),
          "time_projection.1.weight": r(6 * dim, dim), "time_projection.1.bias": r(6 * dim),
          "head.head.weight": r(c_out * 4, dim), "head.head.bias": r(c_out * 4), "head.modulation": r(1, 2, dim)}
    for i in range(layers):
        for attn in ("self_attn", "cross_attn"):
            for proj in "qkvo":
                sd[f"blocks.{i}.{attn}.{proj}.weight"], sd[f"blocks.{i}.{attn}.{proj}.bias"] = r(dim, dim), r(dim)
            sd[f"blocks.{i}.{attn}.norm_q.weight"], sd[f"blocks.{i}.{attn}.norm_k.weight"] = r(dim), r(dim)
        sd[f"blocks.{i}.norm3.weight"], sd[f"blocks.{i}.norm3.bias"] = r(dim), r(dim)
        sd[f"blocks.{i}.ffn.0.weight"], sd[f"blocks.{i}.ffn.0.bias"] = r(ffn, dim), r(ffn)
        sd[f"blocks.{i}.ffn.2.weight"], sd[f"blocks.{i}.ffn.2.bias"] = r(dim, ffn), r(dim)
        sd[f"blocks.{i}.modulation"] = r(1, 6, dim)
    return sd


def test_convert_wan_round_trips_and_loads(tmp_path):
    from safetensors.torch import save_file

    from models.convert_wan import convert, diffusers_to_original, original_to_diffusers

    orig = original_layout()
    conv = original_to_diffusers({"model.diffusion_model." + k: v for k, v in orig.items()})  # ComfyUI prefix
    assert torch.equal(conv["blocks.1.norm2.weight"], orig["blocks.1.norm3.weight"])  # the norm2/norm3 swap
    assert torch.equal(conv["blocks.0.attn2.to_out.0.bias"], orig["blocks.0.cross_attn.o.bias"])
    assert torch.equal(conv["scale_shift_table"], orig["head.modulation"])
    back = diffusers_to_original(conv)
    assert back.keys() == orig.keys() and all(torch.equal(back[k], v) for k, v in orig.items())
    # a folder as Wan-AI ships it → our diffusers folder, which diffusers loads strictly
    os.makedirs(tmp_path / "orig")
    save_file(orig, str(tmp_path / "orig" / "diffusion_pytorch_model.safetensors"))
    json.dump({"_class_name": "WanModel", "model_type": "t2v", "dim": 24, "num_heads": 2, "ffn_dim": 32,
               "freq_dim": 16, "in_dim": 4, "out_dim": 4, "num_layers": 2, "eps": 1e-6},
              open(tmp_path / "orig" / "config.json", "w"))
    convert(str(tmp_path / "orig"), str(tmp_path / "conv"))
    ref = WanTransformer3DModel.from_pretrained(str(tmp_path / "conv"))
    assert ref.config.num_attention_heads == 2 and ref.config.attention_head_dim == 12
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in conv.items())
    with pytest.raises(ValueError, match="not part of the original"):
        original_to_diffusers({**orig, "blocks.0.extra.weight": torch.zeros(1)})


# ------------------------------------------------------------------------------------------- through train.py
def _train_py_has_the_hooks() -> bool:
    import dataclasses

    from training.config import LoopConfig

    return "sample_every" in {f.name for f in dataclasses.fields(LoopConfig)}


@pytest.mark.skipif(not _train_py_has_the_hooks(), reason="train.py's LoRA/sampling integration has not landed yet")
@pytest.mark.slow
def test_lora_run_through_train_py_resumes_samples_and_exports(tmp_path):
    import torch.distributed.checkpoint as dcp

    from training.export import export
    from training.sampling import load_source
    from tests.helpers import run_training
    from training.metrics import read_metrics

    import shutil

    cache = tmp_path / "cache"
    base_cfg = compose_config(tiny_overrides(tmp_path / "x", cache))
    pre = diffusers_model(base_cfg.model.diffusers_kwargs())
    pre.save_pretrained(tmp_path / "pre")
    common = ("conf=tiny_lora", f"model.pretrained={tmp_path / 'pre'}", "train.steps=6", "train.val_every=3",
              "train.sample_every=3", "checkpoint.every=3", "checkpoint.keep_last=3", "sample.steps=2")
    straight = str(tmp_path / "straight")
    run_training(tiny_overrides(straight, cache, *common))
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    shutil.copytree(os.path.join(straight, "step_3"), os.path.join(resumed, "step_3"))
    run_training(tiny_overrides(resumed, cache, *common, "resume=auto"))
    # Checkpoints hold the adapter only and the resumed run re-reads the base from model.pretrained: equal losses
    # after resuming also prove that training never moved the base.
    a, b = ({r["step"]: r for r in read_metrics(d) if "train/loss" in r} for d in (straight, resumed))
    assert [a[s]["train/loss"] for s in (4, 5, 6)] == [b[s]["train/loss"] for s in (4, 5, 6)]
    stored = set(dcp.FileSystemReader(os.path.join(straight, "step_6")).read_metadata().state_dict_metadata)
    assert not any(k.startswith("model.") and ".lora_" not in k for k in stored)
    model, _ = load_source(straight)  # the base under peft's names is the pretrained one
    theirs = pre.state_dict()
    for n, p in model.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(p, theirs[n.replace(".base_layer", "")]), n
    # samples on disk and in the JSONL; step_N/lora is what diffusers loads
    videos = [r for r in read_metrics(straight) if "samples/p0_s0" in r]
    assert [r["step"] for r in videos] == [0, 3, 6] and all(os.path.exists(r["samples/p0_s0"]) for r in videos)
    sheets = [r["samples/contact_sheet"] for r in videos if "samples/contact_sheet" in r]  # step 0 beside the latest
    assert len(sheets) == 2 and os.path.exists(sheets[-1])
    pre.load_lora_adapter(os.path.join(straight, "step_6", "lora"), weight_name=LORA_WEIGHT_NAME)
    x, t, ctx = torch.randn(1, 4, 3, 8, 8), torch.tensor([400.0]), torch.randn(1, 6, base_cfg.model.text_dim)
    with torch.no_grad():
        ours = model(x, t, ctx)
        assert (ref_out(pre, x, t, ctx) - ours).abs().max() <= 1e-5
        full = WanTransformer3DModel.from_pretrained(export(straight, str(tmp_path / "merged"))).eval()
        assert (ref_out(full, x, t, ctx) - ours).abs().max() <= 1e-5


def _run_with_seed(run_dir, seed: int) -> str:
    """A run folder with one checkpoint (step_1) of the tiny model whose weights are drawn from `seed`."""
    from omegaconf import OmegaConf

    from models.build import build_model
    from training.checkpoint import save_checkpoint
    from training.dist import DistContext

    overrides = [f"run_dir={run_dir}"]
    cfg = compose_config(overrides)
    torch.manual_seed(seed)
    model = build_model(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    opt, _ = build_optimizer(model, cfg.optim, 1)
    yaml = OmegaConf.to_yaml(OmegaConf.create(compose_raw(overrides)))
    save_checkpoint(str(run_dir), 1, model, opt, None, {}, yaml, DistContext(), 1)
    return str(run_dir)


def test_re_export_into_the_same_out_loads_the_new_weights_and_keeps_the_old_aside(tmp_path):
    from training.export import export
    from training.load import checkpoint_config, find_checkpoint, load_checkpoint_model

    old, new = _run_with_seed(tmp_path / "old", 1), _run_with_seed(tmp_path / "new", 2)
    out = str(tmp_path / "exported")
    export(old, out)  # one weights file
    (single,) = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    export(new, out, max_shard_size="100KB")  # shards and their index, into the same --out
    names = os.listdir(out)
    assert single not in names and sum(f.endswith(".safetensors") for f in names) > 1, names
    loaded = WanTransformer.from_pretrained(out).state_dict()
    want = load_checkpoint_model(find_checkpoint(new), checkpoint_config(find_checkpoint(new))).state_dict()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)
    (aside,) = [d for d in os.listdir(tmp_path) if d.startswith("exported.old-")]  # kept, never deleted
    assert single in os.listdir(tmp_path / aside)
    assert not [d for d in os.listdir(tmp_path) if ".export-" in d]  # no temporary folder left behind
    # a file in the way is moved aside too, never written through; an export that fails leaves --out as it was
    blocker = tmp_path / "blocked"
    blocker.write_text("not an export")
    export(new, str(blocker))
    assert (blocker / "config.json").exists()
    assert [p.read_text() for p in tmp_path.glob("blocked.old-*")] == ["not an export"]
    with pytest.raises(ValueError, match="not trained with a LoRA adapter"):
        export(new, out, adapter=True)
    assert sorted(os.listdir(out)) == sorted(names) and not [d for d in os.listdir(tmp_path) if ".export-" in d]
