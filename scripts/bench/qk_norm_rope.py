"""Benchmark the fused q/k RMSNorm + RoPE (ops/qk_norm_rope.py) against the eager reference and torch.compile of it.

    python scripts/bench/qk_norm_rope.py                          # the table at the long shapes: CSV + JSON
    python scripts/bench/qk_norm_rope.py --out /tmp/s --sweep     # launch-shape sweep of the two kernels (tuning)
    python scripts/bench/qk_norm_rope.py --out /tmp/s --frames 1 --hw 3 5 --no-compile   # CPU dry run

Wan 2.1 1.3B's q (k is the same op): B=1, 12 heads × 128 (D = 1536), bf16 x, fp32 weight, cos/sin from RoPE3D for
a 480p latent (30 × 52 tokens a frame) at 9 and 21 frames: N = 14040 and 32760, scripts/bench/step.py's long shapes.

Bytes per element of x:
  floor (each tensor moved once, what the fused kernels move): forward x + y = 2·e, backward x + dy + dx = 3·e, each
  plus the token's cos/sin row (8·K bytes per token, 8·K/D per element; 0.33 at K = 64, D = 1536): 4.33 and 6.33
  at bf16. The backward also writes and re-reads P·D fp32 partial rows of dw (P = programs, ~0.2 per element here).
  eager: counted op by op in the same run (every ATen op reads its inputs and writes its outputs once, views free).
`%copy` is the floor's time at the device-to-device copy bandwidth measured in the same run over the measured time.
Timings are medians of triton.testing.do_bench (L2 flushed before each call). Benchmarks never assert.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import harness  # noqa: E402 - one timer and session for every op bench
from harness import add_rates, fmt, rel_err, run_bench, saved_bytes_of  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_op_options(p, "qk_norm_rope", kernels=["fwd", "bwd"])
    p.add_argument("--frames", type=int, nargs="+", default=[9, 21], help="latent frames: N = frames · h · w")
    p.add_argument("--hw", type=int, nargs=2, default=[30, 52], help="tokens a frame (480p latent 60×104, 2×2 patch)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128)
    return p.parse_args(argv)


def make_inputs(frames, h, w, heads, head_dim, device, seed=0):
    """x [1, N, D] bf16 (a q projection), weight [D] fp32, (cos, sin) from Wan's RoPE3D, dy [1, N, D] bf16."""
    import torch

    from models.layers import RoPE3D

    hw_band = 2 * (head_dim // 6)
    cos, sin = RoPE3D((head_dim - 2 * hw_band, hw_band, hw_band))(frames, h, w, device)
    N, D = cos.shape[0], heads * head_dim
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, N, D, device=device, generator=g).to(torch.bfloat16)
    weight = 1 + 0.1 * torch.randn(D, device=device, generator=g)
    dy = torch.randn(1, N, D, device=device, generator=g).to(torch.bfloat16)
    return x, weight, cos, sin, dy


def floor_bytes(phase, N, D, K, elem):
    """Bytes the fused kernels must move (see the docstring)."""
    return (2 if phase == "fwd" else 3) * elem * N * D + 8 * K * N


