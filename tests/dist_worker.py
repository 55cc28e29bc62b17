"""Run under `torchrun --nproc_per_node 2` by tests/test_distributed.py: FSDP2 (gloo) with deliberately unequal
work per rank; argv[2] (optional) is the model's glue and AdaLN backend ("triton": the fused ops, which call the
block's weights inside their own autograd functions, under the interpreter on CPU; every block recomputed, the
block's tail as one op), or "staged": the reference glue with every collective staged through host copies
(training/shared_gpu.py, which launch.debug_share_gpu=host uses for CUDA tensors). Checks nothing itself; writes
rank 0's findings as JSON to argv[1]:
  - the sharded gradients (full tensors) and the single-process gradients of the same samples and loss;
  - measured busy seconds per (rank, slot) and their CV.
"""
import json
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.batch import collate  # noqa: E402
from models.build import build_model, build_parallel_model  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.flow_matching import FlowMatching, ObjectiveConfig  # noqa: E402
from scheduling.efficiency import compute_cv, idle_fraction  # noqa: E402
from training.busy import StepProfiler  # noqa: E402
from training.dist import init_distributed, shutdown  # noqa: E402
from training.step import TrainParts, draw_t_noise, train_step  # noqa: E402

CFG = ModelConfig(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16,
                  freq_dim=16, ffn_dim=64, num_layers=2, text_len=8)


def micro_batch(B, F, H, W, weights, tag):
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))  # stable across processes
    lat = [torch.randn(4, F, H, W, generator=g) for _ in range(B)]
    txt = [torch.randn(5, 16, generator=g) for _ in range(B)]
    keys = [f"{tag}-{i}" for i in range(B)]
    return collate(lat, txt, keys, tag, F * H * W // 4, weights, CFG.text_len)


def make_plan(small: bool):
    """rank 0 carries far more work than rank 1; rank 1's last slot is padding (weight 0). small: fewer tokens (the
    Triton interpreter's pace), the same structure."""
    big, mid = ((2, 3, 8, 8), (1, 3, 4, 8)) if small else ((8, 5, 16, 16), (4, 5, 8, 16))
    plan = {0: [micro_batch(*big, [1.0] * big[0], "big"), micro_batch(*mid, [1.0] * mid[0], "mid")],
            1: [micro_batch(1, 1, 4, 4, [1.0], "small"), micro_batch(1, 1, 4, 4, [0.0], "pad")]}
    return plan, big[0] + mid[0] + 1


class CaptureGrads(torch.optim.SGD):
    """An optimizer whose step records the (global) gradients instead of applying them."""

    def __init__(self, model):
        super().__init__(model.parameters(), lr=0.0)
        self.named = list(model.named_parameters())
        self.grads = {}

    def step(self, closure=None):
        for n, p in self.named:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            self.grads[n] = g.detach().clone()


def main(out_path, glue="torch"):
    torch.set_num_threads(1)
    ctx = init_distributed()
    staged = []
    if glue == "staged":
        from training.shared_gpu import stage_through_host

        stage_through_host(lambda t: staged.append(tuple(t.shape)) or True)
        glue = "torch"
    torch.manual_seed(0)
    model = build_parallel_model(CFG, ctx.rank, ctx.world_size, ctx.device)
    model.glue_backend = model.adaln_backend = glue
    PLAN, NUM_REAL = make_plan(small=glue != "torch")
    if glue != "torch":  # the block's tail as one op (ops/gated_ffn.py) at these short sequences, every block
        # recomputed: its passes under FSDP2's per-block gathers, against the one-process reference (no recompute)
        import ops.gated_ffn

        ops.gated_ffn.GATED_TAIL_MIN_TOKENS = 1
    objective = FlowMatching(ObjectiveConfig(t_sampling="uniform"))
    opt = CaptureGrads(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    prof = StepProfiler(busy_every=1, profile_steps=None, trace_dir="", rank=ctx.rank)
    with prof.context(1):
        parts = TrainParts(model, objective, opt, sched, ctx, 0, checkpoint_policy=lambda B, S: glue != "torch",
                           autocast=lambda: torch.autocast("cpu", enabled=False))
        train_step(parts, iter(PLAN[ctx.rank]), NUM_REAL, 0)
    busy = ctx.all_gather_floats(prof.finish(1, 2)).numpy()
    if ctx.rank == 0:
        torch.manual_seed(0)
        ref = build_model(CFG)  # the same init, one process, every sample in one loss, the reference glue
        total = 0.0
        for batches in PLAN.values():
            for b in batches:
                t, noise = draw_t_noise(objective, b.keys, b.latents.shape[1:], 0, 0)
                total = total + (objective.per_sample_loss(ref, b.latents, b.text, t, noise) * b.loss_weight).sum()
        (total / NUM_REAL).backward()
        diffs = {n: float((opt.grads[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-12))
                 for n, p in ref.named_parameters()}
        diff = max(diffs.values())
        with open(out_path, "w") as f:
            json.dump({"max_rel_grad_diff": diff, "busy": busy.tolist(), "busy_cv": compute_cv(busy),
                       "idle_fraction": idle_fraction(busy), "num_params": len(opt.grads),
                       "staged_tensors": len(staged)}, f)
    ctx.barrier()  # rank 1 must not tear down gloo while rank 0 still works
    prof.settle()
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
