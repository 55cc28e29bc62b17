"""ops/adaln_linear.py: AdaLN feeding linears / the GELU MLP with y recomputed in backward — output and every
gradient against fp64, bit for bit against the unfused Triton composition where the arithmetic is the same, under
autocast, and the saved bytes (x only, never y).

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); shapes are small and odd."""
import pytest
import torch
import torch.nn.functional as F

from ops.adaln import adaln_modulate, adaln_reference
from ops.adaln_linear import adaln_gelu_ffn, adaln_linear
from ops.gelu_ffn import gelu_ffn, gelu_ffn_reference
from ops.triton_setup import HAS_TRITON
from tests.op_helpers import DEV, fp64_leaves, grads_of, rel_err

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _t(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype).requires_grad_()


def _inputs(B, N, D, per_token=False, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = _t(g, B, N, D, dtype=dtype)
    T = N if per_token else 1
    scale, shift = _t(g, B, T, D, scale=0.3), _t(g, B, T, D, scale=0.3)  # fp32 modulation, as Wan's table
    return g, x, scale, shift


@pytest.mark.parametrize("per_token", [False, True])
def test_linears_match_fp64_and_the_unfused_kernels(per_token):
    B, N, D = 2, 37, 24
    g, x, scale, shift = _inputs(B, N, D, per_token)
    lin = [(_t(g, 16, D, scale=D ** -0.5), _t(g, 16)), (_t(g, 8, D, scale=D ** -0.5), None),
           (_t(g, D, D, scale=D ** -0.5), _t(g, D))]  # a bias-free one and odd widths
    leaves = [x, scale, shift, *[t for wb in lin for t in wb]]
    douts = [torch.randn(B, N, w.shape[0], generator=g).to(DEV) for w, _ in lin]

    outs = adaln_linear(x, scale, shift, 1e-6, lin, backend="triton")
    gr = grads_of(outs, leaves, douts)
    y = adaln_modulate(x, scale, shift, 1e-6, backend="triton")
    outs_u = [F.linear(y, w, b) for w, b in lin]
    gr_u = grads_of(outs_u, leaves, douts)
    l64 = fp64_leaves(leaves)
    x64, s64, h64, ws = l64[0], l64[1], l64[2], l64[3:]
    y64 = adaln_reference(x64, s64, h64, 1e-6)
    outs64 = [F.linear(y64, w, b) for w, b in zip(ws[::2], ws[1::2])]
    gr64 = grads_of(outs64, l64, [d.double() for d in douts])

    for o, o_u, o64 in zip(outs, outs_u, outs64):
        assert torch.equal(o, o_u)  # the same kernels in forward
        assert rel_err(o, o64) < 1e-5
    for i, (a, u, r) in enumerate(zip(gr, gr_u, gr64)):
        if r is None:  # the missing bias (a None leaf)
            continue
        assert rel_err(a, r) < 1e-5, i
        if i >= 3 and leaves[i].dim() == 2:
            assert torch.equal(a, u)  # dW = doutᵀ·y with y recomputed bit for bit


@pytest.mark.slow
def test_gelu_ffn_matches_fp64_and_the_unfused_kernels_chunked():
    B, N, D, Fh = 3, 29, 16, 40
    g, x, scale, shift = _inputs(B, N, D, seed=1)
    w1, b1 = _t(g, Fh, D, scale=D ** -0.5), _t(g, Fh)
    w2, b2 = _t(g, D, Fh, scale=Fh ** -0.5), _t(g, D)
    leaves = [x, scale, shift, w1, b1, w2, b2]
    dout = torch.randn(B, N, D, generator=g).to(DEV)
    for rows in (None, 20):  # one chunk, and 87 rows in chunks of 20 (the last short)
        out = adaln_gelu_ffn(x, scale, shift, 1e-6, w1, b1, w2, b2, backend="triton", rows_per_chunk=rows)
        gr = grads_of(out, leaves, dout)
        y = adaln_modulate(x, scale, shift, 1e-6, backend="triton")
        out_u = gelu_ffn(y, w1, b1, w2, b2, backend="triton", rows_per_chunk=rows)
        gr_u = grads_of(out_u, leaves, dout)
        assert torch.equal(out, out_u)
        assert torch.equal(gr[5], gr_u[5])  # dW2 from the recomputed y's MLP: the same bits
        l64 = fp64_leaves(leaves)
        out64 = gelu_ffn_reference(adaln_reference(*l64[:3], 1e-6), *l64[3:])
        gr64 = grads_of(out64, l64, dout.double())
        assert rel_err(out, out64) < 1e-5
        for i, (a, r) in enumerate(zip(gr, gr64)):
            assert rel_err(a, r) < 1e-5, (rows, i)


def _low_variance_x(B, N, D, g):
    """Rows of variance 0, ≈ 1e-7 and ≈ 1, cycling: at eps = 1e-2 the first two are all eps, the third 0.5 % of it."""
    x = torch.randn(B * N, D, generator=g) * torch.tensor([0.0, 3.2e-4, 1.0]).repeat(B * N)[:B * N, None]
    x[::3] += 0.75
    return x.view(B, N, D).to(DEV).requires_grad_()


def test_eps_reaches_the_norm_in_forward_and_in_the_recompute():
    """At eps = 1e-2, on rows whose variance is at or below it, both ops against fp64 at that eps: a norm that used
    another eps in forward, or remade y with another in backward, moves the output or the weights' gradients."""
    B, N, D, Fh, eps = 2, 15, 16, 24, 1e-2
    g = torch.Generator().manual_seed(5)
    x = _low_variance_x(B, N, D, g)
    scale, shift = _t(g, B, 1, D, scale=0.3), _t(g, B, 1, D, scale=0.3)
    w, b = _t(g, Fh, D, scale=D ** -0.5), _t(g, Fh)
    w1, b1, w2, b2 = _t(g, Fh, D, scale=D ** -0.5), _t(g, Fh), _t(g, D, Fh, scale=Fh ** -0.5), _t(g, D)
    for op, leaves, ref in (
            (lambda x, s, h, w, b: adaln_linear(x, s, h, eps, [(w, b)], backend="triton")[0],
             [x, scale, shift, w, b], lambda x, s, h, w, b: F.linear(adaln_reference(x, s, h, eps), w, b)),
            (lambda x, s, h, *p: adaln_gelu_ffn(x, s, h, eps, *p, backend="triton"),
             [x, scale, shift, w1, b1, w2, b2], lambda x, s, h, *p: gelu_ffn_reference(adaln_reference(x, s, h, eps),
                                                                                      *p))):
        out = op(*leaves)
        dout = torch.randn(out.shape, generator=g).to(DEV)
        gr = grads_of(out, leaves, dout)
        l64 = fp64_leaves(leaves)
        out64 = ref(*l64)
        gr64 = grads_of(out64, l64, dout.double())
        assert rel_err(out, out64) < 1e-5
        for i, (a, r) in enumerate(zip(gr, gr64)):
            assert rel_err(a, r) < 1e-5, i


@pytest.mark.parametrize("biases", [(True, False), (False, True)])
def test_gelu_ffn_with_one_bias(biases):
    """One of the MLP's two biases absent: each bias's presence reaches backward on its own (the present one gets
    its gradient, every other gradient against fp64)."""
    B, N, D, Fh = 2, 9, 16, 24
    g, x, scale, shift = _inputs(B, N, D, seed=6)
    w1, w2 = _t(g, Fh, D, scale=D ** -0.5), _t(g, D, Fh, scale=Fh ** -0.5)
    b1 = _t(g, Fh) if biases[0] else None
    b2 = _t(g, D) if biases[1] else None
    leaves = [x, scale, shift, w1, b1, w2, b2]
    dout = torch.randn(B, N, D, generator=g).to(DEV)
    gr = grads_of(adaln_gelu_ffn(x, scale, shift, 1e-6, w1, b1, w2, b2, backend="triton"), leaves, dout)
    l64 = fp64_leaves(leaves)
    gr64 = grads_of(gelu_ffn_reference(adaln_reference(*l64[:3], 1e-6), *l64[3:]), l64, dout.double())
    for i, (a, r) in enumerate(zip(gr, gr64)):
        assert (a is None) == (r is None), i
        if r is not None:
            assert rel_err(a, r) < 1e-5, i


def test_autocast_gives_fp32_master_grads_no_worse_than_eager():
    B, N, D = 1, 33, 32
    g, x, scale, shift = _inputs(B, N, D, seed=2)
    lin = [(_t(g, D, D, scale=D ** -0.5), _t(g, D)), (_t(g, D, D, scale=D ** -0.5), _t(g, D))]
    leaves = [x, scale, shift, *[t for wb in lin for t in wb]]
    douts = [torch.randn(B, N, D, generator=g).to(DEV) for _ in lin]
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        outs = adaln_linear(x, scale, shift, 1e-6, lin, backend="triton")
        gr = grads_of(outs, leaves, douts)
        y = adaln_reference(x, scale, shift, 1e-6)
        gr_e = grads_of([F.linear(y, w, b) for w, b in lin], leaves, douts)
    l64 = fp64_leaves(leaves)
    y64 = adaln_reference(*l64[:3], 1e-6)
    gr64 = grads_of([F.linear(y64, w, b) for w, b in zip(l64[3::2], l64[4::2])], l64, [d.double() for d in douts])
    assert all(o.dtype == torch.bfloat16 for o in outs)
    for a, e, r in zip(gr, gr_e, gr64):
        assert a.dtype == torch.float32
        assert rel_err(a, r) <= 1.5 * rel_err(e, r) + 1e-3
    with pytest.raises(ValueError, match="share a dtype"):
        adaln_linear(x, scale, shift, 1e-6, [(lin[0][0].detach().bfloat16(), None)], backend="triton")


def test_saves_x_not_y():
    """Saved for backward: x (and the stats, weights), never the normalised y — one [B, N, D] tensor fewer a call
    than the unfused path (which saves no shift), and for the MLP also one fewer than gelu_ffn on a saved y."""
    B, N, D, Fh = 2, 64, 16, 48
    g, x, scale, shift = _inputs(B, N, D, seed=3)
    lin = [(_t(g, D, D), _t(g, D)) for _ in range(3)]
    w1, b1, w2, b2 = _t(g, Fh, D), _t(g, Fh), _t(g, D, Fh), _t(g, D)

    def saved(fn):
        ptrs = {}
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: ptrs.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t,
                lambda t: t):
            out = fn()
        return sum(ptrs.values()), out

    y_bytes = B * N * D * 4 - shift.numel() * 4  # y gone; the (small) shift saved to remake it
    fused, _ = saved(lambda: adaln_linear(x, scale, shift, 1e-6, lin, backend="triton"))
    def unfused_linears():
        y = adaln_modulate(x, scale, shift, 1e-6, backend="triton")
        return [F.linear(y, w, b) for w, b in lin]

    unfused, _ = saved(unfused_linears)
    assert unfused - fused == y_bytes
    fused, _ = saved(lambda: adaln_gelu_ffn(x, scale, shift, 1e-6, w1, b1, w2, b2, backend="triton"))
    unfused, _ = saved(lambda: gelu_ffn(adaln_modulate(x, scale, shift, 1e-6, backend="triton"), w1, b1, w2, b2,
                                        backend="triton"))
    assert unfused - fused == y_bytes


