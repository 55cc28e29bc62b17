"""ops/gelu_ffn.py: the MLP with the recomputing, in-place backward against fp64 autograd (output and every
gradient), against the eager module bit for bit where the arithmetic is the same, under autocast, and in a Wan model.

On CPU the GELU-gradient kernel runs under TRITON_INTERPRET=1 (tests/conftest.py); shapes are small and odd (the
last program masked)."""
import pytest
import torch

from ops import gelu_ffn as op
from ops.gelu_ffn import gelu_ffn, gelu_ffn_reference
from ops.triton_setup import HAS_TRITON
from tests.op_helpers import DEV, rel_err

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def params(D, Fh, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) / s[-1] ** 0.5).to(DEV, dtype).requires_grad_()  # noqa: E731
    return mk(Fh, D), mk(Fh) if bias else None, mk(D, Fh), mk(D) if bias else None


def grads(fn, x, ps, dout):
    for t in [x, *ps]:
        if t is not None:
            t.grad = None
    out = fn(x, *ps)
    out.backward(dout)
    return out.detach(), [t.grad.detach() if t is not None and t.grad is not None else None for t in [x, *ps]]



def test_gelu_act_grad_kernel_against_aten_and_fp64():
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(3, 37, 101, generator=g) * 3).to(DEV)  # 111 rows × 101: 7 × 4 programs, the last ones masked
    h.view(-1)[:4] = torch.tensor([0.0, -30.0, 30.0, -1e4])  # tanh saturated both ways, and exp's overflow
    da = torch.randn(3, 37, 101, generator=g).to(DEV)
    h64, da64 = h.double(), da.double()
    a64 = torch.nn.functional.gelu(h64, approximate="tanh")
    dh64 = torch.ops.aten.gelu_backward(da64, h64, approximate="tanh")
    a_aten = torch.nn.functional.gelu(h, approximate="tanh")
    dh_aten = torch.ops.aten.gelu_backward(da, h, approximate="tanh")
    db = torch.full((101,), 0.5, device=DEV)  # accumulated into
    a, dh = op.gelu_act_grad_(da.clone(), h.clone(), db, config=(8, 32, 2, 4))
    for out, ref, ref64 in [(a, a_aten, a64), (dh, dh_aten, dh64)]:
        err, err_aten = (out.double() - ref64).abs(), (ref.double() - ref64).abs()
        assert (err <= 4 * err_aten + 2e-7 * (1 + ref64.abs())).all(), err.max()  # fp32 rounding, as aten's own
    db64 = 0.5 + dh64.reshape(-1, 101).sum(0)
    assert (db.double() - db64).abs().max() < 1e-5 * (1 + dh64.abs().reshape(-1, 101).sum(0)).max()
    a2, dh2 = op.gelu_act_grad_(da.clone(), h.clone())  # the default launch shape, no db: the same values
    assert torch.equal(a2, a) and torch.equal(dh2, dh)
    da16, h16 = da.bfloat16(), h.bfloat16()
    db16 = torch.zeros(101, device=DEV)
    a16, dh16 = op.gelu_act_grad_(da16.clone(), h16.clone(), db16)
    assert a16.dtype == dh16.dtype == torch.bfloat16
    assert rel_err(a16.float(), torch.nn.functional.gelu(h16.float(), approximate="tanh")) < 8e-3  # one rounding
    ref16 = torch.ops.aten.gelu_backward(da16.float(), h16.float(), approximate="tanh")
    assert rel_err(dh16.float(), ref16) < 8e-3
    assert rel_err(db16, ref16.reshape(-1, 101).sum(0)) < 1e-5  # the unrounded dh summed in fp32
    h, da = h.reshape(-1, 101)[:64, :96].contiguous(), da.reshape(-1, 101)[:64, :96].contiguous()
    db_even, db_masked = torch.zeros(96, device=DEV), torch.zeros(96, device=DEV)
    even = op.gelu_act_grad_(da.clone(), h.clone(), db_even, config=(8, 32, 2, 4))  # tiles fill R and F: no masks
    masked = op.gelu_act_grad_(da.clone(), h.clone(), db_masked, config=(8, 32, 3, 4))  # 64 rows in 24-row spans
    assert torch.equal(even[0], masked[0]) and torch.equal(even[1], masked[1])
    torch.testing.assert_close(db_even, db_masked, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        op.gelu_act_grad_(da.transpose(0, 1), h.transpose(0, 1))
    with pytest.raises(ValueError, match="fp32"):
        op.gelu_act_grad_(da.clone(), h.clone(), torch.zeros(101, dtype=torch.float64, device=DEV))


def test_column_sums_over_chunks_reduced_once():
    """ColumnSums: three calls (chunks of 24, 24 and 13 rows) write their partial rows into one buffer; total() is
    Σ_rows dh of all of them (against fp64), the same sum as an fp32 db accumulated call by call, up to fp32 order;
    more rows than it was made for, or another launch shape, is refused."""
    g = torch.Generator().manual_seed(2)
    h = (torch.randn(61, 40, generator=g) * 2).to(DEV)
    da = torch.randn(61, 40, generator=g).to(DEV)
    dh64 = torch.ops.aten.gelu_backward(da.double(), h.double(), approximate="tanh")
    cfg = (8, 32, 2, 4)
    sums, db = op.ColumnSums(61, 3, 40, DEV, config=cfg), torch.zeros(40, device=DEV)
    for r in range(0, 61, 24):
        op.gelu_act_grad_(da[r:r + 24].clone(), h[r:r + 24].clone(), sums, config=cfg)
        op.gelu_act_grad_(da[r:r + 24].clone(), h[r:r + 24].clone(), db, config=cfg)
    assert rel_err(sums.total(), dh64.sum(0)) < 1e-6
    torch.testing.assert_close(sums.total(), db, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="partial rows"):
        op.gelu_act_grad_(da.clone(), h.clone(), sums, config=cfg)
    with pytest.raises(ValueError, match="launch shape"):
        op.gelu_act_grad_(da.clone(), h.clone(), op.ColumnSums(61, 1, 40, DEV), config=cfg)


@pytest.mark.parametrize("bias", [True, False])
def test_matches_fp64_reference_and_eager_bits(bias):
    D, Fh = 24, 72
    ps = params(D, Fh, torch.float32, bias=bias)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 45, D, generator=g).to(DEV).requires_grad_()
    dout = torch.randn(2, 45, D, generator=g).to(DEV)
    out, gr = grads(lambda *a: gelu_ffn(*a, backend="triton"), x, ps, dout)
    out_e, gr_e = grads(gelu_ffn_reference, x, ps, dout)
    x64 = x.detach().double().requires_grad_()
    ps64 = [p.detach().double().requires_grad_() if p is not None else None for p in ps]
    out64, gr64 = grads(gelu_ffn_reference, x64, ps64, dout.double())
    assert torch.equal(out, out_e)  # the same forward kernels
    assert rel_err(gr[3], gr_e[3]) < 1e-6  # dW2 = doutᵀ·a: a remade by our kernel, aten's within fp32 rounding
    for a, b in zip(gr, gr64):
        if b is not None:
            assert rel_err(a, b) < 1e-5
    assert (gr[2] is None) == (not bias)


