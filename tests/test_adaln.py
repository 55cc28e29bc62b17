"""ops/adaln.py: the fused kernels against an fp64 reference, output and every gradient.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it when CUDA is absent); the interpreter
pays ~1 ms per program and loop step, so the shapes are small but awkward: odd D, N not a multiple of the row tile,
several programs per sample, chunk views of a modulation table. On CUDA the same tests run natively, and the tests
marked gpu add model-sized rows, determinism and torch.compile.
"""
import zlib

import pytest
import torch

from ops import adaln
from ops.adaln import adaln_backward, adaln_forward, adaln_modulate, adaln_reference
from ops.triton_setup import HAS_TRITON, KernelConfig, nearest_tuned, sm_count
from tests.op_helpers import DEV, TOL, gpu, rel_err

HALF = {torch.float32: torch.bfloat16, torch.float16: torch.float16, torch.bfloat16: torch.bfloat16}

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def ref64(x, scale, shift, eps=1e-6):
    x = x.double()
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * (1 + scale.double()) + shift.double()



TABLE_SHAPE = {  # the leaf each kind's scale/shift are views of, as diffusers hands them over
    "sample": lambda B, N, D: (B, 6, D),   # Wan 2.1: (table + temb).chunk(6, dim=1) → [B, 1, D], stride 6·D
    "token": lambda B, N, D: (B, N, 6, D),  # Wan 2.2 TI2V: chunk(6, dim=2), squeezed → [B, N, D], stride 6·D
    "bcast": lambda B, N, D: (1, 2, D),     # the output head: one [1, 1, D] modulation for every sample
    "mixed": lambda B, N, D: (B, D, N + 1),  # transposed: per-token scale, per-sample shift, feature stride N+1
    "dstride": lambda B, N, D: (1, N, D, 3),  # features at stride 3, one per-token modulation shared over B
}


def views(kind, table):
    """(scale, shift) as views of the table: read by stride, never copied."""
    if kind in ("sample", "bcast"):
        return table[:, 1:2], table[:, 0:1]
    if kind == "token":
        return tuple(c.squeeze(2) for c in table.chunk(6, dim=2)[:2])
    if kind == "mixed":
        return table.transpose(1, 2)[:, 1:], table.transpose(1, 2)[:, :1]
    return table[..., 0], table[..., 2]


def modulation(kind, B, N, D, dtype, gen):
    table = (0.5 * torch.randn(*TABLE_SHAPE[kind](B, N, D), generator=gen)).to(DEV, dtype)
    return (table, *views(kind, table))


def reference_grads(x, table, kind, dy):
    """fp64: (y, dx, dscale, dshift, dtable)."""
    x64 = x.detach().double().requires_grad_()
    t64 = table.detach().double().requires_grad_()
    s64, h64 = views(kind, t64)
    s64.retain_grad()
    h64.retain_grad()
    y64 = ref64(x64, s64, h64)
    y64.backward(dy.double())
    return y64.detach(), x64.grad, s64.grad, h64.grad, t64.grad


# (kind, D, B, N, x dtype, modulation half?) — every D, B, dtype and kind, pairwise; N never a multiple of rows=4
CASES = [
    ("sample", 37, 3, 13, torch.bfloat16, False), ("sample", 64, 1, 13, torch.float32, False),
    ("sample", 200, 3, 9, torch.float16, True), ("sample", 384, 1, 21, torch.bfloat16, True),
    ("token", 37, 1, 13, torch.float32, True), ("token", 64, 3, 13, torch.bfloat16, False),
    ("token", 200, 1, 10, torch.bfloat16, True), ("token", 384, 3, 7, torch.float16, False),
    ("bcast", 37, 3, 13, torch.float16, False), ("bcast", 64, 3, 9, torch.bfloat16, True),
    ("bcast", 200, 1, 13, torch.float32, False), ("bcast", 384, 3, 5, torch.bfloat16, False),
    ("mixed", 200, 3, 11, torch.bfloat16, False), ("dstride", 64, 3, 9, torch.float32, False),
]


