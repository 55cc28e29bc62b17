"""models/mmdit.py against diffusers' HunyuanVideoTransformer3DModel on tiny configs: keys, outputs, every gradient,
text masks, files, the fused AdaLN, checkpointing and precision.

CPU, fp32; odd latent grids (F=3, H=6, W=10; temporal patch 2 in the second config). Random init from diffusers
(default PyTorch init, so every modulation is non-zero and every path carries signal).
"""
import json
import logging
import math
import os

import pytest
import torch
from diffusers import HunyuanVideoTransformer3DModel  # slow import (~3 s): once per module

from models.mmdit import MMDiT
from ops import adaln

# A tiny config: one block of each kind, guidance on.
TINY = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, mlp_ratio=2, patch_size=2, patch_size_t=1,
            rope_axes_dim=(4, 4, 4), text_embed_dim=16, pooled_projection_dim=8, guidance_embeds=True)
# Deeper, wider heads, temporal patching, in ≠ out channels, fractional mlp_ratio, no guidance, latent_concat.
TINY_B = dict(in_channels=8, out_channels=4, num_attention_heads=3, attention_head_dim=16, num_layers=2,
              num_single_layers=2, num_refiner_layers=2, mlp_ratio=1.5, patch_size=2, patch_size_t=2,
              rope_axes_dim=(4, 6, 6), text_embed_dim=24, pooled_projection_dim=12, guidance_embeds=False,
              rope_theta=100.0, image_condition_type="latent_concat")
CONFIGS = {"tiny": TINY, "tiny_b": TINY_B}
L_TEXT = 9
MASKS = {"none": None, "ragged": [9, 6], "uniform": [5, 5]}  # valid text lengths per sample


