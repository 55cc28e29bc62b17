"""SDPA's kernels on this GPU: forward + backward time of each backend at Wan's shapes (the attention ceiling of the
step's ceiling table), and whether cuDNN serves a boolean key-padding mask correctly (a script, not a test).

    python scripts/bench/attention.py --out DIR            (one H200: ~1 min)
    python scripts/bench/attention.py --tiny --out DIR     (a CPU: checks the script)
    python scripts/bench/attention.py --layouts --out DIR  (cuDNN by input layout and call path, ~1 min; with
                                                            --tiny on a CPU, the math kernel and, for `aten`, the
                                                            CPU flash op: checks the script)

Timed: q, k, v [B, H, S, 128] bf16, no mask, forward + backward (the median; each pass on the host clock between
device syncs, harness.time_reps), FLOPs counted as 3.5 × the forward's 4·B·H·S²·Dh (flash's backward recomputes the
scores: 2.5 × the forward). The mask check: MMDiT-like joint
lengths (video + padded text), a (B, 1, 1, L) key mask with one sample's text shorter; each backend's output and
gradients against fp32 math on the same inputs, and whether they are finite.

--layouts: does the way q, k, v are laid out or handed to cuDNN change its time? At Wan 1.3B's self-attention
(2×14040, 1×32760) and its cross-attention (32760 queries over 512 text keys), cuDNN forward + backward on the same
values as: `bhsd` (each of q, k, v, dO contiguous [B, H, S, Dh]), `bshd` (contiguous [B, S, H, Dh] seen through a
transpose: what diffusers' Wan and ours hand it), `sdpa()` (bshd through ops.attention_backend.sdpa, whose backward
lays dO out as O) and `aten` (bshd through the aten ops ops/rope_attention.py calls). The variants take turns
(ROUNDS rounds of one untimed pass and REPS timed ones each) so a clock that drifts during the run touches them alike;
the median of all timed passes. `sdpa()` asks for cuDNN and would fall back with a logged warning where cuDNN cannot
serve.
Each row also holds the largest relative difference of its dq, dk, dv from bshd's: a variant that computes
something else is not a faster way to do the same.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import harness  # noqa: E402

KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
           "efficient": SDPBackend.EFFICIENT_ATTENTION}
SHAPES = ((21, 1560, 12), (4, 7800, 12), (2, 14040, 12), (1, 32760, 12), (1, 75600, 12), (1, 32760, 40),
          (1, 75600, 40))  # (B, S, heads): Wan 1.3B's buckets, then the 14B's widest
MASKED = ((2, 344, 24), (1, 14160, 24), (2, 14160, 24))  # (B, joint length, heads): where cuDNN failed on 2.11
LAYOUT_SHAPES = ((2, 14040, 14040, 12), (1, 32760, 32760, 12), (1, 32760, 512, 12))  # (B, S, keys, heads)


def timed(fn, dev, reps):
    times, _ = harness.time_reps(fn, dev, 2, reps)
    return harness.median(times)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def layout_variants(B, S, L, H, dev, dtype, g):
    """{name: fwd+bwd callable → (dq, dk, dv)} on the same q [B, H, S, 128], k, v [B, H, L, 128] and dO values
    (module docstring)."""
    from ops.attention_backend import sdpa
    from ops.rope_attention import _attention_backward, _attention_forward

    def make(n):  # contiguous [B, n, H, Dh] memory seen as [B, H, n, Dh]
        return torch.randn(B, n, H, 128, device=dev, dtype=dtype, generator=g).transpose(1, 2)

    q, k, v, do = make(S), make(L), make(L), make(S)
    bshd = [t.requires_grad_() for t in (q, k, v)]
    bhsd = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    do_bhsd = do.contiguous()
    gpu = dev.type == "cuda"  # a CPU runs the math kernel and the CPU flash op: a dry run of the script
    kernel, backend, kind = ((SDPBackend.CUDNN_ATTENTION, "cudnn", "cudnn") if gpu
                             else (SDPBackend.MATH, "math", "cpu_flash"))

    def raw(inputs, grad):
        def step():
            with sdpa_kernel([kernel]):
                o = F.scaled_dot_product_attention(*inputs)
            return torch.autograd.grad(o, inputs, grad)
        return step

    def ours():
        return torch.autograd.grad(sdpa(*bshd, backend=backend), bshd, do)

    def aten():
        qd, kd, vd = (t.detach() for t in bshd)
        o, tensors, ints = _attention_forward(kind, qd, kd, vd)
        return _attention_backward(kind, do, qd, kd, vd, o, tensors, ints)[:3]

    return {"bhsd": raw(bhsd, do_bhsd), "bshd": raw(bshd, do), "sdpa()": ours, "aten": aten}


def layouts(dev, dtype, shapes, reps: int, rounds: int) -> list[dict]:
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for B, S, L, H in shapes:
        variants = layout_variants(B, S, L, H, dev, dtype, g)
        ref = variants["bshd"]()
        agree = {name: max(rel(a, b) for a, b in zip(fn(), ref)) for name, fn in variants.items()}
        del ref
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                times[name] += harness.time_reps(fn, dev, 1, reps)[0]
        base = harness.median(times["bshd"])
        flops = 3.5 * 4 * B * H * S * L * 128
        for name, ts in times.items():
            ms = harness.median(ts)
            row = dict(variant=name, B=B, S=S, keys=L, heads=H, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                       vs_bshd=round(base / ms, 3), spread_ms=[round(min(ts), 3), round(max(ts), 3)],
                       grad_rel_diff_vs_bshd=agree[name])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del variants
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_out(ap, "attention")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layouts", action="store_true", help="cuDNN by input layout and call path (docstring)")
    ap.add_argument("--rounds", type=int, default=4, help="--layouts: turns each variant takes")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.layouts:
        harness.write_rows(args.out, "attention_layouts", harness.run_meta(dev), layouts(
            dev, dtype, ((2, 64, 16, 2),) if args.tiny else LAYOUT_SHAPES, args.reps, args.rounds))
        return
    shapes, masked = ((2, 64, 2),), ((2, 40, 2),)
    if not args.tiny:
        shapes, masked = SHAPES, MASKED
    kernels = KERNELS if dev.type == "cuda" else {"math": SDPBackend.MATH}
    rows, checks = [], []
    g = torch.Generator(device=dev).manual_seed(0)
    for B, S, H in shapes:
        q, k, v = (torch.randn(B, H, S, 128, device=dev, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
        do = torch.randn(B, H, S, 128, device=dev, dtype=dtype, generator=g)
        flops = 3.5 * 4 * B * H * S * S * 128
        for name, kernel in kernels.items():
            def step():
                with sdpa_kernel([kernel]):
                    o = F.scaled_dot_product_attention(q, k, v)
                torch.autograd.grad(o, (q, k, v), do)
            try:
                ms = timed(step, dev, args.reps)
                row = dict(kernel=name, B=B, S=S, heads=H, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
            except RuntimeError as e:
                row = dict(kernel=name, B=B, S=S, heads=H, error=str(e).splitlines()[0][:200])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, do
    for B, L, H in masked:
        q, k, v = (torch.randn(B, H, L, 128, device=dev, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
        do = torch.randn(B, H, L, 128, device=dev, dtype=dtype, generator=g)
        mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device=dev)
        mask[-1, ..., L - L // 8:] = False  # the last sample's text is shorter
        ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel([SDPBackend.MATH]):
            o_ref = F.scaled_dot_product_attention(*ref, attn_mask=mask)
        g_ref = torch.autograd.grad(o_ref, ref, do.float())
        for name, kernel in kernels.items():
            try:
                with sdpa_kernel([kernel]):
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                gr = torch.autograd.grad(o, (q, k, v), do)
                finite = bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(t).all()) for t in gr)
                row = dict(kernel=name, B=B, L=L, heads=H, finite=finite,
                           out_rel_err=rel(o, o_ref) if finite else None,
                           grad_rel_err=[rel(a, b) for a, b in zip(gr, g_ref)] if finite else None)
            except RuntimeError as e:
                row = dict(kernel=name, B=B, L=L, heads=H, error=str(e).splitlines()[0][:200])
            checks.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, do, ref, o_ref, g_ref
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention.json"), "w") as fh:
        json.dump({"meta": meta, "timed": rows, "masked": checks}, fh, indent=1)
    print("| B | S | heads | " + " | ".join(f"{k} ms (TFLOP/s)" for k in kernels) + " |")
    by = {}
    for r in rows:
        by.setdefault((r["B"], r["S"], r["heads"]), {})[r["kernel"]] = r
    for (B, S, H), d in by.items():
        print(f"| {B} | {S} | {H} | " + " | ".join(
            f"{d[k]['ms']:.2f} ({d[k]['tflops']:.0f})" if "ms" in d.get(k, {}) else "—" for k in kernels) + " |")


if __name__ == "__main__":
    main()
