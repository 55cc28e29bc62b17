"""One training step in one process: train_step's loss normalisation (contracts §3: × world_size, padding weight 0)
and its skip rule for a non-finite loss or gradient norm, the validation loss's per-sample mean (training/step.py);
the Batch it reads (data/batch.py); the optimizer pieces it drives (training/optim.py); the metrics row made of it
(training/metrics.py), how that row is logged (training/metrics.py), the busy time read from its slot
ranges (training/busy.py) and the collectives it calls (training/dist.py). A tiny linear model whose losses are written out by hand here, so every number is
checked against arithmetic, not against the code."""
import contextlib
import copy
import math
import os
import warnings

import numpy as np
import pytest
import torch

from data.batch import collate
from data.keys import keyed_generator
from models.flow_matching import FlowMatching, ObjectiveConfig
from training.dist import DistContext
from training.optim import EMA
from training.step import TrainParts, autocast_for, draw_t_noise, train_step, validation_loss

C, TEXT_LEN, TEXT_DIM = 3, 4, 2
SEED, EPOCH = 11, 2
OBJ = FlowMatching(ObjectiveConfig(t_sampling="uniform", shift=1.0))


class Overflow(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by inf (a finite loss whose gradient overflows)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


class Tiny(torch.nn.Module):
    """v̂ = w_c·x_t + b_c·(timestep / 1000) + u_c·mean(text), per channel c."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, -0.3, 0.8]))
        self.b = torch.nn.Parameter(torch.tensor([0.2, 0.1, -0.4]))
        self.u = torch.nn.Parameter(torch.tensor([0.3, 0.0, 0.6]))
        self.overflow = False
        self.checkpointing = []

    def set_activation_checkpointing(self, *args):
        self.checkpointing.append(args)

    def forward(self, x, timestep, text):
        w = Overflow.apply(self.w) if self.overflow else self.w
        ch = lambda p: p.view(1, C, 1, 1, 1)
        cond = text.mean(dim=(1, 2)).view(-1, 1, 1, 1, 1)
        return ch(w) * x + ch(self.b) * (timestep / 1000).view(-1, 1, 1, 1, 1) + ch(self.u) * cond


def hand_loss(model, x0, text, t, noise):
    """docs/contracts.md §5 written out: x_t = (1 − t)·x0 + t·ε, target ε − x0, the mean square per sample."""
    out = []
    for i in range(x0.shape[0]):
        x_t = (1 - t[i]) * x0[i] + t[i] * noise[i]
        v = (model.w.view(C, 1, 1, 1) * x_t + model.b.view(C, 1, 1, 1) * t[i]
             + model.u.view(C, 1, 1, 1) * text[i].mean())
        out.append(((v - (noise[i] - x0[i])) ** 2).mean())
    return torch.stack(out)


def batch(tag, B, weights, F=2, H=2, W=2):
    g = torch.Generator().manual_seed(sum(map(ord, tag)))
    lat = [torch.randn(C, F, H, W, generator=g) for _ in range(B)]
    txt = [torch.randn(3, TEXT_DIM, generator=g) for _ in range(B)]
    return collate(lat, txt, [f"{tag}{i}" for i in range(B)], tag, F * H * W, weights, TEXT_LEN)


class TwoRanks(DistContext):
    """Rank 0 of a 2-process run, in one process: the other rank's loss sum is given, not communicated."""

    def __init__(self, other_loss_sum: float):
        super().__init__(rank=0, world_size=2)
        self.other = other_loss_sum

    def all_gather_floats(self, values):
        return torch.tensor([list(values), [self.other] * len(values)], dtype=torch.float64)

    def all_reduce_max(self, value):
        return max(value, self.other)


class Recording(torch.optim.SGD):
    """SGD whose step first records the gradients it is handed."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def step(model, batches, num_samples, ctx, opt, ema=None, grad_clip=0.0):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return train_step(TrainParts(model, OBJ, opt, sched, ctx, SEED, grad_clip, ema=ema), batches, num_samples, EPOCH)


@pytest.mark.parametrize("num_samples", [7, 5.5])
def test_gradient_is_world_size_times_the_weighted_per_sample_mean_over_the_whole_step(num_samples):
    """Two micro-batches on this rank (one holds a padding sample of weight 0) of a 2-rank step with 7 real samples:
    the gradient handed to the optimizer is 2 · ∇(Σ weight·loss / 7), so that averaging over 2 ranks gives the
    global per-sample mean; the padding sample contributes nothing to loss or gradient. A windowed step divides by
    its window's mean count a step instead (5.5 here), and its gradient is 2 · ∇(Σ weight·loss / 5.5)."""
    model = Tiny()
    mbs = [batch("a", 3, [1.0, 1.0, 1.0]), batch("b", 2, [1.0, 0.0], F=1, H=2, W=4)]
    # 4 real here, 3 on the other rank
    ref = copy.deepcopy(model)
    total, sums = 0.0, []
    for mb in mbs:
        t, noise = draw_t_noise(OBJ, mb.keys, mb.latents.shape[1:], SEED, EPOCH)
        per = hand_loss(ref, mb.latents, mb.text, t, noise)
        sums.append(float((per * mb.loss_weight).sum().detach()))
        total = total + (per * mb.loss_weight).sum()
    (2 * total / num_samples).backward()
    want = [ref.w.grad, ref.b.grad, ref.u.grad]
    # the padding sample's loss is not zero: dropping its weight would change both numbers
    t, noise = draw_t_noise(OBJ, mbs[1].keys, mbs[1].latents.shape[1:], SEED, EPOCH)
    assert hand_loss(ref, mbs[1].latents, mbs[1].text, t, noise)[1] > 0.1

    opt = Recording(model.parameters(), lr=0.0)
    st = step(model, iter(mbs), num_samples, TwoRanks(other_loss_sum=1.25), opt)
    assert not st.skipped and st.S == [mbs[0].S, mbs[1].S] and st.B == [3, 2]
    assert math.isclose(st.loss_sum, sum(sums), rel_tol=1e-6)
    for got, w in zip(opt.seen[0], want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-7)
    assert math.isclose(st.grad_norm, torch.cat(want).norm().item(), rel_tol=1e-5)
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step
    assert model.checkpointing == [(False,), (False,)]  # the policy's decision, once per micro-batch


def test_a_finite_loss_with_a_non_finite_gradient_norm_skips_the_update():
    """The loss is finite but the gradient overflows: the step is marked skipped, and the parameters, the
    optimizer's state and the EMA are exactly as before (no NaN written into any weight)."""
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    ema = EMA(model, 0.5)
    mbs = [batch("c", 2, [1.0, 1.0])]
    first = step(model, iter(mbs), 2, DistContext(), opt, ema, grad_clip=1.0)
    assert not first.skipped and math.isfinite(first.grad_norm)  # a normal step: state to keep
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    shadow = {k: v.clone() for k, v in ema.shadow.items()}

    model.overflow = True
    st = step(model, iter(mbs), 2, DistContext(), opt, ema, grad_clip=1.0)
    assert math.isfinite(st.loss_sum) and st.loss_sum > 0 and not math.isfinite(st.grad_norm)
    assert st.skipped
    for p, before in zip(model.parameters(), params):
        assert torch.isfinite(p).all() and torch.equal(p.detach(), before)
    after = opt.state_dict()["state"]
    assert after.keys() == state.keys()
    for k in state:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after[k][name], state[k][name]), (k, name)
    assert all(torch.equal(ema.shadow[k], shadow[k]) for k in shadow)
    assert all(p.grad is None for p in model.parameters())  # the bad gradient does not leak into the next step


