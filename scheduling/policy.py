"""From the scheduling config to what the planner needs: a batch size per bucket and a cost function.

Explicit config values beat the calibration file; `Schedule.sources` records where each value came from, and the
run logs it. Without a calibration the predicted cost of a micro-batch is its model FLOPs (scheduling/metrics.py)
at `proxy_tflops`: enough for relative balance metrics, not for absolute times.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from scheduling.batching import dual_constraint_batch_size, equal_token_batch_size
from scheduling.config import SchedulingConfig
from scheduling.metrics import model_flops


@dataclass
class ModelShape:
    """What the FLOP proxy needs to know of the model (plain numbers: scheduling never imports models)."""
    p_matmul: int
    layers: int
    dim: int
    text_len: int


@dataclass
class Schedule:
    strategy: str
    batch_sizes: dict  # bucket name → B
    cost_fn: Callable[[int, int], float]
    sources: dict = field(default_factory=dict)  # knob → "config" | "calibration" | "flops"

    def table(self, tokens: Mapping[str, int]) -> str:
        rows = [f"{'bucket':<16}{'S':>8}{'B':>6}{'B·S':>10}{'pred ms':>10}"]
        for name, S in tokens.items():
            B = self.batch_sizes[name]
            rows.append(f"{name:<16}{S:>8}{B:>6}{B * S:>10}{self.cost_fn(B, S):>10.3g}")
        return "\n".join(rows)


def flops_cost_fn(shape: ModelShape, proxy_tflops: float = 100.0) -> Callable[[int, int], float]:
    return lambda B, S: model_flops(B, S, shape.text_len, shape.p_matmul, shape.layers, shape.dim) / (proxy_tflops * 1e9)


def resolve_schedule(cfg: SchedulingConfig, tokens: Mapping[str, int], shape: ModelShape,
                     proxy_tflops: float = 100.0) -> Schedule:
    """tokens: bucket name → S, in bucket order."""
    if cfg.calibration is not None or cfg.strategy in ("cost", "balanced"):
        raise ValueError("scheduling.calibration and the cost/balanced strategies need the cost model of "
                         "scheduling/cost_model.py, which is not built yet: use equal_token or dual_constraint")
    cost_fn = flops_cost_fn(shape, proxy_tflops)
    if cfg.strategy == "equal_token":
        sizes = {n: equal_token_batch_size(S, cfg.m_tokens) for n, S in tokens.items()}
        sources = {"m_tokens": "config"}
    else:
        sizes = {n: dual_constraint_batch_size(S, cfg.m_mem, cfg.m_comp, cfg.p) for n, S in tokens.items()}
        sources = {"m_mem": "config", "m_comp": "config", "p": "config"}
    sources["cost"] = f"flops@{proxy_tflops:g}TFLOP/s"
    return Schedule(cfg.strategy, sizes, cost_fn, sources)
