"""Benchmark the fused AdaLN op (ops/adaln.py) against the eager reference and torch.compile of it.

    python scripts/bench/adaln.py                         # the table: prints it, writes CSV + JSON (runs/bench/adaln)
    python scripts/bench/adaln.py --out /tmp/s --sweep     # launch-shape sweep of the kernels (tuning)

B=1, bf16 x, fp32 modulation as chunk views of a modulation table (per sample: [1, 6, D]; per token: [1, N, 6, D]).
Byte floors per element (each input read once, each output written once): per-sample forward 4 (x, y), backward 6
(x, dy, dx); per-token forward 12 (+ scale, shift), backward 18 (+ scale; dscale, dshift in fp32). `%copy` is the
floor's time at the device-to-device copy bandwidth measured in the same run over the measured time. Timings are
medians of triton.testing.do_bench (L2 flushed before each call). Benchmarks never assert: a failing
implementation is reported as a failure.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import harness  # noqa: E402
from harness import add_rates, fmt, rel_err, run_bench, saved_bytes_of  # noqa: E402

FLOOR_BYTES = {("sample", "fwd"): 4, ("sample", "bwd"): 6, ("token", "fwd"): 12, ("token", "bwd"): 18}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_op_options(p, "adaln", kernels=["fwd", "bwd", "dtile"])
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--d", type=int, nargs="+", default=[1536, 5120])
    p.add_argument("--kinds", nargs="+", default=["sample", "token"], choices=["sample", "token"])
    p.add_argument("--tuned", help="a --sweep JSON: take its fastest launch shapes (ops.adaln.TUNED) for this run")
    return p.parse_args(argv)


def make_inputs(kind, N, D, device, seed=0):
    """x [1, N, D] bf16, scale/shift as strided views of an fp32 table (leaves: grads land on them directly)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, N, D, device=device, generator=g).to(torch.bfloat16)
    if kind == "sample":
        table = torch.randn(1, 6, D, device=device, generator=g) * 0.1
        scale, shift = table[:, 1:2], table[:, 0:1]
    else:
        table = torch.randn(1, N, 6, D, device=device, generator=g) * 0.1
        scale, shift = (c.squeeze(2) for c in table.chunk(6, dim=2)[:2])
    dy = torch.randn(1, N, D, device=device, generator=g).to(torch.bfloat16)
    return x, scale.detach(), shift.detach(), dy


def saved_bytes(fn, x, scale, shift):
    """The modulation table is not counted (the model keeps it anyway), x is (2 bytes/element)."""
    return saved_bytes_of(fn, (x, scale, shift), kept=(scale, shift), callers=(x,))


def impls(kind, compile_cache):
    import torch

    from ops.adaln import adaln_modulate, adaln_reference

    out = {"eager": adaln_reference,
           "triton": lambda x, s, h: adaln_modulate(x, s, h, backend="triton")}
    if compile_cache is not None:
        out["compile"] = compile_cache.setdefault(kind, torch.compile(adaln_reference, dynamic=False))
    return out