def test_a_non_finite_loss_on_another_rank_skips_the_update_here_too():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [p.detach().clone() for p in model.parameters()]
    st = step(model, iter([batch("d", 2, [1.0, 1.0])]), 4, TwoRanks(other_loss_sum=float("nan")), opt)
    assert st.skipped and math.isfinite(st.loss_sum) and math.isfinite(st.grad_norm)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), params))
    st = step(model, iter([batch("d", 2, [1.0, 1.0])]), 4, TwoRanks(other_loss_sum=3.0), opt)
    assert not st.skipped and not all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), params))


def test_validation_loss_is_the_mean_over_samples_and_times_not_over_batches():
    """Two held-out batches of 1 and 3 samples: the value is Σ over samples and the five fixed t / (4 · 5), each sample
    with its own fixed noise (keyed by its key); a mean of the batch means would weigh the lone sample 3×."""
    model = Tiny().train()
    vals = [batch("v", 1, [1.0]), batch("w", 3, [1.0, 1.0, 1.0])]
    losses = []
    with torch.no_grad():
        for mb in vals:
            noise = torch.stack([torch.randn(tuple(mb.latents.shape[1:]), generator=keyed_generator(SEED, "val", k))
                                 for k in mb.keys])
            for tv in (0.1, 0.3, 0.5, 0.7, 0.9):  # docs/contracts.md §9's fixed times
                losses.append(hand_loss(model, mb.latents, mb.text, torch.full((mb.B,), tv), noise))
    per_sample = torch.cat(losses)
    assert per_sample.numel() == 4 * 5
    got = validation_loss(TrainParts(model, OBJ, None, None, DistContext(), SEED), vals)
    assert math.isclose(got, per_sample.mean().item(), rel_tol=1e-6)
    by_batch = sum(torch.cat(losses[i * 5:(i + 1) * 5]).mean().item() for i in range(2)) / 2
    assert not math.isclose(got, by_batch, rel_tol=1e-3)  # the two weightings differ on these batches
    # fixed noise and times: the same value again, and the model is left in training mode, checkpointing off
    assert validation_loss(TrainParts(model, OBJ, None, None, DistContext(), SEED), vals) == got
    assert model.training and model.checkpointing == [(False,), (False,)]


