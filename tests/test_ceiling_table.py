"""scheduling/ceiling.py (scripts/ceiling_table.py): each part's ceiling time from a step bench's profile, worked out by hand."""
import pytest

from scheduling import ceiling as ct


def bench(impl):
    # 1 layer, 2 heads of 4: dim 8; B = 1, S = 8; 1.0 ms at MFU 0.5 → 0.4945 GFLOP of model FLOPs
    return {"meta": {"config": {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 4},
                     "profiles": {"1x8": {impl: {"total_ms": 0.9, "idle_ms": 0.1,
                                                 "attention": {"ms": 0.2}, "gemm": {"ms": 0.5},
                                                 "ours (triton)": {"ms": 0.1}, "other": {"ms": 0.1}}}}},
            "rows": [{"impl": impl, "B": 1, "S": 8, "ms": 1.0, "mfu": 0.5}]}


KERNELS = {"timed": [{"kernel": "cudnn", "B": 1, "S": 8, "heads": 2, "tflops": 1.0},
                     {"kernel": "flash", "B": 1, "S": 8, "heads": 2, "tflops": 0.5},
                     {"kernel": "cudnn", "B": 1, "S": 1000, "heads": 2, "tflops": 9.0}]}


@pytest.mark.parametrize("impl,attn_x,gemm_x", [("ours@glue", 4.5, 8.0), ("ours@none", 3.5, 6.0)])
def test_each_part_runs_its_own_work_at_its_own_ceiling(impl, attn_x, gemm_x):
    [r] = ct.ceiling_rows(bench(impl), KERNELS, gemm=2e12, fused_fraction=0.8)
    flops = 0.5 * 989e12 * 1e-3  # 494.5 GFLOP
    # attention's forward: 4·H·S²·Dh = 2,048 (self) + 4·H·S·512·Dh = 131,072 (cross) = 133,120 FLOP, at cuDNN's
    # 1 TFLOP/s of the nearest measured S (8, not 1000, and not flash's)
    assert r["ceiling_ms"]["attention"] == pytest.approx(133_120 * attn_x / 1e12 * 1e3)
    # P·B·S = (model FLOPs − 12·dim·S·(S + 512)) / 6 = (494.5e9 − 399,360) / 6, at the GEMM's 2 TFLOP/s
    assert r["ceiling_ms"]["gemm"] == pytest.approx(gemm_x * (flops - 399_360) / 6 / 2e12 * 1e3)
    assert r["ceiling_ms"]["ours (triton)"] == pytest.approx(0.08) and r["ceiling_ms"]["other"] == 0.1
    total = sum(r["ceiling_ms"].values())
    assert r["mfu_at_ceiling"] == pytest.approx(flops / (total / 1e3) / 989e12)
    assert "**" in ct.table([r]) and f"{r['mfu_at_ceiling']:.3f}" in ct.table([r])
