"""ops/gated_ffn.py: the block's tail x + gate · MLP(AdaLN(x)) — output and every gradient against fp64 (one chunk
and chunks within each sample), the same output as the composition it replaces, the recompute skipping the down
projection under torch.utils.checkpoint (the pass told by models/checkpointing.py, as the fused Wan block tells it),
placeholders never reaching backward, autocast, and refused inputs.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); shapes are small and odd."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models.checkpointing import checkpoint_pass, current_pass, passes
from ops import gated_ffn
from ops.adaln import adaln_reference
from ops.adaln_linear import adaln_gelu_ffn
from ops.gated_ffn import adaln_gelu_ffn_gated, adaln_gelu_ffn_gated_reference
from ops.gated_residual import gated_residual
from ops.gelu_ffn import gelu_ffn_reference
from ops.triton_setup import HAS_TRITON
from tests.op_helpers import DEV, fp64_leaves, grads_of, rel_err

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.fixture(autouse=True)
def any_length(monkeypatch):
    monkeypatch.setattr(gated_ffn, "GATED_TAIL_MIN_TOKENS", 1)  # the tests' sequences are short


def _t(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype).requires_grad_()


def _leaves(B, N, D, Fh, seed=0, biases=(True, True)):
    g = torch.Generator().manual_seed(seed)
    x = _t(g, B, N, D)
    scale, shift, gate = _t(g, B, 1, D, scale=0.3), _t(g, B, 1, D, scale=0.3), _t(g, B, 1, D)
    w1, w2 = _t(g, Fh, D, scale=D ** -0.5), _t(g, D, Fh, scale=Fh ** -0.5)
    b1 = _t(g, Fh) if biases[0] else None
    b2 = _t(g, D) if biases[1] else None
    return g, [x, scale, shift, gate, w1, b1, w2, b2]


def _reference(x, scale, shift, gate, w1, b1, w2, b2):  # the formula, written out (fp64 in the tests)
    return x + gate * gelu_ffn_reference(adaln_reference(x, scale, shift, 1e-6), w1, b1, w2, b2)


# the forward pass's GELU epilogue (CUDA) sums in its own order: fp32 results a few ulps from the plain path's
CLOSE = dict(atol=1e-6, rtol=1e-6) if DEV.type == "cpu" else dict(atol=5e-5, rtol=1e-4)


def _tail(x, scale, shift, gate, w1, b1, w2, b2, rows=None):  # told the pass it runs in, as FusedWanBlock does
    return adaln_gelu_ffn_gated(x, scale, shift, 1e-6, w1, b1, w2, b2, gate, backend="triton", rows_per_chunk=rows,
                                checkpoint_pass=current_pass())


@pytest.mark.parametrize("biases,B", [((True, True), 2), ((False, False), 2), ((True, True), 1)])
def test_matches_fp64_and_the_composition_it_replaces(biases, B):
    """B = 2: dW2 accumulated over the samples in fp32; B = 1: written once (ops.gated_ffn.gate_w2_)."""
    N, D, Fh = 29, 16, 40
    g, leaves = _leaves(B, N, D, Fh, seed=1, biases=biases)
    dout = torch.randn(B, N, D, generator=g).to(DEV)
    l64 = fp64_leaves(leaves)
    out64 = _reference(*l64)
    gr64 = grads_of(out64, l64, dout.double())
    for rows in (None, 12):  # one chunk; chunks of 12 inside each 29-row sample (the last 5 rows short)
        out = _tail(*leaves, rows=rows)
        gr = grads_of(out, leaves, dout)
        x, scale, shift, gate, w1, b1, w2, b2 = leaves
        composed = gated_residual(x, adaln_gelu_ffn(x, scale, shift, 1e-6, w1, b1, w2, b2, backend="triton",
                                                    rows_per_chunk=rows), gate, backend="triton")
        assert torch.equal(out, composed)  # the forward runs the same kernels and matmuls
        assert rel_err(out, out64) < 1e-5
        for i, (a, r) in enumerate(zip(gr, gr64)):
            if r is None:
                assert a is None or leaves[i] is None
                continue
            assert rel_err(a, r) < 1e-5, (rows, i)


def test_eps_reaches_the_norm_in_forward_and_in_the_recompute():
    """eps = 1e-2 on rows of variance 0, ≈ 1e-7 and ≈ 1 (cycling): the output and every gradient against fp64 at that
    eps, so the norm's eps counts both in the forward and where backward remakes y."""
    B, N, D, Fh, eps = 2, 15, 16, 24, 1e-2
    g, leaves = _leaves(B, N, D, Fh, seed=7)
    with torch.no_grad():
        x = torch.randn(B * N, D, generator=g) * torch.tensor([0.0, 3.2e-4, 1.0]).repeat(B * N)[:B * N, None]
        x[::3] += 0.75
        leaves[0].copy_(x.view(B, N, D))
    dout = torch.randn(B, N, D, generator=g).to(DEV)
    out = adaln_gelu_ffn_gated(*leaves[:3], eps, *leaves[4:], leaves[3], backend="triton")
    gr = grads_of(out, leaves, dout)
    l64 = fp64_leaves(leaves)
    x64, s64, h64, gate64, w1, b1, w2, b2 = l64
    out64 = x64 + gate64 * gelu_ffn_reference(adaln_reference(x64, s64, h64, eps), w1, b1, w2, b2)
    gr64 = grads_of(out64, l64, dout.double())
    assert rel_err(out, out64) < 1e-5
    for i, (a, r) in enumerate(zip(gr, gr64)):
        assert rel_err(a, r) < 1e-5, i


