"""model.attention_backend (ops/attention_backend.py): the kernel order per device, the one-line fallback, the choice
reaching every attention call of Wan and the MMDiT (counted at the aten op), and on a GPU every backend's output and
gradients against the math backend in fp32."""
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ops.attention_backend as ab
from models.config import ModelConfig
from models.layers import apply_attention_backend, cudnn_allowed
from models.mmdit import MMDiT
from models.wan import WanTransformer
from tests.op_helpers import gpu, rel_err

CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
WAN_TINY = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=8, freq_dim=8,
                ffn_dim=32, num_layers=2)
MMDIT_TINY = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=1,
                  num_single_layers=1, num_refiner_layers=1, mlp_ratio=2, patch_size=2, patch_size_t=1,
                  rope_axes_dim=(4, 4, 4), text_embed_dim=16, pooled_projection_dim=8, guidance_embeds=False)


class _Count(TorchDispatchMode):
    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _fresh_log_state():
    ab._seen.clear()
    ab._served.clear()
    yield


def _fake_gpu(monkeypatch, major):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    return torch.device("cuda")


def test_order_prefers_cudnn_from_hopper_and_never_hands_it_a_mask(monkeypatch):
    hopper = _fake_gpu(monkeypatch, 9)
    assert ab.order("auto", hopper) == ["cudnn", "flash", "efficient", "math"]
    assert ab.order("auto", hopper, masked=True) == ["flash", "efficient", "math"]
    assert ab.order("efficient", hopper) == ["efficient", "cudnn", "flash", "math"]
    assert ab.order("cudnn", hopper, masked=True)[0] == "flash"
    assert ab.order("auto", hopper, cudnn=False) == ["flash", "efficient", "math"]  # a caller keeping cuDNN out
    ampere = _fake_gpu(monkeypatch, 8)
    assert ab.order("auto", ampere) == ["flash", "cudnn", "efficient", "math"]
    cpu = torch.device("cpu")
    assert ab.order("auto", cpu) == ab.order("cudnn", cpu) == ["flash", "math"]
    assert ab.order("math", cpu) == ["math"]
    with pytest.raises(ValueError, match="model.attention_backend must be one of"):
        ab.order("fa3", cpu)


def _qkv(seed=0, B=2, H=2, N=24, L=24, D=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, requires_grad=True) for n in (N, L, L)]


def test_a_kernel_that_cannot_serve_falls_back_once_in_the_log_with_the_right_numbers(caplog):
    q, k, v = _qkv()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    with caplog.at_level(logging.WARNING, logger="ops.attention_backend"):
        outs = [ab.sdpa(q, k, v, backend="cudnn") for _ in range(2)]  # cuDNN has no CPU kernel
        ab.sdpa(*_qkv(1, N=40, L=40), backend="cudnn")  # another shape of the same kind: no second line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "asks for cudnn" in lines[0] and "flash serves" in lines[0], lines
    assert all(rel_err(o, ref) < 1e-6 for o in outs)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ops.attention_backend"):
        ab.sdpa(q, k, v, backend="auto")  # auto on a CPU: torch's own choice, nothing to say
        ab.sdpa(q, k, v, backend="flash")  # served as asked
    assert not caplog.records
    assert ab.kernel_for("math", q, k, v) == "math" and ab.kernel_for("flash", q, k, v) == "flash"


def _count_flash(model, *args, **kw):
    with _Count(CPU_FLASH) as mode:
        model(*args, **kw).float().square().mean().backward()
    return mode.calls


def test_the_choice_reaches_every_attention_call_of_wan_and_its_fused_blocks(wide_interpreter_tiles):
    from models.fused_wan import apply_fused_ops

    torch.manual_seed(0)
    model = WanTransformer(**WAN_TINY)
    x, t, ctx = torch.randn(2, 4, 3, 8, 8), torch.tensor([10.0, 900.0]), torch.randn(2, 6, 8)
    for fused in ("torch", "triton"):
        apply_fused_ops(model, fused)
        apply_attention_backend(model, "auto")
        # forward and backward's flash calls: self- and cross-attention in each of 2 blocks (the fused path saves
        # what its backward op needs; the reference's autograd does too)
        assert _count_flash(model, x, t, ctx) >= 4, fused
        apply_attention_backend(model, "math")
        assert _count_flash(model, x, t, ctx) == 0, fused
    assert {m.attention_backend for m in model.modules() if hasattr(type(m), "attention_backend")} == {"math"}