def run_table(args, bench, device, copy_bw, save):
    import torch

    from ops.adaln import adaln_backward, adaln_forward

    compile_cache = None if args.no_compile else {}
    rows = []
    for kind in args.kinds:
        for D in args.d:
            for N in args.n:
                x, scale, shift, dy = make_inputs(kind, N, D, device)
                elems = N * D
                ref = ref_grads = None
                shape_rows = []
                for name, fn in impls(kind, compile_cache).items():
                    rec = {"kind": kind, "N": N, "D": D, "impl": name}
                    shape_rows.append(rec)
                    try:
                        with torch.no_grad():
                            y = fn(x, scale, shift)
                            rec["fwd_ms"] = bench(lambda: fn(x, scale, shift))
                        ref = y.float() if name == "eager" else ref
                        rec["fwd_rel_err_vs_eager"] = rel_err(y, ref)
                    except Exception as e:  # noqa: BLE001 - report, never hide
                        rec["fwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    try:
                        xg, sg, hg = (t.detach().requires_grad_() for t in (x, scale, shift))
                        y = fn(xg, sg, hg)
                        grads = torch.autograd.grad(y, (xg, sg, hg), dy, retain_graph=True)
                        ref_grads = [g.float() for g in grads] if name == "eager" else ref_grads
                        rec["bwd_rel_err_vs_eager"] = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
                        rec["bwd_ms"] = bench(lambda: torch.autograd.grad(y, (xg, sg, hg), dy, retain_graph=True))
                        rec["saved_bytes"], rec["saved_new_bytes"] = saved_bytes(fn, xg, sg, hg)
                        del y, grads
                    except Exception as e:  # noqa: BLE001
                        rec["bwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                # the backward kernels alone, fused partial sums against the paper's D-tile reduction
                _, mean, rstd = adaln_forward(x, scale, shift)
                for dmod in ("fused", "dtile"):
                    rec = {"kind": kind, "N": N, "D": D, "impl": f"triton-{dmod} (launcher)"}
                    rec["bwd_ms"] = bench(lambda: adaln_backward(dy, x, scale, mean, rstd, shift.shape, shift.dtype,
                                                                 dmod=dmod))
                    shape_rows.append(rec)
                rows += shape_rows
                for rec in shape_rows:
                    add_rates(rec, lambda phase: FLOOR_BYTES[(kind, phase)] * elems, elems, copy_bw)
                    print_row(rec)
                save(rows)
                del x, scale, shift, dy, mean, rstd
                torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def print_row(r):
    err = r.get("fwd_error") or r.get("bwd_error")
    print(f"{r['kind']:6s} {r['N']:6d} {r['D']:5d} {r['impl']:24s} "
          f"fwd {fmt(r.get('fwd_ms'), '8.4f')} ms {fmt(r.get('fwd_GBps'), '6.0f')} GB/s "
          f"{fmt(r.get('fwd_pct_copy'), '5.1f')}% | bwd {fmt(r.get('bwd_ms'), '8.4f')} ms "
          f"{fmt(r.get('bwd_GBps'), '6.0f')} GB/s {fmt(r.get('bwd_pct_copy'), '5.1f')}% | "
          f"saved {fmt(r.get('saved_B_per_elem'), '.3f')} B/el" + (f" | FAILED {err}" if err else ""), flush=True)


def sweep_phase1(kernel, kind, D):
    """Launch shapes to try first: rows × warps × grid (split chosen by the vector rule)."""
    from ops.triton_setup import KernelConfig

    block = 1 << (D - 1).bit_length()
    fits = [r for r in (1, 2, 4, 8, 16) if r * block <= 16384]
    if kernel == "dtile":
        return [KernelConfig(r, 4, p, b) for b in (64, 128, 256) for r in (32, 64) for p in (4, 8)]
    if kernel == "fwd" and kind == "token":
        return [KernelConfig(r, w, p, num_stages=st) for r in (1, 2) for w in (4, 8) for p, st in ((0, 1), (4, 3))]
    if kernel == "fwd":  # persistent spans with a pipelined loop, or one tile per program (p = 0)
        return [KernelConfig(r, w, p, num_stages=3 if p else 1) for r in fits for w in (4, 8) for p in (0, 2, 4, 8)]
    if kind == "token":
        return [KernelConfig(1, w, p, num_stages=2) for w in (4, 8, 16) for p in (1, 2, 4)]
    return [KernelConfig(r, w, p, num_stages=st) for r in fits[:2] for w in (4, 8, 16) for p in (1, 2, 4)
            for st in (1, 3)]


def sweep_phase2(best):
    """Around the best of phase 1: one masked tile against two segments, and the pipelining depth."""
    import dataclasses

    return [dataclasses.replace(best, split=sp, num_stages=st) for sp in (True, False) for st in (1, 2, 3)
            if (sp, st) != (best.split, best.num_stages)]


def run_sweep(args, bench, device, copy_bw, save):
    import torch

    from ops.adaln import adaln_backward, adaln_forward, default_config
    from ops.triton_setup import KernelConfig

    rows = []
    for kind in args.kinds:
        for D in args.d:
            for N in args.n:
                x, scale, shift, dy = make_inputs(kind, N, D, device)
                _, mean, rstd = adaln_forward(x, scale, shift)
                floor_f, floor_b = (FLOOR_BYTES[(kind, p)] * N * D for p in ("fwd", "bwd"))

                def time_cfg(kernel, cfg, tag):
                    if kernel == "fwd":
                        fn = lambda: adaln_forward(x, scale, shift, config=cfg)  # noqa: E731
                    elif kernel == "bwd":
                        fn = lambda: adaln_backward(dy, x, scale, mean, rstd, shift.shape,  # noqa: E731
                                                    shift.dtype, config=cfg)
                    else:
                        fn = lambda: adaln_backward(dy, x, scale, mean, rstd, shift.shape,  # noqa: E731
                                                    shift.dtype, dmod="dtile", dtile_config=cfg)
                    try:
                        ms = bench(fn)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {kernel} {cfg} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                        return None
                    pct = 100 * (floor_f if kernel == "fwd" else floor_b) / copy_bw / (ms * 1e-3)
                    rec = {"kind": kind, "N": N, "D": D, "kernel": kernel, "tag": tag, "rows": cfg.rows,
                           "num_warps": cfg.num_warps, "programs_per_sm": cfg.programs_per_sm,
                           "block_d": cfg.block_d, "split": cfg.split, "num_stages": cfg.num_stages, "ms": ms,
                           "pct_copy": pct}
                    rows.append(rec)
                    return rec

                for kernel in args.kernels if kind == "sample" else [k for k in args.kernels if k != "dtile"]:
                    dflt = time_cfg(kernel, default_config(kernel, D, device, kind == "token"), "default")
                    recs = [time_cfg(kernel, c, "phase1") for c in sweep_phase1(kernel, kind, D)]
                    best = min((r for r in recs if r), key=lambda r: r["ms"])
                    if kernel != "dtile":
                        best_cfg = KernelConfig(best["rows"], best["num_warps"], best["programs_per_sm"],
                                                split=best["split"], num_stages=best["num_stages"])
                        recs = [time_cfg(kernel, c, "phase2") for c in sweep_phase2(best_cfg)] + [best]
                        best = min((r for r in recs if r), key=lambda r: r["ms"])
                    print(f"{kind:6s} N={N} D={D} {kernel:5s} best {best['ms']:.4f} ms {best['pct_copy']:.1f}% "
                          f"rows={best['rows']} warps={best['num_warps']} pps={best['programs_per_sm']} "
                          f"bd={best['block_d']} split={best['split']} stages={best['num_stages']} | default "
                          f"{fmt(dflt and dflt['ms'], '.4f')} ms {fmt(dflt and dflt['pct_copy'], '.1f')}%",
                          flush=True)
                    save(rows)
                del x, scale, shift, dy, mean, rstd
                torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def main(argv=None):
    run_bench(parse_args(argv), "adaln", lambda op: {
        "floor_bytes_per_elem": {f"{k}-{p}": v for (k, p), v in FLOOR_BYTES.items()},
        "launch_shapes": {f"{k}-{'token' if t else 'sample'}-{d}": repr(c) for (k, t, d), c in op.TUNED.items()}},
        run_table, run_sweep)


if __name__ == "__main__":
    main()
