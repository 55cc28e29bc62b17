"""On a GPU, under FSDP2 and bf16 autocast: fp32 master weights, bf16 matmuls, and the modulation tables, time
embedder and norms computing in fp32 inside forward (docs/contracts.md §5). Skips cleanly without CUDA."""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def test_fp32_modules_stay_fp32_inside_forward_under_fsdp2(one_rank_group):
    import ops.adaln as adaln
    from models.parallelize import parallelize
    from models.wan import WanTransformer

    torch.manual_seed(0)
    model = WanTransformer(num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, text_dim=32,
                           freq_dim=32, ffn_dim=256, num_layers=2).cuda()
    parallelize(model, world_size=1, shard=True)
    seen = {}

    def record(name):
        return lambda mod, inp, out: seen.setdefault(name, set()).add((out[0] if isinstance(out, tuple) else out).dtype)

    model.condition_embedder.time_embedder.register_forward_hook(record("time_embedder"))
    model.blocks[0].attn1.to_q.register_forward_hook(record("to_q"))
    model.blocks[0].attn1.norm_q.register_forward_hook(record("norm_q"))
    params_in_forward = {}
    model.blocks[0].register_forward_pre_hook(
        lambda mod, inp: params_in_forward.update(table=mod.scale_shift_table.dtype, norm2=mod.norm2.weight.dtype,
                                                  to_q=mod.attn1.to_q.weight.dtype))
    orig = adaln.adaln_modulate
    calls = []

    def spy(x, scale, shift, eps=1e-6, backend="auto"):
        calls.append((x.dtype, scale.dtype, shift.dtype))
        return orig(x, scale, shift, eps, backend)

    import models.wan as wan
    wan.adaln_modulate = spy
    try:
        x = torch.randn(2, 4, 3, 16, 16, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, torch.tensor([100.0, 900.0], device="cuda"), torch.randn(2, 8, 32, device="cuda"))
        out.float().pow(2).mean().backward()
    finally:
        wan.adaln_modulate = orig
    assert seen["time_embedder"] == {torch.float32}
    assert seen["to_q"] == {torch.bfloat16}           # matmuls in bf16
    assert seen["norm_q"] == {torch.bfloat16}         # computed in fp32, returned in the stream's dtype
    # unsharded parameters as forward sees them: fp32 (no bf16 param policy), autocast casts only matmul inputs
    assert params_in_forward == {"table": torch.float32, "norm2": torch.float32, "to_q": torch.float32}
    assert calls and all(s == torch.float32 and h == torch.float32 for _, s, h in calls)  # modulation in fp32
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, n
