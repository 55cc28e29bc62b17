"""Which SDPA kernel runs attention (`model.attention_backend`), chosen per call and never silently replaced.

    auto       cuDNN on CUDA GPUs of compute capability 9.0 and later (measured on Hopper), flash on older ones;
               on a CPU, torch's own choice (its flash kernel for CPU, else math)
    cudnn      torch's cuDNN attention          flash      FlashAttention-2
    efficient  the memory-efficient kernel      math       the composed reference (any dtype, any mask)

Every call runs under `sdpa_kernel(order, set_priority=True)`: the chosen kernel first, then the others in the order
cudnn, flash, efficient, math (on a CPU, flash then math, or math alone). Where the chosen kernel cannot serve a
call (its dtype, head_dim, mask or device) SDPA takes the next that can, and `sdpa` says so once in the log for
each (asked, served, dtype, head_dim, masked): the numbers are always those of a kernel that serves the shape.
Inside torch.compile the choice is not probed, so a compiled model's fallback goes unlogged.

cuDNN's backward is handed its output's gradient laid out as the output (GradLikeOutput). The MMDiT's single-stream
block concatenates the attention's output with its MLP's before one projection, so the gradient reaching SDPA is a
slice of a wider tensor: its rows lie 5·D apart where the output's lie D apart. torch 2.11's cuDNN backward reads
such a dO wrong: raw SDPA's dq, dk and dv land far from fp32 math, sdpa()'s within bf16 rounding
(tests/test_attention_backend.py; the H200's numbers in results/attention_h200.md, "The MMDiT at HunyuanVideo width
on cuDNN"), as the MMDiT's gradients did before the copy. The copy, where the layouts differ (the single-stream
blocks only), costs one pass over the gradient.
A call that passes `cudnn=False` leaves cuDNN out. A call with a boolean mask leaves it out unless
MASKED_CUDNN: a key-padding mask through cuDNN was within 0.3 % of fp32 math (results/attention_h200.md), but torch
2.11's cuDNN backward is reported upstream to return NaN dq under a mask at lengths ≡ 64 (mod 128) (not reproduced
here at the lengths tried: results/attention_h200.md), and the MMDiT runs its padded text without a mask
(models/layers.py KeyLengths). Flash takes no mask either: a masked call runs the
memory-efficient kernel.

The models hold the choice as a module attribute (`attention_backend` on every attention module, set by
models/layers.py apply_attention_backend, as diffusers' `set_attention_backend`) and hand it to every call: an
activation-checkpointed block's recompute runs the kernel its forward ran, and the selective policy that keeps
attention outputs (models/checkpointing.py) sees the same aten op. ops/rope_attention.py asks kernel_for which
kernel to call directly.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
ORDER = ("cudnn", "flash", "efficient", "math")
_SDP = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
_CHOICE = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}  # torch._fused_sdp_choice's values (SDPBackend)
MASKED_CUDNN = False  # whether a boolean mask may go to cuDNN: not while the report below stands (module docstring)
CUDNN_MIN_CAPABILITY = 9  # auto prefers cuDNN from Hopper on (measured: results/attention_h200.md)

log = logging.getLogger(__name__)
_seen: set = set()      # fallbacks already logged
_served: dict = {}      # (asked, shapes, strides, dtype, device, mask, cudnn) → the kernel that serves it


def check_backend(name: str, field: str = "model.attention_backend") -> str:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"{field} must be one of {ATTENTION_BACKENDS}, got {name!r}")
    return name


def preferred(name: str, device: torch.device, cudnn: bool = True) -> str:
    """The kernel `name` asks for on `device` (auto resolved; cudnn=False: a caller that keeps cuDNN out)."""
    check_backend(name)
    if name != "auto":
        return name
    if cudnn and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= CUDNN_MIN_CAPABILITY:
        return "cudnn"
    return "flash"


def order(name: str, device: torch.device, masked: bool = False, cudnn: bool = True) -> list[str]:
    """The kernels SDPA may run for one call, first choice first (cuDNN left out where `cudnn` is false, and under a
    mask unless MASKED_CUDNN). A CPU has two, and SDPA there takes flash wherever it is enabled and serves (it reads
    no priority): math alone when math is asked for."""
    first = preferred(name, device, cudnn)
    if device.type == "cpu":
        return ["math"] if first == "math" else ["flash", "math"]
    kinds = [first] + [k for k in ORDER if k != first]
    return [k for k in kinds if not (k == "cudnn" and (not cudnn or masked and not MASKED_CUDNN))]


def describe(name: str, device: torch.device, cudnn: bool = True) -> str:
    """One line for the run's log: what model.attention_backend resolves to on this device, and why (cudnn=False: a
    model whose attention keeps cuDNN out: the MMDiT where models/layers.py MMDIT_CUDNN is off)."""
    first = preferred(name, device, cudnn)
    if device.type != "cuda":
        served = "math" if first == "math" else "torch's own choice (its flash kernel where it serves, else math)"
        note = ("" if name in ("auto", "flash", "math")
                else f"; a {device.type} has no {first} kernel, said again at the first call")
        return f"attention: model.attention_backend={name} → {served} on {device.type}{note}"
    if name != "auto":
        why = "as configured" + ("" if cudnn or name != "cudnn" else "; this model's attention never runs cuDNN")
    else:
        major, minor = torch.cuda.get_device_capability(device)
        why = f"auto on {torch.cuda.get_device_name(device)} (compute capability {major}.{minor})" + (
            "" if cudnn else "; this model's attention never runs cuDNN")
    return (f"attention: model.attention_backend={name} → {first} ({why}); a call it cannot serve falls back in "
            f"the order {', '.join(order(name, device, cudnn=cudnn)[1:])}, said once; a masked call runs the "
            "memory-efficient kernel")


class GradLikeOutput(torch.autograd.Function):
    """The identity, whose backward hands on the gradient laid out as the output was (strides and all): cuDNN's SDPA
    backward then reads dO as it reads O (the module docstring). No copy where the layouts already agree."""

    @staticmethod
    def forward(ctx, o: torch.Tensor) -> torch.Tensor:
        ctx.layout = o.stride()
        return o.view_as(o)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        if g.stride() == ctx.layout:
            return g
        return torch.empty_strided(g.shape, ctx.layout, dtype=g.dtype, device=g.device).copy_(g)


def sdpa(q_BHND: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor, mask: torch.Tensor | None = None,
         backend: str = "auto", cudnn: bool = True) -> torch.Tensor:
    """F.scaled_dot_product_attention under `backend` (module docstring); q, k, v [B, H, N or L, Dh]."""
    kinds = order(backend, q_BHND.device, mask is not None, cudnn)
    with sdpa_kernel([_SDP[k] for k in kinds], set_priority=True):
        served = kinds[0] if torch.compiler.is_compiling() else kernel_for(backend, q_BHND, k_BHLD, v_BHLD, mask, cudnn)
        o = F.scaled_dot_product_attention(q_BHND, k_BHLD, v_BHLD, attn_mask=mask)
    return GradLikeOutput.apply(o) if served == "cudnn" and o.requires_grad else o


def kernel_for(backend: str, q_BHND: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
               mask: torch.Tensor | None = None, cudnn: bool = True) -> str:
    """The kernel SDPA runs for these tensors under `backend` as autograd would call it (no compute; cached per
    shape and strides), with the fallback logged once per process when it is not the one asked for. Not probed inside
    torch.compile (`sdpa` skips it there): a compiled model's fallback is not logged."""
    dev = q_BHND.device
    key = (backend, tuple(q_BHND.shape), q_BHND.stride(), tuple(k_BHLD.shape), k_BHLD.stride(), v_BHLD.stride(),
           q_BHND.dtype, str(dev), None if mask is None else (mask.dtype, tuple(mask.shape)), cudnn)
    if key not in _served:
        kinds = order(backend, dev, mask is not None, cudnn)
        with sdpa_kernel([_SDP[k] for k in kinds], set_priority=True), torch.enable_grad():
            views = [t.detach().requires_grad_() for t in (q_BHND, k_BHLD, v_BHLD)]
            _served[key] = _CHOICE.get(int(torch._fused_sdp_choice(*views, attn_mask=mask)), "math")
    got, asked = _served[key], preferred(backend, dev, cudnn)
    # auto says nothing on a CPU (torch chooses) nor under a mask (the memory-efficient kernel is the intended one)
    if got != asked and not (backend == "auto" and (dev.type != "cuda" or mask is not None)):
        _log_fallback(backend, asked, got, q_BHND, mask, cudnn)
    return got


def _log_fallback(backend, asked, got, q, mask, cudnn) -> None:
    key = (asked, got, q.dtype, q.shape[-1], mask is not None, q.device.type, cudnn)
    if key in _seen:
        return
    _seen.add(key)
    if asked == "cudnn" and not cudnn:
        why = "this model's attention must not run it (ops/attention_backend.py: wrong gradients)"
    elif asked == "cudnn" and mask is not None and not MASKED_CUDNN:
        why = "it is not given boolean masks (ops/attention_backend.py MASKED_CUDNN)"
    else:
        why = (f"it cannot serve {q.dtype} q [B, H, N, Dh] = {list(q.shape)} on {q.device.type}"
               + (" with a mask" if mask is not None else ""))
    log.warning("attention: model.attention_backend=%s asks for %s, but %s; %s serves these calls", backend, asked,
                why, got)
