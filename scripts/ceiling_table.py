"""Print the ceiling table of step benches (scheduling/ceiling.py says what each column is).

    python scripts/ceiling_table.py --bench DIR_OR_JSON [--bench ...] --kernels results/attention_h200.json \
        [--gemm-tflops 790] [--fused-fraction 0.81] [--out FILE.md]
    python scripts/ceiling_table.py --mix-bound [--model 1.3b|14b]   (no bench: the MFU bound of the Wan mix)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from scheduling.ceiling import ceiling_rows, load_bench, mix_bound, table  # noqa: E402
from scheduling import ceiling  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=ceiling.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", action="append", default=[], help="a step bench's folder or bench_step.json")
    ap.add_argument("--mix-bound", action="store_true", help="the MFU bound of the simulator's default mix (the Wan "
                    "mix's shares) from the kernels' table alone: attention at cuDNN's rate, matmuls at the GEMM "
                    "ceiling, nothing else")
    ap.add_argument("--model", choices=("1.3b", "14b"), default="1.3b", help="with --mix-bound, and the config of a "
                    "bench read from its stream (bench_step.jsonl of a killed run)")
    ap.add_argument("--kernels", default="results/attention_h200.json", help="the attention kernels' table")
    ap.add_argument("--gemm-tflops", type=float, default=790.0)
    ap.add_argument("--fused-fraction", type=float, default=0.81)
    ap.add_argument("--out", default=None, help="also write the table and the rows (FILE.md, FILE.json)")
    args = ap.parse_args(argv)
    with open(args.kernels) as f:
        kernels = json.load(f)
    if args.mix_bound:
        from scheduling.simulate import DEFAULT_MIX

        layers, dim, heads, ffn = (30, 1536, 12, 8960) if args.model == "1.3b" else (40, 5120, 40, 13824)
        # P_matmul as the model counts it (models/wan.py num_matmul_params; contracts §9) but for the patch embedding
        # and the output projection (128·dim: 0.02 % of it): the weights that act on every latent token —
        # self-attention's q, k, v, o, cross-attention's q and o, the MLP — not cross-attention's k and v (they act
        # on the 512 text tokens)
        p_matmul = layers * (6 * dim * dim + 2 * dim * ffn)
        res = mix_bound([(S, share) for _, S, share in DEFAULT_MIX], kernels, p_matmul, layers, dim, heads,
                        args.gemm_tflops * 1e12)
        print(f"Wan {args.model}: attention at cuDNN's measured rate, matmuls at {args.gemm_tflops:g} TFLOP/s, "
              "nothing else (no fused ops, casts, optimizer, host gaps or recompute)")
        print("| S | share of samples | attention's share of the FLOPs | MFU bound |\n|---|---|---|---|")
        for r in res["rows"]:
            print(f"| {r['S']:,} | {r['share']:.2f} | {r['attention_share_of_flops']:.2f} | {r['mfu_bound']:.3f} |")
        print(f"| the mix | | | **{res['mix_mfu_bound']:.3f}** |")
        if not args.bench:
            return
    rows = [r for b in args.bench for r in ceiling_rows(load_bench(b, args.model), kernels, args.gemm_tflops * 1e12,
                                                          args.fused_fraction)]
    if not rows:
        sys.exit("ceiling_table.py: no profiled shape in the benches (run scripts/bench/step.py --profile-every)")
    text = table(rows)
    print(text)
    if args.out:
        stem = os.path.splitext(args.out)[0]
        with open(stem + ".md", "w") as f:
            f.write(text + "\n")
        with open(stem + ".json", "w") as f:
            json.dump({"gemm_tflops": args.gemm_tflops, "fused_fraction": args.fused_fraction, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
