"""Fused execution of the Wan block, applied from outside: the reference model (models/wan.py) with its blocks'
memory-bound work around the matmuls run by the fused ops of ops/, same parameters, same state-dict keys.

    apply_fused_ops(model, "auto")      WanBlock → FusedWanBlock, WanAttention → FusedWanAttention (class swap:
                                        every parameter object and key stays); the backend is read per forward

What the fused block runs where the reference runs plain PyTorch (backend "triton"; "auto" is Triton on CUDA and
the reference elsewhere; "torch" the reference, bit for bit):

    1. self-attention    AdaLN fused into the q/k/v projections, y not saved          ops/adaln_linear.py
                         q/k RMSNorm + RoPE inside attention, saving q and k once     ops/rope_attention.py
                         x + gate · attn in one pass                                   ops/gated_residual.py
    2. cross-attention   LN_affine(x) = AdaLN(x; scale = w − 1, shift = b) fused into to_q, q/k RMSNorm inside
                         attention (angle 0), the residual's gradient summed in the norm's backward kernel
    3. feed-forward      AdaLN → MLP saving x and its pre-activation only              ops/adaln_linear.py
                         or, for long sequences, the whole tail x + gate · MLP(AdaLN(x)) as one op whose
                         checkpoint recompute stops after W1·y                          ops/gated_ffn.py

`recompute_norms` (True): AdaLN's outputs and the rotated q/k are remade in backward rather than saved (the memory
and time it trades: results/step_h200.md). False saves them. The residual stream's gradient reaches dx inside the
norms' backward kernels (adaln_linear's residual alias), not through a separate add.

A projection wrapped by peft (LoRA) runs its module, in the reference path's order (v, q, k: the same dropout draws):
in self-attention any wrapped q/k/v turns the AdaLN fusion off (all three read its output); in cross-attention only
a wrapped to_q does (k and v read the text); a wrapped MLP runs the reference MLP between the fused AdaLN and the
fused residual. Hooks on a plain nn.Linear do not run inside the fused ops, which read its weights directly.

Order (models/parallelize.py): fused ops → activation checkpointing → compile → FSDP2. FSDP2 gives each block a
class of its own (FSDP<Block>), which a swap would drop: apply_fused_ops refuses a reference block wrapped so.
models/build.py applies the fused ops first; afterwards `model.fused_ops` only changes the backend the blocks read.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from models.checkpointing import current_pass
from models.config import warn_deprecated
from models.layers import FP32LayerNorm, attention
from models.wan import WanAttention, WanBlock
from ops.adaln import adaln_modulate
from ops.adaln_linear import adaln_gelu_ffn, adaln_linear, fuses_adaln
from ops.gated_ffn import adaln_gelu_ffn_gated, gated_tail_applies
from ops.gated_residual import gated_residual
from ops.gelu_ffn import gelu_ffn
from ops.qk_norm_rope import qk_norm_rope
from ops.rope_attention import rope_attention
from ops.triton_setup import BACKENDS, HAS_TRITON

FUSED_OPS = BACKENDS  # auto | triton | torch


def resolve_fused_ops(backend: str, x: torch.Tensor) -> str:
    """"auto": the fused ops on CUDA, the reference path (bit for bit diffusers' math) elsewhere."""
    if backend == "auto":
        return "triton" if x.is_cuda and HAS_TRITON else "torch"
    return backend


def _no_rotation(x_BND: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = 1, sin = 0 for every token, as stride-0 views of one row: qk_norm_rope then is RMSNorm exactly
    (n·1 − n'·0 = n in fp32, and n is already rounded to x's dtype)."""
    K = x_BND.shape[-1] // heads // 2
    one = torch.ones(1, K, device=x_BND.device)
    return one.expand(x_BND.shape[1], K), torch.zeros_like(one).expand(x_BND.shape[1], K)


class FusedWanAttention(WanAttention):
    """WanAttention whose forward may take its input's AdaLN and run the fused ops (the module docstring)."""

    def forward(self, x_BND: torch.Tensor, ctx_BLD: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, *, backend: str = "torch",
                norm: tuple | None = None, recompute: bool = True, residual: bool = False):
        """backend "torch" with no norm is WanAttention.forward. norm = (scale, shift, eps, norm backend): x_BND is
        the residual stream and the attention's input is AdaLN(x; scale, shift) — under the fused ops made inside the
        projections that read it (not saved for backward), else made first. recompute=False: AdaLN's output and the
        rotated q/k are saved for backward instead of remade. residual=True returns (output, x_res): x_res is x_BND
        to add the output to — under the fused norm an alias whose gradient the norm's backward kernel sums into dx."""
        x_res = x_BND
        reads_x = [self.to_q] if ctx_BLD is not None else [self.to_q, self.to_k, self.to_v]
        fuse_norm = (backend != "torch" and recompute and norm is not None
                     and all(type(m) is nn.Linear for m in reads_x) and fuses_adaln(x_BND, *norm[:2], norm[3]))
        if norm is not None and not fuse_norm:  # AdaLN's output made here, and saved by what reads it
            x_BND = adaln_modulate(x_BND, *norm[:3], backend=norm[3])
        if backend == "torch":
            out = super().forward(x_BND, ctx_BLD, rope)
            return (out, x_res) if residual else out
        if fuse_norm:
            scale, shift, eps, norm_backend = norm
            *projected, x_res = adaln_linear(x_BND, scale, shift, eps, [(m.weight, m.bias) for m in reads_x],
                                             backend=norm_backend, residual=True)
            if ctx_BLD is None:
                q, k, v = projected
            else:  # v before k: a LoRA-wrapped one draws its dropout in the reference path's order
                q, v = projected[0], self.to_v(ctx_BLD)
                k = self.to_k(ctx_BLD)
        else:  # e.g. a LoRA-wrapped projection, running its module in the reference path's order
            kv_BLD = x_BND if ctx_BLD is None else ctx_BLD
            v = self.to_v(kv_BLD)
            q, k = self.to_q(x_BND), self.to_k(kv_BLD)
        rope_q = rope_k = rope
        if rope is None:  # cross-attention: angle 0, the norm only
            rope_q, rope_k = _no_rotation(q, self.heads), _no_rotation(k, self.heads)
        if not recompute:
            q = qk_norm_rope(q, self.norm_q.weight, *rope_q, self.norm_q.eps, backend=backend)
            k = qk_norm_rope(k, self.norm_k.weight, *rope_k, self.norm_k.eps, backend=backend)
            out = self.to_out[0](attention(q.unflatten(-1, (self.heads, -1)), k.unflatten(-1, (self.heads, -1)),
                                           v.unflatten(-1, (self.heads, -1)), self.attention_backend))
        else:
            out = self.to_out[0](rope_attention(q, k, v, self.heads, self.norm_q.weight, self.norm_k.weight, rope_q,
                                                rope_k, self.norm_q.eps, self.norm_k.eps, backend=backend,
                                                sdpa_backend=self.attention_backend))
        return (out, x_res) if residual else out


class FusedWanBlock(WanBlock):
    """WanBlock run by the fused ops (the module docstring); fused_ops "torch", or "auto" off CUDA, is WanBlock."""

    fused_ops = "torch"      # set by apply_fused_ops (model.fused_ops)
    recompute_norms = True   # AdaLN's outputs and the rotated q/k remade in backward (False: saved)

    @property
    def recompute_glue(self) -> bool:
        """Deprecated: the old name of `recompute_norms` (one release)."""
        warn_deprecated("WanBlock.recompute_glue", "FusedWanBlock.recompute_norms")
        return self.recompute_norms

    @recompute_glue.setter
    def recompute_glue(self, value: bool) -> None:
        warn_deprecated("WanBlock.recompute_glue", "FusedWanBlock.recompute_norms", stacklevel=4)
        self.recompute_norms = value

    def forward(self, x_BND: torch.Tensor, ctx_BLD: torch.Tensor, tmod_BT6D: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        backend = resolve_fused_ops(self.fused_ops, x_BND)
        if backend == "torch":
            return super().forward(x_BND, ctx_BLD, tmod_BT6D, rope)
        shift_msa, scale_msa, gate_msa, shift_ff, scale_ff, gate_ff = self.modulation(tmod_BT6D)
        rec = self.recompute_norms

        # 1. self-attention; x_res: the residual stream, through the fused norm's alias where there is one
        attn, x_res = self.attn1(x_BND, rope=rope, backend=backend, recompute=rec, residual=True,
                                 norm=(scale_msa, shift_msa, self.eps, self.adaln_backend))
        x_BND = gated_residual(x_res, attn, gate_msa, backend=backend)

        # 2. cross-attention
        if isinstance(self.norm2, FP32LayerNorm):  # LN·w + b = AdaLN with scale w − 1, shift b
            w, b = self.norm2.weight.float(), self.norm2.bias.float()
            attn, x_res = self.attn2(x_BND, ctx_BLD, backend=backend, recompute=rec, residual=True,
                                     norm=((w - 1)[None, None], b[None, None], self.norm2.eps, backend))
            x_BND = x_res + attn
        else:
            x_BND = x_BND + self.attn2(self.norm2(x_BND), ctx_BLD, backend=backend, recompute=rec)

        # 3. feed-forward
        proj, out = self.ffn.net[0].proj, self.ffn.net[2]
        if type(proj) is nn.Linear and type(out) is nn.Linear:
            # the MLP saving x and its pre-activation only (ops/gelu_ffn.py), AdaLN's output not at all
            if rec and fuses_adaln(x_BND, scale_ff, shift_ff, self.adaln_backend):
                if gated_tail_applies(x_BND, gate_ff):  # the residual inside: a recompute stops after W1·y
                    return adaln_gelu_ffn_gated(x_BND, scale_ff, shift_ff, self.eps, proj.weight, proj.bias,
                                                out.weight, out.bias, gate_ff, backend=self.adaln_backend,
                                                checkpoint_pass=current_pass())
                y = adaln_gelu_ffn(x_BND, scale_ff, shift_ff, self.eps, proj.weight, proj.bias, out.weight, out.bias,
                                   backend=self.adaln_backend)
            else:
                h = adaln_modulate(x_BND, scale_ff, shift_ff, self.eps, backend=self.adaln_backend)
                y = gelu_ffn(h, proj.weight, proj.bias, out.weight, out.bias, backend=backend)
        else:  # a LoRA-wrapped layer running its module
            y = self.ffn(adaln_modulate(x_BND, scale_ff, shift_ff, self.eps, backend=self.adaln_backend))
        return gated_residual(x_BND, y, gate_ff, backend=backend)


# ------------------------------------------------------------------------------------------------------- applying
_FUSED = {WanBlock: FusedWanBlock, WanAttention: FusedWanAttention}  # reference class → fused class


def apply_fused_ops(model: nn.Module, fused_ops: str = "auto") -> nn.Module:
    """The fused execution on every Wan block of `model`, in place (class swap: parameters, buffers, hooks and
    state-dict keys untouched), with `fused_ops` the backend its blocks read per forward (auto | triton | torch).
    Idempotent; again on a fused model it only changes the backend. A model without Wan blocks (the MMDiT) is left
    as it is. Returns the model. Apply it before FSDP2 (models/parallelize.py's order)."""
    if fused_ops not in FUSED_OPS:
        raise ValueError(f"fused_ops must be one of {FUSED_OPS}, got {fused_ops!r}")
    fused_classes = tuple(_FUSED.values())
    wrapped = [m for m in model.modules() if isinstance(m, tuple(_FUSED)) and type(m) not in _FUSED
               and not isinstance(m, fused_classes)]  # a reference block whose class FSDP2 (or another) replaced
    if wrapped and fused_ops != "torch":
        raise ValueError(f"apply_fused_ops: {type(wrapped[0]).__name__} was wrapped before the fused ops were "
                         "applied; apply them first (fused ops → activation checkpointing → compile → FSDP2: "
                         "models/build.py does so)")
    if not wrapped:
        for m in model.modules():
            if type(m) in _FUSED:
                m.__class__ = _FUSED[type(m)]
                if "recompute_glue" in vars(m):  # the old name, set on a reference block before the swap
                    warn_deprecated("WanBlock.recompute_glue", "FusedWanBlock.recompute_norms")
                    m.recompute_norms = vars(m).pop("recompute_glue")
    for m in model.modules():
        if isinstance(m, FusedWanBlock):
            m.fused_ops = fused_ops
    model._fused_ops = fused_ops
    return model
