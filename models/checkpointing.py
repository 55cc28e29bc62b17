"""Activation checkpointing, applied per micro-batch from outside: which blocks recompute in backward, which of them
keep their self-attention, whether their inputs wait in host memory, and how a block's ops learn which pass runs.

A model that mixes in `CheckpointingMixin` provides `blocks` and runs block i as `self.run_block(i, block, *args)`;
the trainer turns it with `set_activation_checkpointing(k, keep_attention=j)` before each micro-batch (a hook, not a
wrapper, so state-dict keys never change; models/parallelize.py documents the order: fused ops → activation
checkpointing → compile → FSDP). Block i runs

    plainly                                    i ≥ k, or no autograd
    recomputed in backward                     i < k               (torch.utils.checkpoint, non-reentrant)
    recomputed around its kept attention       k − j ≤ i < k       (a selective policy: keep_attention_context)
    recomputed from a host copy of its input   i < k, model.offload_checkpoints (models/offload.py, one process)

The first k blocks, because backward reaches them last: by then the later blocks' saved activations are freed, so k
recomputed blocks lower the peak by k blocks' worth. The last j of those keep their attention, because backward
reaches them first: their kept outputs are freed before the first blocks' backward, where the step peaks.

Passes: a checkpointed block runs twice before its backward — the forward (its output used, what it saves dropped)
and the recompute (what it saves used, its output dropped). `passes(fn)` marks the two calls; `current_pass()` reads
the mark inside (thread-local: backward may run on another thread), and a block hands it to ops that skip the work a
pass does not use (ops/gated_ffn.py's `checkpoint_pass` argument).
"""
from __future__ import annotations

import contextlib
import numbers
import threading

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from models.offload import HostStore, offloaded_checkpoint
from ops.gated_ffn import PASSES

# ------------------------------------------------------------------------------------------------------------- passes
_PASS = threading.local()


@contextlib.contextmanager
def checkpoint_pass(kind: str | None):
    """Marks the code inside as one pass of an activation-checkpointed block: "forward" (its output is used, what it
    saves for backward is not: torch.utils.checkpoint's first call, or a forward without autograd), "recompute" (what
    it saves is used, its output is not), None (a plain call)."""
    if kind not in PASSES:
        raise ValueError(f"checkpoint_pass must be one of {PASSES}, got {kind!r}")
    prev = getattr(_PASS, "kind", None)
    _PASS.kind = kind
    try:
        yield
    finally:
        _PASS.kind = prev


def current_pass() -> str | None:
    """The pass the calling code runs in (checkpoint_pass); None outside any checkpointed block."""
    return getattr(_PASS, "kind", None)


def passes(fn):
    """fn with its calls marked: the first the forward, later ones recomputes (torch.utils.checkpoint's calls, or the
    offloaded checkpoint's). One wrapper per checkpoint call, around one block whose tail op's output is what fn
    returns: nothing inside the checkpointed region may read that output (in the recompute it is NaN — a forward hook
    on the block computing with it, or two tails in one region, would see NaN gradients, not silently wrong ones).
    Selective policies may save attention (keep_attention_context), not matmuls: on CUDA the forward pass calls the up
    projection as _addmm_activation and the recompute as addmm, so a saved addmm would be handed to the wrong call
    (torch.utils.checkpoint raises on the mismatch)."""
    calls = [0]

    def run(*args, **kwargs):
        calls[0] += 1
        with checkpoint_pass("forward" if calls[0] == 1 else "recompute"):
            return fn(*args, **kwargs)
    return run


