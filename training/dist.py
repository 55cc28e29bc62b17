"""Process group, device and the few collectives the loop needs; one code path on gloo (CPU) and NCCL (GPU).

Single-process CPU is the default; distributed only adds. `maybe_launch` lets `python train.py conf=wan21_8gpu`
start its own processes (torch's launcher API) when `launch.num_processes` asks for more than are running.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    ranks_per_device: int = 1  # >1 only under launch.debug_share_gpu (training/shared_gpu.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable; between our own processes only), in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_gather_floats(self, values: list[float]) -> torch.Tensor:
        """(world, len(values)) tensor of every rank's values."""
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        if not self.distributed:
            return t[None].cpu()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return torch.stack(out).cpu()

    def all_reduce_max(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    @property
    def comm_device(self) -> torch.device:
        return self.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")


def init_distributed(share_gpu: Optional[str] = None) -> DistContext:
    """accelerate's PartialState owns the process group and device placement (NCCL on GPUs, gloo on CPUs), whether
    torchrun, `accelerate launch` or train.py's own launcher started us. share_gpu (launch.debug_share_gpu, a debug
    rehearsal): every local rank on the machine's GPUs round-robin, the process group of training/shared_gpu.py."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and share_gpu is not None:
        from training.shared_gpu import init_process_group

        return DistContext(*init_process_group(share_gpu))
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistContext(0, 1, 0, device)
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    device = state.device if state.device.type == "cuda" else torch.device("cpu")
    return DistContext(state.process_index, state.num_processes, state.local_process_index, device)


def fsdp_options_from_env() -> dict:
    """FSDP2 options from `accelerate launch --config_file` (it exports its FSDP config as FSDP_* variables)."""
    flag = lambda name, default: os.environ.get(name, str(default)).lower() in ("1", "true", "yes")
    return {"reshard_after_forward": flag("FSDP_RESHARD_AFTER_FORWARD", True),
            "offload_params": flag("FSDP_OFFLOAD_PARAMS", False)}


def check_devices(num_processes: int, device: str, share_gpu: Optional[str] = None) -> None:
    """Refuse at once what cannot run here: launch.device=cuda with fewer GPUs than local processes (a GPU preset
    on a CPU machine would otherwise build its model in host memory, once per process), or more processes than
    GPUs on a GPU machine — unless launch.debug_share_gpu puts them on the GPUs there are (it needs one)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if share_gpu is not None:
        from training.shared_gpu import check_mode, device_for

        check_mode(share_gpu)
        if device == "cpu":
            raise ValueError("launch.debug_share_gpu puts ranks on a GPU, launch.device=cpu on CPUs: choose one")
        device_for(0, gpus)  # refuses a machine without a GPU
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))
    if device == "cuda" and gpus < local:
        raise ValueError(f"this run wants {local} GPU process(es) (launch.device=cuda, launch.num_processes="
                         f"{num_processes}) but this machine has {gpus} GPU(s): run it where there are, "
                         + (f"lower launch.num_processes to {gpus}, " if gpus else "")
                         + "or set launch.device=cpu to try it on CPUs")
    if gpus and "LOCAL_RANK" not in os.environ and gpus < num_processes:
        raise ValueError(f"launch.num_processes={num_processes} but this machine has {gpus} GPUs: lower it or use "
                         "a multi-node launcher")


def launcher() -> str:
    """Who started this process: torchrun (or train.py's own launch), accelerate, or plain python."""
    if any(k.startswith("ACCELERATE_") for k in os.environ):
        return "accelerate launch"
    if os.environ.get("ADAPTIVELOAD_SELF_LAUNCHED"):
        return "train.py (launch.num_processes)"
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        return "torchrun"
    return "python (one process)"


def cpu_threads(requested: Optional[int]) -> int:
    """Intra-op threads for a CPU process: launch.cpu_threads, else OMP_NUM_THREADS, else 1. torch's default (every
    core) oversubscribes a shared machine, and the small CPU models gain nothing from more threads."""
    n = requested or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or 1
    torch.set_num_threads(n)
    return n


def maybe_launch(num_processes: int, device: str = "auto", share_gpu: Optional[str] = None) -> None:
    """Re-run this command under torch's elastic launcher with `num_processes` processes when no launcher did."""
    check_devices(num_processes, device, share_gpu)
    if num_processes <= 1 or "LOCAL_RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    from torch.distributed.run import main as torchrun

    # On SIGTERM the launcher forwards the signal and kills the workers after this many seconds (default 30): each
    # rank finishes its step and writes its checkpoint shards first, which takes longer than 30 s at 14B.
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "900")
    os.environ["ADAPTIVELOAD_SELF_LAUNCHED"] = "1"
    torchrun(["--standalone", f"--nproc_per_node={num_processes}", sys.argv[0], *sys.argv[1:]])
    sys.exit(0)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
