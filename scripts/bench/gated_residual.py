"""Benchmark the fused gated residual (ops/gated_residual.py) against the eager formula and torch.compile of it.

    python scripts/bench/gated_residual.py                         # the table: prints it, writes CSV + JSON
    python scripts/bench/gated_residual.py --out /tmp/s --sweep    # launch-shape sweep of the kernels (tuning)
    python scripts/bench/gated_residual.py --tuned /tmp/s/gated_residual_h200_sweep.json

B=1, bf16 x and y, fp32 gate as a chunk view of a modulation table (per sample: [1, 6, D], stride 6·D; per token:
[1, N, 6, D] squeezed). Implementations: `eager` = models.layers.gated_residual `(x.float() + y.float()·gate)`,
`diffusers` = `(x.float() + y·gate)` (the same values; y·gate promotes without a separate fp32 copy of y),
`compile` = torch.compile of `eager`, `triton` = gated_residual(..., backend="triton"). Backward: the gradients of
x, y and the gate through torch.autograd.grad.

Byte floors per element (each input read once, each output written once): per-sample forward 6 (x, y; out),
backward 6 (dout, y; dy — dx is dout itself); per-token forward 10 (+ gate fp32), backward 14 (+ gate; dgate fp32).
`%copy` is the floor's time at the device-to-device copy bandwidth measured in the same run over the measured time.
Timings are medians of triton.testing.do_bench (L2 flushed before each call). Benchmarks never assert: a failing
implementation is reported as a failure.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import harness  # noqa: E402
from harness import add_rates, fmt, rel_err, run_bench, saved_bytes_of  # noqa: E402

FLOOR_BYTES = {("sample", "fwd"): 6, ("sample", "bwd"): 6, ("token", "fwd"): 10, ("token", "bwd"): 14}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_op_options(p, "gated_residual", kernels=["fwd", "bwd"])
    p.add_argument("--n", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--d", type=int, nargs="+", default=[1536, 5120])
    p.add_argument("--kinds", nargs="+", default=["sample", "token"], choices=["sample", "token"])
    p.add_argument("--tuned", help="a --sweep JSON: take its fastest launch shapes (ops.gated_residual.TUNED)")
    return p.parse_args(argv)


def make_inputs(kind, N, D, device, seed=0):
    """x, y [1, N, D] bf16, the gate as a strided view of an fp32 table, dout [1, N, D] bf16."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, N, D, device=device, generator=g).to(torch.bfloat16)
    y = torch.randn(1, N, D, device=device, generator=g).to(torch.bfloat16)
    if kind == "sample":
        gate = (torch.randn(1, 6, D, device=device, generator=g) * 0.1)[:, 2:3]
    else:
        gate = (torch.randn(1, N, 6, D, device=device, generator=g) * 0.1).chunk(6, dim=2)[2].squeeze(2)
    dout = torch.randn(1, N, D, device=device, generator=g).to(torch.bfloat16)
    return x, y, gate, dout


def saved_bytes(fn, x, y, gate):
    """saved_bytes_of: the gate's table is not counted (the model keeps it anyway), y is (the branch output would
    otherwise be freed)."""
    return saved_bytes_of(fn, (x, y, gate), kept=(gate,), callers=(x, y))


def diffusers_formula(x, y, gate):
    return (x.float() + y * gate).type_as(x)


def impls(kind, compile_cache):
    import torch

    from ops.gated_residual import gated_residual, gated_residual_reference

    out = {"eager": gated_residual_reference, "diffusers": diffusers_formula,
           "triton": lambda x, y, g: gated_residual(x, y, g, backend="triton")}
    if compile_cache is not None:
        out["compile"] = compile_cache.setdefault(kind, torch.compile(gated_residual_reference, dynamic=False))
    return out


def print_row(r):
    err = r.get("fwd_error") or r.get("bwd_error")
    print(f"{r['kind']:6s} {r['N']:6d} {r['D']:5d} {r['impl']:10s} "
          f"fwd {fmt(r.get('fwd_ms'), '8.4f')} ms {fmt(r.get('fwd_GBps'), '6.0f')} GB/s "
          f"{fmt(r.get('fwd_pct_copy'), '5.1f')}% | bwd {fmt(r.get('bwd_ms'), '8.4f')} ms "
          f"{fmt(r.get('bwd_GBps'), '6.0f')} GB/s {fmt(r.get('bwd_pct_copy'), '5.1f')}% | "
          f"saved {fmt(r.get('saved_B_per_elem'), '.3f')} B/el, new {fmt(r.get('saved_new_B_per_elem'), '.3f')}"
          + (f" | FAILED {err}" if err else ""), flush=True)