@pytest.mark.parametrize("rows", [7, 64])
def test_chunked_rows_match_fp64_and_one_chunk(rows):
    """Chunks of rows (the last one short): output and every gradient as fp64, and as the one-chunk path."""
    D, Fh = 16, 40
    ps = params(D, Fh, torch.float32, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 47, D, generator=g).to(DEV).requires_grad_()  # 141 rows
    dout = torch.randn(3, 47, D, generator=g).to(DEV)
    out_c, gr_c = grads(lambda *a: gelu_ffn(*a, backend="triton", rows_per_chunk=rows), x, ps, dout)
    out_1, gr_1 = grads(lambda *a: gelu_ffn(*a, backend="triton"), x, ps, dout)
    x64 = x.detach().double().requires_grad_()
    out64, gr64 = grads(gelu_ffn_reference, x64, [p.detach().double().requires_grad_() for p in ps], dout.double())
    assert rel_err(out_c, out64) < 1e-6
    for a, b, c in zip(gr_c, gr64, gr_1):
        assert a.dtype == c.dtype and rel_err(a, b) < 1e-5 and rel_err(a, c) < 1e-5
    assert op.chunk_rows(32760, 8960, 2) == 7488 and op.chunk_rows(100, 8960, 2) == 100  # 128 MiB of bf16 rows


def test_bf16_and_autocast_keep_fp32_master_grads():
    D, Fh = 32, 64
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 33, D, generator=g).to(DEV).requires_grad_()
    dout = torch.randn(1, 33, D, generator=g).to(DEV)
    ps = params(D, Fh, torch.float32)
    ps64 = [p.detach().double().requires_grad_() for p in ps]
    _, gr64 = grads(gelu_ffn_reference, x.detach().double().requires_grad_(), ps64, dout.double())
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        out, gr = grads(lambda *a: gelu_ffn(*a, backend="triton"), x, ps, dout)
        out_e, gr_e = grads(gelu_ffn_reference, x, ps, dout)
    assert out.dtype == out_e.dtype == torch.bfloat16
    for a, e, b in zip(gr, gr_e, gr64):
        assert a.dtype == torch.float32  # fp32 params get fp32 grads through the cast
        assert rel_err(a, b) <= 1.5 * rel_err(e, b) + 1e-3  # no worse than eager autocast
    ps16 = [p.detach().bfloat16().requires_grad_() for p in ps]
    with pytest.raises(ValueError, match="share a dtype"):
        gelu_ffn(x, *ps16, backend="triton")
    out16, gr16 = grads(lambda *a: gelu_ffn(*a, backend="triton"), x.detach().bfloat16().requires_grad_(), ps16,
                        dout.bfloat16())
    assert all(t.dtype == torch.bfloat16 for t in gr16) and rel_err(out16, out_e) < 2e-2