@pytest.mark.parametrize("kind,D,B,N,x_dtype,half_mod", CASES,
                         ids=[f"{c[0]}-D{c[1]}-B{c[2]}-N{c[3]}-{str(c[4])[6:]}-{'half' if c[5] else 'fp32'}mod"
                              for c in CASES])
def test_matches_fp64_reference(kind, D, B, N, x_dtype, half_mod):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}{D}{B}{N}".encode()))
    mod_dtype = HALF[x_dtype] if half_mod else torch.float32
    x = (torch.randn(B, N, D, generator=gen) * 2 + 0.5).to(DEV, x_dtype)
    table, scale, shift = modulation(kind, B, N, D, mod_dtype, gen)
    dy = torch.randn(B, N, D, generator=gen).to(DEV, x_dtype)
    y64, dx64, ds64, dh64, dt64 = reference_grads(x, table, kind, dy)

    # the launchers: every output in its input's dtype and shape
    y, mean, rstd = adaln_forward(x, scale, shift)
    assert (y.dtype, y.shape, mean.dtype, mean.shape) == (x_dtype, x.shape, torch.float32, (B, N))
    dx, ds, dh = adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype)
    assert (dx.dtype, dx.shape) == (x_dtype, x.shape)
    assert (ds.dtype, ds.shape, dh.dtype, dh.shape) == (mod_dtype, scale.shape, mod_dtype, shift.shape)
    assert rel_err(y, y64) < TOL[x_dtype]
    assert rel_err(dx, dx64) < TOL[x_dtype]
    assert rel_err(ds, ds64) < TOL[mod_dtype]
    assert rel_err(dh, dh64) < TOL[mod_dtype]

    # the public op through autograd, down to the table behind the views
    x_leaf = x.clone().requires_grad_()
    t_leaf = table.clone().requires_grad_()
    scale_v, shift_v = views(kind, t_leaf)
    y_op = adaln_modulate(x_leaf, scale_v, shift_v, backend="triton")
    y_op.backward(dy)
    assert torch.equal(y_op, y)
    assert torch.equal(x_leaf.grad, dx)
    assert t_leaf.grad.dtype == mod_dtype
    assert rel_err(t_leaf.grad, dt64) < TOL[mod_dtype]


def low_variance_x(B, N, D, x_dtype, gen):
    """Rows whose variance is at or below eps next to ordinary ones, cycling by row: constant (variance 0, at 0.75
    and −2: exactly representable, so x − μ is exactly 0), variance ≈ 1e-7 and ≈ 1e-9 around 0 (bf16 keeps such
    small values to 3 digits), and variance ≈ 1. With eps moved outside the square root these rows differ by
    orders of magnitude (or are inf/nan); with eps = 1e-2, even the variance-1 rows differ by 0.5 %."""
    rows = [torch.full((D,), 0.75), torch.full((D,), -2.0)]
    x = torch.empty(B, N, D)
    for i in range(B * N):
        kind = i % 5
        z = torch.randn(D, generator=gen)
        x.view(-1, D)[i] = rows[kind] if kind < 2 else (3.2e-4, 3.2e-5, 1.0)[kind - 2] * z
    return x.to(DEV, x_dtype)


def check_low_variance(kind, B, N, D, x_dtype, eps, gen):
    """The launchers and the public op at this eps against fp64: output and the gradients of x, scale and shift,
    over all rows and over the low-variance rows alone (so ordinary rows cannot hide them)."""
    x = low_variance_x(B, N, D, x_dtype, gen)
    table, scale, shift = modulation(kind, B, N, D, torch.float32, gen)
    dy = torch.randn(B, N, D, generator=gen).to(DEV, x_dtype)
    x64 = x.detach().double().requires_grad_()
    t64 = table.detach().double().requires_grad_()
    s64, h64 = views(kind, t64)
    s64.retain_grad()
    h64.retain_grad()
    y64 = ref64(x64, s64, h64, eps)
    y64.backward(dy.double())
    low = torch.arange(B * N, device=DEV).view(B, N) % 5 < 4

    y, mean, rstd = adaln_forward(x, scale, shift, eps)
    dx, ds, dh = adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype)
    assert torch.isfinite(rstd).all()
    torch.testing.assert_close(rstd.double(), 1 / (x.double().var(-1, unbiased=False) + eps).sqrt(), rtol=1e-4,
                               atol=0)
    for got, ref in ((y, y64), (dx, x64.grad)):
        assert rel_err(got, ref) < TOL[x_dtype]
        assert rel_err(got[low], ref[low]) < TOL[x_dtype]
    assert rel_err(ds, s64.grad) < TOL[torch.float32] and rel_err(dh, h64.grad) < TOL[torch.float32]

    x_leaf, t_leaf = x.clone().requires_grad_(), table.clone().requires_grad_()
    y_op = adaln_modulate(x_leaf, *views(kind, t_leaf), eps=eps, backend="triton")
    y_op.backward(dy)
    assert torch.equal(y_op, y) and torch.equal(x_leaf.grad, dx)
    assert rel_err(t_leaf.grad, t64.grad) < TOL[torch.float32]