def test_the_choice_reaches_every_attention_call_of_the_mmdit():
    torch.manual_seed(0)
    model = MMDiT(**MMDIT_TINY)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 6, 10, generator=g)
    kw = dict(timestep=torch.tensor([37.5, 912.0]), encoder_hidden_states=torch.randn(2, 9, 16, generator=g),
              encoder_attention_mask=None, pooled_projections=torch.randn(2, 8, generator=g))
    apply_attention_backend(model, "auto")
    assert _count_flash(model, x, **kw) > 0
    apply_attention_backend(model, "math")
    assert _count_flash(model, x, **kw) == 0


def test_the_config_names_the_field_and_build_applies_it():
    with pytest.raises(ValueError, match="model.attention_backend must be one of"):
        ModelConfig(attention_backend="sage")
    from models.build import build_model

    model = build_model(ModelConfig(**WAN_TINY, attention_backend="efficient", text_len=6))
    kinds = {m.attention_backend for m in model.modules() if hasattr(type(m), "attention_backend")}
    assert kinds == {"efficient"} and model.attention_backend == "efficient"


# ------------------------------------------------------------------------------------------------------------ GPU
def _wan_case(dev):
    torch.manual_seed(0)
    cfg = dict(WAN_TINY, num_attention_heads=2, attention_head_dim=128, text_dim=32, ffn_dim=512)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 16, 20, generator=g).to(dev)   # 240 tokens a sample
    args = (x, torch.tensor([10.0, 900.0], device=dev), torch.randn(2, 77, 32, generator=g).to(dev))
    return WanTransformer(**cfg).to(dev), args, {}


def _mmdit_case(dev, lengths):
    torch.manual_seed(0)
    cfg = dict(MMDIT_TINY, attention_head_dim=128, rope_axes_dim=(16, 56, 56), text_embed_dim=32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 16, 20, generator=g).to(dev)
    mask = None if lengths is None else (torch.arange(20)[None] < torch.tensor(lengths)[:, None]).to(dev)
    kw = dict(timestep=torch.tensor([37.5, 912.0], device=dev), encoder_hidden_states=torch.randn(
        2, 20, 32, generator=g).to(dev), encoder_attention_mask=mask,
        pooled_projections=torch.randn(2, 8, generator=g).to(dev))
    return MMDiT(**cfg).to(dev), (x,), kw


