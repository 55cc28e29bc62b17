"""ops/qk_norm_rope.py: the fused q/k RMSNorm + RoPE against an fp64 reference (output, dx, dw) and against the
model's own path (models.layers RMSNorm then apply_rope) to rounding.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); the interpreter pays ~1 ms per program and
loop step, so the shapes are small but awkward: head_dim 12 (6 angles per head, not a power of two), 16 and 128,
1–3 heads (D/2 pairs that split into two segments or leave the second empty), odd N from real RoPE3D grids, a row
stride that is not D. On CUDA the same tests run natively; the tests marked gpu add Wan's D = 1536, determinism
and Inductor.
"""
import zlib

import pytest
import torch

from models.layers import RMSNorm, RoPE3D, apply_rope
from ops import qk_norm_rope as op
from ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_backward, qk_norm_rope_forward, qk_norm_rope_reference
from ops.triton_setup import HAS_TRITON, KernelConfig, sm_count
from tests.op_helpers import DEV, TOL, gpu, rel_err


pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def wan_rope(head_dim, grid):
    """(cos, sin) [f·h·w, head_dim/2] as WanTransformer builds them: bands t | h | w, h = w = 2·⌊head_dim/6⌋."""
    hw = 2 * (head_dim // 6)
    return RoPE3D((head_dim - 2 * hw, hw, hw))(*grid, DEV)


def ref64(x, w, cos, sin, eps=1e-6):
    """The function without intermediate roundings, in fp64."""
    x = x.double()
    n = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()
    n1, n2 = n.unflatten(-1, (-1, cos.shape[-1], 2)).unbind(-1)
    c, s = cos.double()[:, None], sin.double()[:, None]
    return torch.stack([n1 * c - n2 * s, n1 * s + n2 * c], dim=-1).flatten(-3)


def model_path(x, w, cos, sin, heads, eps=1e-6):
    """What WanAttention.forward does to q today: its RMSNorm module, unflatten to heads, apply_rope."""
    norm = RMSNorm(x.shape[-1], eps).to(DEV, w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        return apply_rope(norm(x).unflatten(-1, (heads, -1)), cos, sin).flatten(2)


def reference_grads(x, w, cos, sin, dy, eps=1e-6):
    """fp64: (y, rstd, dx, dw)."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y64 = ref64(x64, w64, cos, sin, eps)
    y64.backward(dy.double())
    rstd64 = torch.rsqrt(x64.detach().square().mean(-1) + eps)
    return y64.detach(), rstd64, x64.grad, w64.grad



def assert_equal_to_rounding(y, ref, min_exact):
    """y is ref up to the last bits' rounding, and mostly bit-for-bit. Half precision: within 2 ulps of each rotated
    pair's norm (a flip of the rounded RMSNorm output moves both members of a pair by up to an ulp of it); fp32: 8,
    for rstd's own last bits (another summation order) pass through to the output."""
    ulps = 8 if ref.dtype == torch.float32 else 2
    pair_norm = ref.float().unflatten(-1, (-1, 2)).norm(dim=-1, keepdim=True).expand(*ref.shape[:-1], -1, 2)
    bound = ulps * torch.finfo(ref.dtype).eps * pair_norm.flatten(-2) + torch.finfo(ref.dtype).tiny
    assert ((y.float() - ref.float()).abs() <= bound).all()
    assert (y == ref).float().mean().item() >= min_exact


def make_inputs(B, N, D, x_dtype, w_dtype, gen):
    x = (torch.randn(B, N, D, generator=gen) * 2 + 0.3).to(DEV, x_dtype)
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV, w_dtype)
    dy = torch.randn(B, N, D, generator=gen).to(DEV, x_dtype)
    return x, w, dy


# (heads, head_dim, RoPE grid (f, h, w), B, x dtype, weight dtype): every head count, head_dim, B and dtype,
# pairwise; N = f·h·w odd, never a multiple of the interpreter's 4-row tile; a half weight as a model cast to bf16 has
CASES = [
    (1, 12, (1, 3, 5), 2, torch.bfloat16, torch.float32), (2, 12, (3, 1, 3), 1, torch.float32, torch.float32),
    (3, 12, (1, 1, 7), 2, torch.float16, torch.float32), (1, 16, (3, 3, 1), 1, torch.float16, torch.float16),
    (2, 16, (1, 5, 3), 2, torch.bfloat16, torch.bfloat16), (3, 16, (3, 1, 1), 1, torch.float32, torch.float32),
    (1, 128, (1, 3, 3), 2, torch.float32, torch.bfloat16), (2, 128, (3, 3, 1), 1, torch.bfloat16, torch.float32),
    (3, 128, (5, 1, 3), 2, torch.float16, torch.float32), (3, 128, (1, 1, 1), 1, torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("heads,head_dim,grid,B,x_dtype,w_dtype", CASES,
                         ids=[f"H{c[0]}-Dh{c[1]}-N{c[2][0] * c[2][1] * c[2][2]}-B{c[3]}-{str(c[4])[6:]}-"
                              f"w{str(c[5])[6:]}" for c in CASES])
def test_matches_fp64_reference(heads, head_dim, grid, B, x_dtype, w_dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{heads}{head_dim}{grid}{B}".encode()))
    cos, sin = wan_rope(head_dim, grid)
    N, D = cos.shape[0], heads * head_dim
    x, w, dy = make_inputs(B, N, D, x_dtype, w_dtype, gen)
    y64, rstd64, dx64, dw64 = reference_grads(x, w, cos, sin, dy)

    # the launchers: every output in its input's dtype and shape
    y, rstd = qk_norm_rope_forward(x, w, cos, sin)
    assert (y.dtype, y.shape, rstd.dtype, rstd.shape) == (x_dtype, x.shape, torch.float32, (B, N))
    assert y.is_contiguous()
    dx, dw = qk_norm_rope_backward(dy, x, w, cos, sin, rstd)
    assert (dx.dtype, dx.shape, dw.dtype, dw.shape) == (x_dtype, x.shape, w_dtype, w.shape)
    assert rel_err(rstd, rstd64) < 1e-6
    assert rel_err(y, y64) < TOL[x_dtype]
    assert rel_err(dx, dx64) < TOL[x_dtype]
    assert rel_err(dw, dw64) < TOL[w_dtype]

    # the public op through autograd gives the launchers' numbers
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_op = qk_norm_rope(x_leaf, w_leaf, cos, sin, backend="triton")
    y_op.backward(dy)
    assert torch.equal(y_op, y)
    assert torch.equal(x_leaf.grad, dx) and torch.equal(w_leaf.grad, dw)


def low_rms_x(B, N, D, x_dtype, gen):
    """Rows whose mean square is at or below eps next to ordinary ones, cycling by row: zero (mean square 0),
    ≈ 1e-7 and ≈ 1e-9, and ≈ 1. With eps moved outside the square root these rows differ by orders of magnitude
    (or are inf/nan); with eps = 1e-2 the ordinary rows differ by 0.5 %."""
    x = torch.randn(B * N, D, generator=gen) * torch.tensor([0.0, 3.2e-4, 3.2e-5, 1.0]).repeat(B * N)[:B * N, None]
    return x.view(B, N, D).to(DEV, x_dtype)


def check_low_rms(heads, head_dim, grid, B, x_dtype, eps, gen):
    """Launchers and public op at this eps against fp64: rstd, output, dx over all rows and the low rows alone, dw."""
    cos, sin = wan_rope(head_dim, grid)
    N, D = cos.shape[0], heads * head_dim
    x = low_rms_x(B, N, D, x_dtype, gen)
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV)
    dy = torch.randn(B, N, D, generator=gen).to(DEV, x_dtype)
    y64, rstd64, dx64, dw64 = reference_grads(x, w, cos, sin, dy, eps)
    y, rstd = qk_norm_rope_forward(x, w, cos, sin, eps)
    dx, dw = qk_norm_rope_backward(dy, x, w, cos, sin, rstd)
    assert rel_err(rstd, rstd64) < 1e-6
    kind = torch.arange(B * N, device=DEV).view(B, N) % 4
    low = kind < 3
    assert (y[kind == 0] == 0).all()  # a zero row stays zero
    for got, ref in ((y, y64), (dx, dx64)):
        assert rel_err(got, ref) < TOL[x_dtype]
        assert rel_err(got[low], ref[low]) < TOL[x_dtype]
    assert rel_err(dw, dw64) < TOL[torch.float32]
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_op = qk_norm_rope(x_leaf, w_leaf, cos, sin, eps=eps, backend="triton")
    y_op.backward(dy)
    assert torch.equal(y_op, y) and torch.equal(x_leaf.grad, dx) and torch.equal(w_leaf.grad, dw)


@pytest.mark.parametrize("x_dtype,eps", [(torch.float32, 1e-6), (torch.bfloat16, 1e-6), (torch.float32, 1e-2)])
@pytest.mark.slow
def test_rows_with_mean_square_at_or_below_eps(x_dtype, eps):
    """rstd = 1 / sqrt(mean(x²) + eps): where mean(x²) ≤ eps the placement of eps decides the output and dx."""
    check_low_rms(2, 12, (1, 3, 5), 2, x_dtype, eps, torch.Generator().manual_seed(int(1 / eps) + x_dtype.itemsize))


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_equals_model_path(x_dtype):
    """The op is the function WanAttention computes today: to rounding against RMSNorm + apply_rope (bit-for-bit for
    nearly every element in half precision, where leaving out the rounded RMSNorm output would change ~18 %), and
    backend="torch" is bit-for-bit that path."""
    heads, head_dim = 3, 128
    cos, sin = wan_rope(head_dim, (3, 3, 3))
    gen = torch.Generator().manual_seed(11)
    x, w, _ = make_inputs(2, cos.shape[0], heads * head_dim, x_dtype, torch.float32, gen)
    ref = model_path(x, w, cos, sin, heads)
    assert torch.equal(qk_norm_rope(x, w, cos, sin, backend="torch"), ref)
    assert torch.equal(qk_norm_rope_reference(x, w, cos, sin), ref)
    y = qk_norm_rope(x, w, cos, sin, backend="triton")
    assert_equal_to_rounding(y, ref, min_exact=0.99 if x_dtype != torch.float32 else 0.5)


@pytest.mark.slow
def test_strided_x_and_launch_shapes():
    """x as the q slice of a fused qkv projection (row stride 3·D, read in place) and as a view with a strided last
    dim (copied); other launch shapes — several programs per sample so that dw sums several partial rows, a span
    ending in a partial tile, one masked tile per row instead of two segments, a pipelined loop — agree."""
    heads, head_dim, B = 3, 16, 2
    cos, sin = wan_rope(head_dim, (3, 5, 1))
    N, D = cos.shape[0], heads * head_dim
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, N, 3 * D, generator=gen).to(DEV, torch.bfloat16)
    x = qkv[..., :D]
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV)
    dy = torch.randn(B, N, D, generator=gen).to(DEV, torch.bfloat16)
    y64, _, dx64, dw64 = reference_grads(x, w, cos, sin, dy)
    ref = model_path(x, w, cos, sin, heads)
    cfg = KernelConfig(rows=2, num_warps=4, programs_per_sm=6 * sm_count(DEV), split=False, num_stages=2)
    y, rstd = qk_norm_rope_forward(x, w, cos, sin, config=cfg)
    y2, rstd2 = qk_norm_rope_forward(x, w, cos, sin)
    assert_equal_to_rounding(y, ref, min_exact=0.99)
    assert_equal_to_rounding(y2, ref, min_exact=0.99)
    assert torch.allclose(rstd, rstd2, rtol=1e-6)
    # two power-of-two segments a row (24 pairs = 16 + 8), as the tuned GPU shapes at D = 1536 and 5120 run
    split = KernelConfig(rows=2, num_warps=4, programs_per_sm=2, split=True)
    y3, rstd3 = qk_norm_rope_forward(x, w, cos, sin, config=split)
    assert_equal_to_rounding(y3, ref, min_exact=0.99)
    for got in (qk_norm_rope_backward(dy, x, w, cos, sin, rstd, config=cfg),
                qk_norm_rope_backward(dy, x, w, cos, sin, rstd2),
                qk_norm_rope_backward(dy, x, w, cos, sin, rstd3, config=split)):
        assert rel_err(got[0], dx64) < TOL[torch.bfloat16]
        assert rel_err(got[1], dw64) < TOL[torch.float32]

    xt = qkv[..., :D].transpose(0, 1).contiguous().transpose(0, 1)  # samples interleaved: batch stride D
    x_odd = torch.randn(B, D, N, generator=gen).to(DEV, torch.bfloat16).transpose(1, 2)  # last dim strided
    for xs in (xt, x_odd):
        assert_equal_to_rounding(qk_norm_rope(xs, w, cos, sin, backend="triton"),
                                 model_path(xs, w, cos, sin, heads), min_exact=0.99)


def test_no_rows_give_an_empty_output_and_zero_dw():
    """N = 0 (nothing to launch): empty y and dx, and dw exactly zero, not whatever memory held."""
    cos, sin = wan_rope(16, (3, 5, 1))
    w = (1 + 0.3 * torch.randn(48, generator=torch.Generator().manual_seed(2))).to(DEV)
    for _ in range(2):  # the second time on reused memory
        garbage = torch.full((4096,), float("nan"), device=DEV)
        del garbage
        x = torch.randn(2, 0, 48, device=DEV)
        y, rstd = qk_norm_rope_forward(x, w, cos[:0], sin[:0])
        dx, dw = qk_norm_rope_backward(torch.randn(2, 0, 48, device=DEV), x, w, cos[:0], sin[:0], rstd)
        assert y.shape == dx.shape == (2, 0, 48) and dw.shape == (48,)
        assert torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.slow
def test_checkpointing_and_opcheck():
    """The custom op recomputes under non-reentrant activation checkpointing, and torch.library.opcheck accepts its
    schema, fake implementation and autograd registration."""
    from torch.utils.checkpoint import checkpoint

    cos, sin = wan_rope(12, (1, 1, 5))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 24, generator=gen).to(DEV, torch.bfloat16).requires_grad_()
    w = (1 + 0.3 * torch.randn(24, generator=gen)).to(DEV).requires_grad_()

    def f(x, w):
        return qk_norm_rope(x, w, cos, sin, backend="triton").float().square().sum()

    grads = torch.autograd.grad(f(x, w), (x, w))
    grads_ckpt = torch.autograd.grad(checkpoint(f, x, w, use_reentrant=False), (x, w))
    for a, b in zip(grads, grads_ckpt):
        assert torch.equal(a, b)

    torch.library.opcheck(torch.ops.adaptiveload.qk_norm_rope_fwd.default, (x, w, cos, sin, 1e-6),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    y, rstd = qk_norm_rope_forward(x.detach(), w.detach(), cos, sin)
    torch.library.opcheck(torch.ops.adaptiveload.qk_norm_rope_bwd.default,
                          (torch.randn_like(y), x.detach(), w.detach(), cos, sin, rstd),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("compiler", ["aot_eager"] + (["inductor"] if DEV.type == "cuda" else []))
@pytest.mark.slow
def test_torch_compile_fullgraph(compiler):
    """Inside a compiled graph (fullgraph: the op must not break it) the op gives the eager op's output and grads."""
    heads, head_dim = (12, 128) if DEV.type == "cuda" else (2, 16)
    cos, sin = wan_rope(head_dim, (1, 1, 7))
    gen = torch.Generator().manual_seed(0)
    x, w, dy = make_inputs(1, 7, heads * head_dim, torch.bfloat16, torch.float32, gen)
    x, w = x.requires_grad_(), w.requires_grad_()

    def f(x, w, cos, sin):
        return qk_norm_rope(x, w, cos, sin, backend="triton")

    y = f(x, w, cos, sin)
    grads = torch.autograd.grad(y, (x, w), dy)
    y_c = torch.compile(f, fullgraph=True, backend=compiler)(x, w, cos, sin)
    grads_c = torch.autograd.grad(y_c, (x, w), dy)
    assert torch.equal(y, y_c)
    for a, b in zip(grads, grads_c):
        assert torch.equal(a, b)


def test_backends_and_errors(monkeypatch):
    cos, sin = wan_rope(12, (1, 1, 3))
    x = torch.randn(2, 3, 24, device=DEV)
    w = torch.ones(24, device=DEV)
    y_auto = qk_norm_rope(x, w, cos, sin)
    if DEV.type == "cpu":  # auto means the reference off CUDA
        assert torch.equal(y_auto, qk_norm_rope_reference(x, w, cos, sin))
    else:
        assert torch.equal(y_auto, qk_norm_rope(x, w, cos, sin, backend="triton"))
    with pytest.raises(ValueError, match="backend"):
        qk_norm_rope(x, w, cos, sin, backend="cuda")
    with pytest.raises(ValueError, match="cos"):
        qk_norm_rope(x, w, cos[:2], sin[:2], backend="triton")  # N differs
    with pytest.raises(ValueError, match="cos"):
        qk_norm_rope(x[..., :20], w[:20], cos, sin, backend="triton")  # D not a multiple of head_dim
    with pytest.raises(ValueError, match="weight"):
        qk_norm_rope(x, w[:12], cos, sin, backend="triton")
    with pytest.raises(ValueError, match="cos/sin"):
        qk_norm_rope(x, w, cos.clone().requires_grad_(), sin, backend="triton")
    x64 = x.double()
    assert torch.equal(qk_norm_rope(x64, w, cos, sin), qk_norm_rope_reference(x64, w, cos, sin))  # auto: reference
    monkeypatch.setattr(op, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="triton"):
        qk_norm_rope(x, w, cos, sin, backend="triton")
    assert torch.equal(qk_norm_rope(x, w, cos, sin, backend="torch"), qk_norm_rope_reference(x, w, cos, sin))


# ------------------------------------------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_gpu_rows_with_mean_square_at_or_below_eps(x_dtype, eps):
    """The compiled kernels at Wan's width (12 heads × 128) and tuned launch shapes."""
    check_low_rms(12, 128, (1, 30, 52), 2, x_dtype, eps, torch.Generator().manual_seed(3))


@gpu
@pytest.mark.gpu
def test_gpu_auto_takes_triton_only_where_the_angles_fit():
    """backend="auto" picks the kernel for CUDA tensors whose cos/sin have one row per token and D/2 angles per head
    pair; otherwise the reference (which then refuses the mismatch itself)."""
    cos, sin = wan_rope(128, (1, 3, 52))
    N = cos.shape[0]
    x = torch.randn(1, N, 12 * 128, device=DEV, dtype=torch.bfloat16)
    w = torch.ones(12 * 128, device=DEV)
    assert op.triton_supported(x, w, cos, sin)
    assert not op.triton_supported(x, w, cos[:-1], sin[:-1])  # one token short
    assert not op.triton_supported(x[..., :100], w[:100], cos, sin)  # D not a whole number of heads
    assert not op.triton_supported(x.float().cpu(), w.cpu(), cos.cpu(), sin.cpu())  # not on CUDA


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 2])
def test_gpu_wan_size_deterministic(B):
    """Wan 1.3B's q: 12 heads × 128, one 480p latent frame (30 × 52 tokens), bf16 — against fp64, against the model
    path to rounding (CUDA's RMSNorm sums in another order: rstd's last bit may flip a rounding), bit-for-bit
    repeatable."""
    heads, head_dim = 12, 128
    cos, sin = wan_rope(head_dim, (1, 30, 52))
    gen = torch.Generator().manual_seed(B)
    x, w, dy = make_inputs(B, cos.shape[0], heads * head_dim, torch.bfloat16, torch.float32, gen)
    y64, _, dx64, dw64 = reference_grads(x, w, cos, sin, dy)
    y, rstd = qk_norm_rope_forward(x, w, cos, sin)
    runs = [qk_norm_rope_backward(dy, x, w, cos, sin, rstd) for _ in range(2)]
    for a, b in zip(*runs):  # no atomics: bit-for-bit the same
        assert torch.equal(a, b)
    assert rel_err(y, y64) < TOL[torch.bfloat16]
    assert rel_err(runs[0][0], dx64) < TOL[torch.bfloat16] and rel_err(runs[0][1], dw64) < TOL[torch.float32]
    assert_equal_to_rounding(y, model_path(x, w, cos, sin, heads), min_exact=0.99)