def run_table(args, bench, device, copy_bw, save):
    import torch

    compile_cache = None if args.no_compile else {}
    rows = []
    for kind in args.kinds:
        for D in args.d:
            for N in args.n:
                x, y, gate, dout = make_inputs(kind, N, D, device)
                elems = N * D
                ref = ref_grads = None
                for name, fn in impls(kind, compile_cache).items():
                    rec = {"kind": kind, "N": N, "D": D, "impl": name}
                    rows.append(rec)
                    try:
                        with torch.no_grad():
                            out = fn(x, y, gate)
                            rec["fwd_ms"] = bench(lambda: fn(x, y, gate))
                        ref = out.float() if name == "eager" else ref
                        rec["fwd_max_abs_diff_vs_eager"] = (out.float() - ref).abs().max().item()
                    except Exception as e:  # noqa: BLE001 - report, never hide
                        rec["fwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    try:
                        xg, yg, gg = (t.detach().requires_grad_() for t in (x, y, gate))
                        out = fn(xg, yg, gg)
                        grads = torch.autograd.grad(out, (xg, yg, gg), dout, retain_graph=True)
                        ref_grads = [g.float() for g in grads] if name == "eager" else ref_grads
                        rec["bwd_rel_err_vs_eager"] = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
                        rec["bwd_ms"] = bench(lambda: torch.autograd.grad(out, (xg, yg, gg), dout, retain_graph=True))
                        rec["saved_bytes"], rec["saved_new_bytes"] = saved_bytes(fn, xg, yg, gg)
                        out = grads = None
                    except Exception as e:  # noqa: BLE001
                        rec["bwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    add_rates(rec, lambda phase: FLOOR_BYTES[(kind, phase)] * elems, elems, copy_bw)
                    print_row(rec)
                save(rows)
                x = y = gate = dout = None  # free before the next shape
                torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def sweep_configs(kernel, kind, D):
    """Launch shapes to try: tiles of 1024-8192 elements (rows × the feature tile at its default, the widest power
    of two dividing D up to 1024, or 256) × warps × grid (persistent spans with a pipelined loop, or for what needs
    no per-sample partial sums, one tile per program)."""
    from ops.gated_residual import block_d_of
    from ops.triton_setup import KernelConfig

    grids = [(0, 1), (4, 3), (8, 3), (16, 2)] if kernel == "fwd" or kind == "token" else [(4, 1), (4, 3), (8, 3),
                                                                                         (16, 2)]
    cfgs = [KernelConfig(r, w, p, block_d=bd, num_stages=st) for bd in (0, 256) for r in (1, 2, 4, 8, 16, 32)
            for w in (4, 8) for p, st in grids]
    return [c for c in cfgs if 1024 <= c.rows * block_d_of(D, c) <= 8192]


def run_sweep(args, bench, device, copy_bw, save):
    import torch

    from ops.gated_residual import default_config, gated_residual_backward, gated_residual_forward

    rows = []
    for kind in args.kinds:
        for D in args.d:
            for N in args.n:
                x, y, gate, dout = make_inputs(kind, N, D, device)
                floor = {p: FLOOR_BYTES[(kind, p)] * N * D for p in ("fwd", "bwd")}

                def time_cfg(kernel, cfg, tag):
                    fn = ((lambda: gated_residual_forward(x, y, gate, config=cfg)) if kernel == "fwd" else
                          (lambda: gated_residual_backward(dout, y, gate, config=cfg)))
                    try:
                        ms = bench(fn)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {kernel} {cfg} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                        return None
                    rec = {"kind": kind, "N": N, "D": D, "kernel": kernel, "tag": tag, "rows": cfg.rows,
                           "num_warps": cfg.num_warps, "programs_per_sm": cfg.programs_per_sm,
                           "block_d": cfg.block_d, "split": None, "num_stages": cfg.num_stages, "ms": ms,
                           "pct_copy": 100 * floor[kernel] / copy_bw / (ms * 1e-3)}
                    rows.append(rec)
                    return rec

                for kernel in args.kernels:
                    dflt = time_cfg(kernel, default_config(kernel, D, device, kind == "token"), "default")
                    recs = [time_cfg(kernel, c, "sweep") for c in sweep_configs(kernel, kind, D)]
                    best = min((r for r in recs + [dflt] if r), key=lambda r: r["ms"])
                    print(f"{kind:6s} N={N} D={D} {kernel:3s} best {best['ms']:.4f} ms {best['pct_copy']:.1f}% "
                          f"rows={best['rows']} warps={best['num_warps']} pps={best['programs_per_sm']} "
                          f"bd={best['block_d']} stages={best['num_stages']} | default "
                          f"{fmt(dflt and dflt['ms'], '.4f')} ms {fmt(dflt and dflt['pct_copy'], '.1f')}%",
                          flush=True)
                    save(rows)
                x = y = gate = dout = None  # free before the next shape
                torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def main(argv=None):
    run_bench(parse_args(argv), "gated_residual", lambda op: {
        "floor_bytes_per_elem": {f"{k}-{p}": v for (k, p), v in FLOOR_BYTES.items()},
        "launch_shapes": {f"{k}-{'token' if t else 'sample'}-{d}": repr(c) for (k, t, d), c in op.TUNED.items()}},
        run_table, run_sweep)


if __name__ == "__main__":
    main()
