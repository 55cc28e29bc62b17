"""models/wan.py against diffusers' WanTransformer3DModel on tiny configs: keys, outputs, every gradient, files.

Odd latent grids (F=3, H=6, W=10) and head_dim 12/16 (non-empty t/h/w RoPE bands) on CPU in fp32.
"""
import json
import math
import os

import pytest
import torch
from diffusers import WanTransformer3DModel  # slow import (~3 s): once per module

from models.wan import WanTransformer

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2)
# Second variant: no cross-attention norm, other eps and head_dim, in ≠ out channels, a temporal patch.
TINY_B = dict(patch_size=(2, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=6, out_channels=4,
              text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=False, eps=1e-5)
CONFIGS = {"cross_norm": TINY, "no_cross_norm": TINY_B}


def make_pair(cfg, seed=0):
    """A diffusers model with random weights (tables perturbed off their init) and ours holding the same."""
    torch.manual_seed(seed)
    ref = WanTransformer3DModel(**cfg)
    with torch.no_grad():
        for p in ref.parameters():  # non-trivial norms/biases so that every term shows in the outputs
            p.add_(0.1 * torch.randn_like(p))
    ours = WanTransformer(**cfg)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def inputs(cfg, frames, per_token=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    p_t, p_h, p_w = cfg["patch_size"]
    x = torch.randn(2, cfg["in_channels"], frames, 6, 10, generator=g)
    if per_token:
        n = frames // p_t * (6 // p_h) * (10 // p_w)
        t = torch.rand(2, n, generator=g) * 1000
    else:
        t = torch.tensor([37.5, 912.0])
    ctx = torch.randn(2, 5, cfg["text_dim"], generator=g)
    return x, t, ctx


def ref_forward(ref, x, t, ctx):
    return ref(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]


def loss_and_grads(model, out):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    model.zero_grad()
    (out * w).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_dict_keys_match_diffusers_both_ways(name):
    cfg = CONFIGS[name]
    ref, ours = make_pair(cfg)
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert list(our_sd) == list(ref_sd)
    assert {k: v.shape for k, v in our_sd.items()} == {k: v.shape for k, v in ref_sd.items()}
    # our keys load into a fresh diffusers model strictly and carry the values
    fresh = WanTransformer3DModel(**cfg)
    fresh.load_state_dict(our_sd, strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in our_sd.items())
    assert ("blocks.0.norm2.weight" in our_sd) == cfg.get("cross_attn_norm", True)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_and_every_grad_match_diffusers(name):
    cfg = CONFIGS[name]
    ref, ours = make_pair(cfg)
    x, t, ctx = inputs(cfg, frames=4 if cfg["patch_size"][0] == 2 else 3)
    y_ref, y = ref_forward(ref, x, t, ctx), ours(x, t, ctx)
    assert y.shape == x.shape[:1] + (cfg["out_channels"],) + x.shape[2:]
    assert (y - y_ref).abs().max().item() <= 1e-5
    g_ref, g = loss_and_grads(ref, y_ref), loss_and_grads(ours, y)
    assert g.keys() == g_ref.keys()
    for k in g:
        assert g[k].abs().sum() > 0, k  # every parameter takes part
        assert (g[k] - g_ref[k]).abs().max().item() <= 1e-4, k


def test_per_token_timestep_matches_diffusers():
    ref, ours = make_pair(TINY)
    x, t_BN, ctx = inputs(TINY, frames=3, per_token=True)
    y_ref, y = ref_forward(ref, x, t_BN, ctx), ours(x, t_BN, ctx)
    assert (y - y_ref).abs().max().item() <= 1e-5
    g_ref, g = loss_and_grads(ref, y_ref), loss_and_grads(ours, y)
    for k in g:
        assert (g[k] - g_ref[k]).abs().max().item() <= 1e-4, k
    # a constant per-token timestep is the per-sample path
    t_B = torch.tensor([37.5, 912.0])
    y_const = ours(x, t_B[:, None].expand_as(t_BN), ctx)
    assert (y_const - ours(x, t_B, ctx)).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="timestep"):
        ours(x, t_BN[:, :-1], ctx)


@pytest.mark.parametrize("shard", [None, "10KB"])
def test_from_pretrained_reads_diffusers_folder(tmp_path, shard):
    ref, _ = make_pair(TINY)
    kw = {"max_shard_size": shard} if shard else {}
    ref.save_pretrained(tmp_path / "transformer", **kw)
    files = os.listdir(tmp_path / "transformer")
    assert ("diffusion_pytorch_model.safetensors.index.json" in files) == (shard is not None)
    ours = WanTransformer.from_pretrained(str(tmp_path), subfolder="transformer")
    assert all(p.dtype == torch.float32 and p.requires_grad for p in ours.parameters())
    x, t, ctx = inputs(TINY, frames=3)
    with torch.no_grad():
        assert torch.equal(ours(x, t, ctx), ref_forward(ref, x, t, ctx))

    bf16 = WanTransformer.from_pretrained(str(tmp_path / "transformer"), torch_dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in bf16.named_parameters()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert dtypes["proj_out.weight"] == torch.bfloat16
    for n in ("condition_embedder.time_embedder.linear_1.weight", "blocks.1.scale_shift_table",
              "scale_shift_table", "blocks.0.norm2.weight"):
        assert dtypes[n] == torch.float32, n
    ref_bf16 = WanTransformer3DModel.from_pretrained(str(tmp_path / "transformer"), torch_dtype=torch.bfloat16)
    assert dtypes == {n: p.dtype for n, p in ref_bf16.named_parameters()}


@pytest.mark.parametrize("shard", [None, "10KB"])
def test_save_pretrained_is_read_by_diffusers(tmp_path, shard):
    _, ours = make_pair(TINY_B)
    ours.save_pretrained(str(tmp_path), max_shard_size=shard)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel" and "_diffusers_version" in config
    n_shards = sum(f.endswith(".safetensors") for f in os.listdir(tmp_path))
    assert (n_shards > 1) == (shard is not None)
    ref = WanTransformer3DModel.from_pretrained(str(tmp_path))
    x, t, ctx = inputs(TINY_B, frames=4)
    with torch.no_grad():
        assert torch.equal(ref_forward(ref, x, t, ctx), ours(x, t, ctx))
    # and back into ours, with an unknown key that must be reported, not fatal
    config["some_future_field"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="some_future_field"):
        again = WanTransformer.from_pretrained(str(tmp_path))
    assert again.config == ours.config


def test_activation_checkpointing_same_output_and_grads():
    _, model = make_pair(TINY)
    x, t, ctx = inputs(TINY, frames=3)
    calls = []
    for block in model.blocks:
        # a pre-hook: recomputation stops early (once the saved tensors exist), so post-hooks miss it
        block.register_forward_pre_hook(lambda *_: calls.append(1))

    y_off = model(x, t, ctx)
    g_off = loss_and_grads(model, y_off)
    assert len(calls) == 2

    calls.clear()
    model.set_activation_checkpointing(True)
    y_on = model(x, t, ctx)
    g_on = loss_and_grads(model, y_on)
    assert len(calls) == 4  # each block ran again in backward: checkpointing was really on
    assert torch.equal(y_on, y_off)
    for k in g_off:
        assert torch.equal(g_on[k], g_off[k]), k

    calls.clear()
    model.set_activation_checkpointing(1)  # the first block only (the memory policy's partial recompute)
    g_one = loss_and_grads(model, model(x, t, ctx))
    assert len(calls) == 3  # 2 blocks + the first again
    for k in g_off:
        assert torch.equal(g_one[k], g_off[k]), k
    with pytest.raises(ValueError, match="3 blocks asked for"):
        model.set_activation_checkpointing(3)

    calls.clear()
    model.set_activation_checkpointing(True)
    model.offload_checkpoints = True  # inputs kept off the device between forward and backward (models/offload.py)
    y_off2 = model(x, t, ctx)
    g_host = loss_and_grads(model, y_off2)
    assert len(calls) == 4 and torch.equal(y_off2, y_off)
    for k in g_off:  # the text and modulation gradients sum per block in another order: last-bit differences
        torch.testing.assert_close(g_host[k], g_off[k], rtol=1e-5, atol=1e-6, msg=k)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the recompute runs under the forward's autocast
        y16 = model(x, t, ctx)
        model.offload_checkpoints = False
        y16_ref = model(x, t, ctx)
    g16 = loss_and_grads(model, y16.float())
    model.offload_checkpoints = False
    g16_ref = loss_and_grads(model, y16_ref.float())
    for k in g16:  # inside the blocks the same bf16 ops run (a recompute outside autocast would not match)
        if k.startswith("blocks."):
            assert torch.equal(g16[k], g16_ref[k]), k
        else:  # summed over blocks in bf16, in another order
            assert ((g16[k] - g16_ref[k]).norm() / g16_ref[k].norm()).item() < 1e-2, k

    calls.clear()
    with torch.no_grad():  # nothing to recompute without autograd
        model(x, t, ctx)
    assert len(calls) == 2
    assert list(model.state_dict()) == list(make_pair(TINY)[1].state_dict())


def test_adaln_backend_torch_equals_auto_and_is_checked():
    _, model = make_pair(TINY)
    x, t, ctx = inputs(TINY, frames=3)
    with torch.no_grad():
        y_auto = model(x, t, ctx)
        model.adaln_backend = "torch"
        assert all(b.adaln_backend == "torch" for b in model.blocks)
        y_torch = model(x, t, ctx)
    assert torch.equal(y_auto, y_torch)
    with pytest.raises(ValueError, match="adaln_backend"):
        model.adaln_backend = "cuda"
    with pytest.raises(ValueError, match="adaln_backend"):
        WanTransformer(**TINY, adaln_backend="fused")


@pytest.mark.parametrize("per_token", [False, True])
def test_fused_adaln_model_equals_reference_model(per_token, monkeypatch):
    """The Triton AdaLN (the interpreter on CPU) in every norm1/norm3/head: same output and parameter gradients."""
    import ops.adaln as adaln

    calls = []
    real_apply = adaln._AdaLNFunction.apply
    monkeypatch.setattr(adaln._AdaLNFunction, "apply", lambda *a: calls.append(1) or real_apply(*a))
    if not adaln._HAS_TRITON:
        pytest.skip("triton is not installed")
    _, model = make_pair(TINY)
    x, t, ctx = inputs(TINY, frames=3, per_token=per_token)
    outs, grads = {}, {}
    for backend in ("torch", "triton"):
        model.adaln_backend = backend
        outs[backend] = model(x, t, ctx)
        grads[backend] = loss_and_grads(model, outs[backend])
    assert len(calls) == 2 * TINY["num_layers"] + 1  # the fused op ran for norm1, norm3 and the head
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=1e-5)
    for n, g in grads["torch"].items():
        torch.testing.assert_close(grads["triton"][n], g, atol=1e-5, rtol=1e-4, msg=n)


def test_autocast_bf16_keeps_time_embedder_fp32():
    _, model = make_pair(TINY)
    x, t, ctx = inputs(TINY, frames=3)
    with torch.no_grad():
        y32 = model(x, t, ctx)
    seen = {}
    ce = model.condition_embedder
    ce.time_embedder.register_forward_hook(lambda m, i, o: seen.update(time_embedder=o.dtype))
    ce.time_proj.register_forward_hook(lambda m, i, o: seen.update(time_proj=o.dtype))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = model(x, t, ctx)
    assert seen == {"time_embedder": torch.float32, "time_proj": torch.bfloat16}
    assert torch.isfinite(y16).all()
    assert (y16.float() - y32).abs().max() < 0.1 * y32.abs().max()


def test_num_matmul_params_and_config_errors():
    model = WanTransformer(**TINY)
    D, L, ffn, p = 24, 2, 32, math.prod(TINY["patch_size"])
    expected = L * (6 * D * D + 2 * D * ffn) + 4 * p * D + D * 4 * p
    assert model.num_matmul_params() == expected
    assert model.config["num_layers"] == 2 and model.config["patch_size"] == (1, 2, 2)
    with pytest.raises(NotImplementedError, match="image"):
        WanTransformer(**TINY, image_dim=8)
    with pytest.raises(ValueError, match="qk_norm"):
        WanTransformer(**TINY, qk_norm=None)
    x, t, ctx = inputs(TINY, frames=3)
    with pytest.raises(ValueError, match="divisible"):
        model(x[..., :5], t, ctx)


def test_lora_with_per_module_ranks_round_trips_and_a_foreign_key_is_refused(tmp_path):
    """An adapter whose modules have different ranks (peft's rank_pattern) keeps them through save_lora's metadata
    and load_lora, weights included; a file holding a key the adapter it describes has no place for is refused."""
    from safetensors.torch import load_file, save_file

    from models.config import LoRAConfig
    from models.lora import LORA_WEIGHT_NAME, apply_lora, load_lora, lora_metadata, lora_state_dict, save_lora

    torch.manual_seed(0)
    model = WanTransformer(**TINY)
    apply_lora(model, LoRAConfig(rank=4, targets=["to_q", "to_k"]), rank_pattern={"^blocks.0.attn1.to_q$": 2})
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn_like(p))
    meta = lora_metadata(model)
    assert meta["transformer.rank_pattern"] == {"^blocks.0.attn1.to_q$": 2} and meta["transformer.r"] == 4
    path = save_lora(model, str(tmp_path / "a"))
    back = load_lora(WanTransformer(**TINY), path)
    sd, sd_back = lora_state_dict(model), lora_state_dict(back)
    assert sd.keys() == sd_back.keys() and all(torch.equal(sd[k], sd_back[k]) for k in sd)
    assert sd["transformer.blocks.0.attn1.to_q.lora_A.weight"].shape[0] == 2
    assert sd["transformer.blocks.1.attn1.to_q.lora_A.weight"].shape[0] == 4

    state = load_file(path)
    state["transformer.blocks.1.ffn.net.2.lora_A.weight"] = torch.zeros(4, 32)  # no lora_B: nowhere to load it
    os.makedirs(tmp_path / "b")
    save_file(state, str(tmp_path / "b" / LORA_WEIGHT_NAME))
    with pytest.raises(ValueError, match="does not fit"):
        load_lora(WanTransformer(**TINY), str(tmp_path / "b"))


