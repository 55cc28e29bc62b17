"""The attention projections of a Wan block, timed on one GPU: three matmuls against one over the concatenated weights.

Wan 1.3B's to_q, to_k, to_v read the same AdaLN output y [S, D] (D = 1536, bf16). Each piece's median device time
over --reps calls, per S:
  fwd_sep / fwd_cat / fwd_cat+cat   three F.linear(y, W_i, b_i); one F.linear over [3D, D]; that plus torch.cat
  dgrad_sep / dgrad_cat             dy = Σ_i dout_i · W_i (mm, then addmm_ twice, as ops.adaln_linear does); one mm
  wgrad_sep / wgrad_cat             dW_i = dout_iᵀ · y three times; once over [S, 3D]
  bias_sep / bias_cat / bias_mv     db_i = Σ_rows dout_i (aten's sum, three times); one sum over [S, 3D];
                                    the same as a matrix-vector product with ones (cuBLAS gemv)
  out / out_nobias                  to_out: F.linear(o, W_o, b_o) with and without the bias epilogue
  attn_v / attn_v_strided           cuDNN attention's forward with v contiguous, and v a column slice of [S, 3D]
Wall times above come from CUDA events around the Python call (host time included where a call is short); at
S = 32760 the *_dev entries are the profiler's device time per kernel (probe_kernels): the fused glue's
memory-bound kernels, the tail's G pass against eager's four, and reducing per-program partial rows by aten's sum
against cuBLAS gemv. Writes one JSON line per S to --out/probe_projections.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts.probe_mlp_tail import rel_err, timed  # noqa: E402


def probe(S: int, D: int, reps: int) -> dict:
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    y = torch.randn(S, D, device=dev, dtype=bf, generator=g)
    ws = [(torch.randn(D, D, device=dev, generator=g) / D**0.5).to(bf) for _ in range(3)]
    bs = [(torch.randn(D, device=dev, generator=g) * 0.1).to(bf) for _ in range(3)]
    wcat, bcat = torch.cat(ws), torch.cat(bs)
    dcat = torch.randn(S, 3 * D, device=dev, dtype=bf, generator=g)
    ds = [t.contiguous() for t in dcat.split(D, 1)]
    ones = torch.ones(S, device=dev, dtype=bf)
    row = {"S": S, "D": D}
    row["fwd_sep_ms"] = timed(lambda: [F.linear(y, w, b) for w, b in zip(ws, bs)], reps)
    row["fwd_cat_ms"] = timed(lambda: F.linear(y, wcat, bcat), reps)
    row["fwd_cat+cat_ms"] = timed(lambda: F.linear(y, torch.cat(ws), torch.cat(bs)), reps)

    def dgrad_sep():
        dy = ds[0] @ ws[0]
        dy.addmm_(ds[1], ws[1])
        return dy.addmm_(ds[2], ws[2])
    row["dgrad_sep_ms"] = timed(dgrad_sep, reps)
    row["dgrad_cat_ms"] = timed(lambda: dcat @ wcat, reps)
    row["wgrad_sep_ms"] = timed(lambda: [d.t() @ y for d in ds], reps)
    row["wgrad_cat_ms"] = timed(lambda: dcat.t() @ y, reps)
    row["bias_sep_ms"] = timed(lambda: [d.sum(0) for d in ds], reps)
    row["bias_cat_ms"] = timed(lambda: dcat.sum(0), reps)
    row["bias_sep_f32_ms"] = timed(lambda: [d.sum(0, dtype=torch.float32) for d in ds], reps)
    row["bias_mv_ms"] = timed(lambda: [ones @ d for d in ds], reps)
    ref = ds[0].double().sum(0)
    row["bias_sum_rel_err"] = rel_err(ds[0].sum(0), ref)
    row["bias_mv_rel_err"] = rel_err(ones @ ds[0], ref)
    row["out_ms"] = timed(lambda: F.linear(y, ws[0], bs[0]), reps)
    row["out_nobias_ms"] = timed(lambda: F.linear(y, ws[0]), reps)
    heads = lambda t: t.unflatten(-1, (D // 128, 128)).transpose(1, 2)  # [1, S, D] → [1, H, S, 128]  # noqa: E731
    q, k = heads(ds[0][None]), heads(ds[1][None])
    attn = torch.ops.aten._scaled_dot_product_cudnn_attention
    try:
        o1 = attn(q, k, heads(ds[2][None]), None, False)[0]
        o2 = attn(q, k, heads(dcat[None, :, 2 * D:]), None, False)[0]
        row["attn_v_strided_max_diff"] = float((o1.float() - o2.float()).abs().max())
        row["attn_v_ms"] = timed(lambda: attn(q, k, heads(ds[2][None]), None, False), max(3, reps // 4))
        row["attn_v_strided_ms"] = timed(lambda: attn(q, k, heads(dcat[None, :, 2 * D:]), None, False),
                                         max(3, reps // 4))
    except Exception as e:  # noqa: BLE001 - what fails is the answer
        row["attn_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if S == 32760:
        row.update(probe_kernels(ds, bs, reps))
    return row


def device_ms(fn, reps: int) -> dict:
    """{kernel name: device ms per call} of fn, from the profiler's kernel records (no host time in it)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:40]] = out.get(e.name[:40], 0.0) + e.device_time / 1000 / reps
    return {k: round(v, 4) for k, v in out.items()}


