"""Direct checks of units the train step builds on that its end-to-end tests reach only in passing: the MMDiT's
inputs at the data → model seam (training/inputs.py), the fused Wan block's deprecated alias and its no-rotation
table (models/fused_wan.py), and the Triton set-up every fused op shares (ops/triton_setup.py: a missing triton, row
segments, modulation strides). Each pins one rule a plausible slip would break (an earlier mutation pass); all run on
the CPU in well under a second each.
"""
import pytest
import torch

import models.config as model_config
from models.fused_wan import apply_fused_ops
from models.wan import WanTransformer
from ops.triton_setup import KernelConfig, import_triton, mod_layout, segments
from tests.test_wan_parity import TINY


def test_reading_the_deprecated_recompute_glue_warns_and_gives_recompute_norms(monkeypatch):
    monkeypatch.setattr(model_config, "_WARNED", set())
    block = apply_fused_ops(WanTransformer(**TINY), "triton").blocks[0]
    block.recompute_norms = False
    with pytest.warns(FutureWarning, match=r"WanBlock\.recompute_glue is deprecated.*recompute_norms"):
        assert block.recompute_glue is False


def test_the_no_rotation_table_is_half_a_head_of_ones_and_zeros_per_token():
    """The cross-attention's q/k go through qk_norm_rope with cos = 1, sin = 0: K = head_dim / 2 columns, as RoPE3D's
    (at Wan's head_dim 128, K = 42 would not even divide D = 1536 into pairs of heads)."""
    from models.fused_wan import _no_rotation

    x = torch.zeros(2, 5, 12 * 128, dtype=torch.bfloat16)
    cos, sin = _no_rotation(x, 12)
    assert cos.shape == sin.shape == (5, 64) and cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, torch.ones(5, 64)) and torch.equal(sin, torch.zeros(5, 64))
    assert cos.stride(0) == sin.stride(0) == 0  # one row, viewed per token


def test_the_triton_backend_without_triton_installed_says_so_before_importing():
    with pytest.raises(RuntimeError, match=r"adaln: backend='triton' needs the `triton` package"):
        import_triton("adaln", interpret=False, available=False)


def test_mmdit_inputs_without_a_text_mask_pass_none_and_compute_no_text_span():
    """A batch may carry no text mask (all tokens valid): the model gets None and finds the span itself; with a mask
    on the host, its span is computed here (no host sync inside the model's forward)."""
    from data.batch import Batch
    from models.config import MMDiTConfig
    from models.mmdit import text_span
    from training.inputs import model_inputs

    cfg = MMDiTConfig(num_layers=1, num_single_layers=1, text_embed_dim=16, pooled_projection_dim=8, guidance_scale=2.0)
    text, pooled = torch.randn(2, 5, 16), torch.randn(2, 8)
    batch = Batch(torch.zeros(2, 4, 1, 2, 2), text, ["a", "b"], "img", 1, torch.ones(2), pooled=pooled)
    got = model_inputs(cfg, batch)
    assert got.keys() == {"encoder_attention_mask", "pooled_projections", "guidance"}
    assert got["encoder_attention_mask"] is None and got["pooled_projections"] is pooled
    assert got["guidance"].tolist() == [2000.0, 2000.0]
    mask = torch.tensor([[True, True, False, False, False], [True, True, True, False, False]])
    got = model_inputs(cfg, Batch(**{**batch.__dict__, "text_mask": mask}))
    assert got["text_span"] == text_span(mask) and got["encoder_attention_mask"] is mask


@pytest.mark.parametrize("D, rows, warps, elem, split, expected", [
    (1536, 1, 2, 2, None, (1024, 512)),   # 1·512·2 B = 16 B · 32 lanes · 2 warps: exactly a 16-byte load each, split
    (1280, 1, 2, 2, None, (2048, 1)),     # 1·256·2 B < 1024 B: one masked tile
    (5120, 2, 4, 4, None, (4096, 1024)),  # 2·1024·4 B ≥ 2048 B
    (1024, 1, 8, 2, None, (1024, 1)),     # a power of two: one segment, the second a single masked lane
    (1536, 1, 2, 2, False, (2048, 1)),    # the config's own choice wins
    (1280, 1, 2, 2, True, (1024, 256)),
])
def test_a_row_splits_into_two_segments_when_each_thread_still_loads_16_bytes(D, rows, warps, elem, split, expected):
    assert segments(D, KernelConfig(rows=rows, num_warps=warps, programs_per_sm=0, split=split), elem) == expected


def test_a_modulation_layout_gives_stride_0_on_every_axis_it_broadcasts_over():
    """(per token, batch stride, token stride, feature stride) of a [B|1, N|1, D] scale/shift/gate."""
    B, N, D = 3, 5, 8
    assert mod_layout(torch.zeros(B, N, D), B, N) == (True, N * D, D, 1)
    assert mod_layout(torch.zeros(B, 1, D), B, N) == (False, D, 0, 1)
    assert mod_layout(torch.zeros(1, 1, D), B, N) == (False, 0, 0, 1)
    assert mod_layout(torch.zeros(1, N, D), B, N) == (True, 0, D, 1)
    assert mod_layout(torch.zeros(B, 1, D), B, 1) == (False, D, 0, 1)  # one token: nothing to step over
    assert mod_layout(torch.zeros(B, D, N).transpose(1, 2), B, N) == (True, N * D, 1, N)  # any strides, as given


def test_the_ops_tests_run_the_interpreter_on_4_row_tiles():
    """The ops' own tests cross tile and span boundaries at small shapes only with 4-row tiles; whole-model tests
    widen them (tests/conftest.py wide_interpreter_tiles)."""
    from ops.triton_setup import INTERPRETER_ROWS, interpreter_config

    assert INTERPRETER_ROWS == 4 and interpreter_config(block_d=64) == KernelConfig(4, 4, 2, block_d=64)