def test_rope_refuses_odd_bands_and_grids_past_its_table():
    """RoPE3D's bands must be positive and even (pairs rotate together), and every grid axis within rope_max_seq_len
    — whichever axis it is: one long axis is enough to run past the table."""
    from models.layers import RoPE3D

    for bands in ((2, 3, 4), (0, 4, 4), (4, 4, -2)):
        with pytest.raises(ValueError, match="positive and even"):
            RoPE3D(bands)
    rope = RoPE3D((4, 4, 4), max_seq_len=16)
    cos, sin = rope(16, 2, 3, torch.device("cpu"))
    assert cos.shape == sin.shape == (16 * 2 * 3, 6)
    for grid in ((17, 2, 3), (2, 17, 3), (1, 1, 17)):
        with pytest.raises(ValueError, match="rope_max_seq_len"):
            rope(*grid, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_autocast_bf16_checkpointing_and_block_compile():
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16, out_channels=16,
               text_dim=64, freq_dim=32, ffn_dim=256, num_layers=2)
    ref, ours = make_pair(cfg)
    ref, ours = ref.cuda(), ours.cuda()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 5, 16, 16, generator=g).cuda()
    t = torch.tensor([37.5, 912.0]).cuda()
    ctx = torch.randn(2, 32, 64, generator=g).cuda()
    keys = list(ours.state_dict())

    with torch.no_grad():
        y32 = ours(x, t, ctx)
        assert (y32 - ref_forward(ref, x, t, ctx)).abs().max().item() <= 1e-3  # TF32 convs on both sides
        with torch.autocast("cuda", dtype=torch.bfloat16):
            err = (ours(x, t, ctx).float() - y32).abs().max().item()
            err_ref = (ref_forward(ref, x, t, ctx).float() - y32).abs().max().item()
    print(f"autocast bf16 vs fp32: ours {err:.2e}, diffusers {err_ref:.2e}")
    assert err <= 1.5 * err_ref + 1e-3, (err, err_ref)  # no worse than diffusers under the same autocast

    from tests.helpers import check_checkpointing_and_compile

    w = torch.randn(y32.shape, generator=g).cuda()
    check_checkpointing_and_compile(ours, lambda: ours(x, t, ctx), w, keys)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("glue", ["torch", "triton", "triton+offload", "triton+offload+keep"])
