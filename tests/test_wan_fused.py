"""Execution applied from outside the reference model (models/wan.py), against its plain forward on tiny configs: the
fused ops (models/fused_wan.py: apply_fused_ops, model.fused_ops), the AdaLN kernel (model.adaln_backend) and
activation checkpointing (models/checkpointing.py) with kept attention and offloaded inputs — outputs and every
gradient, with the same parameter objects and state-dict keys.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py); on a GPU they compile. The reference
model's own parity with diffusers, and the helpers used here: tests/test_wan_parity.py.
"""
import dataclasses

import pytest
import torch

import models.fused_wan as fused_wan
from models.checkpointing import attention_ops
from models.fused_wan import FusedWanAttention, FusedWanBlock, apply_fused_ops
from models.offload import HostStore
from models.wan import WanAttention, WanBlock, WanTransformer
from ops.triton_setup import HAS_TRITON
from tests.test_wan_parity import CONFIGS, TINY, inputs, loss_and_grads, make_pair

# the Triton interpreter runs whole models (minutes on a CPU), on wide tiles (conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("wide_interpreter_tiles")]


def test_apply_fused_ops_keeps_every_parameter_and_key_and_torch_is_the_reference():
    """apply_fused_ops swaps classes only: the same parameter objects under the same keys. Its "torch" — and "auto"
    on CPU tensors — is the reference forward bit for bit, output and every gradient; applied again it only changes
    the backend the blocks read."""
    _, ref = make_pair(TINY)
    _, model = make_pair(TINY)
    x, t, ctx = inputs(TINY, frames=3)
    y_ref = ref(x, t, ctx)
    g_ref = loss_and_grads(ref, y_ref)
    params, keys = dict(model.named_parameters()), list(model.state_dict())
    assert type(model.blocks[0]) is WanBlock and model.fused_ops == "torch"  # a bare model is the reference
    assert apply_fused_ops(model, "torch") is model
    for block in model.blocks:
        assert type(block) is FusedWanBlock
        assert type(block.attn1) is FusedWanAttention and type(block.attn2) is FusedWanAttention
    assert list(model.state_dict()) == keys and all(p is params[n] for n, p in model.named_parameters())
    for backend in ("torch", "auto"):
        model.fused_ops = backend
        assert model.fused_ops == backend and all(b.fused_ops == backend for b in model.blocks)
        y = model(x, t, ctx)
        g = loss_and_grads(model, y)
        assert torch.equal(y, y_ref), backend
        for n in g_ref:
            assert torch.equal(g[n], g_ref[n]), (backend, n)
    with pytest.raises(ValueError, match="fused_ops must be one of"):
        apply_fused_ops(model, "cuda")


def test_fused_ops_go_before_a_wrapper_that_replaces_the_block_class():
    """FSDP2's fully_shard swaps each block's class for a subclass (FSDP<Block>): a reference block wrapped so is
    refused (a class swap would undo the wrapper) unless the reference is asked for; a fused block wrapped after the
    fused ops still takes a new backend. The MMDiT has no fused blocks: it is left as it is."""
    from models.mmdit import MMDiT

    model = WanTransformer(**TINY)
    model.blocks[0].__class__ = type("FSDPWanBlock", (WanBlock,), {})
    with pytest.raises(ValueError, match="apply them first"):
        apply_fused_ops(model, "triton")
    assert type(model.blocks[1]) is WanBlock and type(model.blocks[1].attn1) is WanAttention  # nothing swapped
    apply_fused_ops(model, "torch")
    assert model.fused_ops == "torch" and type(model.blocks[1]) is WanBlock

    model = apply_fused_ops(WanTransformer(**TINY), "auto")
    model.blocks[0].__class__ = type("FSDPFusedWanBlock", (FusedWanBlock,), {})
    model.fused_ops = "triton"
    assert [b.fused_ops for b in model.blocks] == ["triton", "triton"]

    mmdit = MMDiT(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=1,
                  num_single_layers=1, num_refiner_layers=1, mlp_ratio=2, rope_axes_dim=(4, 4, 4), text_embed_dim=16,
                  pooled_projection_dim=8)
    types, keys = [type(m) for m in mmdit.modules()], list(mmdit.state_dict())
    mmdit.fused_ops = "auto"
    assert [type(m) for m in mmdit.modules()] == types and list(mmdit.state_dict()) == keys
    assert mmdit.fused_ops == "auto"


def test_build_model_applies_the_configured_fused_ops():
    from models.build import build_model
    from models.config import ModelConfig

    model = build_model(ModelConfig(**TINY, fused_ops="triton"))
    assert model.fused_ops == "triton" and all(type(b) is FusedWanBlock and b.fused_ops == "triton"
                                               for b in model.blocks)
    assert list(model.state_dict()) == list(WanTransformer(**TINY).state_dict())
    assert build_model(ModelConfig(**TINY)).fused_ops == "auto"  # the config default


