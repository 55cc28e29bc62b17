"""The matmul pieces a recomputed Wan block's MLP tail could use instead of what it runs, timed on one GPU.

Wan 1.3B's MLP at S tokens (dim 1536, ffn 8960, bf16), each piece's median device time over --reps calls:
  up            F.linear(y, W1, b1)                                    what every pass runs now
  up+gelu       F.linear then F.gelu(tanh)                             the forward's a = GELU(h), two kernels
  up_gelu_lt    torch._addmm_activation(b1, y, W1ᵀ, use_gelu=True)    GELU in cuBLASLt's epilogue, one kernel
  down          F.linear(a, W2, b2)                                    the down projection a recompute need not run
  dW2           doutᵀ·a (bf16 out)                                     the weight gradient as backward makes it now
  G_f32         torch.mm(doutᵀ, a, out_dtype=fp32)                     the same product kept in fp32
  G_acc_f32     torch.addmm(G, doutᵀ, a, out_dtype=fp32, out=G)        accumulated in place (chunks of rows)
and each fp32-output call's error against an fp64 product. With --elementwise, the backward's elementwise work on
one chunk of rows (ops.gelu_ffn.chunk_rows) as eager runs it against ops.gelu_ffn.gelu_act_grad_ (and its launch
shapes), and ops.adaln's backward with the residual's gradient added in its pass against a separate add:
  gelu / gelu_backward / bias_sum   aten's three passes (a = GELU(h); dh = da·GELU'(h); db1 = Σ_rows dh)
  act_grad[cfg]                     the one pass making a, dh and db1's partial sums (cfg: rows, features, iters, warps)
  adaln_bwd / adaln_bwd+add / adaln_bwd_dres
Writes one JSON line per S to --out/probe_mlp_tail.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return round(statistics.median(times), 3)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def probe(S: int, D: int, Fdim: int, reps: int) -> dict:
    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    y = torch.randn(S, D, device=dev, dtype=bf, generator=g)
    w1 = (torch.randn(Fdim, D, device=dev, generator=g) / D**0.5).to(bf)
    b1 = (torch.randn(Fdim, device=dev, generator=g) * 0.1).to(bf)
    w2 = (torch.randn(D, Fdim, device=dev, generator=g) / Fdim**0.5).to(bf)
    b2 = (torch.randn(D, device=dev, generator=g) * 0.1).to(bf)
    dout = torch.randn(S, D, device=dev, dtype=bf, generator=g)
    a = F.gelu(F.linear(y, w1, b1), approximate="tanh")
    row = {"S": S, "D": D, "ffn": Fdim}
    row["up_ms"] = timed(lambda: F.linear(y, w1, b1), reps)
    row["up+gelu_ms"] = timed(lambda: F.gelu(F.linear(y, w1, b1), approximate="tanh"), reps)
    try:
        lt = torch._addmm_activation(b1, y, w1.t(), use_gelu=True)
        row["up_gelu_lt_ms"] = timed(lambda: torch._addmm_activation(b1, y, w1.t(), use_gelu=True), reps)
        ref = F.gelu(y.double() @ w1.double().t() + b1.double(), approximate="tanh")
        row["up_gelu_lt_rel_err"] = rel_err(lt, ref)
        row["up+gelu_rel_err"] = rel_err(a, ref)
        del lt, ref
    except Exception as e:  # noqa: BLE001 - what fails is the answer
        row["up_gelu_lt_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    row["down_ms"] = timed(lambda: F.linear(a, w2, b2), reps)
    row["dW2_bf16_ms"] = timed(lambda: dout.t() @ a, reps)
    ref = dout.double().t() @ a.double()
    try:
        G = torch.mm(dout.t(), a, out_dtype=torch.float32)
        row["G_f32_ms"] = timed(lambda: torch.mm(dout.t(), a, out_dtype=torch.float32), reps)
        row["G_f32_rel_err"] = rel_err(G, ref)
        row["dW2_bf16_rel_err"] = rel_err(dout.t() @ a, ref)
        half = S // 2
        G.zero_()
        torch.addmm(G, dout[:half].t(), a[:half], out_dtype=torch.float32, out=G)
        torch.addmm(G, dout[half:].t(), a[half:], out_dtype=torch.float32, out=G)
        row["G_acc_f32_rel_err"] = rel_err(G, ref)  # two chunks accumulated in place
        row["G_acc_f32_ms"] = timed(lambda: torch.addmm(G, dout.t(), a, out_dtype=torch.float32, out=G), reps)
    except Exception as e:  # noqa: BLE001
        row["G_f32_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


ACT_GRAD_CONFIGS = [(8, 256, 8, 4), (16, 256, 4, 4), (32, 256, 2, 8), (64, 256, 1, 8), (8, 128, 8, 4), (16, 128, 4, 4),
                    (32, 128, 2, 4), (64, 128, 1, 4), (4, 256, 16, 4), (8, 256, 4, 4), (16, 256, 2, 4), (32, 256, 1, 4),
                    (8, 512, 8, 4), (16, 256, 8, 4), (16, 128, 8, 4), (8, 256, 8, 8)]


def probe_elementwise(S: int, D: int, Fdim: int, reps: int) -> dict:
    from ops.adaln import adaln_backward, adaln_forward
    from ops.gelu_ffn import GELU_GRAD_CONFIG, chunk_rows, gelu_act_grad_

    dev, bf = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    R = chunk_rows(S, Fdim, 2)
    h = torch.randn(R, Fdim, device=dev, dtype=bf, generator=g)
    da = torch.randn(R, Fdim, device=dev, dtype=bf, generator=g)
    row = {"chunk_rows": R, "act_grad_default": list(GELU_GRAD_CONFIG["cuda"])}
    row["gelu_ms"] = timed(lambda: F.gelu(h, approximate="tanh"), reps)
    row["gelu_backward_ms"] = timed(lambda: torch.ops.aten.gelu_backward(da, h, approximate="tanh"), reps)
    row["bias_sum_ms"] = timed(lambda: da.sum(0, dtype=torch.float32), reps)
    row["eager_elementwise_ms"] = round(row["gelu_ms"] + row["gelu_backward_ms"] + row["bias_sum_ms"], 3)
    db = torch.zeros(Fdim, device=dev)
    for cfg in ACT_GRAD_CONFIGS:  # in place: h and da drift over the reps (GELU of GELU…), their sizes do not
        row[f"act_grad{list(cfg)}_ms"] = timed(lambda: gelu_act_grad_(da, h, db, config=cfg), reps)
    row["act_grad_best"] = list(min(ACT_GRAD_CONFIGS, key=lambda c: row[f"act_grad{list(c)}_ms"]))
    x = torch.randn(1, S, D, device=dev, dtype=bf, generator=g)
    dy, dres = torch.randn_like(x), torch.randn_like(x)
    scale, shift = torch.randn(2, 1, 1, D, device=dev, generator=g) * 0.1
    _, mean, rstd = adaln_forward(x, scale, shift)
    bwd = lambda **kw: adaln_backward(dy, x, scale, mean, rstd, list(shift.shape), shift.dtype, **kw)  # noqa: E731
    row["adaln_bwd_ms"] = timed(bwd, reps)
    row["adaln_bwd+add_ms"] = timed(lambda: bwd()[0].add_(dres), reps)
    row["adaln_bwd_dres_ms"] = timed(lambda: bwd(dres=dres), reps)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="7488,14040,32760")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--elementwise", action="store_true", help="also the backward's elementwise passes")
    ap.add_argument("--no-matmuls", action="store_true", help="skip the matmul pieces")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(args.out, "probe_mlp_tail.json"), "w") as f:
        for S in (int(s) for s in args.tokens.split(",")):
            row = {**meta, "S": S, **({} if args.no_matmuls else probe(S, 1536, 8960, args.reps))}
            if args.elementwise:
                row.update(probe_elementwise(S, 1536, 8960, args.reps))
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