@pytest.mark.parametrize("kind,D,x_dtype,eps", [("sample", 37, torch.float32, 1e-6), ("token", 64, torch.bfloat16, 1e-6),
                                                ("sample", 64, torch.float32, 1e-2), ("bcast", 37, torch.bfloat16, 1e-2)])
def test_rows_with_variance_at_or_below_eps(kind, D, x_dtype, eps):
    """rstd = 1 / sqrt(var + eps): where var ≤ eps the placement of eps decides the output and every gradient."""
    check_low_variance(kind, 2, 10, D, x_dtype, eps, torch.Generator().manual_seed(D + int(1 / eps)))


@pytest.mark.parametrize("kind", ["sample", "bcast", "mixed"])
@pytest.mark.slow
def test_dtile_variant_and_spans(kind):
    """The paper's D-tile reduction and other launch shapes (several programs per sample, a persistent span that
    ends in a partial tile, one masked tile per row instead of two segments, a pipelined loop) give the same."""
    B, N, D = 3, 13, 200
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(B, N, D, generator=gen).to(DEV, torch.bfloat16)
    table, scale, shift = modulation(kind, B, N, D, torch.float32, gen)
    dy = torch.randn(B, N, D, generator=gen).to(DEV, torch.bfloat16)
    _, dx64, ds64, dh64, _ = reference_grads(x, table, kind, dy)
    cfg = KernelConfig(rows=2, num_warps=4, programs_per_sm=9 * sm_count(DEV),  # 3 programs per sample
                       split=False, num_stages=2)
    y, mean, rstd = adaln_forward(x, scale, shift, config=KernelConfig(rows=2, num_warps=4, programs_per_sm=0,
                                                                       split=False))
    y2, mean2, rstd2 = adaln_forward(x, scale, shift)
    assert (y.float() - y2.float()).abs().max() <= 0.01 * y2.float().abs().max()  # summation order differs
    assert torch.allclose(mean, mean2, atol=1e-6) and torch.allclose(rstd, rstd2, rtol=1e-5)
    fused = adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype, config=cfg)
    dtile = adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype, dmod="dtile", config=cfg,
                           dtile_config=KernelConfig(rows=4, num_warps=4, programs_per_sm=6, block_d=64))
    # one row tile per program: each sample's 13 rows split over 7 programs, each of which must stop at its span
    split = adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype, dmod="dtile", config=cfg,
                           dtile_config=KernelConfig(rows=2, num_warps=4, programs_per_sm=0, block_d=64))
    for got in (fused, dtile, split):
        assert rel_err(got[0], dx64) < TOL[torch.bfloat16]
        assert rel_err(got[1], ds64) < TOL[torch.float32]
        assert rel_err(got[2], dh64) < TOL[torch.float32]
    assert torch.equal(fused[0], dtile[0])


