"""ops/rope_attention.py: attention over qk_norm_rope'd q/k that saves the projections only — output and every
gradient against fp64, the same output bits as the unfused composition, the saved bytes, the math fallback, and
selective checkpointing (models.checkpointing.keep_attention_context) still skipping attention in the recompute.

On CPU the norm kernels run under TRITON_INTERPRET=1 and attention through aten's CPU flash kernel; the GPU test
runs each of SDPA's CUDA kernels (cuDNN, flash, memory-efficient) in bf16."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from models.checkpointing import keep_attention_context
from models.layers import RoPE3D
from ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference
from ops.rope_attention import rope_attention
from ops.triton_setup import HAS_TRITON
from tests.op_helpers import DEV, gpu, rel_err

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

HEADS, DH = 2, 16  # head_dim a multiple of 8: SDPA's CUDA kernel ops take no other (tests run on GPUs too)


def _case(B=2, N=30, L=None, dtype=torch.float32, seed=0, dev=DEV):
    """q [B, N, D], k/v [B, L, D], the norm weights, RoPE angles for a 3×2×5 grid (N = 30) or none (cross)."""
    g = torch.Generator().manual_seed(seed)
    D = HEADS * DH
    L = L or N
    mk = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(dev, dtype).requires_grad_()  # noqa: E731
    q, k, v = mk(B, N, D, sc=2.0), mk(B, L, D), mk(B, L, D)
    wq, wk = mk(D, sc=0.5), mk(D, sc=0.5)
    with torch.no_grad():
        wq += 1
        wk += 1
    if L == N == 30:
        cos, sin = RoPE3D((8, 4, 4))(3, 2, 5, dev)
        rq = rk = (cos, sin)
    else:  # cross-attention: angle 0
        rq = (torch.ones(N, DH // 2, device=dev), torch.zeros(N, DH // 2, device=dev))
        rk = (torch.ones(L, DH // 2, device=dev), torch.zeros(L, DH // 2, device=dev))
    return (q, k, v, wq, wk), rq, rk, torch.randn(B, N, D, generator=g).to(dev, dtype)


def _run(fn, leaves, dout):
    for t in leaves:
        t.grad = None
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad.detach().clone() for t in leaves]


def _sdpa(q, k, v, heads):
    h = lambda t: t.unflatten(-1, (heads, -1)).transpose(1, 2)  # noqa: E731
    return F.scaled_dot_product_attention(h(q), h(k), h(v)).transpose(1, 2).flatten(2)


def _reference(rq, rk, heads=HEADS):
    """fp64 (given fp64 leaves): qk_norm_rope's reference, then SDPA."""
    def fn(q, k, v, wq, wk):
        qr = qk_norm_rope_reference(q, wq, *[t.to(q.dtype) for t in rq])
        kr = qk_norm_rope_reference(k, wk, *[t.to(k.dtype) for t in rk])
        return _sdpa(qr, kr, v, heads)
    return fn


def _unfused(rq, rk, heads=HEADS):
    """What the Wan block ran before: the fused norm kernels, then SDPA on the rotated q/k (saved by autograd)."""
    def fn(q, k, v, wq, wk):
        return _sdpa(qk_norm_rope(q, wq, *rq, backend="triton"), qk_norm_rope(k, wk, *rk, backend="triton"), v, heads)
    return fn


@pytest.mark.parametrize("cross", [False, True])
def test_matches_fp64_and_the_unfused_composition(cross):
    leaves, rq, rk, dout = _case(L=7 if cross else None, seed=1 + cross)
    fused = lambda q, k, v, wq, wk: rope_attention(q, k, v, HEADS, wq, wk, rq, rk, backend="triton")  # noqa: E731
    out, gr = _run(fused, leaves, dout)
    out_u, gr_u = _run(_unfused(rq, rk), leaves, dout)
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    out64, gr64 = _run(_reference(rq, rk), l64, dout.double())
    assert torch.equal(out, out_u)  # the same kernels in forward
    assert rel_err(out, out64) < 1e-5
    for name, a, u, r in zip("q k v wq wk".split(), gr, gr_u, gr64):
        assert rel_err(a, r) < 1e-5, name
        assert rel_err(a, u) < 1e-5, name


@pytest.mark.slow
def test_q_and_k_norms_use_their_own_eps_in_forward_and_recompute():
    """eps_q ≠ eps_k, both large against the rows' mean squares (q ≈ 4, k ≈ 1): each reaches its own norm, in the
    forward and in the backward's recompute of q' and k' (every gradient against fp64 at the same two eps)."""
    leaves, rq, rk, dout = _case(seed=5)
    eps_q, eps_k = 0.5, 2.0
    fused = lambda q, k, v, wq, wk: rope_attention(q, k, v, HEADS, wq, wk, rq, rk, eps_q, eps_k,  # noqa: E731
                                                   backend="triton")
    assert type(fused(*leaves).grad_fn).__name__ == "_RoPEAttentionBackward"
    out, gr = _run(fused, leaves, dout)

    def ref(q, k, v, wq, wk):
        return _sdpa(qk_norm_rope_reference(q, wq, *[t.double() for t in rq], eps_q),
                     qk_norm_rope_reference(k, wk, *[t.double() for t in rk], eps_k), v, HEADS)

    l64 = [t.detach().double().requires_grad_() for t in leaves]
    out64, gr64 = _run(ref, l64, dout.double())
    assert rel_err(out, out64) < 1e-5
    for name, a, r in zip("q k v wq wk".split(), gr, gr64):
        assert rel_err(a, r) < 1e-5, name
    torch_out, _ = _run(lambda *a: rope_attention(*a[:3], HEADS, *a[3:], rq, rk, eps_q, eps_k, backend="torch"),
                        leaves, dout)
    assert rel_err(torch_out, out64) < 1e-5  # the reference backend takes them too


