"""What the op tests (adaln, gated_residual, qk_norm_rope, gelu_ffn, adaln_linear, gated_ffn) share: the device, the
tolerances against fp64, the relative error, the CUDA-only marker, leaves' gradients. Kept apart from
tests/helpers.py, which imports Hydra."""
import pytest
import torch

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # Triton compiles on CUDA, else interprets
# ‖out − ref‖ / ‖ref‖ against fp64 on the same rounded inputs: the output's own rounding dominates
TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64; out must be finite."""
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def grads_of(out, leaves, douts) -> list:
    """Backward of out (a tensor or a sequence) with douts; the leaves' gradients (None for a None leaf or one that
    got none), cleared afterwards so that the next call starts from zero."""
    torch.autograd.backward(out, douts)
    gs = [t.grad.detach().clone() if t is not None and t.grad is not None else None for t in leaves]
    for t in leaves:
        if t is not None:
            t.grad = None
    return gs


def fp64_leaves(ts) -> list:
    """Detached fp64 copies that require grad (None stays None): the reference's leaves."""
    return [t.detach().double().requires_grad_() if t is not None else None for t in ts]