def test_deprecated_names_still_work_for_one_release(monkeypatch):
    """model.glue_backend (config field and model attribute) and WanBlock.recompute_glue: each warns once (a
    FutureWarning) and maps to fused_ops / recompute_norms; a bad value is named under the name that was set."""
    import models.config as config
    from models.config import MMDiTConfig, ModelConfig

    monkeypatch.setattr(config, "_WARNED", set())
    with pytest.warns(FutureWarning, match="model.glue_backend"):
        cfg = ModelConfig(glue_backend="torch")
    assert (cfg.fused_ops, cfg.glue_backend) == ("torch", None)
    assert dataclasses.replace(cfg, pretrained=None).fused_ops == "torch"  # the alias is not read again
    with pytest.raises(ValueError, match="model.glue_backend"):
        ModelConfig(glue_backend="fused")
    with pytest.raises(ValueError, match="model.fused_ops"):
        ModelConfig(fused_ops="fused")
    with pytest.raises(ValueError, match="model.glue_backend=triton"):
        MMDiTConfig(glue_backend="triton")
    with pytest.raises(ValueError, match="model.fused_ops=triton"):
        MMDiTConfig(fused_ops="triton")
    model = WanTransformer(**TINY)
    with pytest.warns(FutureWarning, match="glue_backend"):
        model.glue_backend = "triton"
    assert model.fused_ops == "triton" and model.glue_backend == "triton"
    with pytest.warns(FutureWarning, match="recompute_glue"):
        model.blocks[0].recompute_glue = False
    assert model.blocks[0].recompute_norms is False and model.blocks[1].recompute_norms is True
    bare = WanTransformer(**TINY)  # the old name set on a reference block, before the fused ops are applied
    bare.blocks[1].recompute_glue = False
    monkeypatch.setattr(config, "_WARNED", set())
    with pytest.warns(FutureWarning, match="recompute_glue"):
        apply_fused_ops(bare, "torch")
    assert bare.blocks[1].recompute_norms is False and bare.blocks[0].recompute_norms is True


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
    if not HAS_TRITON:
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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_ops_model_equals_reference_model(monkeypatch, name):
    """fused_ops="triton" (the interpreter on CPU): the fused gated residual, the AdaLN feeding the q/k/v
    projections and the MLP without saving its output, attention over the q/k RMSNorm-RoPE saving q and k once (self-
    and cross-attention, whose LayerNorm runs as AdaLN where the block has one) in every block give the reference
    model's output and parameter gradients — with and without the cross-attention norm."""
    cfg = CONFIGS[name]
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    calls = {"gated_residual": 0, "rope_attention": 0, "adaln_linear": 0, "adaln_gelu_ffn": 0}

    def spy(mod, name):
        real = getattr(mod, name)

        def wrapped(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        monkeypatch.setattr(mod, name, wrapped)

    for name in ("gated_residual", "rope_attention", "adaln_linear", "adaln_gelu_ffn"):
        spy(fused_wan, name)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton compiles on CUDA, else interprets
    # fp32 throughout (matmuls are by default): a TF32 convolution rounds the two passes' (1e-7-apart)
    # inputs 1e-3 apart (seen on the H200)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = make_pair(cfg)[1].to(dev)
    x, t, ctx = (a.to(dev) for a in inputs(cfg, frames=4 if cfg["patch_size"][0] == 2 else 3))
    outs, grads = {}, {}
    for backend in ("torch", "triton", "triton-saved"):  # saved: AdaLN outputs and rotated q/k saved, not remade
        model.fused_ops = model.adaln_backend = backend.split("-")[0]  # the AdaLN kernel too (auto: reference)
        for block in model.blocks:
            block.recompute_norms = not backend.endswith("saved")
        outs[backend] = model(x, t, ctx)
        grads[backend] = loss_and_grads(model, outs[backend])
        if backend == "triton":
            L, norms = cfg["num_layers"], 2 if cfg.get("cross_attn_norm", True) else 1  # AdaLN-fused projections
            assert calls == {"gated_residual": 2 * L, "rope_attention": 2 * L, "adaln_linear": norms * L,
                             "adaln_gelu_ffn": L}  # only the triton pass
    for block in model.blocks:
        block.recompute_norms = True
    for backend in ("triton", "triton-saved"):
        torch.testing.assert_close(outs[backend], outs["torch"], atol=1e-5, rtol=1e-5)
        for n, g in grads["torch"].items():
            torch.testing.assert_close(grads[backend][n], g, atol=1e-5, rtol=1e-4, msg=(backend, n))
    assert calls["rope_attention"] == 2 * L  # the saved pass ran none of the remaking functions
    with pytest.raises(ValueError, match="fused_ops"):
        model.fused_ops = "cuda"

    # the trainer's precision: fp32 master weights under bf16 autocast, every block recomputed — the fused ops are
    # no further from the fp32 truth than the reference path under the same autocast
    model.set_activation_checkpointing(True)
    for backend in ("torch", "triton"):
        model.fused_ops = model.adaln_backend = backend
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
    """The block's tail as one op (ops/gated_ffn.py; every sequence counts as long here): the fused model gives
    the reference model's output and gradients plainly, under torch.utils.checkpoint (whose recompute then stops
    after the MLP's W1·y), with offloaded inputs, and keeping a block's attention."""
    import ops.gated_ffn as gf

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(gf, "GATED_TAIL_MIN_TOKENS", 1)
    calls, real = [], fused_wan.adaln_gelu_ffn_gated
    monkeypatch.setattr(fused_wan, "adaln_gelu_ffn_gated",
                        lambda *a, **k: calls.append(k["checkpoint_pass"]) or real(*a, **k))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = make_pair(TINY)[1].to(dev)
    x, t, ctx = (a.to(dev) for a in inputs(TINY, frames=3))
    ref_out = model(x, t, ctx)
    ref = loss_and_grads(model, ref_out)
    model.fused_ops = model.adaln_backend = "triton"
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
    """Under the fused ops no residual-stream gradient is summed by a separate add in backward: each of a block's
    three residuals hands its gradient to the fused norm's backward kernel (attention inputs through adaln_linear's
    alias, the tail inside its op). The reference model sums them with aten adds, which the counter sees."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import ops.gated_ffn as gf

    if not HAS_TRITON:
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
    for backend in ("torch", "triton"):
        model.fused_ops = model.adaln_backend = backend
        out = model(x, t, ctx)
        with Adds() as adds:
            out.float().pow(2).sum().backward()
        counts[backend] = adds.shapes.count(stream)
    assert counts["torch"] >= 3 * TINY["num_layers"] and counts["triton"] == 0, counts


def test_lora_and_frozen_embedders_with_fused_ops_and_offload(monkeypatch):
    """LoRA (dropout on) with every fused path: the adapted FFN runs its modules (the fused MLP would skip the
    adapters), and offloaded checkpoints — whose block inputs do not require grad once the embedders are frozen —
    still give every adapter the plain model's gradient, with the forward's dropout mask redrawn in the recompute.
    On the GPU when there is one (Triton compiles there; on the CPU it interprets)."""
    from models.config import LoRAConfig
    from models.lora import apply_lora

    if not HAS_TRITON:
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

    def run(backend, k, offload):
        model.fused_ops, model.offload_checkpoints = backend, offload
        model.set_activation_checkpointing(k)
        torch.manual_seed(3)  # the same dropout masks in every run
        out = model(x, t, ctx)
        model.zero_grad()
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(dev)).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref_out, ref = run("torch", 0, False)
    for backend, k, offload in [("triton", 0, False), ("torch", 2, True), ("triton", 1, True)]:
        out, grads = run(backend, k, offload)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], atol=1e-5, rtol=1e-4, msg=f"{backend} k={k} {n}")

    model.fused_ops, model.offload_checkpoints = "torch", True
    model.set_activation_checkpointing(True)
    y = model(x, t, ctx).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        y.backward()
    with pytest.raises(TypeError, match="block count"):
        model.set_activation_checkpointing(1.5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_keep_attention_skips_attention_in_the_recompute(backend):
    """set_activation_checkpointing(k, keep_attention=j): the last j recomputed blocks save the self-attention's
    outputs, so it runs once for them (twice for the other recomputed blocks, and the cross-attention twice
    everywhere), with the same output and gradients —
    also under the fused ops, whose attention (ops/rope_attention.py) calls SDPA's kernels through their ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if backend == "triton" and (not HAS_TRITON or torch.cuda.is_available()):
        pytest.skip("the fused ops on CPU tensors need the interpreter, which a CUDA machine's tests do not set")

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in attention_ops()
            return func(*args, **(kwargs or {}))

    _, model = make_pair(TINY)
    model.fused_ops = model.adaln_backend = backend
    x, t, ctx = inputs(TINY, frames=3)
    L = TINY["num_layers"]
    runs = {}
    configs = [(0, 0), (L, 0), (L, L), (L, 1)] if backend == "torch" else [(0, 0), (L, 1)]  # the interpreter is slow
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
    if backend != "torch":  # the fused ops' kept blocks offload their inputs too (models/offload.py's context_fn)
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
        return  # which blocks keep does not depend on the backend
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
            if func in attention_ops():
                self.per[current[0]] += 1
            return func(*args, **(kwargs or {}))

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