def test_residual_gradient_added_in_the_dx_pass():
    """dres (a residual's gradient around the norm) is added to dx before its one rounding: dx + dres against fp64,
    the modulation gradients untouched; a dres of another shape is refused."""
    B, N, D = 2, 11, 200
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(B, N, D, generator=gen).to(DEV, torch.bfloat16)
    table, scale, shift = modulation("sample", B, N, D, torch.float32, gen)
    dy = torch.randn(B, N, D, generator=gen).to(DEV, torch.bfloat16)
    dres = torch.randn(B, N, D, generator=gen).to(DEV, torch.bfloat16)
    _, dx64, ds64, dh64, _ = reference_grads(x, table, "sample", dy)
    _, mean, rstd = adaln_forward(x, scale, shift)
    dx, ds, dh = adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype, dres=dres)
    plain = adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype)
    assert rel_err(dx, dx64 + dres.double()) < TOL[torch.bfloat16]
    assert not torch.equal(dx, plain[0])
    assert torch.equal(ds, plain[1]) and torch.equal(dh, plain[2])
    assert rel_err(ds, ds64) < TOL[torch.float32] and rel_err(dh, dh64) < TOL[torch.float32]
    with pytest.raises(ValueError, match="dres must have"):
        adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype, dres=dres[:, :5])


@pytest.mark.slow
def test_checkpointing_and_opcheck():
    """The custom op recomputes under non-reentrant activation checkpointing, and torch.library.opcheck accepts its
    schema, fake implementation and autograd registration."""
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 40, generator=gen).to(DEV, torch.bfloat16).requires_grad_()
    table = torch.randn(2, 6, 40, generator=gen).to(DEV).requires_grad_()

    def f(x, table):
        return adaln_modulate(x, table[:, 1:2], table[:, 0:1], backend="triton").float().square().sum()

    grads = torch.autograd.grad(f(x, table), (x, table))
    grads_ckpt = torch.autograd.grad(checkpoint(f, x, table, use_reentrant=False), (x, table))
    for a, b in zip(grads, grads_ckpt):
        assert torch.equal(a, b)

    scale, shift = table[:, 1:2].detach().requires_grad_(), table[:, 0:1].detach().requires_grad_()
    torch.library.opcheck(torch.ops.adaptiveload.adaln_fwd.default, (x, scale, shift, 1e-6),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    y, mean, rstd = adaln_forward(x.detach(), scale.detach(), shift.detach())
    torch.library.opcheck(torch.ops.adaptiveload.adaln_bwd.default,
                          (torch.randn_like(y), x.detach(), scale.detach(), mean, rstd, [2, 1, 40], torch.float32),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("compiler", ["aot_eager"] + (["inductor"] if DEV.type == "cuda" else []))
@pytest.mark.slow
def test_torch_compile_fullgraph(compiler):
    """Inside a compiled graph (fullgraph: the op must not break it) the op gives the eager op's output and grads,
    at B=1 where compiling the reference fails on the [1, 1, D] gradient. Inductor only on CUDA (20 s on CPU)."""
    D = 1536 if DEV.type == "cuda" else 40
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 7, D, generator=gen).to(DEV, torch.bfloat16).requires_grad_()
    table = torch.randn(1, 6, D, generator=gen).to(DEV).requires_grad_()
    dy = torch.randn(1, 7, D, generator=gen).to(DEV, torch.bfloat16)

    def f(x, table):
        scale, shift = table.chunk(6, dim=1)[:2]
        return adaln_modulate(x, scale, shift, backend="triton")

    y = f(x, table)
    grads = torch.autograd.grad(y, (x, table), dy)
    y_c = torch.compile(f, fullgraph=True, backend=compiler)(x, table)
    grads_c = torch.autograd.grad(y_c, (x, table), dy)
    assert torch.equal(y, y_c)
    for a, b in zip(grads, grads_c):
        assert torch.equal(a, b)


def test_backends_and_errors(monkeypatch):
    x = torch.randn(2, 3, 8, device=DEV)
    scale, shift = torch.randn(2, 1, 8, device=DEV), torch.randn(1, 1, 8, device=DEV)
    y_auto = adaln_modulate(x, scale, shift)
    if DEV.type == "cpu":  # auto means the reference off CUDA
        assert torch.equal(y_auto, adaln_reference(x, scale, shift))
    else:
        assert torch.equal(y_auto, adaln_modulate(x, scale, shift, backend="triton"))
    with pytest.raises(ValueError, match="backend"):
        adaln_modulate(x, scale, shift, backend="cuda")
    with pytest.raises(ValueError, match="scale"):
        adaln_modulate(x, torch.randn(2, 2, 8, device=DEV), shift, backend="triton")
    with pytest.raises(ValueError, match="dmod"):
        adaln_backward(x, x, scale, x[..., 0], x[..., 0], shift.shape, shift.dtype, dmod="atomic")
    x64 = x.double()
    assert torch.equal(adaln_modulate(x64, scale, shift), adaln_reference(x64, scale, shift))  # auto: reference
    monkeypatch.setattr(adaln, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="triton"):
        adaln_modulate(x, scale, shift, backend="triton")
    assert torch.equal(adaln_modulate(x, scale, shift, backend="torch"), adaln_reference(x, scale, shift))


# ------------------------------------------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("D", [200, 1536, 5120])
@pytest.mark.parametrize("kind", ["sample", "token"])
def test_gpu_model_sizes_deterministic(kind, D):
    B, N = 2, 1000
    gen = torch.Generator().manual_seed(D)
    x = (torch.randn(B, N, D, generator=gen) * 3 + 1).to(DEV, torch.bfloat16)
    table, scale, shift = modulation(kind, B, N, D, torch.float32, gen)
    dy = torch.randn(B, N, D, generator=gen).to(DEV, torch.bfloat16)
    y64, dx64, ds64, dh64, _ = reference_grads(x, table, kind, dy)
    y, mean, rstd = adaln_forward(x, scale, shift)
    runs = [adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype) for _ in range(2)]
    for a, b in zip(*runs):  # no atomics: bit-for-bit the same
        assert torch.equal(a, b)
    dx, ds, dh = runs[0]
    assert rel_err(y, y64) < TOL[torch.bfloat16] and rel_err(dx, dx64) < TOL[torch.bfloat16]
    assert rel_err(ds, ds64) < TOL[torch.float32] and rel_err(dh, dh64) < TOL[torch.float32]
    if kind == "sample":
        dtile = adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype, dmod="dtile")
        assert rel_err(dtile[1], ds64) < TOL[torch.float32] and rel_err(dtile[2], dh64) < TOL[torch.float32]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