def test_collate_counts_real_samples_and_caps_text_at_the_model_length():
    """The Batch a step receives: padding samples (weight 0) are not real, text is zero-padded or cut to text_len
    with a mask, and L_text is each caption's kept length."""
    g = torch.Generator().manual_seed(0)
    texts = [torch.randn(2, TEXT_DIM, generator=g), torch.randn(7, TEXT_DIM, generator=g),
             torch.randn(4, TEXT_DIM, generator=g)]
    b = collate([torch.randn(C, 1, 2, 2, generator=g) for _ in range(3)], texts, ["a", "b", "c"], "img", 4,
                [1.0, 0.0, 0.5], TEXT_LEN)
    assert (b.B, b.num_real, b.L_text) == (3, 2, [2, 4, 4])
    assert b.text.shape == (3, TEXT_LEN, TEXT_DIM) and b.text_mask.tolist() == [[True, True, False, False],
                                                                                 [True] * 4, [True] * 4]
    assert torch.equal(b.text[0, :2], texts[0]) and not b.text[0, 2:].any() and torch.equal(b.text[1], texts[1][:4])


def test_a_step_of_padding_only_has_zero_gradient_and_no_division_by_zero():
    """The epoch's last step may hold no real sample on a rank (num_samples counts the whole step: 0 here)."""
    model = Tiny()
    opt = Recording(model.parameters(), lr=0.0)
    st = step(model, iter([batch("p", 1, [0.0])]), 0, DistContext(), opt)
    assert not st.skipped and st.loss_sum == 0.0 and st.grad_norm == 0.0
    assert all(not g.any() for g in opt.seen[0])


def test_autocast_is_bf16_on_cuda_only():
    assert autocast_for(torch.device("cpu"), "bf16") is contextlib.nullcontext
    assert autocast_for(torch.device("cuda"), "fp32") is contextlib.nullcontext
    with warnings.catch_warnings():  # "CUDA is not available": the context is made, not entered
        warnings.simplefilter("ignore")
        ctx = autocast_for(torch.device("cuda"), "bf16")()
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16 and ctx.device == "cuda"