def test_cuda_bf16_parity_with_diffusers_at_wan_1p3b_width(glue):
    """Issue 9's parity: Wan 2.1 1.3B widths (12 heads × 128, ffn 8960, text 4096), two blocks, bf16 parameters on
    both sides (as scripts/bench_step.py runs them), checkpointed, one 480p frame (S = 1560): output and every
    gradient within bf16 tolerance of diffusers' — measured against diffusers' own distance from fp32. "+keep":
    every block keeps its self-attention (the (b) columns' setting), here through SDPA's CUDA kernel ops."""
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
               out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=2)
    ref32, ours = make_pair(cfg)
    ref32, ours = ref32.cuda(), ours.cuda()
    g = torch.Generator().manual_seed(5)
    x, ctx = torch.randn(2, 16, 1, 60, 104, generator=g).cuda(), torch.randn(2, 512, 4096, generator=g).cuda()
    t = torch.tensor([37.5, 912.0]).cuda()
    w = torch.randn(2, 16, 1, 60, 104, generator=g).cuda()

    def run(model, diffusers, dtype):
        model.zero_grad()
        args = (x.to(dtype), t, ctx.to(dtype))
        out = ref_forward(model, *args) if diffusers else model(*args)
        (out.float() * w).sum().backward()
        return out.float(), {n: p.grad.float() for n, p in model.named_parameters()}

    y32, g32 = run(ref32, True, torch.float32)  # the fp32 truth
    import copy
    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    ref16.enable_gradient_checkpointing()
    yr, gr_ = run(ref16, True, torch.bfloat16)
    ours._cast_params(torch.bfloat16)
    ours.set_activation_checkpointing(True, keep_attention=2 if glue.endswith("+keep") else 0)
    ours.glue_backend = glue.split("+")[0]
    ours.offload_checkpoints = "+offload" in glue  # block inputs through pinned host memory and back
    yo, go = run(ours, False, torch.bfloat16)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(yo, yr) <= 2e-2 and rel(yo, y32) <= 1.5 * rel(yr, y32) + 1e-3
    for n in g32:
        if g32[n].norm() == 0:
            continue
        assert rel(go[n], g32[n]) <= 1.5 * rel(gr_[n], g32[n]) + 2e-3, (n, rel(go[n], g32[n]), rel(gr_[n], g32[n]))