def make_pair(cfg, seed=0):
    torch.manual_seed(seed)
    ref = HunyuanVideoTransformer3DModel(**cfg)
    ours = MMDiT(**cfg)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def inputs(cfg, lengths=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    frames = 4 if cfg["patch_size_t"] == 2 else 3
    x = torch.randn(2, cfg["in_channels"], frames, 6, 10, generator=g)
    text = torch.randn(2, L_TEXT, cfg["text_embed_dim"], generator=g)
    mask = None if lengths is None else torch.arange(L_TEXT)[None, :] < torch.tensor(lengths)[:, None]
    kw = dict(timestep=torch.tensor([37.5, 912.0]), encoder_hidden_states=text, encoder_attention_mask=mask,
              pooled_projections=torch.randn(2, cfg["pooled_projection_dim"], generator=g),
              guidance=torch.tensor([6000.0, 3500.0]) if cfg["guidance_embeds"] else None)
    return x, kw


def ref_forward(ref, x, kw):
    kw = dict(kw)
    if kw["encoder_attention_mask"] is None:  # diffusers needs a mask: all valid
        kw["encoder_attention_mask"] = torch.ones(kw["encoder_hidden_states"].shape[:2], dtype=torch.bool)
    return ref(x, **kw, return_dict=False)[0]


def loss_and_grads(model, y, seed=2):
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    model.zero_grad()
    (y * w).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", CONFIGS)
def test_state_dict_keys_and_shapes_match_diffusers_both_ways(name):
    ref, ours = make_pair(CONFIGS[name])
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    ref.load_state_dict(ours.state_dict(), strict=True)
    theirs = {k: tuple(v) if isinstance(v, list) else v for k, v in ref.config.items() if not k.startswith("_")}
    assert ours.config == theirs


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name", CONFIGS)
def test_output_and_every_gradient_match_diffusers(name, mask):
    cfg = CONFIGS[name]
    ref, ours = make_pair(cfg)
    x, kw = inputs(cfg, MASKS[mask])
    y_ref, y = ref_forward(ref, x, kw), ours(x, **kw)
    assert y.shape == x[:, :cfg["out_channels"]].shape
    assert (y - y_ref).abs().max().item() <= 1e-5
    g_ref, g = loss_and_grads(ref, y_ref), loss_and_grads(ours, y)
    assert g.keys() == g_ref.keys()
    for k in g:
        assert (g[k] - g_ref[k]).abs().max().item() <= 1e-4, k
    if mask != "none":  # the mask must matter, or this test could not tell a dropped mask
        with torch.no_grad():
            y_unmasked = ours(x, **{**kw, "encoder_attention_mask": None})
        assert (y_unmasked - y).abs().max().item() > 1e-3


def test_padded_text_runs_the_joint_attention_maskless_and_equals_the_masked_run(monkeypatch):
    """Left-aligned padded text reaches the joint attention as key lengths (layers.KeyLengths): one maskless call a
    sample, so cuDNN or flash can serve it; outputs and every gradient equal the boolean-mask path's (forced by a
    text_span without the row lengths), and a mask with a hole keeps the mask."""
    from models import layers
    from models.mmdit import text_span

    _, ours = make_pair(TINY)
    x, kw = inputs(TINY, [4, 7])
    span = text_span(kw["encoder_attention_mask"])
    assert span == (7, True, (4, 7))
    calls, real = [], layers.sdpa
    monkeypatch.setattr(layers, "sdpa", lambda q, k, v, mask=None, *a, **k2: calls.append(
        (q.shape[0], k.shape[2], mask is None)) or real(q, k, v, mask, *a, **k2))
    y = ours(x, **kw)
    joint = [c for c in calls if c[1] > L_TEXT]  # the refiner's calls are text only
    N = joint[0][1] - 4
    assert joint and set(joint) == {(1, N + 4, True), (1, N + 7, True)}, joint
    g = loss_and_grads(ours, y)
    calls.clear()
    y_mask = ours(x, **kw, text_span=span[:2])
    assert {c[2] for c in calls if c[1] > L_TEXT} == {False}  # the mask path ran
    assert (y - y_mask).abs().max().item() <= 1e-6
    g_mask = loss_and_grads(ours, y_mask)
    assert max((g[n] - g_mask[n]).abs().max().item() for n in g) <= 1e-6
    holes = kw["encoder_attention_mask"].clone()
    holes[1, 2] = False
    assert text_span(holes) == (7, True, None)


def test_attention_run_as_key_lengths_is_kept_by_keep_attention_as_under_a_mask():
    """Every block recomputed and keeping its attention: backward reruns no joint attention whether the padded text
    runs as key lengths or under the mask (the keep policy tells self-attention by its key count, which key lengths
    shorten: models/checkpointing.py joint_attention)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.checkpointing import attention_ops
    from models.mmdit import text_span

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func in attention_ops() and args[1].shape[-2] > L_TEXT  # the joint ones, not the refiner's
            return func(*args, **(kwargs or {}))

    _, ours = make_pair(TINY)
    x, kw = inputs(TINY, [4, 7])
    span = text_span(kw["encoder_attention_mask"])
    n = len(ours.blocks)
    reruns = {}
    for name, spans in (("lengths", span), ("mask", span[:2])):
        for keep in (0, n):
            ours.set_activation_checkpointing(n, keep_attention=keep)
            y = ours(x, **kw, text_span=spans)
            with Count() as c:
                (y * y).sum().backward()
            reruns[name, keep] = c.calls
    ours.set_activation_checkpointing(False)
    assert reruns["lengths", 0] > 0 and reruns["mask", 0] > 0  # recomputed blocks rerun their attention
    assert reruns["lengths", n] == reruns["mask", n] == 0, reruns


def test_the_joint_attention_keeps_the_mask_where_key_lengths_would_not_serve():
    _, ours = make_pair(TINY)
    mask = torch.arange(L_TEXT)[None, :] < torch.tensor([4, 7])[:, None]
    x = torch.zeros(1)
    assert ours._joint_mask(mask, False, (4, 7), 10, x) is None
    assert ours._joint_mask(mask, True, (4, 7), 10, x) == (14, 17)
    want = torch.cat([torch.ones(2, 10, dtype=torch.bool), mask], 1)[:, None, None, :]
    assert torch.equal(ours._joint_mask(mask, True, None, 10, x), want)  # a row with holes
    ours.blocks[0].compile()  # lazy: nothing compiles until a call
    assert torch.equal(ours._joint_mask(mask, True, (4, 7), 10, x), want)  # compiled blocks: one mask, no recompiles


def test_padded_text_is_ignored_and_all_zero_mask_is_finite():
    _, ours = make_pair(TINY)
    x, kw = inputs(TINY, [4, 7])
    junk = kw["encoder_hidden_states"].clone()
    junk[~kw["encoder_attention_mask"]] = 1e3
    with torch.no_grad():
        y = ours(x, **kw)
        assert torch.allclose(ours(x, **{**kw, "encoder_hidden_states": junk}), y, atol=1e-6, rtol=0)
        empty = ours(x, **{**kw, "encoder_attention_mask": torch.zeros_like(kw["encoder_attention_mask"])})
    assert torch.isfinite(empty).all()  # diffusers divides by zero in the refiner's masked mean here


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_from_pretrained_reads_diffusers_folder(tmp_path, shard):
    ref, _ = make_pair(TINY_B)
    ref.save_pretrained(tmp_path / "transformer", **({"max_shard_size": shard} if shard else {}))
    assert ("diffusion_pytorch_model.safetensors.index.json" in os.listdir(tmp_path / "transformer")) == bool(shard)
    ours = MMDiT.from_pretrained(str(tmp_path), subfolder="transformer")
    assert all(p.dtype == torch.float32 and p.requires_grad for p in ours.parameters())
    x, kw = inputs(TINY_B, MASKS["ragged"])
    with torch.no_grad():
        assert (ours(x, **kw) - ref_forward(ref, x, kw)).abs().max().item() <= 1e-5

    bf16 = MMDiT.from_pretrained(str(tmp_path / "transformer"), torch_dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in bf16.named_parameters()}
    for n in ("transformer_blocks.0.attn.to_q.weight", "single_transformer_blocks.1.proj_mlp.weight",
              "context_embedder.proj_in.weight", "x_embedder.proj.weight", "proj_out.weight"):
        assert dtypes[n] == torch.bfloat16, n
    for n in ("time_text_embed.timestep_embedder.linear_1.weight", "transformer_blocks.1.norm1_context.linear.weight",
              "single_transformer_blocks.0.norm.linear.bias", "norm_out.linear.weight",
              "context_embedder.time_text_embed.text_embedder.linear_2.weight",
              "context_embedder.token_refiner.refiner_blocks.0.norm_out.linear.weight",
              "context_embedder.token_refiner.refiner_blocks.1.norm2.weight",
              "transformer_blocks.0.attn.norm_added_k.weight"):
        assert dtypes[n] == torch.float32, n


def test_save_pretrained_is_read_by_diffusers(tmp_path):
    _, ours = make_pair(TINY)
    ours.save_pretrained(str(tmp_path), max_shard_size="10KB")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["_class_name"] == "HunyuanVideoTransformer3DModel" and config["rope_axes_dim"] == [4, 4, 4]
    assert sum(f.endswith(".safetensors") for f in os.listdir(tmp_path)) > 1
    ref = HunyuanVideoTransformer3DModel.from_pretrained(str(tmp_path))
    x, kw = inputs(TINY, MASKS["ragged"])
    with torch.no_grad():
        assert (ref_forward(ref, x, kw) - ours(x, **kw)).abs().max().item() <= 1e-5
    config["some_future_field"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="some_future_field"):
        again = MMDiT.from_pretrained(str(tmp_path))
    assert again.config == ours.config


def _triton_failure() -> str | None:
    """Why ops/adaln.py's triton backend cannot run here (no triton, no driver, no interpreter), or None."""
    try:
        x = torch.randn(1, 3, 8)
        adaln.adaln_modulate(x, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), backend="triton")
        return None
    except Exception as e:  # noqa: BLE001 — reported as the skip reason
        return f"{type(e).__name__}: {e}"