def test_torch_backend_is_the_reference_and_frozen_weights_get_no_grad():
    g, x, scale, shift = _inputs(1, 9, 8, seed=4)
    w, b = _t(g, 8, 8), _t(g, 8)
    ref = F.linear(adaln_reference(x, scale, shift, 1e-6), w, b)
    assert torch.equal(adaln_linear(x, scale, shift, 1e-6, [(w, b)], backend="torch")[0], ref)
    with pytest.raises(ValueError, match="backend"):
        adaln_linear(x, scale, shift, 1e-6, [(w, b)], backend="cuda")
    w.requires_grad_(False)
    b.requires_grad_(False)
    (out,) = adaln_linear(x, scale, shift, 1e-6, [(w, b)], backend="triton")
    out.sum().backward()
    assert w.grad is None and b.grad is None and x.grad is not None and scale.grad is not None


@pytest.mark.parametrize("rows", [0, 4099])
def test_bias_grad_is_the_column_sum(rows):
    """ops.adaln_linear.bias_grad, the projections' bias gradient: on CUDA a matrix-vector product with ones (cuBLAS
    gemv, fp32 accumulation), elsewhere aten's sum — either way Σ_rows in the gradient's dtype, as close to fp64 as
    aten's own bf16 sum, the same bits twice; no rows give zeros."""
    from ops.adaln_linear import bias_grad
    g = torch.Generator().manual_seed(3)
    d = (torch.randn(rows, 1536, generator=g) + 0.25).to(DEV, torch.bfloat16)
    got = bias_grad(d)
    assert got.dtype == torch.bfloat16 and got.shape == (1536,)
    if rows == 0:
        assert not got.any()
        return
    ref = d.double().sum(0)
    assert rel_err(got, ref) <= 1.5 * rel_err(d.sum(0), ref) + 1e-6 and rel_err(got, ref) < 8e-3
    assert torch.equal(bias_grad(d), got)
