"""scheduling/ceiling.py (scripts/ceiling_table.py): each part's ceiling time from a step bench's profile, and the
mix bound, worked out by hand."""
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


def test_the_mix_bound_counts_attention_at_cudnns_rate_and_matmuls_at_the_gemm_ceiling():
    """One layer of dim 8 (2 heads), S = 8, no text: FLOPs 6·P·S + 12·dim·S² = 6·100·8 + 12·8·64 = 10,944; time
    3.5 · 4·S²·dim / 1 TFLOP/s + 6·P·S / 2 TFLOP/s = 7,168 / 1e12 + 4,800 / 2e12 s; and a mix of it with S = 1000
    at 9 TFLOP/s weighs each by its share of samples."""
    one = ct.mix_bound([(8, 1.0)], KERNELS, p_matmul=100, layers=1, dim=8, heads=2, gemm=2e12, text_len=0)
    t8 = 7168 / 1e12 + 4800 / 2e12
    assert one["rows"][0]["mfu_bound"] == pytest.approx(10_944 / t8 / 989e12)
    assert one["rows"][0]["attention_share_of_flops"] == pytest.approx(6144 / 10_944)
    F1000, t1000 = 6 * 100 * 1000 + 12 * 8 * 1000**2, 3.5 * 4 * 1000**2 * 8 / 9e12 + 6 * 100 * 1000 / 2e12
    two = ct.mix_bound([(8, 0.75), (1000, 0.25)], KERNELS, p_matmul=100, layers=1, dim=8, heads=2, gemm=2e12,
                       text_len=0)
    assert two["mix_mfu_bound"] == pytest.approx((0.75 * 10_944 + 0.25 * F1000) / (0.75 * t8 + 0.25 * t1000) / 989e12)
    assert ct.attention_rate(KERNELS, 8, 2) == 1e12 and ct.attention_rate(KERNELS, 5000, 2) == 9e12
    mid = ct.attention_rate(KERNELS, 89, 2)  # 89 ≈ √(8 · 1000) = 89.4: half way in log S, half way in rate
    assert mid == pytest.approx(5e12, rel=3e-3) and mid < 5e12


def test_a_killed_benchs_stream_reads_as_its_whole_file(tmp_path, monkeypatch):
    """bench_step.jsonl (rows and profiles as taken, no meta) gives the rows the finished file would, the config from
    the model named; the finished file wins where both exist."""
    import json

    whole = bench("ours@none")
    prof = whole["meta"]["profiles"]["1x8"]["ours@none"]
    with open(tmp_path / "bench_step.jsonl", "w") as f:
        f.write(json.dumps(whole["rows"][0]) + "\n")
        f.write(json.dumps({"profile_of": "ours@none", "BxS": "1x8", **prof}) + "\n")
    monkeypatch.setitem(ct.WAN_CONFIGS, "tiny", whole["meta"]["config"])
    streamed = ct.load_bench(str(tmp_path), "tiny")
    assert streamed["meta"]["profiles"] == whole["meta"]["profiles"] and streamed["rows"] == whole["rows"]
    assert ct.ceiling_rows(streamed, KERNELS, 2e12, 0.8) == ct.ceiling_rows(whole, KERNELS, 2e12, 0.8)
    assert ct.load_bench(str(tmp_path / "bench_step.jsonl"), "1.3b")["meta"]["config"]["num_layers"] == 30
    (tmp_path / "bench_step.json").write_text(json.dumps({**whole, "rows": []}))
    assert ct.load_bench(str(tmp_path))["rows"] == []