@pytest.mark.parametrize("kind,D", [("sample", 1536), ("token", 1536), ("sample", 5120)])
def test_gpu_rows_with_variance_at_or_below_eps(kind, D, eps):
    """The compiled kernels at model widths, tuned launch shapes included, on rows of variance 0, 1e-7, 1e-9, 1."""
    for x_dtype in (torch.bfloat16, torch.float32):
        check_low_variance(kind, 2, 250, D, x_dtype, eps, torch.Generator().manual_seed(D))


def test_launch_config_from_the_nearest_tuned_width():
    """On CUDA each op starts from its tuned entry at the nearest width (log scale): the entry itself at a tuned
    width, rows scaled by the power-of-two widths elsewhere (a pure function of numbers: runs on the CPU)."""
    import ops.adaln as adaln
    import ops.qk_norm_rope as qk

    cuda = torch.device("cuda")
    assert nearest_tuned({("a", 1): 1, ("a", 8): 2, ("b", 2): 3}, ("a",), 2) == (1, 1)  # |log2 2/1| < |log2 2/8|
    assert nearest_tuned({("a", 1): 1, ("a", 8): 2, ("b", 2): 3}, ("a",), 5) == (8, 2)
    for (kind, per_token, D), cfg in adaln.TUNED.items():
        assert adaln.default_config(kind, D, cuda, per_token) == cfg
    fwd = adaln.TUNED["fwd", False, 1536]
    assert adaln.default_config("fwd", 1024, cuda).rows == max(1, min(64, fwd.rows * 2048 // 1024))
    for (kind, D), cfg in qk.TUNED.items():
        assert qk.default_config(kind, D, cuda) == cfg
    for kind in ("fwd", "bwd"):  # an untuned width: the nearest entry, rows scaled by the power-of-two widths
        near = qk.TUNED[kind, 1536]
        assert qk.default_config(kind, 768, cuda).rows == max(1, min(64, near.rows * 2048 // 1024)) == 2 * near.rows