@pytest.mark.slow
def test_fused_adaln_matches_reference_in_the_model(wide_interpreter_tiles):
    failure = _triton_failure()
    if failure:
        pytest.skip(f"ops/adaln.py's triton backend does not run here ({failure})")
    _, model = make_pair(TINY)
    x, kw = inputs(TINY, MASKS["ragged"])
    model.adaln_backend = "torch"
    y_ref = model(x, **kw)
    g_ref = loss_and_grads(model, y_ref)
    model.adaln_backend = "triton"
    assert all(b.adaln_backend == "triton" for b in model.blocks)
    y = model(x, **kw)
    g = loss_and_grads(model, y)
    assert (y - y_ref).abs().max().item() <= 1e-5
    for k in g:
        assert (g[k] - g_ref[k]).abs().max().item() <= 1e-4, k


def test_activation_checkpointing_same_output_and_grads():
    _, model = make_pair(TINY_B)
    x, kw = inputs(TINY_B, MASKS["ragged"])
    calls = []
    for block in model.blocks:  # a pre-hook: recomputation stops early, so post-hooks would miss it
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    y_off = model(x, **kw)
    g_off = loss_and_grads(model, y_off)
    assert len(calls) == 4
    calls.clear()
    model.set_activation_checkpointing(True)
    y_on = model(x, **kw)
    g_on = loss_and_grads(model, y_on)
    assert len(calls) == 8  # every block ran again in backward
    assert torch.equal(y_on, y_off)
    for k in g_off:
        assert torch.equal(g_on[k], g_off[k]), k
    calls.clear()
    n_dual = len(model.transformer_blocks)
    model.set_activation_checkpointing(n_dual + 1)  # every dual-stream block and the first single-stream one
    g_part = loss_and_grads(model, model(x, **kw))
    assert len(calls) == 4 + n_dual + 1
    for k in g_off:
        assert torch.equal(g_part[k], g_off[k]), k