# ---------------------------------------------------------------------------------------------- kept self-attention
def attention_ops() -> tuple:
    """The aten ops of SDPA's fused kernels (what F.scaled_dot_product_attention and ops/rope_attention.py call)."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return tuple(getattr(aten, n).default for n in names if hasattr(aten, n))


class _Joint(threading.local):
    depth = 0


_JOINT = _Joint()


@contextlib.contextmanager
def joint_attention():
    """Marks SDPA calls that are a self-attention although their keys are fewer than their queries (the MMDiT's
    joint attention over padded text, run as key lengths: models/layers.py KeyLengths), so that keep_attention
    keeps them as it keeps the same attention run with a mask."""
    _JOINT.depth += 1
    try:
        yield
    finally:
        _JOINT.depth -= 1


def keep_attention_context():
    """Selective checkpointing (torch.utils.checkpoint): the self-attention's SDPA kernel is saved in forward,
    everything else is recomputed — the recompute then reuses its output and log-sum-exp instead of running it.
    Self-attention only (keys as many as queries): a cross-attention to 512 text tokens costs 512/S of it to rerun
    but holds as many output bytes (what keeping both costs in memory: results/step_h200.md). A cross-attention to
    exactly as many tokens as queries is kept too (memory only)."""
    ops = attention_ops()

    def policy(ctx, op, *args, **kwargs):
        # q, k: [B, H, N, Dh], [B, H, L, Dh]; a joint attention run as key lengths has fewer keys than queries
        if op in ops and (args[0].shape[-2] == args[1].shape[-2] or _JOINT.depth):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


# -------------------------------------------------------------------------------------------------------- the mixin
class CheckpointingMixin:
    """Mixin: which blocks recompute their activations in backward, set per micro-batch from outside (the module
    docstring). The model provides `blocks` and runs them through `run_block`."""

    _checkpointing = 0    # the number of leading blocks that recompute in backward
    _keep_attention = 0   # of the recomputed blocks, how many (the last of them) keep their self-attention outputs
    # Recomputed blocks keep their inputs in pinned host memory between forward and backward (models/offload.py;
    # model.offload_checkpoints; what it saves: results/step_h200.md). Single process only (parallelize refuses it
    # under FSDP2). Honoured by models whose forward hands run_block an offload_store (Wan).
    offload_checkpoints = False

    def set_activation_checkpointing(self, enabled, keep_attention: int = 0) -> None:
        """Which blocks recompute their activations in backward (the trainer decides per micro-batch): True every
        block, False none, an int k the first k blocks.

        keep_attention = j ≤ k: the last j recomputed blocks (k − j … k − 1) keep their self-attention's output and
        log-sum-exp from the forward (keep_attention_context), so their recompute skips it, the costliest op at long
        S, for B·S·D·2 bytes a block (plus B·heads·S·4)."""
        n = len(self.blocks)
        if isinstance(enabled, bool) or (hasattr(enabled, "dtype") and getattr(enabled, "dtype", None) == bool):
            k = n if enabled else 0
        elif isinstance(enabled, numbers.Integral):
            k = int(enabled)
        else:
            raise TypeError(f"set_activation_checkpointing takes a bool or a block count, got {enabled!r}")
        if not 0 <= k <= n:
            raise ValueError(f"activation checkpointing: {enabled!r} blocks asked for, the model has {n}")
        if not isinstance(keep_attention, numbers.Integral) or not 0 <= keep_attention <= k:
            raise ValueError(f"activation checkpointing: keep_attention={keep_attention!r} must lie in [0, {k}] "
                             "(the recomputed blocks)")
        self._checkpointing, self._keep_attention = k, int(keep_attention)

    def recomputes(self, i: int) -> bool:
        """Whether block i recomputes in this forward (never without autograd)."""
        return i < self._checkpointing and torch.is_grad_enabled()

    def keeps_attention(self, i: int) -> bool:
        """Whether block i, recomputed, keeps its self-attention outputs (the last keep_attention recomputed blocks)."""
        return self._checkpointing - self._keep_attention <= i < self._checkpointing

    def offload_store(self, device: torch.device) -> HostStore | None:
        """Where this forward's recomputed blocks keep their inputs: a HostStore when model.offload_checkpoints is on
        and some block recomputes, else None (their inputs stay on the device)."""
        if self.offload_checkpoints and self._checkpointing > 0 and torch.is_grad_enabled():
            return HostStore(device)
        return None

    def run_block(self, i: int, block, *args, store: HostStore | None = None):
        """Block i as this forward runs it: plainly, recomputed in backward, or recomputed around its kept attention;
        with a store (offload_store), recomputed from a host copy of its input. Every recompute is marked (passes):
        the block's ops learn which call is the recompute."""
        if not self.recomputes(i):
            return block(*args)
        context_fn = keep_attention_context if self.keeps_attention(i) else None
        if store is not None:  # its input in host memory, its kept attention output (if any) on the device
            return _offloaded(block, store, args, context_fn)
        if context_fn is not None:
            return checkpoint(passes(block), *args, use_reentrant=False, context_fn=context_fn)
        return checkpoint(passes(block), *args, use_reentrant=False)


def _offloaded(block, store: HostStore, args: tuple, context_fn):
    """offloaded_checkpoint over block(x, *rest), whose arguments are tensors or tuples of tensors (RoPE's (cos, sin)):
    the tuples travel flattened and are rebuilt for the block (as plain tuples: a tuple subclass such as the MMDiT's
    KeyLengths, which holds ints, must not come this way — the MMDiT hands run_block no offload store)."""
    sizes = [len(a) if isinstance(a, tuple) else None for a in args[1:]]
    flat = [t for a in args[1:] for t in (a if isinstance(a, tuple) else (a,))]

    def run(x, *tensors):
        rest, it = [], iter(tensors)
        for n in sizes:
            rest.append(next(it) if n is None else tuple(next(it) for _ in range(n)))
        return block(x, *rest)

    return offloaded_checkpoint(passes(run), store, args[0], *flat, context_fn=context_fn)