def test_saves_less_than_eager():
    """Saved for backward: x and h (plus weights), not a = GELU(h)."""
    D, Fh = 16, 256
    ps = params(D, Fh, torch.float32)
    x = torch.randn(4, 64, D).to(DEV).requires_grad_()

    def saved_bytes(fn):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            fn(x, *ps).sum().backward()
        return sum(sizes)

    fused, eager = saved_bytes(lambda *a: gelu_ffn(*a, backend="triton")), saved_bytes(gelu_ffn_reference)
    assert eager - fused >= 4 * 64 * Fh  # one [tokens, ffn_dim] tensor fewer


def test_backend_errors():
    ps = params(8, 16, torch.float32)
    x = torch.randn(1, 4, 8).to(DEV)
    with pytest.raises(ValueError, match="backend"):
        gelu_ffn(x, *ps, backend="cuda")
    torch.testing.assert_close(gelu_ffn(x, *ps, backend="auto"), gelu_ffn_reference(x, *ps))
    assert torch.equal(gelu_ffn(x, *ps, backend="torch"), gelu_ffn_reference(x, *ps))  # the reference, bit for bit


def test_second_backward_is_refused():
    """Backward makes a in h's place: a second backward through one forward would read a as h, so it raises."""
    from ops.adaln_linear import adaln_gelu_ffn
    ps = params(8, 16, torch.float32)
    x = torch.randn(1, 5, 8).to(DEV).requires_grad_()
    out = gelu_ffn(x, *ps, backend="triton").sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.backward()
    scale, shift = torch.zeros(1, 1, 8).to(DEV), torch.zeros(1, 1, 8).to(DEV)
    out = adaln_gelu_ffn(x, scale, shift, 1e-6, *ps, backend="triton").sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.backward()


@pytest.mark.parametrize("trainable", ["x", "w1", "b1", "w2"])
def test_second_backward_is_refused_whenever_the_first_made_dh(trainable):
    """Whichever one input needs a gradient through h (x, w1 or b1), backward overwrites h and a second one raises;
    with only w2 trainable no dh is made, h stays, and a second backward gives the first one's gradient again."""
    ps = list(params(8, 16, torch.float32))
    x = torch.randn(1, 5, 8).to(DEV)
    leaves = dict(zip(["w1", "b1", "w2", "b2"], ps), x=x)
    for name, t in leaves.items():
        t.requires_grad_(name == trainable)
    out = gelu_ffn(x, *ps, backend="triton").square().sum()
    out.backward(retain_graph=True)
    first = leaves[trainable].grad.clone()
    if trainable == "w2":
        leaves["w2"].grad = None
        out.backward()
        assert torch.equal(leaves["w2"].grad, first)
    else:
        with pytest.raises(RuntimeError, match="second backward"):
            out.backward()


@pytest.mark.parametrize("rows", [None, 16])
def test_no_rows_give_zero_gradients(rows):
    """An empty batch (N = 0): no chunk runs; the weights get zero gradients, as the reference gives them."""
    from ops.adaln_linear import adaln_gelu_ffn
    ps = params(8, 16, torch.float32)
    for fn in (lambda x: gelu_ffn(x, *ps, backend="triton", rows_per_chunk=rows),
               lambda x: adaln_gelu_ffn(x, torch.zeros(1, 1, 8).to(DEV), torch.zeros(1, 1, 8).to(DEV), 1e-6, *ps,
                                        backend="triton", rows_per_chunk=rows)):
        x = torch.randn(2, 0, 8).to(DEV).requires_grad_()
        out, gr = grads(lambda x_, *p_: fn(x_), x, ps, torch.zeros(2, 0, 8).to(DEV))
        assert out.shape == (2, 0, 8) and gr[0].shape == (2, 0, 8)
        assert all(g is not None and g.shape == p.shape and not g.any() for g, p in zip(gr[1:], ps))


@pytest.mark.parametrize("rows", [None, 16])
def test_frozen_weights_get_no_gradient_and_x_still_does(rows):
    """Only the gradients autograd asks for are made (a frozen MLP under LoRA / model.freeze): backward runs the two
    matmuls of dx per chunk (da = dout·W2, dx = dh·W1), not the two weight-gradient ones, and dx is right."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMM(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountMM.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                                  torch.ops.aten.addmm_.default, torch.ops.aten.mm.out)
            return func(*args, **(kwargs or {}))

    D, Fh = 16, 40
    w1, b1, w2, b2 = params(D, Fh, torch.float32, seed=6)
    for p in (w1, b1, w2):
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 37, D, generator=g).to(DEV).requires_grad_()
    dout = torch.randn(2, 37, D, generator=g).to(DEV)
    out = gelu_ffn(x, w1, b1, w2, b2, backend="triton", rows_per_chunk=rows)
    with CountMM():
        out.backward(dout)
    chunks = 1 if rows is None else -(-74 // rows)
    assert CountMM.n == 2 * chunks
    dx, db2 = x.grad.clone(), b2.grad.clone()
    _, gr_e = grads(gelu_ffn_reference, x.detach().clone().requires_grad_(), [w1, b1, w2, b2], dout)
    assert rel_err(dx, gr_e[0]) < 1e-6 and rel_err(db2, gr_e[4]) < 1e-6