def test_autocast_bf16_keeps_embedders_and_modulation_fp32():
    _, model = make_pair(TINY)
    x, kw = inputs(TINY, MASKS["ragged"])
    with torch.no_grad():
        y32 = model(x, **kw)
    seen = {}
    model.time_text_embed.register_forward_hook(lambda m, i, o: seen.update(temb=o.dtype))
    model.context_embedder.time_text_embed.register_forward_hook(lambda m, i, o: seen.update(refiner_temb=o.dtype))
    model.transformer_blocks[0].norm1.register_forward_hook(lambda m, i, o: seen.update(mod={t.dtype for t in o}))
    model.transformer_blocks[0].attn.to_q.register_forward_hook(lambda m, i, o: seen.update(to_q=o.dtype))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = model(x, **kw)
    assert seen == {"temb": torch.float32, "refiner_temb": torch.float32, "mod": {torch.float32},
                    "to_q": torch.bfloat16}
    assert torch.isfinite(y16).all()
    assert (y16.float() - y32).abs().max() < 0.1 * y32.abs().max()


def test_num_matmul_params_blocks_and_errors():
    model = MMDiT(**TINY_B)
    D, p, mlp = 48, 2 * 2 * 2, int(48 * 1.5)
    single = 3 * D * D + D * mlp + (D + mlp) * D
    dual_stream = 4 * D * D + 2 * D * mlp
    assert model.num_matmul_params() == 8 * p * D + D * p * 4 + 2 * dual_stream + 2 * single
    refiner = 4 * D * D + 2 * D * 4 * D
    assert model.num_text_matmul_params() == 24 * D + 2 * refiner + 2 * dual_stream + 2 * single
    assert [type(b).__name__ for b in model.blocks] == ["DualStreamBlock"] * 2 + ["SingleStreamBlock"] * 2
    assert "blocks" not in dict(model.named_children())  # a view, not a module: keys stay diffusers'
    # AdaLN-Zero: a fresh model's modulation (gates included) starts at zero
    assert all((b.norm1.linear.weight == 0).all() for b in model.transformer_blocks)
    with torch.device("meta"):
        assert MMDiT(**TINY).proj_out.weight.is_meta

    with pytest.raises(NotImplementedError, match="token_replace"):
        MMDiT(**{**TINY, "image_condition_type": "token_replace"})
    with pytest.raises(ValueError, match="qk_norm"):
        MMDiT(**{**TINY, "qk_norm": "layer_norm"})
    with pytest.raises(ValueError, match="rope_axes_dim"):
        MMDiT(**{**TINY, "rope_axes_dim": (4, 4, 6)})
    with pytest.raises(ValueError, match="adaln_backend"):
        MMDiT(**TINY, adaln_backend="fused")
    tiny = MMDiT(**TINY)
    x, kw = inputs(TINY)
    with pytest.raises(ValueError, match="guidance"):
        tiny(x, **{**kw, "guidance": None})
    with pytest.raises(ValueError, match="pooled_projections"):
        tiny(x, **{**kw, "pooled_projections": None})
    with pytest.raises(ValueError, match="divisible"):
        tiny(x[..., :5], **kw)
    with pytest.raises(ValueError, match="encoder_attention_mask"):
        tiny(x, **{**kw, "encoder_attention_mask": torch.ones(2, 3, dtype=torch.bool)})
    assert math.prod(tiny.patch) == 4