def traffic_mode():
    """A dispatch mode that sums the bytes every ATen op reads and writes (views, allocations and detaches move
    nothing; a broadcast input counts its distinct elements)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def nbytes(t):
        n = t.element_size()
        for size, stride in zip(t.shape, t.stride()):
            n *= size if stride else 1
        return n

    free = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::detach"}

    class Traffic(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes, self.ops = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._schema.name in free or any(r.alias_info is not None for r in func._schema.returns):
                return out
            flat = tree_flatten((args, kwargs))[0] + tree_flatten(out)[0]
            self.bytes += sum(nbytes(t) for t in flat if isinstance(t, torch.Tensor))
            self.ops += 1
            return out

    return Traffic()


def eager_traffic(fn, x, weight, cos, sin, dy):
    """(forward bytes, forward ops, backward bytes, backward ops) of fn run op by op."""
    import torch

    xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
    with traffic_mode() as f:
        y = fn(xg, wg, cos, sin)
    with traffic_mode() as b:
        torch.autograd.grad(y, (xg, wg), dy)
    return f.bytes, f.ops, b.bytes, b.ops


def saved_bytes(fn, x, weight, cos, sin):
    """saved_bytes_of: weight and cos/sin are not counted (the model keeps them anyway), x is (nothing else keeps a
    projection's output)."""
    return saved_bytes_of(fn, (x, weight, cos, sin), kept=(weight, cos, sin), callers=(x,))


def impls(compile_cache):
    import torch

    from ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    out = {"eager": qk_norm_rope_reference,
           "triton": lambda x, w, c, s: qk_norm_rope(x, w, c, s, backend="triton")}
    if compile_cache is not None:
        out["compile"] = compile_cache.setdefault("ref", torch.compile(qk_norm_rope_reference, dynamic=False))
    return out


def run_table(args, bench, device, copy_bw, save):
    import torch

    from ops.qk_norm_rope import qk_norm_rope_backward, qk_norm_rope_forward, qk_norm_rope_reference

    compile_cache = None if args.no_compile else {}
    rows = []
    for frames in args.frames:
        x, weight, cos, sin, dy = make_inputs(frames, *args.hw, args.heads, args.head_dim, device)
        N, D, K = x.shape[1], x.shape[2], cos.shape[1]
        elems = N * D
        f_bytes, f_ops, b_bytes, b_ops = eager_traffic(qk_norm_rope_reference, x, weight, cos, sin, dy)
        counted = {"eager": (f_bytes, b_bytes)}
        ref = ref_grads = None
        shape_rows = []
        for name, fn in impls(compile_cache).items():
            rec = {"frames": frames, "N": N, "D": D, "impl": name}
            shape_rows.append(rec)
            if name in counted:
                rec["fwd_counted_B_per_elem"], rec["bwd_counted_B_per_elem"] = (v / elems for v in counted[name])
                rec["fwd_ops"], rec["bwd_ops"] = f_ops, b_ops
            try:
                with torch.no_grad():
                    y = fn(x, weight, cos, sin)
                    rec["fwd_ms"] = bench(lambda: fn(x, weight, cos, sin))
                ref = y.float() if name == "eager" else ref
                rec["fwd_rel_err_vs_eager"] = rel_err(y, ref)
                rec["fwd_bitwise_eq_eager"] = (y.float() == ref).float().mean().item()
            except Exception as e:  # noqa: BLE001 - report, never hide
                rec["fwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            try:
                xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
                y = fn(xg, wg, cos, sin)
                grads = torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
                ref_grads = [g.float() for g in grads] if name == "eager" else ref_grads
                rec["bwd_rel_err_vs_eager"] = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
                rec["bwd_ms"] = bench(lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True))
                rec["saved_bytes"], rec["saved_new_bytes"] = saved_bytes(fn, xg, wg, cos, sin)
                del y, grads
            except Exception as e:  # noqa: BLE001
                rec["bwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        # the kernels alone (no autograd, no dispatcher): what the op costs inside a compiled graph
        y, rstd = qk_norm_rope_forward(x, weight, cos, sin)
        shape_rows.append({"frames": frames, "N": N, "D": D, "impl": "triton (launchers)",
                           "fwd_ms": bench(lambda: qk_norm_rope_forward(x, weight, cos, sin)),
                           "bwd_ms": bench(lambda: qk_norm_rope_backward(dy, x, weight, cos, sin, rstd))})
        for rec in shape_rows:
            floor_of = lambda phase: floor_bytes(phase, N, D, K, x.element_size())  # noqa: E731
            add_rates(rec, floor_of, elems, copy_bw)
            for phase in ("fwd", "bwd"):
                if rec.get(f"{phase}_ms") is not None:
                    rec[f"{phase}_floor_B_per_elem"] = floor_of(phase) / elems
            print_row(rec)
        rows += shape_rows
        save(rows)
    return rows


def print_row(r):
    err = r.get("fwd_error") or r.get("bwd_error")
    counted = (f" | eager moves {fmt(r.get('fwd_counted_B_per_elem'), '.1f')}/"
               f"{fmt(r.get('bwd_counted_B_per_elem'), '.1f')} B/el in {r['fwd_ops']}/{r['bwd_ops']} ops"
               if "fwd_ops" in r else "")
    print(f"N={r['N']:6d} D={r['D']:5d} {r['impl']:20s} "
          f"fwd {fmt(r.get('fwd_ms'), '8.4f')} ms {fmt(r.get('fwd_pct_copy'), '5.1f')}% | "
          f"bwd {fmt(r.get('bwd_ms'), '8.4f')} ms {fmt(r.get('bwd_pct_copy'), '5.1f')}% | "
          f"saved {fmt(r.get('saved_B_per_elem'), '.2f')} B/el ({fmt(r.get('saved_new_B_per_elem'), '.2f')} new)"
          + counted
          + (f" | FAILED {err}" if err else ""), flush=True)


def sweep_configs():
    """Launch shapes to try: rows × warps × programs per SM × segments × pipelining depth."""
    from ops.triton_setup import KernelConfig

    return [KernelConfig(r, w, p, split=sp, num_stages=st) for r in (1, 2, 4) for w in (4, 8) for p in (0, 2, 4, 8)
            for sp in (True, False) for st in ((1,) if p == 0 else (1, 3))]  # p = 0: one tile per program


def run_sweep(args, bench, device, copy_bw, save):
    from ops.qk_norm_rope import default_config, qk_norm_rope_backward, qk_norm_rope_forward

    rows = []
    for frames in args.frames:
        x, weight, cos, sin, dy = make_inputs(frames, *args.hw, args.heads, args.head_dim, device)
        N, D, K = x.shape[1], x.shape[2], cos.shape[1]
        _, rstd = qk_norm_rope_forward(x, weight, cos, sin)
        for kernel in args.kernels:
            floor = floor_bytes(kernel, N, D, K, x.element_size())
            recs = []
            for tag, cfg in [("default", default_config(kernel, D, device))] + [("sweep", c) for c in sweep_configs()]:
                if kernel == "fwd":
                    fn = lambda: qk_norm_rope_forward(x, weight, cos, sin, config=cfg)  # noqa: E731
                else:
                    fn = lambda: qk_norm_rope_backward(dy, x, weight, cos, sin, rstd, config=cfg)  # noqa: E731
                try:
                    ms = bench(fn)
                except Exception as e:  # noqa: BLE001
                    print(f"  {kernel} {cfg} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                recs.append({"N": N, "D": D, "kernel": kernel, "tag": tag, "rows": cfg.rows,
                             "num_warps": cfg.num_warps, "programs_per_sm": cfg.programs_per_sm, "split": cfg.split,
                             "num_stages": cfg.num_stages, "ms": ms,
                             "pct_copy": 100 * floor / copy_bw / (ms * 1e-3)})
            rows += recs
            best, dflt = min(recs, key=lambda r: r["ms"]), recs[0]
            print(f"N={N} D={D} {kernel} best {best['ms']:.4f} ms {best['pct_copy']:.1f}% rows={best['rows']} "
                  f"warps={best['num_warps']} pps={best['programs_per_sm']} split={best['split']} "
                  f"stages={best['num_stages']} | default {dflt['ms']:.4f} ms {dflt['pct_copy']:.1f}%", flush=True)
            save(rows)
    return rows


def main(argv=None):
    args = parse_args(argv)
    run_bench(args, "qk_norm_rope", lambda op: {
        "heads": args.heads, "head_dim": args.head_dim, "hw": args.hw,
        "launch_shapes": {f"{k}-{d}": repr(c) for (k, d), c in op.TUNED.items()}}, run_table, run_sweep, cache_size=64)


if __name__ == "__main__":
    main()
