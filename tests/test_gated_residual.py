"""ops/gated_residual.py: the fused kernels against an fp64 reference, output and every gradient, and against the
eager formula bit for bit where the arithmetic is the same.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it when CUDA is absent); the interpreter
pays ~1 ms per program and loop step, so the shapes are small but awkward: odd D, N not a multiple of the row tile,
gates as strided chunk views of a modulation table, several spans and feature tiles per sample. The interpreter
truncates fp32 → bf16 where the GPU rounds to nearest even; the kernels' stores round to nearest even there too
(ops.triton_setup.store_cast), so bf16 results match the eager formula to the last bit on both. The tests marked gpu add
model-sized rows, determinism and Inductor.
"""
import zlib

import pytest
import torch

from ops import gated_residual as gr
from ops.gated_residual import (gated_residual, gated_residual_backward, gated_residual_forward,
                                gated_residual_reference)
from ops.triton_setup import HAS_TRITON, KernelConfig
from tests.op_helpers import DEV, TOL, gpu, rel_err

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")



def assert_rounded_from(got, value_f32):
    """got is value_f32 (the fp32 result of the same arithmetic) rounded to got.dtype to nearest even, as eager
    PyTorch and the GPU do — the kernels' bf16 stores emulate it under the interpreter (ops.triton_setup.store_cast)."""
    assert got.shape == value_f32.shape
    assert torch.equal(got, value_f32.to(got.dtype))


TABLE_SHAPE = {  # the leaf each kind's gate is a view of, as diffusers hands it over
    "sample": lambda B, N, D: (B, 6, D),     # Wan 2.1: (table + temb).chunk(6, dim=1) → [B, 1, D], stride 6·D
    "token": lambda B, N, D: (B, N, 6, D),   # Wan 2.2 TI2V: chunk(6, dim=2), squeezed → [B, N, D], stride 6·D
    "bcast": lambda B, N, D: (1, 2, D),      # one [1, 1, D] gate for every sample
    "shared": lambda B, N, D: (1, N, D, 3),  # per token, shared over B, features at stride 3
}


def gate_view(kind, table):
    if kind == "sample":
        return table[:, 2:3]
    if kind == "token":
        return table.chunk(6, dim=2)[2].squeeze(2)
    if kind == "bcast":
        return table[:, 1:2]
    return table[..., 1]


def inputs(kind, B, N, D, x_dtype, y_dtype, gate_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, N, D, generator=gen) * 2 + 0.5).to(DEV, x_dtype)
    y = torch.randn(B, N, D, generator=gen).to(DEV, y_dtype)
    table = (0.5 * torch.randn(*TABLE_SHAPE[kind](B, N, D), generator=gen)).to(DEV, gate_dtype)
    dout = torch.randn(B, N, D, generator=gen).to(DEV, x_dtype)
    return x, y, table, dout


def reference_grads(x, y, table, kind, dout):
    """fp64: (out, dx, dy, dgate, dtable)."""
    x64, y64, t64 = (t.detach().double().requires_grad_() for t in (x, y, table))
    g64 = gate_view(kind, t64)
    g64.retain_grad()
    out64 = x64 + y64 * g64
    out64.backward(dout.double())
    return out64.detach(), x64.grad, y64.grad, g64.grad, t64.grad


# (kind, D, B, N, x dtype, y dtype, gate dtype) — every kind, D, B and dtype pairwise; N never a multiple of rows=4
CASES = [
    ("sample", 37, 3, 13, BF16, BF16, F32), ("sample", 64, 1, 13, F32, F32, F32),
    ("sample", 200, 3, 9, F16, F16, BF16), ("sample", 64, 3, 10, BF16, F32, F32),
    ("token", 37, 1, 13, F32, F32, BF16), ("token", 64, 3, 13, BF16, BF16, F32),
    ("token", 200, 1, 10, F16, F16, F32), ("token", 37, 3, 9, BF16, F32, BF16),
    ("bcast", 37, 3, 13, F16, F16, F32), ("bcast", 64, 3, 9, BF16, BF16, BF16),
    ("bcast", 200, 1, 13, F32, F32, F32),
    ("shared", 200, 3, 11, BF16, BF16, F32), ("shared", 64, 3, 9, F32, F32, F32),
]


