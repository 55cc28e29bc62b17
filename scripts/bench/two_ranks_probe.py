"""Which collectives a process-group backend serves on CUDA tensors when every rank shares one GPU (a script).

    torchrun --standalone --nproc_per_node 2 scripts/bench/two_ranks_probe.py --backend nccl --out probe_nccl.json
    torchrun --standalone --nproc_per_node 2 scripts/bench/two_ranks_probe.py --backend gloo --out probe_gloo.json

Every rank takes cuda:0. For each collective that FSDP2, DTensor's gradient clipping, DCP and the trainer call
(all_reduce SUM/AVG/MAX, broadcast, all_gather, all_gather_into_tensor, reduce_scatter_tensor SUM/AVG, barrier,
all_gather_object), in bf16 and fp32: whether it ran, whether its numbers are right, and the first line of the
error where it failed. Rank 0 writes the rows (JSON) and prints them. Checks nothing else; never asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

BACKENDS = {"nccl": "cpu:gloo,cuda:nccl", "gloo": "cpu:gloo,cuda:gloo"}


def cases(rank: int, world: int, dev: torch.device, dtype: torch.dtype):
    """(name, run) pairs; run() returns whether the result is right."""
    R = dist.ReduceOp
    n = 8
    mine = lambda: torch.arange(n, dtype=dtype, device=dev) + 100 * rank  # noqa: E731
    every = [torch.arange(n, dtype=torch.float64) + 100 * r for r in range(world)]

    def all_reduce(op, want):
        t = mine()
        dist.all_reduce(t, op=op)
        return torch.allclose(t.double().cpu(), want)

    def broadcast():
        t = mine()
        dist.broadcast(t, src=0)
        return torch.allclose(t.double().cpu(), every[0])

    def all_gather():
        out = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
        dist.all_gather(out, mine())
        return all(torch.allclose(o.double().cpu(), e) for o, e in zip(out, every))

    def all_gather_into_tensor():
        out = torch.empty(world * n, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, mine())
        return torch.allclose(out.double().cpu(), torch.cat(every))

    def reduce_scatter_tensor(op, scale):
        inp = torch.cat([mine() for _ in range(world)])
        out = torch.empty(n, dtype=dtype, device=dev)
        dist.reduce_scatter_tensor(out, inp, op=op)
        return torch.allclose(out.double().cpu(), sum(every) * scale)

    def barrier():
        dist.barrier()
        return True

    def all_gather_object():
        out = [None] * world
        dist.all_gather_object(out, {"rank": rank})
        return [o["rank"] for o in out] == list(range(world))

    return [("all_reduce SUM", lambda: all_reduce(R.SUM, sum(every))),
            ("all_reduce AVG", lambda: all_reduce(R.AVG, sum(every) / world)),
            ("all_reduce MAX", lambda: all_reduce(R.MAX, every[-1])),
            ("broadcast", broadcast), ("all_gather", all_gather), ("all_gather_into_tensor", all_gather_into_tensor),
            ("reduce_scatter_tensor SUM", lambda: reduce_scatter_tensor(R.SUM, 1.0)),
            ("reduce_scatter_tensor AVG", lambda: reduce_scatter_tensor(R.AVG, 1.0 / world)),
            ("barrier", barrier), ("all_gather_object", all_gather_object)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=sorted(BACKENDS), required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rows = []
    try:
        dist.init_process_group(BACKENDS[args.backend])
        init_error = None
    except Exception as e:  # what the backend says is the finding
        init_error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400]}"
    if init_error is None:
        for dtype in (torch.float32, torch.bfloat16):
            for name, run in cases(rank, world, dev, dtype):
                t0 = time.perf_counter()
                try:
                    ok, error = bool(run()), None
                    torch.cuda.synchronize()
                except Exception as e:
                    ok, error = False, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:400]}"
                rows.append({"backend": args.backend, "collective": name, "dtype": str(dtype).split(".")[-1],
                             "served": error is None, "right": ok, "error": error,
                             "ms": round(1e3 * (time.perf_counter() - t0), 2)})
                if error and args.backend == "nccl":
                    break  # a failed communicator fails every later call alike
            if rows and rows[-1]["error"] and args.backend == "nccl":
                break
    if rank == 0:
        out = {"backend": args.backend, "process_group": BACKENDS[args.backend], "world": world,
               "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "init_error": init_error,
               "rows": rows}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
        for r in rows:
            print(f"  {r['backend']:5s} {r['dtype']:9s} {r['collective']:26s} served={r['served']!s:5s} "
                  f"right={r['right']!s:5s} {r['error'] or ''}")
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


if __name__ == "__main__":
    main()
