"""Activation checkpointing whose saved block inputs wait in pinned host memory (activation offload).

A recomputed block keeps only its input between forward and backward; over L blocks those inputs are L·B·S·D
elements on the GPU (Wan 1.3B at S = 32760: 30 × 100 MB = 3 GB, a third of the step's peak). Here each input is
copied to pinned host memory on a side stream as soon as the block has run, and copied back one block ahead of
backward (while the block after it recomputes), so the GPU holds at most two of them. The copies overlap compute.
Each cross-stream use is ordered: a forward input is record_stream'd to the copy stream (its memory is not reused
before the copy has read it); a prefetch buffer belongs to the compute stream, which waits for its copy before use,
so its memory returns the moment backward drops it, however far the CPU runs ahead of the GPU.

    forward:   out = block(x) without autograd (with a selective policy: under it, the graph dropped at once);
               host[i] ← x  (side stream)
    backward:  x = host[i] (prefetched);  out = block(x) with autograd, under the forward's autocast state;
               out.backward(dout);  prefetch host[i−1];  return dx and the gradients of the block's other inputs

A selective policy (context_fn, as torch.utils.checkpoint takes it) may keep some ops' outputs from the forward for
the recompute: the blocks that keep their attention (set_activation_checkpointing(keep_attention=j)) offload their
inputs too and keep only the self-attention's output.

`run` is called twice, the forward then the recompute: models/checkpointing.py (the only caller) marks the two calls
as it marks torch.utils.checkpoint's, so the block's last op skips what a pass does not use. The recompute is the
same forward as torch.utils.checkpoint's (autocast state and random state restored), so outputs and gradients equal
the plain model's (tested, also with frozen embedders). Limits, each refused with a
message: one backward per forward, `.backward()` only (not torch.autograd.grad), a single process (FSDP2's hooks
expect the non-reentrant checkpoint; parallelize refuses the pair).
On the CPU the "host copy" is a clone (same code path, nothing to save).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

_STREAMS: dict = {}  # one copy stream per device, shared by every forward


class HostStore:
    """The offloaded block inputs of one forward pass, in forward order."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            key = device.index if device.index is not None else torch.cuda.current_device()
            self.stream = _STREAMS.setdefault(key, torch.cuda.Stream(device))
        else:
            self.stream = None
        self.host: list = []   # pinned host copies (None once fetched)
        self.done: list = []   # event: the device-to-host copy finished
        self.gpu: dict = {}    # i → (device tensor, event: host-to-device copy finished), for prefetched inputs

    def __del__(self):
        # A prefetched input never taken (a backward that failed midway, e.g. out of memory) goes back to the
        # compute stream's pool when this dies: that stream first waits for its copy, so no later allocation there
        # is written by the copy still in flight.
        try:
            for x, ready in self.gpu.values():
                torch.cuda.current_stream(x.device).wait_event(ready)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to protect
            pass

    def put(self, x: torch.Tensor) -> int:
        x = x.detach()
        if not self.cuda:
            self.host.append(x.clone())
            self.done.append(None)
            return len(self.host) - 1
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(x.device))  # x is written
        with torch.cuda.stream(self.stream):
            host.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        x.record_stream(self.stream)  # x's memory is not reused before the copy has read it
        self.host.append(host)
        self.done.append(done)
        return len(self.host) - 1

    def _prefetch(self, i: int, device: torch.device) -> None:
        if i < 0 or i in self.gpu or self.host[i] is None:
            return
        # Allocated on the compute stream, which uses and frees it: its memory comes back the moment the block's
        # backward drops it. (Allocated on the side stream with record_stream, every free waited for an event, and
        # with the CPU queueing backward blocks ahead of the GPU, seven inputs were alive at the peak, not two.)
        # The copy waits until the compute stream is done with the memory's previous owner.
        current = torch.cuda.current_stream(device)
        x = torch.empty(self.host[i].shape, dtype=self.host[i].dtype, device=device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.done[i])
            x.copy_(self.host[i], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        self.gpu[i] = (x, ready)

    def take(self, i: int, device: torch.device) -> torch.Tensor:
        """Block i's input back on the device (backward runs blocks last to first: i − 1 is fetched meanwhile)."""
        if self.host[i] is None and i not in self.gpu:
            raise RuntimeError("model.offload_checkpoints: this block's input was already used by a backward; a "
                               "second backward through the same forward (retain_graph=True) is not supported")
        if not self.cuda:
            x, self.host[i] = self.host[i], None
            return x
        self._prefetch(i, device)
        x, ready = self.gpu.pop(i)
        current = torch.cuda.current_stream(device)
        current.wait_event(ready)  # every use of x on this stream comes after its copy
        self.host[i] = None
        self._prefetch(i - 1, device)
        return x


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Callable, store: HostStore, context_fn, anchor: torch.Tensor, x: torch.Tensor,
                *args: torch.Tensor) -> torch.Tensor:
        dev = x.device
        ctx.run, ctx.store, ctx.device = run, store, dev
        ctx.autocast = (torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))
        ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)
        if context_fn is None:
            ctx.recompute_context = None
            with torch.no_grad():
                out = run(x, *args)
        else:  # as the recompute will run it (autograd on, the same inputs needing grad): a selective policy's ops
            # must be called alike in both (SDPA computes its log-sum-exp only for autograd); the graph dies here
            forward_context, ctx.recompute_context = context_fn()
            needs = ctx.needs_input_grad[4:]
            with torch.enable_grad(), forward_context:
                out = run(*[a.detach().requires_grad_(n) for a, n in zip((x, *args), needs)]).detach()
        ctx.index = store.put(x)
        ctx.save_for_backward(*args)  # the small inputs (text, modulation, RoPE angles) stay where they are
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("model.offload_checkpoints recomputes blocks inside backward: it works with "
                               ".backward(), not torch.autograd.grad() or backward(inputs=...)")
        x = ctx.store.take(ctx.index, ctx.device).requires_grad_(ctx.needs_input_grad[4])
        args = [a.detach().requires_grad_(need) for a, need in zip(ctx.saved_tensors, ctx.needs_input_grad[5:])]
        enabled, dtype = ctx.autocast
        cuda = ctx.device.type == "cuda"
        # the forward's random state (e.g. LoRA dropout), so the recompute draws what the forward drew
        with torch.random.fork_rng(devices=[ctx.device] if cuda else [], device_type=ctx.device.type):
            torch.set_rng_state(ctx.rng[0])
            if cuda:
                torch.cuda.set_rng_state(ctx.rng[1], ctx.device)
            recompute_context, ctx.recompute_context = ctx.recompute_context or nullcontext(), None
            with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled), \
                    recompute_context:
                out = ctx.run(x, *args)  # only its graph is used: the block's last op may skip its output
        torch.autograd.backward(out, dout)
        return (None, None, None, None, x.grad if x.requires_grad else None,
                *(a.grad if a.requires_grad else None for a in args))


# Always requires grad, so that a block whose inputs do not (frozen embedders: LoRA, model.freeze) still runs its
# backward and its own parameters get their gradients — reentrant checkpointing's known gap.
_ANCHOR = torch.empty(0, requires_grad=True)


def offloaded_checkpoint(run: Callable, store: HostStore, x: torch.Tensor, *args: torch.Tensor,
                         context_fn: Callable | None = None) -> torch.Tensor:
    """run(x, *args) (tensors only) recomputed in backward from a host copy of x.

    context_fn: as torch.utils.checkpoint's — () → (forward context, recompute context), e.g. a selective policy
    (models.checkpointing.keep_attention_context) whose forward caches what the recompute then reuses. With one, the
    forward runs under autograd as the recompute will (its graph freed at once), so that every op is called alike."""
    return _OffloadedCheckpoint.apply(run, store, context_fn, _ANCHOR, x, *args)