def test_bf16_fp32_adaln_no_worse_than_diffusers():
    """The documented difference: ours normalises in fp32 where diffusers works in x's dtype."""
    ref, ours = make_pair(TINY_B)
    x, kw = inputs(TINY_B, MASKS["ragged"])
    with torch.no_grad():
        y32 = ref_forward(ref, x, kw)
        bf = lambda v: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
        kw16 = {k: bf(v) for k, v in kw.items()}
        err_ref = (ref_forward(ref.bfloat16(), bf(x), kw16).float() - y32).abs().max().item()
        err = (ours.bfloat16()(bf(x), **kw16).float() - y32).abs().max().item()
    assert err <= 1.25 * err_ref + 1e-3, (err, err_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_autocast_bf16_checkpointing_fused_adaln_and_block_compile():
    cfg = dict(in_channels=16, out_channels=16, num_attention_heads=4, attention_head_dim=32, num_layers=2,
               num_single_layers=2, num_refiner_layers=1, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
               rope_axes_dim=(8, 12, 12), text_embed_dim=64, pooled_projection_dim=32, guidance_embeds=True)
    ref, ours = make_pair(cfg)
    ref, ours = ref.cuda(), ours.cuda()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 5, 16, 16, generator=g).cuda()
    kw = dict(timestep=torch.tensor([37.5, 912.0]), encoder_hidden_states=torch.randn(2, 24, 64, generator=g),
              encoder_attention_mask=torch.arange(24)[None] < torch.tensor([[24], [13]]),
              pooled_projections=torch.randn(2, 32, generator=g), guidance=torch.tensor([6000.0, 1000.0]))
    kw = {k: v.cuda() for k, v in kw.items()}
    keys = list(ours.state_dict())

    with torch.no_grad():
        y32 = ours(x, **kw)  # adaln "auto": the Triton kernels on CUDA
        assert (y32 - ref_forward(ref, x, kw)).abs().max().item() <= 1e-3  # TF32 convs on both sides
        ours.adaln_backend = "torch"
        assert (ours(x, **kw) - y32).abs().max().item() <= 1e-4
        ours.adaln_backend = "auto"
        with torch.autocast("cuda", dtype=torch.bfloat16):
            err = (ours(x, **kw).float() - y32).abs().max().item()
            err_ref = (ref_forward(ref, x, kw).float() - y32).abs().max().item()
    print(f"autocast bf16 vs fp32: ours {err:.2e}, diffusers {err_ref:.2e}")
    assert err <= 1.5 * err_ref + 1e-3, (err, err_ref)

    from tests.helpers import check_checkpointing_and_compile

    w = torch.randn(y32.shape, generator=g).cuda()
    # Left out: the refiner's key bias. With no q/k norm, q·b is one constant per query added to every logit, which
    # the softmax ignores: its exact gradient is zero (1e-10 in fp32 on CPU), so the relative difference is noise
    # over noise (1.1 seen on the H200). The other key biases pass through RMSNorm and have real gradients.
    check_checkpointing_and_compile(
        ours, lambda: ours(x, **kw), w, keys,
        ignore_grad=lambda n: n.startswith("context_embedder.token_refiner") and n.endswith("attn.to_k.bias"))