def probe_kernels(ds, bs, reps: int) -> dict:
    """Device time per kernel (profiler) at S = 32760: q/k RMSNorm-RoPE and AdaLN's backward (with and without
    dres), the tail's G pass against eager's, and the reduction of per-program fp32 partial rows ([P, D] → [D]) by
    aten's sum against cuBLAS gemv (a product with ones)."""
    from models.layers import RoPE3D
    from ops.adaln import adaln_backward, adaln_forward
    from ops.gated_ffn import gate_w2_
    from ops.qk_norm_rope import qk_norm_rope_backward, qk_norm_rope_forward
    dev, D = ds[0].device, ds[0].shape[1]
    cos, sin = RoPE3D((44, 42, 42))(21, 30, 52, dev)
    x, dy, w = ds[0][None], ds[1][None], torch.ones(D, device=dev, dtype=torch.bfloat16)
    _, rstd = qk_norm_rope_forward(x, w, cos, sin)
    row = {"qk_fwd_dev": device_ms(lambda: qk_norm_rope_forward(x, w, cos, sin), reps),
           "qk_bwd_dev": device_ms(lambda: qk_norm_rope_backward(dy, x, w, cos, sin, rstd), reps)}
    table = torch.randn(1, 6, D, device=dev) * 0.1
    scale, shift = table[:, 1:2], table[:, 0:1]  # strided [1, 1, D] views, as a Wan block's
    _, mean, rstd = adaln_forward(x, scale, shift)
    for tag, kw in (("", {}), ("_dres", {"dres": ds[2][None]})):
        row[f"adaln_bwd{tag}_dev"] = device_ms(
            lambda: adaln_backward(dy, x, scale, mean, rstd, list(shift.shape), shift.dtype, **kw), reps)
    G = torch.randn(D, 8960, device=dev)
    w2 = torch.randn(D, 8960, device=dev, dtype=torch.bfloat16)
    dw2, dgate = torch.empty_like(w2), torch.empty(D, device=dev)
    row["gate_w2_dev"] = device_ms(lambda: gate_w2_(G, w2, table[0, 2], dw2, dgate, accumulate=False), reps)
    row["gate_w2_eager_dev"] = device_ms(lambda: ((G * table[0, 2][:, None]).to(w2.dtype), (G * w2).sum(1)), reps)
    for P, width in ((264, D), (528, D), (1056, D), (585, 8960)):
        part = torch.randn(P, width, device=dev)
        ones = torch.ones(P, device=dev)
        row[f"partial_sum_{P}x{width}_dev"] = device_ms(lambda: part.sum(0), reps)
        row[f"partial_mv_{P}x{width}_dev"] = device_ms(lambda: torch.mv(part.t(), ones), reps)
        ref = part.double().sum(0)
        row[f"partial_rel_err_{P}x{width}"] = [rel_err(part.sum(0), ref), rel_err(torch.mv(part.t(), ones), ref)]
    part2 = torch.randn(2, 528, D, device=dev)
    row["partial_sum_2x528_dev"] = device_ms(lambda: part2.sum(1), reps)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="32760,28080,24960")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(args.out, "probe_projections.json"), "w") as f:
        for S in (int(s) for s in args.tokens.split(",")):
            row = {**meta, **probe(S, 1536, args.reps)}
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
