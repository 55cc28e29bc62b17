"""The ceiling table (scripts/ceiling_table.py prints it): where a Wan step's device time goes at each bucket
shape, each part against its own kernel's measured ceiling on the GPU, and the MFU the design could reach with every
part at its ceiling; and the bound of a whole bucket mix (mix_bound).

    python scripts/ceiling_table.py --bench DIR_OR_JSON [--bench ...] --kernels results/attention_h200.json \
        [--gemm-tflops 790] [--fused-fraction 0.81] [--out FILE.md]

Inputs, all measured on the one GPU:
- `scripts/bench/step.py --profile-every` outputs (bench_step.json): each shape's device-time split of one step by
  kernel kind (attention, GEMM, our Triton kernels, the rest) for ours@glue (every block recomputed) and ours@none
  (no recompute, where it fits), beside the rows' wall ms and MFU;
- `scripts/bench/attention.py`'s kernel table (attention_h200.json "timed"): cuDNN's forward + backward TFLOP/s at
  Wan's shapes (3.5 × the forward's 4·B·H·S²·Dh), the attention's ceiling at S (attention_rate);
- the bf16 GEMM ceiling (--gemm-tflops; 790 TFLOP/s measured on this GPU kind) and the fused ops' measured share of
  the copy bandwidth (--fused-fraction; results/adaln_h200.md: 77–85 %).

Per part, the ceiling time is the work it executes at its ceiling rate:
- attention: layers × (self-attention 4·B·H·S²·Dh + cross-attention 4·B·H·S·L·Dh) × (3.5, or 4.5 when the block
  is recomputed: its forward runs twice) ÷ cuDNN's measured rate at that S;
- matmuls: (6, or 8 recomputed) · P_matmul · B·S ÷ the GEMM ceiling (P_matmul from the model FLOPs, contracts §9);
- fused Triton ops: measured × the fused fraction (what they would take at the full copy bandwidth);
- the rest (casts, norms, reductions, copies): at its measured time, no ceiling claimed; the GPU's idle time
  inside the step: 0 at the ceiling.
MFU at the ceiling = the model FLOPs (no recompute counted) ÷ (Σ ceiling times × 989 TFLOP/s).
"""
from __future__ import annotations

import json
import math
import os

from scheduling.efficiency import model_flops

PEAK = 989e12
TEXT_LEN = 512


WAN_CONFIGS = {"1.3b": {"num_layers": 30, "num_attention_heads": 12, "attention_head_dim": 128},
               "14b": {"num_layers": 40, "num_attention_heads": 40, "attention_head_dim": 128}}


