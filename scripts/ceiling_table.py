"""Print the ceiling table of step benches (scheduling/ceiling.py says what each column is).

    python scripts/ceiling_table.py --bench DIR_OR_JSON [--bench ...] --kernels results/attention_h200.json \
        [--gemm-tflops 790] [--fused-fraction 0.81] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from scheduling.ceiling import ceiling_rows, load_bench, table  # noqa: E402
from scheduling import ceiling  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=ceiling.__doc__)
    ap.add_argument("--bench", action="append", required=True, help="a step bench's folder or bench_step.json")
    ap.add_argument("--kernels", default="results/attention_h200.json", help="the attention kernels' table")
    ap.add_argument("--gemm-tflops", type=float, default=790.0)
    ap.add_argument("--fused-fraction", type=float, default=0.81)
    ap.add_argument("--out", default=None, help="also write the table and the rows (FILE.md, FILE.json)")
    args = ap.parse_args(argv)
    with open(args.kernels) as f:
        kernels = json.load(f)
    rows = [r for b in args.bench for r in ceiling_rows(load_bench(b), kernels, args.gemm_tflops * 1e12,
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