def test_fused_glue_model_equals_reference_model(monkeypatch):
    """glue_backend="triton" (the interpreter on CPU): the fused gated residual, the AdaLN feeding the q/k/v
    projections and the MLP without saving its output, attention over the q/k RMSNorm-RoPE saving q and k once (self-
    and cross-attention, whose LayerNorm runs as AdaLN) in every block give the reference model's output and
    parameter gradients."""
    import models.wan as wan
    import ops.gated_residual as gr

    if not gr._HAS_TRITON:
        pytest.skip("triton is not installed")
    calls = {"gated_residual": 0, "rope_attention": 0, "adaln_linear": 0, "adaln_gelu_ffn": 0}

    def spy(mod, name):
        real = getattr(mod, name)

        def wrapped(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        monkeypatch.setattr(mod, name, wrapped)

    spy(gr, "gated_residual")
    for name in ("rope_attention", "adaln_linear", "adaln_gelu_ffn"):
        spy(wan, name)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton compiles on CUDA, else interprets
    # fp32 throughout (matmuls are by default): a TF32 convolution rounds the two passes' (1e-7-apart)
    # inputs 1e-3 apart (seen on the H200)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = make_pair(TINY)[1].to(dev)
    x, t, ctx = (a.to(dev) for a in inputs(TINY, frames=3))
    outs, grads = {}, {}
    for backend in ("torch", "triton", "triton-saved"):  # saved: AdaLN outputs and rotated q/k saved, not remade
        model.glue_backend = model.adaln_backend = backend.split("-")[0]  # the AdaLN kernel too (auto: reference)
        for block in model.blocks:
            block.recompute_glue = not backend.endswith("saved")
        outs[backend] = model(x, t, ctx)
        grads[backend] = loss_and_grads(model, outs[backend])
        if backend == "triton":
            L = TINY["num_layers"]
            assert calls == {"gated_residual": 2 * L, "rope_attention": 2 * L, "adaln_linear": 2 * L,
                             "adaln_gelu_ffn": L}  # only the triton pass
    for block in model.blocks:
        block.recompute_glue = True
    for backend in ("triton", "triton-saved"):
        torch.testing.assert_close(outs[backend], outs["torch"], atol=1e-5, rtol=1e-5)
        for n, g in grads["torch"].items():
            torch.testing.assert_close(grads[backend][n], g, atol=1e-5, rtol=1e-4, msg=(backend, n))
    assert calls["rope_attention"] == 2 * L  # the saved pass ran none of the remaking functions
    with pytest.raises(ValueError, match="glue_backend"):
        model.glue_backend = "cuda"

    # the trainer's precision: fp32 master weights under bf16 autocast, every block recomputed — the fused glue is
    # no further from the fp32 truth than the reference glue under the same autocast
    model.set_activation_checkpointing(True)
    for backend in ("torch", "triton"):
        model.glue_backend = model.adaln_backend = backend
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = model(x, t, ctx)
        assert out.dtype == torch.bfloat16
        outs[backend + "16"], grads[backend + "16"] = out.float(), loss_and_grads(model, out.float())

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(outs["triton16"], outs["torch"]) <= 1.5 * rel(outs["torch16"], outs["torch"]) + 1e-3
    for n, g in grads["torch"].items():
        assert grads["triton16"][n].dtype == torch.float32, n  # fp32 master weights get fp32 gradients
        assert rel(grads["triton16"][n], g) <= 1.5 * rel(grads["torch16"][n], g) + 1e-3, n


def test_gated_tail_in_the_model(monkeypatch):
    """The block's tail as one op (ops/gated_ffn.py; every sequence counts as long here): the fused-glue model gives
    the reference model's output and gradients plainly, under torch.utils.checkpoint (whose recompute then stops
    after the MLP's W1·y), with offloaded inputs, and keeping a block's attention."""
    import models.wan as wan
    import ops.gated_ffn as gf
    import ops.gated_residual as gr

    if not gr._HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(gf, "GATED_TAIL_MIN_TOKENS", 1)
    calls, real = [], wan.adaln_gelu_ffn_gated
    monkeypatch.setattr(wan, "adaln_gelu_ffn_gated", lambda *a, **k: calls.append(gf.current_pass()) or real(*a, **k))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = make_pair(TINY)[1].to(dev)
    x, t, ctx = (a.to(dev) for a in inputs(TINY, frames=3))
    ref_out = model(x, t, ctx)
    ref = loss_and_grads(model, ref_out)
    model.glue_backend = model.adaln_backend = "triton"
    L = TINY["num_layers"]
    for k, j, offload in [(0, 0, False), (L, 0, False), (L, 0, True), (L, 1, False)]:
        model.set_activation_checkpointing(k, keep_attention=j)
        model.offload_checkpoints = offload
        calls.clear()
        out = model(x, t, ctx)
        grads = loss_and_grads(model, out)
        # each block's tail told which pass runs: the forward's (saves dropped), then backward's recompute
        assert calls == ([None] * L if not k else ["forward"] * L + ["recompute"] * L), (k, j, offload, calls)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        for n, g in ref.items():
            torch.testing.assert_close(grads[n], g, atol=1e-5, rtol=1e-4, msg=(k, j, offload, n))
    model.offload_checkpoints = False


def test_residual_gradients_summed_inside_the_norm_kernels(monkeypatch):
    """Under the fused glue no residual-stream gradient is summed by a separate add in backward: each of a block's
    three residuals hands its gradient to the fused norm's backward kernel (attention inputs through adaln_linear's
    alias, the tail inside its op). The reference model sums them with aten adds, which the counter sees."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import ops.gated_ffn as gf
    import ops.gated_residual as gr

    if not gr._HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(gf, "GATED_TAIL_MIN_TOKENS", 1)

    class Adds(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_) and isinstance(out, torch.Tensor):
                self.shapes.append(tuple(out.shape))
            return out

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = make_pair(TINY)[1].to(dev)
    x, t, ctx = (a.to(dev) for a in inputs(TINY, frames=3))
    stream = (x.shape[0], 3 * (x.shape[-2] // 2) * (x.shape[-1] // 2), TINY["num_attention_heads"]
              * TINY["attention_head_dim"])  # [B, N, D] of the residual stream
    counts = {}
    for glue in ("torch", "triton"):
        model.glue_backend = model.adaln_backend = glue
        out = model(x, t, ctx)
        with Adds() as adds:
            out.float().pow(2).sum().backward()
        counts[glue] = adds.shapes.count(stream)
    assert counts["torch"] >= 3 * TINY["num_layers"] and counts["triton"] == 0, counts


def test_lora_and_frozen_embedders_with_fused_glue_and_offload(monkeypatch):
    """LoRA (dropout on) with every fused path: the adapted FFN runs its modules (the fused MLP would skip the
    adapters), and offloaded checkpoints — whose block inputs do not require grad once the embedders are frozen —
    still give every adapter the plain model's gradient, with the forward's dropout mask redrawn in the recompute.
    On the GPU when there is one (Triton compiles there; on the CPU it interprets)."""
    import ops.gated_residual as gr
    from models.config import LoRAConfig
    from models.lora import apply_lora

    if not gr._HAS_TRITON:
        pytest.skip("triton is not installed")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # fp32 convolutions, as the reference's
    _, model = make_pair(TINY)
    apply_lora(model, LoRAConfig(rank=4, dropout=0.5))
    model.to(dev)
    with torch.no_grad():  # B starts at zero: make the adapters visible
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    x, t, ctx = (a.to(dev) for a in inputs(TINY, frames=3))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("ffn.net.0.proj.lora_B" in n for n in trainable) and not any("patch_embedding" in n for n in trainable)

    def run(glue, k, offload):
        model.glue_backend, model.offload_checkpoints = glue, offload
        model.set_activation_checkpointing(k)
        torch.manual_seed(3)  # the same dropout masks in every run
        out = model(x, t, ctx)
        model.zero_grad()
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dev)).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref_out, ref = run("torch", 0, False)
    for glue, k, offload in [("triton", 0, False), ("torch", 2, True), ("triton", 1, True)]:
        out, grads = run(glue, k, offload)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], atol=1e-5, rtol=1e-4, msg=f"{glue} k={k} {n}")

    model.glue_backend, model.offload_checkpoints = "torch", True
    model.set_activation_checkpointing(True)
    y = model(x, t, ctx).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        y.backward()
    with pytest.raises(TypeError, match="block count"):
        model.set_activation_checkpointing(1.5)


@pytest.mark.parametrize("glue", ["torch", "triton"])
def test_keep_attention_skips_attention_in_the_recompute(glue):
    """set_activation_checkpointing(k, keep_attention=j): the last j recomputed blocks save the self-attention's
    outputs, so it runs once for them (twice for the other recomputed blocks, and the cross-attention twice
    everywhere), with the same output and gradients —
    also under the fused glue, whose attention (ops/rope_attention.py) calls SDPA's kernels through their ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import ops.gated_residual as gr
    from models.layers import _attention_ops

    if glue == "triton" and (not gr._HAS_TRITON or torch.cuda.is_available()):
        pytest.skip("the fused glue on CPU tensors needs the interpreter, which a CUDA machine's tests do not set")

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in _attention_ops()
            return func(*args, **(kwargs or {}))

    _, model = make_pair(TINY)
    model.glue_backend = model.adaln_backend = glue
    x, t, ctx = inputs(TINY, frames=3)
    L = TINY["num_layers"]
    runs = {}
    configs = [(0, 0), (L, 0), (L, L), (L, 1)] if glue == "torch" else [(0, 0), (L, 1)]  # the interpreter is slow
    for k, j in configs:
        model.set_activation_checkpointing(k, keep_attention=j)
        with Count() as c:
            out = model(x, t, ctx)
            grads = loss_and_grads(model, out)
        runs[k, j] = (out, grads, c.n)
    per_pass = runs[0, 0][2]  # self- and cross-attention of every block, once
    assert per_pass == 2 * L
    expected = {(L, 0): 2 * per_pass,  # everything recomputed
                (L, L): per_pass + L,  # kept: no self-attention in the recompute (the cheap cross-attention reruns)
                (L, 1): 2 * per_pass - 1}  # one block's self-attention kept
    for key in configs[1:]:
        assert runs[key][2] == expected[key], key
        assert torch.equal(runs[key][0], runs[0, 0][0])
        for n, g in runs[0, 0][1].items():
            assert torch.equal(runs[key][1][n], g), (key, n)
    if glue != "torch":  # the fused glue's kept blocks offload their inputs too (models/offload.py's context_fn)
        from models.offload import HostStore

        model.offload_checkpoints = True
        model.set_activation_checkpointing(L, keep_attention=1)
        put, puts = HostStore.put, []
        HostStore.put = lambda self, x_: puts.append(1) or put(self, x_)
        try:
            with Count() as c:
                out = model(x, t, ctx)
                grads = loss_and_grads(model, out)
        finally:
            model.offload_checkpoints = False
            HostStore.put = put
        assert len(puts) == L  # every block's input in host memory, the kept one's too
        assert c.n == expected[L, 1] and torch.equal(out, runs[0, 0][0])
        for n, g in runs[0, 0][1].items():  # offload sums the text/modulation gradients per block in another order
            torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=n)
        return  # which blocks keep does not depend on the glue
    # which blocks: the last j of the k recomputed (backward frees their outputs before the peak at the first blocks)
    for k, j, kept in [(L, 1, [L - 1]), (L - 1, 1, [L - 2]), (L, L, list(range(L))), (L, 0, [])]:
        model.set_activation_checkpointing(k, keep_attention=j)
        assert [i for i in range(L) if model.keeps_attention(i)] == kept
    # and the model runs them so: attention ops per block, forward + recompute (a forward pre-hook marks the block)
    current = [None]
    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)) for i, b in enumerate(model.blocks)]

    class PerBlock(Count):
        def __init__(self):
            super().__init__()
            self.per = [0] * L

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in _attention_ops():
                self.per[current[0]] += 1
            return func(*args, **(kwargs or {}))

    from models.offload import HostStore

    put, puts = HostStore.put, []
    HostStore.put = lambda self, x_: puts.append(1) or put(self, x_)
    try:
        for offload in (False, True):  # offload: every recomputed block goes through models/offload.py
            model.offload_checkpoints = offload
            model.set_activation_checkpointing(L, keep_attention=1)
            puts.clear()
            with PerBlock() as c:
                loss_and_grads(model, model(x, t, ctx))
            assert c.per == [4] * (L - 1) + [3], (offload, c.per)  # self + cross, twice; the kept last block's self once
            assert len(puts) == (L if offload else 0)  # the kept block's input in host memory too
    finally:
        model.offload_checkpoints = False
        HostStore.put = put
        for h in hooks:
            h.remove()
    with pytest.raises(ValueError, match="keep_attention"):
        model.set_activation_checkpointing(1, keep_attention=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_holds_two_inputs_while_the_cpu_runs_ahead():
    """models/offload.py: backward holds the current block's input and the prefetched next one, however far the CPU
    queues ahead of the GPU (the GPU is held back by a sleep kernel, so every take() below is queued before the first
    copy runs). Eight 64 MiB inputs: a prefetch buffer whose free waits for the GPU would keep all eight alive."""
    from models.offload import HostStore

    dev = torch.device("cuda")
    n, mib = 8, 64
    xs = [torch.full((mib * 2**20 // 4,), float(i), device=dev) for i in range(n)]
    store = HostStore(dev)
    idx = [store.put(x) for x in xs]
    del xs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the inputs' frees that waited on the copy stream complete before the baseline
    torch.cuda.reset_peak_memory_stats()
    # active bytes, not allocated: a freed block still waiting on another stream's events counts as active (it
    # cannot be reused) but no longer as allocated — the old prefetch's buffers were exactly such blocks
    base = torch.cuda.memory_stats()["active_bytes.all.current"]
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: the loop below runs on the CPU long before
    sums = []
    for i in reversed(idx):
        x = store.take(i, dev)
        sums.append(x.sum())  # a use on the compute stream, then x is dropped
        del x
    torch.cuda.synchronize()
    assert [float(s) for s in sums] == [float(i) * mib * 2**20 / 4 for i in reversed(range(n))]
    extra = (torch.cuda.memory_stats()["active_bytes.all.peak"] - base) / 2**20
    assert extra <= 2 * mib + 1, f"{extra:.0f} MiB alive in backward: more than the current and the prefetched input"