# ----------------------------------------------------------------------------------------------- optimizer pieces
def test_optimizer_defaults_schedule_groups_and_ema():
    """AdamW's own default eps; the LR factor of each schedule at its ends and middle; a named group gets its lr
    and weight decay (no decay on 1-D parameters); the EMA moves each shadow by (1 − decay) towards its parameter."""
    import inspect

    from training.optim import OptimConfig, build_optimizer, lr_factor

    assert OptimConfig().eps == inspect.signature(torch.optim.AdamW).parameters["eps"].default
    cos = OptimConfig(schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_factor(s, cos, 12) for s in (0, 1)] == [0.5, 1.0]  # warm-up: (step + 1) / warmup_steps
    assert [lr_factor(s, cos, 12) for s in (2, 7, 12)] == pytest.approx([1.0, 0.55, 0.1])  # 0.1 + 0.9·(1 + cos πf)/2
    assert lr_factor(4, cos, 12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    lin = OptimConfig(schedule="linear")
    assert [lr_factor(s, lin, 10) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, groups={"head": {"match": r"^1\.", "lr": 5e-3,
                                                                  "weight_decay": 0.2}})
    opt, _ = build_optimizer(model, cfg, 10)
    got = {g["name"]: ([id(p) for p in g["params"]], g["lr"], g["weight_decay"]) for g in opt.param_groups}
    ids = {n: id(p) for n, p in model.named_parameters()}
    assert got == {"default": ([ids["0.weight"]], 1e-3, 0.1), "default/no_decay": ([ids["0.bias"]], 1e-3, 0.0),
                   "head": ([ids["1.weight"]], 5e-3, 0.2), "head/no_decay": ([ids["1.bias"]], 5e-3, 0.0)}
    assert opt.defaults["eps"] == cfg.eps

    ema = EMA(model, 0.75)
    before = {k: v.clone() for k, v in ema.shadow.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ema.shadow[n], 0.75 * before[n] + 0.25 * p.detach())


# --------------------------------------------------------------------------------------------- the metrics row
def test_metrics_row_loss_is_the_per_sample_mean_and_mfu_uses_this_steps_time(monkeypatch):
    """train/loss = Σ every rank's weighted loss sum / real samples of the step; perf/mfu = the step's model FLOPs /
    (this step's seconds · world · peak), on a CUDA context (the memory probe stubbed: this runs on the CPU)."""
    from scheduling.planner import SampleTable, plan_step
    from scheduling.efficiency import model_flops
    from scheduling.policy import ModelShape
    from training import metrics as step_metrics
    from training.step import StepStats

    monkeypatch.setattr(step_metrics, "peak_memory_gib", lambda device: 0.0)
    table = SampleTable(np.arange(6, dtype=np.int64), np.array([0, 0, 0, 1, 1, 1], dtype=np.int32),
                        np.array([16, 16, 16, 48, 48, 48], dtype=np.int64))
    plan, _ = plan_step(table, 0, 0, 0, 2, "equal_token", 2, [2, 1], lambda B, S: float(B * S))
    assert plan.num_samples == 5
    shape = ModelShape(p_matmul=1000, layers=2, dim=8, text_len=4)

    ctx = TwoRanks(other_loss_sum=3.0)
    ctx.device = torch.device("cuda")  # MFU is reported on GPUs only; nothing here touches the device
    metrics = step_metrics.StepMetrics(ctx, shape, peak_tflops=1e-6, warmup_steps=3)
    st = StepStats(loss_sum=2.0, grad_norm=0.5)
    flops = sum(mb.num_real * model_flops(1, mb.S, 4, 1000, 2, 8) for r in plan.ranks for mb in r)
    for step_s in (4.0, 2.0):  # rank 0's step time; the other rank reports the same values (TwoRanks)
        row = metrics.row(1, plan, st, step_s, None)
        assert row["train/loss"] == pytest.approx((2.0 + 3.0) / 5)
        assert row["perf/mfu"] == pytest.approx(flops / (max(step_s, 3.0) * 2 * 1e-6 * 1e12))
    assert row["train/grad_norm"] == 0.5 and row["balance/step_time_cv"] == pytest.approx(0.5 / 3.5)  # 4 s, 3 s


def test_metrics_log_means_lists_for_wandb_and_finishes_its_run(tmp_path, monkeypatch):
    """JSONL keeps every value (±inf as ±1e308, NaN as null); wandb gets numbers, a list of numbers as its mean, and
    no strings, bools or mixed lists; close() finishes the wandb run."""
    import json

    from training.metrics import LoggingConfig, MetricsLogger

    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = MetricsLogger(str(tmp_path), LoggingConfig(), "t", {})

    class FakeRun:
        logged, finished = [], False

        def log(self, row, step):
            self.logged.append((step, row))

        def finish(self):
            FakeRun.finished = True

    logger._wandb = FakeRun()
    logger.log_metrics(3, {"batch/S": [16, 48, 48], "batch/bucket": ["a", "b", "b"], "train/loss": 0.5,
                           "flag": True, "mixed": [1, "x"], "bools": [True, False], "big": float("inf"),
                           "none": float("nan")})
    assert FakeRun.logged == [(3, {"batch/S": pytest.approx(112 / 3), "train/loss": 0.5, "big": float("inf"),
                                   "none": pytest.approx(float("nan"), nan_ok=True)})]
    logger.close()
    assert FakeRun.finished and logger._wandb is None
    row = json.loads(open(tmp_path / "metrics.jsonl").read())
    assert row["step"] == 3 and row["batch/S"] == [16, 48, 48] and row["big"] == 1e308 and row["none"] is None
    assert MetricsLogger(str(tmp_path / "x"), LoggingConfig(), "t", {}, enabled=False).log_metrics(1, {}) is None


# ------------------------------------------------------------------------------------------------- busy time
def test_busy_per_slot_from_kernel_intervals_clipped_to_each_slot():
    """GPU path: a slot's busy time is the union of its kernels' intervals, clipped to the slot's range, NCCL kernels
    left out (times in µs, results in s)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from training.busy import busy_per_slot

    ev = lambda name, a, b: SimpleNamespace(name=name, device_type=DeviceType.CUDA, thread=0,  # noqa: E731
                                            time_range=SimpleNamespace(start=a, end=b))
    events = [ev("slot0", 100, 200), ev("slot1", 200, 400),
              ev("gemm", 50, 120),      # starts before slot 0: only 100–120 counts there
              ev("gemm", 110, 150),     # overlaps the one before: union 100–150
              ev("ncclKernel_AllGather", 150, 260),  # communication: never busy
              ev("gelu", 190, 230),     # spans both slots: 190–200 in slot 0, 200–230 in slot 1
              ev("gemm", 380, 450)]     # runs past slot 1's end: 380–400
    assert busy_per_slot(events, 3) == pytest.approx([60e-6, 50e-6, 0.0])


def test_profiler_writes_a_trace_per_profiled_step_into_one_folder(tmp_path):
    from training.busy import StepProfiler

    prof = StepProfiler(busy_every=0, profile_steps=[2, 3], trace_dir=str(tmp_path / "traces"), rank=0)
    assert [prof.wants(s) for s in (1, 2, 3, 4)] == [False, True, True, False]
    for s in (2, 3):
        with prof.context(s):
            with torch.profiler.record_function("slot0"):
                torch.ones(4).sum()
        busy = prof.finish(s, 1)
        assert len(busy) == 1 and busy[0] > 0
    assert sorted(os.listdir(tmp_path / "traces")) == ["step2_rank0.json", "step2_rank0_split.json",
                                                        "step3_rank0.json", "step3_rank0_split.json"]


def test_one_cuda_graph_serves_mmdit_batches_whose_text_rows_differ_in_length():
    from types import SimpleNamespace

    from training.step import graph_key

    batch = SimpleNamespace(bucket="i480", latents=torch.zeros(2, 4, 1, 8, 8), text=torch.zeros(2, 9, 16))
    key = lambda span: graph_key(batch, 3, {"extra.encoder_attention_mask": 0}, {"text_span": span})  # noqa: E731
    assert key((7, True, (4, 7))) == key((7, True, (7, 5))) == key((7, True, (7, 7)))  # the capture runs the mask
    assert key((7, True, (4, 7))) != key((7, True, None)) != key((6, True, None)) != key((7, False, None))
    assert key((7, True)) != key((6, True))  # a caller's two-element span


def test_step_split_sums_each_kernel_kind_and_the_gpu_idle_inside_the_step():
    """A traced step's device time by kind (µs in, ms out) and the idle time between its kernels: the span less the
    union of the kernels, overlapping kernels counted once in the union."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from training.busy import kernel_kind, step_split

    ev = lambda name, a, b, dev=DeviceType.CUDA: SimpleNamespace(  # noqa: E731
        name=name, device_type=dev, thread=0, time_range=SimpleNamespace(start=a, end=b))
    events = [ev("slot0", 0, 10_000), ev("aten::mm", 0, 9_000, DeviceType.CPU),  # neither is a kernel
              ev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 1_000, 3_000),
              ev("void at::native::reduce_kernel<512, 1>", 1_200, 1_500),  # inside the attention's span (a side
              # stream): no gap after it
              ev("nvjet_tst_128x256_64x4", 2_500, 4_000),     # overlaps the attention by 500 µs
              ev("_fwd_kernel", 6_000, 6_500),                 # a gap of 2 ms before it
              ev("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", 7_000, 7_200),
              ev("void at::native::vectorized_elementwise_kernel<4, add>", 7_200, 8_000),
              SimpleNamespace(name="Optimizer.step#AdamW.step", device_type=DeviceType.CUDA, thread=0,
                              is_user_annotation=True, time_range=SimpleNamespace(start=6_600, end=7_300))]
    got = step_split(events)
    assert got["span_ms"] == 7.0 and got["busy_ms"] == 4.5 and got["idle_ms"] == pytest.approx(2.5)  # gaps: 2 + 0.5
    assert (got["attention_ms"], got["gemm_ms"], got["ours (triton)_ms"], got["optimizer_ms"], got["other_ms"]) == \
        (2.0, 1.5, 0.5, 0.2, 1.1)
    assert [g[0] for g in got["top_gaps"]] == [2.0, 0.5] and got["top_gaps"][0][2] == "_fwd_kernel"
    assert kernel_kind("_bwd_kernel") == "ours (triton)" and kernel_kind("triton_poi_fused_bwd_kernel") == "other"
    assert step_split([ev("slot0", 0, 1)]) == {}


# ----------------------------------------------------------------------------------------- the collectives a step uses
def _collectives_worker(rank: int, init_file: str, out_dir: str) -> None:
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = DistContext(rank=rank, world_size=2)
        got = {"broadcast": ctx.broadcast_object({"from": rank}),
               "gathered": ctx.all_gather_floats([rank, 10.0 + rank]).tolist(),
               "max": ctx.all_reduce_max(3.0 * rank - 1.0)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(got, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_collectives_on_two_gloo_processes(tmp_path):
    """training/dist.py's collectives between two real processes: rank 0's object is the one broadcast, every rank's
    floats are gathered in rank order, the max is taken over ranks — the same answer on both."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_collectives_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = json.load(open(tmp_path / f"rank{rank}.json"))
        assert got == {"broadcast": {"from": 0}, "gathered": [[0.0, 10.0], [1.0, 11.0]], "max": 2.0}