@pytest.mark.parametrize("accumulate", [False, True])
def test_gate_w2_one_pass(accumulate):
    """ops.gated_ffn.gate_w2_ over rows and features that fill no tile: dW2 = G ⊙ gate (bf16, the same bits as eager's
    multiply-then-cast) or dW2 += G ⊙ gate (fp32), and dgate = Σ_k G ⊙ W2 against fp64."""
    g = torch.Generator().manual_seed(4)
    D, Fh = 37, 300
    G = torch.randn(D, Fh, generator=g).to(DEV)
    w2 = torch.randn(D, Fh, generator=g).to(DEV, torch.bfloat16)
    gate = torch.randn(D, generator=g).to(DEV)
    dw2 = torch.randn(D, Fh, generator=g).to(DEV) if accumulate else torch.empty(D, Fh, dtype=torch.bfloat16,
                                                                                 device=DEV)
    start = dw2.clone()
    dgate = torch.full((D,), float("nan"), device=DEV)
    gated_ffn.gate_w2_(G, w2, gate, dw2, dgate, accumulate=accumulate)
    if accumulate:
        torch.testing.assert_close(dw2, start + G * gate[:, None], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(dw2, (G * gate[:, None]).to(torch.bfloat16))
    assert rel_err(dgate, (G.double() * w2.double()).sum(1)) < 1e-6
    # one of the two asked for: the other untouched
    dw2_only, dgate_only = dw2.clone(), torch.full((D,), float("nan"), device=DEV)
    gated_ffn.gate_w2_(G, w2, gate, dw2_only, None, accumulate=accumulate)
    gated_ffn.gate_w2_(G, w2, gate, None, dgate_only, accumulate=accumulate)
    if accumulate:  # a second accumulation onto the first
        torch.testing.assert_close(dw2_only, dw2 + G * gate[:, None], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(dw2_only, dw2)
    assert torch.equal(dgate_only, dgate)
    with pytest.raises(ValueError, match="contiguous"):  # the kernel reads rows of F: a strided view is refused
        gated_ffn.gate_w2_(G, w2, torch.randn(D, 2, device=DEV)[:, 0], dw2, dgate, accumulate=accumulate)


class _CountMatmuls(TorchDispatchMode):
    OPS = ("aten.mm.default", "aten.addmm.default", "aten._addmm_activation.default", "aten.bmm.default")

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += str(func) in self.OPS
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_checkpoint_recompute_skips_the_down_projection():
    """Under torch.utils.checkpoint with passes(): the same output and gradients as the plain call, one matmul
    fewer in backward (the recompute stops after W1·y), and the forward's placeholder for h never read."""
    B, N, D, Fh = 2, 23, 16, 24
    g, leaves = _leaves(B, N, D, Fh, seed=2)
    dout = torch.randn(B, N, D, generator=g).to(DEV)
    ref = _tail(*leaves)
    gref = grads_of(ref, leaves, dout)
    counts = {}
    for name, fn in (("plain", _tail), ("passes", passes(_tail))):
        out = checkpoint(fn, *leaves, use_reentrant=False)
        torch.testing.assert_close(out, ref, **CLOSE)
        with _CountMatmuls() as mode:
            gr = grads_of(out, leaves, dout)
        counts[name] = mode.n
        for i, (a, r) in enumerate(zip(gr, gref)):
            torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5, msg=(name, i))  # the recompute is the plain path
    assert counts["passes"] == counts["plain"] - 1

    # a forward pass's placeholders reaching backward is an error, not garbage gradients
    with checkpoint_pass("forward"):
        out = _tail(*leaves)
    with pytest.raises(RuntimeError, match="placeholders"):
        out.backward(dout)
    with pytest.raises(ValueError, match="checkpoint_pass"):
        with checkpoint_pass("backward"):
            pass

    # the recompute's output is NaN, never read when the tail ends the region; an op after it that saves it (a hook
    # scaling the block's output) gets NaN gradients, not silently wrong ones
    ls = torch.ones(D, device=DEV, requires_grad=True)
    checkpoint(passes(lambda *a: _tail(*a) * ls), *leaves, use_reentrant=False).backward(dout)
    assert torch.isnan(ls.grad).all()


@pytest.mark.slow
def test_no_grad_and_autocast():
    """Without autograd the forward pass's path (epilogue, nothing saved) gives the same output; under bf16
    autocast fp32 master weights get fp32 gradients no further from fp64 than eager's under the same autocast —
    two samples in chunks of 4 rows (G and dW1 accumulated in fp32 over all 20: in bf16, dW1 was 1.5× eager's
    error), backward outside autocast as the trainer runs it and inside it."""
    B, N, D, Fh = 2, 40, 32, 48
    g, leaves = _leaves(B, N, D, Fh, seed=3)
    with torch.no_grad():
        fast = _tail(*leaves)
    torch.testing.assert_close(fast, _tail(*leaves).detach(), **CLOSE)  # the plain path
    torch.testing.assert_close(fast, _reference(*leaves), atol=1e-5, rtol=1e-5)
    dout = torch.randn(B, N, D, generator=g).to(DEV)
    l64 = fp64_leaves(leaves)
    gr64 = grads_of(_reference(*l64), l64, dout.double())
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        out, ref = _tail(*leaves, rows=4), _reference(*leaves)
        gr_in = grads_of(_tail(*leaves, rows=4).float(), leaves, dout)  # backward inside autocast
    assert out.dtype == torch.float32  # the residual stream's dtype (fp32 here), as ops.gated_residual
    gr, gr_e = grads_of(out.float(), leaves, dout), grads_of(ref.float(), leaves, dout)
    for i, (a, a_in, e, r) in enumerate(zip(gr, gr_in, gr_e, gr64)):
        assert a.dtype == torch.float32
        assert rel_err(a, r) <= 1.2 * rel_err(e, r) + 1e-4, (i, rel_err(a, r), rel_err(e, r))
        torch.testing.assert_close(a_in, a, atol=0, rtol=0)  # autocast does not reach into the backward


def test_modulation_as_views_of_one_table():
    """Wan's shift/scale/gate: [B, 1, D] views of one [B, 1, 6, D] fp32 table (stride 6·D), never copied; the
    table's gradient against fp64."""
    B, N, D, Fh = 2, 21, 16, 24
    g, (x, _, _, _, w1, b1, w2, b2) = _leaves(B, N, D, Fh, seed=8)
    table = (torch.randn(B, 1, 6, D, generator=g) * 0.3).to(DEV).requires_grad_()
    dout = torch.randn(B, N, D, generator=g).to(DEV)

    def run(x, table, w1, b1, w2, b2, fn):
        shift, scale, gate = table.unbind(2)[:3]
        return fn(x, scale, shift, gate, w1, b1, w2, b2)

    leaves = [x, table, w1, b1, w2, b2]
    gr = grads_of(run(*leaves, lambda *a: _tail(*a, rows=8)), leaves, dout)
    l64 = fp64_leaves(leaves)
    gr64 = grads_of(run(*l64, _reference), l64, dout.double())
    for i, (a, r) in enumerate(zip(gr, gr64)):
        assert rel_err(a, r) < 1e-5, i
    assert gr[1][:, :, 3:].abs().max() == 0  # the rows the block's tail does not read


def test_refuses_what_it_does_not_take(monkeypatch):
    g, (x, scale, shift, gate, w1, b1, w2, b2) = _leaves(2, 8, 16, 24, seed=4)
    with pytest.raises(ValueError, match="per-sample gate"):  # a per-token gate (Wan 2.2)
        adaln_gelu_ffn_gated(x, scale, shift, 1e-6, w1, b1, w2, b2, gate.expand(2, 8, 16), backend="triton")
    ref = adaln_gelu_ffn_gated_reference(x, scale, shift, 1e-6, w1, b1, w2, b2, gate)
    assert torch.equal(adaln_gelu_ffn_gated(x, scale, shift, 1e-6, w1, b1, w2, b2, gate, backend="torch"), ref)
    torch.testing.assert_close(ref, _reference(x, scale, shift, gate, w1, b1, w2, b2), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="backend must be one of"):
        adaln_gelu_ffn_gated(x, scale, shift, 1e-6, w1, b1, w2, b2, gate, backend="cuda")
    with pytest.raises(ValueError, match="checkpoint_pass must be one of"):
        adaln_gelu_ffn_gated(x, scale, shift, 1e-6, w1, b1, w2, b2, gate, backend="triton", checkpoint_pass="backward")
    with pytest.raises(ValueError, match="share a dtype"):
        adaln_gelu_ffn_gated(x, scale, shift, 1e-6, w1.detach().double(), b1, w2, b2, gate, backend="triton")
    monkeypatch.setattr(gated_ffn, "GATED_TAIL_MIN_TOKENS", 9)
    assert not gated_ffn.gated_tail_applies(x, gate)
    with pytest.raises(ValueError, match="N ≥ 9"):
        adaln_gelu_ffn_gated(x, scale, shift, 1e-6, w1, b1, w2, b2, gate, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_epilogue_gelu_is_the_tanh_approximation(monkeypatch):
    """The forward pass's up projection (cuBLASLt's GELU epilogue) is GELU_tanh, as Wan's MLP: fp32, TF32 off, it
    matches F.gelu(·, "tanh") to 1e-5 while erf's GELU is ~5e-4 away; and the bf16 tail matches fp64 on the GPU."""
    g = torch.Generator().manual_seed(6)
    y, w, b = (torch.randn(*s, generator=g).cuda() for s in ((512, 64), (256, 64), (256,)))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    h = F.linear(y, w, b)
    got = gated_ffn._up_gelu(y, w, b)
    assert (got - F.gelu(h, approximate="tanh")).abs().max() < 1e-5
    assert (F.gelu(h) - F.gelu(h, approximate="tanh")).abs().max() > 1e-4
    B, N, D, Fh = 2, 300, 128, 256
    _, leaves = _leaves(B, N, D, Fh, seed=7)
    l16 = [t.detach().bfloat16().requires_grad_() for t in leaves]
    l16[1:4] = [t.detach().float().requires_grad_() for t in l16[1:4]]  # fp32 modulation and gate, as Wan's
    dout = torch.randn(B, N, D, generator=g).cuda().bfloat16()
    l64 = fp64_leaves(l16)
    gr64 = grads_of(_reference(*l64), l64, dout.double())
    for fn in (_tail, passes(_tail)):  # plain, and checkpointed with its passes
        out = checkpoint(fn, *l16, rows=128, use_reentrant=False) if fn is not _tail else _tail(*l16, rows=128)
        assert rel_err(out, _reference(*l64)) < 1e-2
        for i, (a, r) in enumerate(zip(grads_of(out, l16, dout), gr64)):
            assert rel_err(a, r) < 2e-2, i
