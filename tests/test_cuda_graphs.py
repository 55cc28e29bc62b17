"""Micro-batch graphs: the bookkeeping (static buffers, warm-up, keys, fallback) on the CPU through FakeGraphs, whose
replay calls the function again on the static buffers; replays of real CUDA graphs against eager on a GPU."""

import pytest
import torch

from data.batch import collate
from models.flow_matching import FlowMatching, ObjectiveConfig
from training.cuda_graphs import FakeGraphs, MicroBatchGraphs, clear_cublas_workspaces, graphs_for, graphs_for_plan
from training.dist import DistContext
from training.optim import EMA, OptimConfig, build_optimizer
from training.step import TrainParts, autocast_for, train_step

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
            text_dim=8, freq_dim=16, ffn_dim=32, num_layers=2)


def _model(device="cpu"):
    from models.wan import WanTransformer

    torch.manual_seed(0)
    with torch.device(device):
        return WanTransformer(**TINY)


def _batches(shapes, seed, device="cpu"):
    """Micro-batches of (B, F, H, W), keys named after their slot and step so every draw differs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (B, F, H, W) in enumerate(shapes):
        lat = [torch.randn(4, F, H, W, generator=g) for _ in range(B)]
        txt = [torch.randn(3 + i, 8, generator=g) for i in range(B)]
        w = [1.0] * (B - 1) + [0.0 if k == 1 else 1.0]  # a padding sample in slot 1
        b = collate(lat, txt, [f"s{seed}k{k}i{i}" for i in range(B)], f"b{F}x{H}", F * H * W // 4, w, 6)
        out.append(b)
    return out


def _train(graphs, steps, device="cpu", policy=lambda B, S: False):
    model = _model(device)
    opt, sched = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0), 10)
    ema = EMA(model, 0.9)
    obj = FlowMatching(ObjectiveConfig())
    ctx = DistContext(device=torch.device(device))
    losses, norms = [], []
    for step, shapes in enumerate(steps):
        batches = _batches(shapes, step, device)
        parts = TrainParts(model, obj, opt, sched, ctx, 0, 1.0, ema, policy,
                           autocast_for(ctx.device, "bf16", cache=graphs is None), graphs=graphs)
        st = train_step(parts, batches, sum(b.num_real for b in batches), 0)
        losses.append(st.loss_sum), norms.append(st.grad_norm)
    return model, ema, losses, norms


# the same (shape, B) recurs across steps and twice within step 2; (1, 3, 4, 4) comes once and stays eager
STEPS = [[(2, 1, 4, 4), (1, 3, 4, 4)], [(2, 1, 4, 4), (2, 2, 4, 4)], [(2, 1, 4, 4), (2, 1, 4, 4)],
         [(2, 2, 4, 4), (2, 1, 4, 4)]]


def test_replays_on_static_buffers_equal_eager_bit_for_bit():
    m0, e0, l0, n0 = _train(None, STEPS)
    graphs = FakeGraphs(torch.device("cpu"))
    m1, e1, l1, n1 = _train(graphs, STEPS)
    assert l0 == l1 and n0 == n1
    assert all(torch.equal(a, b) for a, b in zip(m0.state_dict().values(), m1.state_dict().values()))
    assert all(torch.equal(e0.shadow[n], e1.shadow[n]) for n in e0.shadow)
    # (2,1,4,4): eager once, then captured and replayed 4 times; (2,2,4,4): eager, then replayed; (1,3,4,4): eager.
    # (2,2,4,4) has more tokens than the graph already captured: that one is dropped, recaptured after it
    assert graphs.stats.captured == 3 and graphs.stats.recaptures == 1
    assert graphs.stats.replays == 5 and graphs.stats.eager == 3
    assert all(p.grad is not None and not p.grad.any() for p in m1.parameters())  # zeroed in place, kept


def test_a_replay_reads_this_micro_batch_not_the_captured_one():
    """A runner that forgot to copy new inputs into the static buffers would replay the captured batch."""
    class NoCopy(FakeGraphs):
        def run(self, key, tokens, fn, inputs):
            e = self.entries.get(key)
            if e is not None and e.graph is not None:
                self._replay(e.graph, fn, e.statics)
                return True
            return super().run(key, tokens, fn, inputs)

    _, _, l0, _ = _train(None, STEPS)
    _, _, l1, _ = _train(NoCopy(torch.device("cpu")), STEPS)
    assert l0[0] == l1[0] and l0[2] != l1[2]


@pytest.mark.slow
def test_keys_over_max_tokens_and_failed_captures_stay_eager(caplog):
    class Failing(FakeGraphs):
        def _capture(self, graph, fn, statics):
            raise RuntimeError("operation not permitted when stream is capturing")

    big = FakeGraphs(torch.device("cpu"), max_tokens=4)  # every micro-batch here has more tokens
    _, _, l_big, _ = _train(big, STEPS)
    assert big.stats.captured == 0 and big.stats.eager == 8
    failing = Failing(torch.device("cpu"))
    with caplog.at_level("WARNING"):
        _, _, l_fail, _ = _train(failing, STEPS)
    assert failing.stats.failed == 2 and failing.stats.captured == 0 and "capture failed" in caplog.text
    _, _, l0, _ = _train(None, STEPS)
    assert l_big == l0 == l_fail


def test_recompute_decision_is_part_of_the_key():
    """A graph captured with recompute off must not serve a micro-batch that recomputes (and back)."""
    flip = {"n": 0}

    def policy(B, S):
        flip["n"] += 1
        return flip["n"] % 2 == 0

    graphs = FakeGraphs(torch.device("cpu"))
    _train(graphs, STEPS, policy=policy)
    decisions = {k[3] for k in graphs.entries}
    assert decisions == {"True", "False"}


def test_graphs_for_says_why_it_is_off(caplog):
    with caplog.at_level("INFO"):
        assert graphs_for("auto", torch.device("cpu"), 1, [], None) is None
    assert "not a CUDA GPU" in caplog.text
    with pytest.raises(ValueError, match="FSDP2 over several processes"):
        graphs_for("on", torch.device("cuda", 0), 2, [], None)
    with pytest.raises(ValueError, match="offload"):
        graphs_for("on", torch.device("cuda", 0), 1, ["model.offload_checkpoints moves tensors to the host"], None)
    assert graphs_for("off", torch.device("cuda", 0), 1, [], None) is None


def test_the_graphs_capture_only_up_to_what_the_plan_reserved_for(caplog):
    """train.py narrows its graphs to Schedule.graph_tokens: the same graphs with the smaller cap, or none (eager)
    where no planned micro-batch is within train.graph_max_tokens; one line says so; an unchanged cap is silent."""
    dev = torch.device("cuda", 0)  # never touched: the constructor keeps the device only
    with caplog.at_level("INFO"):
        g = MicroBatchGraphs(dev, max_tokens=16384)
        assert graphs_for_plan(g, 15600) is g and g.max_tokens == 15600
        assert "up to 15,600 tokens are captured" in caplog.text and "graph_max_tokens=16,384" in caplog.text
        caplog.clear()
        assert graphs_for_plan(g, 15600) is g and not caplog.text
        assert graphs_for_plan(MicroBatchGraphs(dev, max_tokens=16384), 0) is None
        assert "off: every planned micro-batch is over train.graph_max_tokens=16,384" in caplog.text
        caplog.clear()
        assert graphs_for_plan(MicroBatchGraphs(dev, max_tokens=16384), 0, is_main=False) is None and not caplog.text
    uncapped = MicroBatchGraphs(dev, max_tokens=None)
    assert graphs_for_plan(uncapped, None) is uncapped and uncapped.max_tokens is None
    assert graphs_for_plan(None, 0) is None


def test_a_graph_captured_under_a_wider_cap_runs_eager_once_the_cap_narrows():
    """The replay (training/replay.py Runner.capture_up_to) narrows one set of graphs per setting: a key captured
    under an earlier, wider cap runs eagerly while it is over the cap now, and replays again once it is within."""
    calls = []
    g = FakeGraphs(torch.device("cpu"), max_tokens=16)

    def fn(x):
        calls.append(float(x["x"].sum()))

    for _ in range(2):  # one eager run, then the capture (which replays)
        g.run("big", 16, fn, {"x": torch.ones(2)})
    assert g.stats.captured == 1 and g.stats.replays == 1 and g.stats.eager == 1
    g.max_tokens = 8
    assert g.run("big", 16, fn, {"x": torch.full((2,), 3.0)}) is False
    assert g.stats.replays == 1 and g.stats.eager == 2 and calls[-1] == 6.0
    g.max_tokens = 16
    assert g.run("big", 16, fn, {"x": torch.full((2,), 5.0)}) is True and g.stats.replays == 2 and calls[-1] == 10.0


def test_calibration_auto_clears_the_benchmarks_cublas_workspaces_once_it_is_done(monkeypatch, tmp_path):
    """The shape benchmark's graphs capture on a stream of their own; its cuBLAS workspaces go when it returns, not
    before (its graphs replay until then), and off CUDA nothing is cleared."""
    import training.shape_benchmark as sb
    from tests.helpers import compose_config

    order = []
    monkeypatch.setattr(sb, "find_calibration", lambda *a, **k: (None, []))
    monkeypatch.setattr(sb, "calibrate_config", lambda *a, **k: order.append("benchmark"))
    monkeypatch.setattr(sb, "clear_cublas_workspaces", lambda device: order.append(("clear", str(device))))
    cfg = compose_config([f"run_dir={tmp_path}"])
    path, how = sb.calibration_for_run(cfg, DistContext(0, 1, 0, torch.device("cpu")), lambda s: None)
    assert order == ["benchmark", ("clear", "cpu")] and how.startswith("measured now")
    assert clear_cublas_workspaces(torch.device("cpu")) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_side_streams_cublas_workspace_is_freed_by_the_clearing():
    dev = torch.device("cuda")
    a = torch.randn(512, 512, device=dev, dtype=torch.bfloat16)
    clear_cublas_workspaces(dev)
    before = torch.cuda.memory_allocated(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        b = a @ a
    torch.cuda.current_stream(dev).wait_stream(side)
    del b
    torch.cuda.synchronize(dev)
    held = torch.cuda.memory_allocated(dev) - before
    assert held >= 2**20, held  # the side stream's workspace pair (tens of MiB on Hopper)
    assert clear_cublas_workspaces(dev) is True
    assert torch.cuda.memory_allocated(dev) <= before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recompute", [False, True])
def test_cuda_graph_replays_match_eager_on_the_gpu(recompute):
    """Real graphs, the fused glue and recompute: losses, gradient norms and weights after four steps agree with eager
    (bf16 autocast: the same kernels run, so they agree to rounding of reduction order at most)."""
    policy = lambda B, S: recompute
    m0, e0, l0, n0 = _train(None, STEPS, "cuda", policy)
    graphs = MicroBatchGraphs(torch.device("cuda", 0))
    m1, e1, l1, n1 = _train(graphs, STEPS, "cuda", policy)
    assert graphs.stats.captured == 3 and graphs.stats.failed == 0
    for a, b in zip(l0 + n0, l1 + n1):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-6)
    for (name, a), b in zip(m0.state_dict().items(), m1.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5), name