def test_train_flops_matches_counted_matmuls():
    from torch.utils.flop_counter import FlopCounterMode

    _, model = make_pair(TINY_B)
    x, kw = inputs(TINY_B)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x, **kw).sum().backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    matmul = sum(v for k, v in counts.items() if "attention" not in k)
    S, L, D = 2 * 3 * 5, L_TEXT, 48
    attention = 12 * D * (4 * (S + L) ** 2 + 2 * L ** 2)
    predicted = 2 * (model.train_flops(S, L) - attention)  # B = 2
    # the counter skips input gradients nobody needs (patch embedding, first embedder layers): a little less
    assert 0.97 * predicted <= matmul <= predicted, (matmul, predicted)


@pytest.mark.slow
def test_tiny_preset_trains_and_its_val_loss_falls(tmp_path):
    from tests.helpers import run_training, tiny_overrides
    from training.metrics import read_metrics

    run_dir = str(tmp_path / "run")
    run_training(["conf=mmdit_tiny", *tiny_overrides(run_dir, str(tmp_path / "cache"), "train.steps=40",
                                                      "train.val_every=20")])
    val = [r["val/loss"] for r in read_metrics(run_dir) if "val/loss" in r]
    assert len(val) == 3 and val[-1] <= 0.8 * val[0], val

    # the trained checkpoint exports to a folder diffusers' HunyuanVideo transformer loads, with our output
    from training.export import export

    out = export(run_dir, str(tmp_path / "export"))
    ours, theirs = MMDiT.from_pretrained(out), HunyuanVideoTransformer3DModel.from_pretrained(out)
    g = torch.Generator().manual_seed(0)
    x, txt, pooled = (torch.randn(*s, generator=g) for s in ((1, 4, 3, 8, 8), (1, 6, 32), (1, 32)))
    kw = dict(encoder_attention_mask=torch.ones(1, 6, dtype=torch.bool), pooled_projections=pooled,
              guidance=torch.tensor([1000.0]))
    with torch.no_grad():
        torch.testing.assert_close(ours(x, torch.tensor([500.0]), txt, **kw),
                                   theirs(hidden_states=x, timestep=torch.tensor([500.0]), encoder_hidden_states=txt,
                                          return_dict=False, **kw)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_calibration_fits_joint_attention_and_balanced_plans_train(tmp_path, caplog):
    import json

    from tests.helpers import compose_config, run_training, tiny_overrides
    from training.metrics import read_metrics
    from training.shape_benchmark import calibrate_config

    cal = str(tmp_path / "cal.json")
    cfg = compose_config(["conf=mmdit_tiny"])
    calibrate_config(cfg, {"max_points": 6, "repeats": 1, "out": cal}, command="test", log=lambda s: None)
    rec = next(iter(json.load(open(cal))["modes"].values()))
    quad = rec["fits"]["quadratic"]
    assert quad["joint"] is True and quad["L"] == cfg.model.text_len  # (S + L)²: text joins the attention
    run_dir = str(tmp_path / "bal")
    with caplog.at_level(logging.INFO, logger="train"):
        run_training(["conf=mmdit_tiny", "scheduling=balanced", f"scheduling.calibration={cal}",
                      *tiny_overrides(run_dir, str(tmp_path / "cache"), "train.steps=3", "train.val_every=3")])
    assert read_metrics(run_dir)[-1]["step"] == 3
    sources = next(r.args[-1] for r in caplog.records if r.msg.startswith("scheduling: strategy"))
    assert sources["cost"].startswith("calibration:") and sources["cost"].endswith(":" + rec["cost_model"]["form"])


@pytest.mark.slow
def test_llama_clip_text_side_feeds_pooled_text_to_the_mmdit_from_raw_shards(tmp_path, monkeypatch):
    """HunyuanVideo's text side (LLaMA hidden states + CLIP pooled, tiny from config) on a raw corpus: every
    micro-batch reaches the model with its encoder's pooled embedding, and training runs."""
    import train
    from data.encoders import TEXT_ENCODERS, EncoderConfig
    from data.synthetic_raw import write_raw_corpus
    from tests.helpers import run_training, tiny_overrides
    from training.metrics import read_metrics

    enc = TEXT_ENCODERS["llama_clip"](EncoderConfig(text="llama_clip", device="cpu", pooled_dim=8), 16,
                                      torch.device("cpu"))
    both = enc.encode(["a red ball", "two blue squares drifting left"])
    one = enc.encode(["a red ball"])
    assert both.embeds.shape[-1] == 16 and both.pooled.shape == (2, 8)
    torch.testing.assert_close(one.pooled[0], both.pooled[0])  # batch mates and padding change nothing
    torch.testing.assert_close(one.per_sample()[0], both.per_sample()[0])
    assert not torch.allclose(both.pooled[0], both.pooled[1])

    root = str(tmp_path / "raw")
    write_raw_corpus(root, images=6, videos=4, seconds=(0.7, 1.5), samples_per_shard=5, seed=0)
    seen = []
    real = train.model_inputs
    monkeypatch.setattr(train, "model_inputs", lambda cfg, b: seen.append(b.pooled is not None) or real(cfg, b))
    run_dir = str(tmp_path / "run")
    run_training(["conf=mmdit_tiny", f"data.urls='{root}/shard-*.tar'", "data.encoders.text=llama_clip",
                  "data.encoders.pooled_dim=32", "data.encoders.device=cpu", "data.val_samples=2",
                  *tiny_overrides(run_dir, str(tmp_path / "cache"), "train.steps=2", "train.val_every=2")])
    assert seen and all(seen)
    assert read_metrics(run_dir)[-1]["step"] == 2


@pytest.mark.slow
def test_pooled_text_of_its_own_width_comes_from_the_corpus(tmp_path, monkeypatch):
    """pooled_projection_dim ≠ text_embed_dim (as HunyuanVideo: 768 vs 4096): the synthetic corpus then stores a
    pooled embedding per sample; a latent corpus without one is refused before training."""
    import train
    from tests.helpers import run_training, tiny_overrides

    seen = []
    real = train.model_inputs
    monkeypatch.setattr(train, "model_inputs", lambda cfg, b: seen.append(None if b.pooled is None
                                                                            else b.pooled.shape[-1]) or real(cfg, b))
    cache = str(tmp_path / "cache")
    run_training(["conf=mmdit_tiny", "model.pooled_projection_dim=8",
                  *tiny_overrides(str(tmp_path / "a"), cache, "train.steps=2", "train.val_every=2")])
    assert seen and set(seen) == {8}
    with_pooled = [os.path.join(cache, d) for d in os.listdir(cache) if d.startswith("synthetic-")]
    with pytest.raises(ValueError, match=r"pooled text has width 8 but the model takes 32"):
        run_training(["conf=mmdit_tiny", f"data.index={with_pooled[0]}",
                      *tiny_overrides(str(tmp_path / "b"), cache, "train.steps=1")])
    run_training(tiny_overrides(str(tmp_path / "wan"), cache, "train.steps=1"))  # a Wan corpus: no pooled text
    plain = [os.path.join(cache, d) for d in os.listdir(cache)
             if d.startswith("synthetic-") and os.path.join(cache, d) not in with_pooled]
    assert len(plain) == 1
    with pytest.raises(ValueError, match="pooled text of width 8 but the corpus has none"):
        run_training(["conf=mmdit_tiny", "model.pooled_projection_dim=8", f"data.index={plain[0]}",
                      *tiny_overrides(str(tmp_path / "c"), cache, "train.steps=1")])


def test_lora_targets_that_match_nothing_are_reported(caplog):
    """Wan's default targets on the MMDiT: the attention projections match, the Wan FFN names (ffn.net.*) do not —
    the run says so instead of silently adapting attention alone; ff.net.* names the MMDiT's feed-forwards."""
    from models.config import LoRAConfig
    from models.lora import apply_lora, lora_modules

    with caplog.at_level(logging.WARNING, logger="models.lora"):
        model = apply_lora(MMDiT(**TINY), LoRAConfig(rank=2))
    assert any("ffn.net.0.proj" in r.getMessage() and "ffn.net.2" in r.getMessage() for r in caplog.records)
    assert not any(n.endswith(("ff.net.0.proj", "ff.net.2")) for n in lora_modules(model))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="models.lora"):
        model = apply_lora(MMDiT(**TINY), LoRAConfig(rank=2, targets=["to_q", "ff.net.0.proj"]))
    assert not caplog.records and any(n.endswith("ff.net.0.proj") for n in lora_modules(model))