@pytest.mark.slow
def test_compiled_graph_takes_the_composition():
    """Inside torch.compile (fullgraph: nothing may break the graph) rope_attention is the composition of the norm's
    custom op and SDPA, which Inductor plans itself: the same output and gradients as eager."""
    leaves, rq, rk, dout = _case(seed=9)
    fn = lambda q, k, v, wq, wk: rope_attention(q, k, v, HEADS, wq, wk, rq, rk, backend="triton")  # noqa: E731
    out, gr = _run(fn, leaves, dout)
    out_c, gr_c = _run(torch.compile(fn, fullgraph=True, backend="aot_eager"), leaves, dout)
    assert rel_err(out_c, out) < 1e-6
    for name, a, b in zip("q k v wq wk".split(), gr_c, gr):
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.slow
def test_saves_the_projections_not_the_rotated_q_and_k():
    leaves, rq, rk, _ = _case(seed=3)
    q, k, v, wq, wk = leaves

    def saved(fn):
        ptrs = {}
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: ptrs.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t,
                lambda t: t):
            fn()
        return sum(ptrs.values())

    fused = saved(lambda: rope_attention(q, k, v, HEADS, wq, wk, rq, rk, backend="triton"))
    assert saved(lambda: _unfused(rq, rk)(*leaves)) - fused == q.numel() * 4 + k.numel() * 4  # q' and k' (fp32 here)


class _CountAttention(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(DEV.type != "cpu", reason="counts the CPU attention kernel")
@pytest.mark.slow
def test_keep_attention_policy_skips_its_recompute_and_math_falls_back(wide_interpreter_tiles):
    leaves, rq, rk, dout = _case(seed=4)
    fn = lambda q, k, v, wq, wk: rope_attention(q, k, v, HEADS, wq, wk, rq, rk, backend="triton")  # noqa: E731
    _, gr = _run(fn, leaves, dout)
    for context_fn, calls in ((None, 2), (keep_attention_context, 1)):  # forward + recompute, or forward only
        kw = {"context_fn": context_fn} if context_fn else {}
        with _CountAttention() as mode:
            _, gr_c = _run(lambda *a: checkpoint(fn, *a, use_reentrant=False, **kw), leaves, dout)
        assert mode.calls == calls
        for a, b in zip(gr_c, gr):
            assert torch.equal(a, b)
    assert type(fn(*leaves).grad_fn).__name__ == "_RoPEAttentionBackward"  # the remaking function
    fn_m = lambda q, k, v, wq, wk: rope_attention(q, k, v, HEADS, wq, wk, rq, rk, backend="triton",  # noqa: E731
                                                  sdpa_backend="math")
    assert type(fn_m(*leaves).grad_fn).__name__ != "_RoPEAttentionBackward"  # SDPA's math path: so does rope_attention
    out_m, gr_m = _run(fn_m, leaves, dout)
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    out64, gr64 = _run(_reference(rq, rk), l64, dout.double())
    assert rel_err(out_m, out64) < 1e-5 and all(rel_err(a, r) < 1e-5 for a, r in zip(gr_m, gr64))


@gpu
@pytest.mark.parametrize("name,kernel", [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                                         ("efficient", SDPBackend.EFFICIENT_ATTENTION)])
def test_cuda_kernels_bf16_match_the_unfused_composition(name, kernel):
    """Each CUDA kernel through its aten ops: bf16, Wan's head_dim 128, 333 tokens (not a multiple of the tiles)."""
    heads, N, dev = 4, 333, torch.device("cuda")
    g = torch.Generator().manual_seed(6)
    mk = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(dev, torch.bfloat16).requires_grad_()  # noqa: E731
    leaves = [mk(1, N, heads * 128, sc=2.0), mk(1, N, heads * 128), mk(1, N, heads * 128),
              mk(heads * 128, sc=0.1), mk(heads * 128, sc=0.1)]
    with torch.no_grad():
        leaves[3] += 1
        leaves[4] += 1
    rq = rk = RoPE3D((44, 42, 42))(3, 111, 1, dev)
    dout = torch.randn(1, N, heads * 128, generator=g).to(dev, torch.bfloat16)
    fused = lambda q, k, v, wq, wk: rope_attention(q, k, v, heads, wq, wk, rq, rk, backend="triton",  # noqa: E731
                                                   sdpa_backend=name)
    assert type(fused(*leaves).grad_fn).__name__ == "_RoPEAttentionBackward"  # through the kernel's own ops
    out, gr = _run(fused, leaves, dout)
    with sdpa_kernel([kernel]):  # the unfused composition, SDPA restricted to that kernel
        out_u, gr_u = _run(_unfused(rq, rk, heads), leaves, dout)
    assert torch.equal(out, out_u)  # the kernel model.attention_backend names, called through its op
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    _, gr64 = _run(_reference(rq, rk, heads), l64, dout.double())
    for name, a, u, r in zip("q k v wq wk".split(), gr, gr_u, gr64):
        assert rel_err(a, r) <= 1.5 * rel_err(u, r) + 1e-3, name  # no further from fp64 than the unfused path