@pytest.mark.parametrize("kind,D,B,N,x_dtype,y_dtype,gate_dtype", CASES,
                         ids=[f"{c[0]}-D{c[1]}-B{c[2]}-N{c[3]}-x{str(c[4])[6:]}-y{str(c[5])[6:]}-g{str(c[6])[6:]}"
                              for c in CASES])
def test_matches_fp64_reference_and_eager_bits(kind, D, B, N, x_dtype, y_dtype, gate_dtype):
    x, y, table, dout = inputs(kind, B, N, D, x_dtype, y_dtype, gate_dtype, zlib.crc32(f"{kind}{D}{B}{N}".encode()))
    gate = gate_view(kind, table)
    out64, dx64, dy64, dg64, dt64 = reference_grads(x, y, table, kind, dout)
    per_token = kind in ("token", "shared")

    # the launchers: every output in its input's dtype and shape
    out = gated_residual_forward(x, y, gate)
    assert (out.dtype, out.shape) == (x_dtype, x.shape)
    dy, dgate = gated_residual_backward(dout, y, gate)
    assert (dy.dtype, dy.shape, dgate.dtype, dgate.shape) == (y_dtype, y.shape, gate_dtype, gate.shape)
    assert rel_err(out, out64) < TOL[x_dtype]
    assert rel_err(dy, dy64) < TOL[y_dtype]
    assert rel_err(dgate, dg64) < TOL[gate_dtype]

    # the same arithmetic as the eager formula (diffusers' Wan block): the same fp32 value, rounded once
    assert_rounded_from(out, x.float() + y.float() * gate.float())
    assert torch.equal(out, gated_residual_reference(x, y, gate))
    assert_rounded_from(dy, dout.float() * gate.float())
    if per_token:
        assert_rounded_from(dgate, (dout.float() * y.float()).sum(0, keepdim=True) if gate.shape[0] < B
                            else dout.float() * y.float())

    # the public op through autograd, down to the table behind the view
    x_leaf, y_leaf, t_leaf = (t.clone().requires_grad_() for t in (x, y, table))
    out_op = gated_residual(x_leaf, y_leaf, gate_view(kind, t_leaf), backend="triton")
    out_op.backward(dout)
    assert torch.equal(out_op, out)
    assert (x_leaf.grad.dtype, y_leaf.grad.dtype, t_leaf.grad.dtype) == (x_dtype, y_dtype, gate_dtype)
    assert torch.equal(x_leaf.grad, dout)  # dx = dout, exactly
    assert torch.equal(y_leaf.grad, dy)
    assert rel_err(t_leaf.grad, dt64) < TOL[gate_dtype]
    untouched = torch.ones_like(table, dtype=torch.bool)
    gate_view(kind, untouched).zero_()
    assert (t_leaf.grad[untouched] == 0).all()  # the other rows of the table get no gradient


@pytest.mark.parametrize("kind", ["sample", "token", "bcast"])
@pytest.mark.slow
def test_launch_shapes(kind):
    """Other launch shapes — several feature tiles (the last one masked), several spans per sample of which the
    last ends in a partial tile, a pipelined loop — give the same output and dy bit for bit, and a per-sample dgate
    that differs only in summation order."""
    B, N, D = 3, 13, 200
    x, y, table, dout = inputs(kind, B, N, D, BF16, BF16, F32, seed=7)
    gate = gate_view(kind, table)
    _, _, dy64, dg64, _ = reference_grads(x, y, table, kind, dout)
    cfg = KernelConfig(rows=2, num_warps=4, programs_per_sm=36 if DEV.type == "cpu" else 1, block_d=64,
                       num_stages=2)
    # 4 feature tiles × 3 samples; on CPU (one "SM") 36 programs → 3 spans of the 7 row tiles: 3 + 3 + 1
    _, n_dtiles, spans, tiles_per_span = gr._grid(N, B, D, cfg, DEV)
    assert n_dtiles == 4 and spans > 1 and (DEV.type == "cuda" or (spans, tiles_per_span) == (3, 3))
    out = gated_residual_forward(x, y, gate)
    assert torch.equal(gated_residual_forward(x, y, gate, config=cfg), out)
    dy, dgate = gated_residual_backward(dout, y, gate)
    dy2, dgate2 = gated_residual_backward(dout, y, gate, config=cfg)
    assert torch.equal(dy2, dy)
    if kind == "token":
        assert torch.equal(dgate2, dgate)
    for g in (dgate, dgate2):
        assert rel_err(g, dg64) < TOL[F32]


