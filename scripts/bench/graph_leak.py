"""What a released CUDA-graph column of scripts/bench/step.py leaves allocated (docs/gpu_next.md, item 3).

    python scripts/bench/graph_leak.py --out DIR            (a GPU: Wan 1.3B at 1 × 1560)
    python scripts/bench/graph_leak.py --tiny --out DIR     (a CPU dry run, FakeGraphs)

Ours at one shape: an eager step, then one graph per recompute setting (as ours@graph's search captures them), each
released with step.py's release(); after each, the bytes still allocated beyond the model's parameters, and at the
end the largest live blocks (with --history, the frames that allocated them: torch.cuda.memory._record_memory_history,
which broke our autograd functions' apply with a SystemError on an H100 with torch 2.11, 2026-12-07).
Writes DIR/graph_leak.json. Measured: results/attention_h100.md, call 10.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # step.py, harness.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch  # noqa: E402

import step  # noqa: E402


def allocated(dev) -> float:
    gc.collect()
    if dev.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev) / 2**30


def live_blocks(top: int) -> list[dict]:
    """The largest allocated blocks and the repo frames (else the innermost ones) that allocated them."""
    snap = torch.cuda.memory._snapshot()
    blocks = []
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = [f"{os.path.relpath(f['filename'])}:{f['line']} {f['name']}" for f in b.get("frames", [])]
            ours = [f for f in frames if not f.startswith(("..", "/")) and "site-packages" not in f]
            blocks.append({"mib": round(b["size"] / 2**20, 1), "pool": list(seg.get("segment_pool_id", ())),
                           "frames": (ours or frames)[:6]})
    return sorted(blocks, key=lambda b: -b["mib"])[:top]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--settings", default="0,15,30", help="recomputed blocks of each capture, in order")
    ap.add_argument("--history", action="store_true", help="record the allocations' frames (see the docstring)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    cfg = step.TINY if args.tiny else step.WAN_1P3B
    shape = step.TINY_SHAPES[3] if args.tiny else step.SHAPES[5]
    if dev.type == "cuda" and args.history:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    theirs, ours = step.build(cfg, dev)
    del theirs
    ours = ours.to(torch.bfloat16)
    ours.fused_ops = "triton" if dev.type == "cuda" else "torch"
    base = allocated(dev)
    rows = [{"after": "the model", "gib": base}]
    x, t, ctx = step.inputs(cfg, shape, dev, torch.bfloat16)
    ours.set_activation_checkpointing(False)
    step.step_fn(ours, x, t, ctx, False, False, dev)()
    for p in ours.parameters():
        p.grad = None
    rows.append({"after": "one eager step, gradients dropped", "gib": allocated(dev) - base})
    for k in (int(s) for s in args.settings.split(",")):
        ours.set_activation_checkpointing(k)
        run, graphs = step.graph_step(ours, *step.inputs(cfg, shape, dev, torch.bfloat16), False, dev)
        for _ in range(1 + graphs.warmup + 2):
            run()
        step.release(ours, graphs)
        del run, graphs
        rows.append({"after": f"a graph with {k} blocks recomputed, released", "gib": allocated(dev) - base})
    for r in rows:
        print(f"{r['after']}: {r['gib']:.3f} GiB", flush=True)
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "shape": list(shape),
           "torch": torch.__version__, "rows": rows, "live": live_blocks(25) if dev.type == "cuda" else []}
    for b in out["live"][:12]:
        print(b["mib"], "MiB", b["pool"], " <- ".join(b["frames"][:3]), flush=True)
    with open(os.path.join(args.out, "graph_leak.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