def _run(model, args, kw, backend, bf16):
    apply_attention_backend(model, backend)
    model.zero_grad()
    with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
        y = model(*args, **kw)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.device)
    (y.float() * w).sum().backward()
    return y.float().detach(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


@gpu
@pytest.mark.parametrize("case", ["wan", "wan_fused", "mmdit", "mmdit_ragged"])
@pytest.mark.parametrize("backend", ["cudnn", "flash", "efficient"])
def test_every_backend_matches_the_math_backend_in_fp32(case, backend):
    """bf16 autocast under `backend` is within 3× bf16 math's own distance from fp32 math + 1e-2 (outputs and every
    gradient), and the kernel asked for is the kernel that serves a maskless call (the MMDiT's too: its padded text
    runs as key lengths), a masked one running the memory-efficient kernel (flash and cuDNN taking no mask here)."""
    from models.fused_wan import apply_fused_ops

    dev = torch.device("cuda")
    model, args, kw = _wan_case(dev) if case.startswith("wan") else _mmdit_case(
        dev, [20, 11] if case == "mmdit_ragged" else None)
    apply_fused_ops(model, "triton" if case == "wan_fused" else "torch")
    y64, g64 = _run(model, args, kw, "math", bf16=False)
    y_m, g_m = _run(model, args, kw, "math", bf16=True)
    y, g = _run(model, args, kw, backend, bf16=True)
    assert g.keys() == g64.keys()
    assert rel_err(y, y64) <= 3 * rel_err(y_m, y64) + 1e-2
    bad = {n: (rel_err(g[n], g64[n]), rel_err(g_m[n], g64[n])) for n in g64
           if not rel_err(g[n], g64[n]) <= 3 * rel_err(g_m[n], g64[n]) + 1e-2}
    assert not bad, bad
    q = torch.randn(2, 2, 240, 128, device=dev, dtype=torch.bfloat16)
    mmdit = case.startswith("mmdit")
    assert ab.kernel_for(backend, q, q, q, None, cudnn=cudnn_allowed("mmdit" if mmdit else "wan")) == backend
    # a boolean mask (the refiner's; the joint attention runs padded text as key lengths) takes efficient
    assert ab.kernel_for(backend, q, q, q, torch.ones(2, 1, 1, 240, dtype=torch.bool, device=dev)) == "efficient"


@gpu
def test_cudnn_is_handed_its_output_gradient_laid_out_as_its_output():
    """The MMDiT's single-stream block slices the attention's gradient out of a wider tensor (rows 5·D apart where
    the output's are D apart). sdpa() under cuDNN hands it on laid out as the output (GradLikeOutput): dq, dk, dv
    within bf16 rounding of fp32 math. Raw SDPA on the same gradient is printed beside it (whether this torch's
    cuDNN reads such a dO right: results/attention_h200.md)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    B, H, N, Dh = 2, 4, 300, 128  # B = 2: a batch stride read as O's would show too
    qkv = [torch.randn(B, N, H, Dh, device=dev, generator=g).transpose(1, 2) for _ in range(3)]
    wide = torch.randn(B, N, 5 * H * Dh, device=dev, generator=g)  # dO = wide[..., :H·Dh], as after a cat

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in qkv]
        o = fn(*leaves)
        # sliced after the cast: a cast of the slice would lay it out densely, as O, and test nothing
        dO = wide.to(dtype)[..., :H * Dh].unflatten(-1, (H, Dh)).transpose(1, 2)
        assert dO.stride() != o.stride()
        o.backward(dO)
        return [t.grad.float() for t in leaves]

    ref = grads(lambda q, k, v: ab.sdpa(q, k, v, backend="math"), torch.float32)
    ours = grads(lambda q, k, v: ab.sdpa(q, k, v, backend="cudnn"), torch.bfloat16)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
        raw = grads(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v), torch.bfloat16)
    print("cuDNN with a dO laid out unlike O, relative error of dq, dk, dv: raw SDPA",
          [round(rel_err(a, r), 4) for a, r in zip(raw, ref)], "sdpa()",
          [round(rel_err(a, r), 4) for a, r in zip(ours, ref)])
    assert all(rel_err(a, r) <= 2e-2 for a, r in zip(ours, ref))


def test_grad_like_output_lays_the_gradient_out_as_the_output():
    o = torch.randn(2, 5, 3, 4).transpose(1, 2).requires_grad_()  # [B, H, N, Dh] over BNHD memory
    wide = torch.randn(2, 5, 3 * 4 * 5)
    g = wide[..., :12].unflatten(-1, (3, 4)).transpose(1, 2)  # the same values, rows 60 apart, not 12
    seen = {}
    o.register_hook(lambda grad: seen.setdefault("g", grad))
    ab.GradLikeOutput.apply(o).backward(g)
    assert seen["g"].stride() == o.stride() != g.stride() and torch.equal(seen["g"], g)
    same = torch.randn(2, 5, 3, 4).transpose(1, 2)
    seen.clear()
    ab.GradLikeOutput.apply(o).backward(same)
    assert seen["g"].data_ptr() == same.data_ptr()  # no copy where the layouts agree