@pytest.mark.parametrize("frozen", ["gate", "y", "both"])
def test_only_needed_gradients(frozen):
    """A frozen gate (LoRA: the modulation is not trained) skips dgate and the read of y; a frozen branch skips dy;
    both frozen launch nothing. The gradients that are asked for do not change."""
    B, N, D = 2, 9, 64
    x, y, table, dout = inputs("sample", B, N, D, BF16, BF16, F32, seed=11)
    gate = gate_view("sample", table)
    dy_full, dgate_full = gated_residual_backward(dout, y, gate)
    x_leaf = x.clone().requires_grad_()
    y_leaf = y.clone().requires_grad_(frozen not in ("y", "both"))
    t_leaf = table.clone().requires_grad_(frozen not in ("gate", "both"))
    gated_residual(x_leaf, y_leaf, gate_view("sample", t_leaf), backend="triton").backward(dout)
    assert torch.equal(x_leaf.grad, dout)
    assert (y_leaf.grad is None) == (frozen in ("y", "both"))
    assert (t_leaf.grad is None) == (frozen in ("gate", "both"))
    if y_leaf.grad is not None:
        assert torch.equal(y_leaf.grad, dy_full)
    if t_leaf.grad is not None:
        assert torch.equal(gate_view("sample", t_leaf.grad), dgate_full)
    dy, dgate = gated_residual_backward(dout, y, gate, need_dy=frozen == "gate", need_dgate=frozen == "y")
    assert (dy is None, dgate is None) == (frozen != "gate", frozen != "y")


def test_saves_only_y_and_the_gate_view():
    """Autograd keeps y and the gate (a view of the table), both the caller's tensors: x is not saved and nothing
    new is allocated for backward (the eager formula keeps an fp32 copy of y)."""
    x, y, table, _ = inputs("sample", 2, 5, 40, BF16, BF16, F32, seed=1)
    x, y, table = (t.requires_grad_() for t in (x, y, table))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gated_residual(x, y, gate_view("sample", table), backend="triton")
    ptrs = {t.untyped_storage().data_ptr() for t in saved}
    assert len(saved) == 2 and ptrs == {y.untyped_storage().data_ptr(), table.untyped_storage().data_ptr()}
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gated_residual(x, y, gate_view("sample", table), backend="torch")
    assert any(t.dtype == F32 and t.shape == y.shape for t in saved)  # the reference's fp32 y: what we avoid


