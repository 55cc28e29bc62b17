"""Debug only: several ranks of one run on one GPU (`launch.debug_share_gpu`), to rehearse the trainer's multi-rank
CUDA code — device placement, FSDP2's sharding of CUDA parameters, mixed precision, DCP checkpoints from GPU memory,
resume — on a machine with one GPU. Slower than one process and never a way to train; results/two_ranks_one_gpu.md
says what ran.

Every local rank takes device cuda:(local_rank mod GPUs), and the process group is built here instead of by
accelerate's PartialState (which would place local rank r on cuda:r):

    nccl   cpu:gloo, cuda:nccl   NCCL itself; it refuses two ranks on one device when its communicator is made
                                 (at the first CUDA collective), and says so
    gloo   gloo for CPU and CUDA gloo's own CUDA collectives (it stages through host memory inside)
    host   gloo, with every torch.distributed collective on a CUDA tensor staged here: the CUDA tensors are
           copied to the host, the gloo collective runs on the copies, the first argument (the output) is
           copied back. For the collectives gloo does not serve on CUDA tensors. Functional collectives
           (DTensor's redistribution) bypass it and reach gloo directly.

Each rank's memory is its share of the device: total memory / ranks on it (`ranks_per_device`), as the allocator's
cap (torch.cuda.set_per_process_memory_fraction) and as the live shape benchmark's budget (whose file records the
sharing in its `execution`, so no run on whole GPUs takes it). A calibration file's budget is the whole device's:
set scheduling.mem_budget_gib to each rank's share when planning from one.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MODES = ("nccl", "gloo", "host")
BACKENDS = {"nccl": "cpu:gloo,cuda:nccl", "gloo": "cpu:gloo,cuda:gloo", "host": "cpu:gloo,cuda:gloo"}
# the torch.distributed collectives a host-staged process stages (whichever this torch has: FSDP2 calls
# all_gather_into_tensor / reduce_scatter_tensor in torch ≤ 2.12, all_gather_single / reduce_scatter_single after)
STAGED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
          "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single")
OUTPUT_NAMES = ("output", "output_tensor", "output_tensor_list", "tensor_list", "tensor")  # their first parameter


def check_mode(mode: str | None) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"launch.debug_share_gpu must be null or one of {MODES} (a debug rehearsal of several "
                         f"ranks on one GPU), got {mode!r}")


def device_for(local_rank: int, gpus: int) -> torch.device:
    """The device of a local rank when every local rank shares the machine's `gpus` GPUs round-robin."""
    if gpus < 1:
        raise ValueError("launch.debug_share_gpu puts several ranks on one GPU, and this machine has none: leave it "
                         "null")
    return torch.device("cuda", local_rank % gpus)


def ranks_per_device(local_world: int, gpus: int, local_rank: int) -> int:
    """How many of this node's `local_world` ranks share local_rank's device (round-robin placement)."""
    return len([r for r in range(local_world) if r % gpus == local_rank % gpus])


def init_process_group(mode: str) -> tuple[int, int, int, torch.device, int]:
    """(rank, world size, local rank, device, ranks on this device) of this process, its process group made for
    `mode` (module docstring)."""
    check_mode(mode)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = device_for(local_rank, gpus)
    torch.cuda.set_device(device)
    dist.init_process_group(backend=BACKENDS[mode])
    if mode == "host":
        stage_through_host(lambda t: t.is_cuda)
    share = ranks_per_device(local_world, gpus, local_rank)
    # each rank's allocator holds its share of the device and no more: the memory budget is then true per rank, and
    # a micro-batch that does not fit runs out of memory on every rank at the same allocation (ranks sharing the
    # device without a cap ran out one at a time: one rank's cached blocks starved the other, which left it alone in
    # the shape benchmark's out-of-memory handling while the other waited in FSDP's reduce-scatter)
    torch.cuda.set_per_process_memory_fraction(1.0 / share, device)
    if rank == 0:
        log.warning("launch.debug_share_gpu=%s: %d local rank(s) on %d GPU(s), %d on this one; process group %s%s. "
                    "A rehearsal of the multi-rank CUDA code, not a way to train", mode, local_world, gpus, share,
                    BACKENDS[mode], ", CUDA collectives staged through host memory" if mode == "host" else "")
    return rank, world, local_rank, device, share


class _Done:
    """What an async_op=True staged collective returns: it has already finished (callers that wait, may)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _to_host(x: Any, stage: Callable[[torch.Tensor], bool]) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True) if stage(x) else x
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(v, stage) for v in x)
    return x


def _back(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        if dst is not src:
            dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _back(d, s)


def _has(x: Any, stage: Callable[[torch.Tensor], bool]) -> bool:
    if isinstance(x, torch.Tensor):
        return stage(x)
    return isinstance(x, (list, tuple)) and any(_has(v, stage) for v in x)


def staged(fn: Callable, stage: Callable[[torch.Tensor], bool]) -> Callable:
    """fn (a torch.distributed collective whose first argument is its output, or its in-place tensor) with every
    tensor argument for which stage(tensor) holds run on a host copy; the output is copied back. Synchronous: with
    async_op=True it returns an already-completed work."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not any(_has(a, stage) for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)
        async_op = kwargs.pop("async_op", False)
        host_args = [_to_host(a, stage) for a in args]
        host_kwargs = {k: _to_host(v, stage) for k, v in kwargs.items()}
        work = fn(*host_args, **host_kwargs)
        if work is not None and hasattr(work, "wait"):  # async_op passed by position: finish before copying back
            work.wait()
        if args:
            _back(args[0], host_args[0])
        else:  # called by keyword
            name = next(n for n in OUTPUT_NAMES if n in kwargs)
            _back(kwargs[name], host_kwargs[name])
        return _Done() if async_op else None

    run.__wrapped_collective__ = fn
    return run


def stage_through_host(stage: Callable[[torch.Tensor], bool]) -> list[str]:
    """Replace this process's torch.distributed collectives (STAGED, those this torch has) by staged ones; returns
    their names. Idempotent; `restore()` undoes it."""
    done = []
    for name in STAGED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        setattr(dist, name, staged(getattr(fn, "__wrapped_collective__", fn), stage))
        done.append(name)
    return done


def restore() -> None:
    for name in STAGED:
        fn = getattr(dist, name, None)
        if fn is not None and hasattr(fn, "__wrapped_collective__"):
            setattr(dist, name, fn.__wrapped_collective__)