def test_model_inputs_pool_the_valid_text_tokens_and_embed_the_guidance():
    """training.inputs.model_inputs for a corpus without pooled text: the mean of each sample's valid text tokens
    (a sample with none pools to zeros, not NaN); the embedded guidance is 1000·guidance_scale for every sample;
    a stored pooled embedding is passed through, and Wan takes no extra inputs."""
    from data.batch import Batch
    from training.inputs import model_inputs
    from models.config import MMDiTConfig, ModelConfig

    cfg = MMDiTConfig(**{**TINY, "pooled_projection_dim": 16}, guidance_scale=3.5)
    g = torch.Generator().manual_seed(0)
    text = torch.randn(3, 5, 16, generator=g)
    mask = torch.tensor([[True, True, True, False, False], [True] * 5, [False] * 5])
    batch = Batch(torch.zeros(3, 4, 1, 2, 2), text, ["a", "b", "c"], "img", 1, torch.ones(3), text_mask=mask)
    got = model_inputs(cfg, batch)
    torch.testing.assert_close(got["pooled_projections"],
                               torch.stack([text[0, :3].mean(0), text[1].mean(0), torch.zeros(16)]))
    assert got["guidance"].tolist() == [3500.0] * 3 and got["encoder_attention_mask"] is mask
    pooled = torch.randn(3, 16, generator=g)
    assert model_inputs(cfg, Batch(**{**batch.__dict__, "pooled": pooled}))["pooled_projections"] is pooled
    no_guidance = MMDiTConfig(**{**TINY, "guidance_embeds": False, "pooled_projection_dim": 16})
    assert model_inputs(no_guidance, batch)["guidance"] is None
    with pytest.raises(ValueError, match="pooled_projection_dim"):
        model_inputs(MMDiTConfig(**TINY), batch)  # 8 ≠ 16 and nothing stored to pool from
    assert model_inputs(ModelConfig(), batch) == {}


def test_config_defaults_are_diffusers_and_run_knobs_are_checked():
    """MMDiTConfig's architecture defaults are diffusers' HunyuanVideoTransformer3DModel's (HunyuanVideo 13B), field
    by field; its run knobs go through the same checks as Wan's; attention_layers counts both kinds of block."""
    import inspect

    from models.config import MMDiTConfig

    theirs = inspect.signature(HunyuanVideoTransformer3DModel.__init__).parameters
    ours = MMDiTConfig().diffusers_kwargs()
    assert ours == {k: theirs[k].default for k in ours}
    for bad in ({"adaln_backend": "cuda"}, {"checkpointing": "some"}, {"precision": "fp8"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MMDiTConfig(**TINY, **bad)
    assert MMDiTConfig(**TINY_B).attention_layers == 4 and MMDiTConfig(**TINY).attention_layers == 2