@pytest.mark.slow
def test_checkpointing_and_opcheck():
    """The custom op recomputes under non-reentrant activation checkpointing, and torch.library.opcheck accepts its
    schema, fake implementation and autograd registration."""
    from torch.utils.checkpoint import checkpoint

    x, y, table, _ = inputs("sample", 2, 5, 40, BF16, BF16, F32, seed=3)
    x, y, table = (t.requires_grad_() for t in (x, y, table))

    def f(x, y, table):
        return gated_residual(x, y, table[:, 2:3], backend="triton").float().square().sum()

    grads = torch.autograd.grad(f(x, y, table), (x, y, table))
    grads_ckpt = torch.autograd.grad(checkpoint(f, x, y, table, use_reentrant=False), (x, y, table))
    for a, b in zip(grads, grads_ckpt):
        assert torch.equal(a, b)

    gate = table[:, 2:3].detach().requires_grad_()
    torch.library.opcheck(torch.ops.adaptiveload.gated_residual_fwd.default, (x, y, gate),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    dout = torch.randn_like(x).detach()
    for need in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(torch.ops.adaptiveload.gated_residual_bwd.default,
                              (dout, y.detach(), table[:, 2:3].detach(), *need),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("compiler", ["aot_eager"] + (["inductor"] if DEV.type == "cuda" else []))
@pytest.mark.parametrize("kind", ["sample", "token"])
@pytest.mark.slow
def test_torch_compile_fullgraph(compiler, kind):
    """Inside a compiled graph (fullgraph: the op must not break it) the op gives the eager op's output and grads,
    at B=1, where compiling the reference fails on the [1, 1, D] gradient. Inductor only on CUDA (slow on CPU)."""
    D = 1536 if DEV.type == "cuda" else 40
    x, y, table, dout = inputs(kind, 1, 7, D, BF16, BF16, F32, seed=0)
    x, y, table = (t.requires_grad_() for t in (x, y, table))

    def f(x, y, table):
        return gated_residual(x, y, gate_view(kind, table), backend="triton")

    out = f(x, y, table)
    grads = torch.autograd.grad(out, (x, y, table), dout)
    out_c = torch.compile(f, fullgraph=True, backend=compiler)(x, y, table)
    grads_c = torch.autograd.grad(out_c, (x, y, table), dout)
    assert torch.equal(out, out_c)
    for a, b in zip(grads, grads_c):
        assert torch.equal(a, b)


def test_backends_and_errors(monkeypatch):
    x, y = torch.randn(2, 3, 8, device=DEV), torch.randn(2, 3, 8, device=DEV, dtype=BF16)
    gate = torch.randn(2, 1, 8, device=DEV)
    out_auto = gated_residual(x, y, gate)
    if DEV.type == "cpu":  # auto means the reference off CUDA
        assert torch.equal(out_auto, gated_residual_reference(x, y, gate))
    else:
        assert torch.equal(out_auto, gated_residual(x, y, gate, backend="triton"))
    with pytest.raises(ValueError, match="backend"):
        gated_residual(x, y, gate, backend="cuda")
    with pytest.raises(ValueError, match="gate"):
        gated_residual(x, y, torch.randn(2, 2, 8, device=DEV), backend="triton")
    with pytest.raises(ValueError, match="y must"):
        gated_residual(x, y[:, :1], gate, backend="triton")
    # auto: the reference wherever the kernels do not apply (other dtypes, broadcast patterns), on any device
    for args in ((x.double(), y, gate), (x, y, gate[..., :1]), (x, y[:, :1], gate)):
        assert not gr.triton_supported(*args)
        assert torch.equal(gated_residual(*args), gated_residual_reference(*args))
    monkeypatch.setattr(gr, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="triton"):
        gated_residual(x, y, gate, backend="triton")
    assert torch.equal(gated_residual(x, y, gate, backend="torch"), gated_residual_reference(x, y, gate))


@pytest.mark.parametrize("B,N,D", [(2, 0, 16), (0, 5, 16), (2, 5, 0)])
@pytest.mark.parametrize("kind", ["sample", "token"])
def test_empty_inputs(kind, B, N, D):
    """Empty tensors launch nothing; a per-sample gradient over no rows is zero."""
    x, y, table, dout = inputs(kind, B, N, D, BF16, BF16, F32, seed=0)
    gate = gate_view(kind, table)
    assert gated_residual_forward(x, y, gate).shape == (B, N, D)
    dy, dgate = gated_residual_backward(dout, y, gate)
    assert dy.shape == (B, N, D) and torch.equal(dgate, torch.zeros_like(gate))


def test_cuda_launch_shapes_for_an_empty_width():
    """The CUDA launch-shape lookup (the nearest tuned width, on a log scale) takes D = 0 — an empty tensor launches
    nothing but still asks (it once divided by zero on the H200); no GPU needed to ask."""
    from ops import adaln, qk_norm_rope

    cuda = torch.device("cuda")
    for kind in ("fwd", "bwd"):
        assert gr.default_config(kind, 0, cuda, False).rows >= 1
        assert adaln.default_config(kind, 0, cuda).rows >= 1
        assert qk_norm_rope.default_config(kind, 0, cuda).rows >= 1


# ------------------------------------------------------------------------------------------------------- GPU only
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("D", [200, 1536, 5120])
@pytest.mark.parametrize("kind", ["sample", "token", "bcast"])
def test_gpu_model_sizes_bit_exact_deterministic(kind, D):
    """The tuned launch shapes at model widths: output, dx and dy equal the eager formula bit for bit (the forward
    runs without FMA contraction), dgate is deterministic and within fp32 rounding of fp64."""
    B, N = 2, 1000
    x, y, table, dout = inputs(kind, B, N, D, BF16, BF16, F32, seed=D)
    gate = gate_view(kind, table)
    _, _, dy64, dg64, _ = reference_grads(x, y, table, kind, dout)
    out = gated_residual_forward(x, y, gate)
    assert torch.equal(out, gated_residual_reference(x, y, gate))
    runs = [gated_residual_backward(dout, y, gate) for _ in range(2)]
    for a, b in zip(*runs):  # no atomics: bit-for-bit the same
        assert torch.equal(a, b)
    dy, dgate = runs[0]
    assert torch.equal(dy, (dout.float() * gate).to(BF16))
    assert rel_err(dy, dy64) < TOL[BF16] and rel_err(dgate, dg64) < TOL[F32]