def load_bench(path: str, model: str = "1.3b") -> dict:
    """A step bench's bench_step.json, or, where the run was killed before writing it, its stream bench_step.jsonl
    (rows and profiles as they were taken; the model's config then from `model`, which the stream does not hold)."""
    if os.path.isdir(path):
        whole = os.path.join(path, "bench_step.json")
        path = whole if os.path.exists(whole) else os.path.join(path, "bench_step.jsonl")
    if not path.endswith(".jsonl"):
        with open(path) as f:
            return json.load(f)
    rows, profiles = [], {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "profile_of" in rec:
                profiles.setdefault(rec.pop("BxS"), {})[rec.pop("profile_of")] = rec
            elif "impl" in rec:
                rows.append(rec)
    return {"meta": {"config": WAN_CONFIGS[model], "profiles": profiles}, "rows": rows}


def ceiling_rows(bench: dict, kernels: dict, gemm: float, fused_fraction: float) -> list[dict]:
    cfg = bench["meta"]["config"]
    layers, heads, dh = cfg["num_layers"], cfg["num_attention_heads"], cfg["attention_head_dim"]
    dim = heads * dh
    rows = {(r["impl"], r["B"], r["S"]): r for r in bench["rows"]}
    out = []
    for key, profs in sorted((bench["meta"].get("profiles") or {}).items(), key=lambda kv: int(kv[0].split("x")[1])):
        B, S = (int(v) for v in key.split("x"))
        for impl, prof in sorted(profs.items()):
            row = rows.get((impl, B, S))
            if row is None or row.get("mfu") is None:
                continue
            flops = row["mfu"] * PEAK * row["ms"] / 1e3  # the model FLOPs of the step (no recompute)
            attn_fwd = layers * B * (4.0 * heads * S * S * dh + 4.0 * heads * S * TEXT_LEN * dh)
            p_tokens = (flops - model_flops(B, S, TEXT_LEN, 0, layers, dim)) / 6.0  # P_matmul · B·S
            recompute = impl != "ours@none"
            rate = attention_rate(kernels, S, heads)
            parts = {k: (prof.get(k) or {}).get("ms", 0.0) for k in ("attention", "gemm", "ours (triton)", "other")}
            idle = prof.get("idle_ms", 0.0) or 0.0
            ceil = {"attention": attn_fwd * (4.5 if recompute else 3.5) / rate * 1e3,
                    "gemm": (8.0 if recompute else 6.0) * p_tokens / gemm * 1e3,
                    "ours (triton)": parts["ours (triton)"] * fused_fraction,
                    "other": parts["other"]}
            total_ceiling = sum(ceil.values())
            out.append({"impl": impl, "B": B, "S": S, "wall_ms": row["ms"], "mfu": row["mfu"],
                        "device_ms": prof.get("total_ms"), "idle_ms": idle, "parts_ms": parts,
                        "ceiling_ms": ceil, "attention_rate_tflops": rate / 1e12,
                        "model_tflop": flops / 1e12, "mfu_at_ceiling": flops / (total_ceiling / 1e3) / PEAK,
                        "part_of_ceiling": {k: (ceil[k] / parts[k] if parts[k] else None) for k in parts}})
    return out


def table(rows: list[dict]) -> str:
    names = {"ours@glue": "every block recomputed", "ours@none": "no recompute"}
    lines = ["| B × S | policy | step ms (MFU) | attention ms: measured / ceiling | matmuls | fused ops | the rest "
             "| GPU idle in the step | MFU with every part at its ceiling |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, c = r["parts_ms"], r["ceiling_ms"]
        cell = lambda k: f"{p[k]:.0f} / {c[k]:.0f} ({100 * c[k] / p[k]:.0f} %)" if p[k] else "—"  # noqa: E731
        lines.append(f"| {r['B']} × {r['S']:,} | {names.get(r['impl'], r['impl'])} | {r['wall_ms']:.0f} "
                     f"({r['mfu']:.3f}) | {cell('attention')} | {cell('gemm')} | {cell('ours (triton)')} | "
                     f"{p['other']:.0f} | {r['idle_ms']:.0f} | **{r['mfu_at_ceiling']:.3f}** |")
    return "\n".join(lines)


def attention_rate(kernels: dict, S: int, heads: int) -> float:
    """cuDNN's forward + backward FLOP/s at S: the measured rate at a measured S, else log-linear in S between the
    two nearest measured (the nearest outside them); the model's head count where it was measured."""
    rows = sorted({r["S"]: r["tflops"] for r in kernels["timed"] if r["kernel"] == "cudnn" and r.get("tflops")
                   and r["heads"] == heads}.items()) or \
        sorted({r["S"]: r["tflops"] for r in kernels["timed"] if r["kernel"] == "cudnn" and r.get("tflops")}.items())
    Ss = [s for s, _ in rows]
    if S <= Ss[0] or S >= Ss[-1] or S in Ss:
        return dict(rows)[min(Ss, key=lambda s: abs(s - S))] * 1e12
    hi = next(i for i, s in enumerate(Ss) if s > S)
    (s0, r0), (s1, r1) = rows[hi - 1], rows[hi]
    w = (math.log(S) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return ((1 - w) * r0 + w * r1) * 1e12


def mix_bound(mix, kernels: dict, p_matmul: float, layers: int, dim: int, heads: int, gemm: float = 790e12,
              text_len: int = TEXT_LEN) -> dict:
    """An upper bound on a design's MFU that runs cuDNN's attention and cuBLAS's GEMMs: per bucket (S, share of
    samples), the model FLOPs (contracts §9) over the time of attention at cuDNN's measured rate at that S (3.5 × the
    forward's FLOPs, no recompute) plus the matmuls (6·P·S) at the GEMM ceiling — nothing else (no fused ops, no
    casts, no optimizer, no host gap, no recompute) — and the mix's: Σ share·FLOPs / Σ share·time."""
    rows, F_all, T_all = [], 0.0, 0.0
    for S, share in mix:
        F = model_flops(1, S, text_len, p_matmul, layers, dim)
        fwd = layers * (4.0 * S * S * dim + 4.0 * S * text_len * dim)
        t = 3.5 * fwd / attention_rate(kernels, S, heads) + 6.0 * p_matmul * S / gemm
        rows.append({"S": S, "share": share, "attention_share_of_flops": 1.0 - 6.0 * p_matmul * S / F,
                     "mfu_bound": F / t / PEAK})
        F_all += share * F
        T_all += share * t
    return {"rows": rows, "mix_mfu_bound": F_all / T_all / PEAK}
