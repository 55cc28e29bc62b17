"""Typed configuration of the scheduler (the `scheduling:` group); knobs named as docs/contracts.md §8."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from scheduling.batching import STRATEGIES
from scheduling.planner import check_planner


@dataclass
class SchedulingConfig:
    RESUME_DEFAULT = "plan"  # every field changes the sample plan (resume classes: training/resume.py)
    strategy: str = "equal_token"
    m_tokens: Optional[int] = None              # equal_token: tokens per micro-batch
    m_mem: Optional[float] = None               # memory bound on B·S
    mem_budget_gib: Optional[float] = None      # or m_mem from the calibration's memory model at this budget
    m_comp: Optional[float] = None              # dual_constraint: bound on B·S^p
    p: Optional[float] = None                   # dual_constraint: exponent
    target_microbatch_ms: Optional[float] = None  # cost / balanced: predicted fwd+bwd ms per micro-batch
    planner: Optional[str] = None               # stream | sorted | windowed | reformed (needs m_mem); null: the
                                                # rule's default (balanced: sorted, windowed when window > 1; the
                                                # other rules: stream)
    window: int = 1                             # steps planned together (planner windowed)
    calibration: Optional[str] = None           # JSON written by scripts/calibrate.py; `auto`: the trainer finds
                                                # one for this model and device, or measures it on first use
    benchmark_points: int = 8                   # calibration=auto's shape benchmark: at most this many points,
    benchmark_time_s: float = 300.0             # within this many seconds of scanning
    tokens_per_step: Optional[float] = None     # a fixed global batch: expected real tokens per GPU per optimizer
                                                # step; the strategy's knob and train.micro_batches are chosen for it

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"scheduling.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for name in ("m_tokens", "m_mem", "mem_budget_gib", "m_comp", "p", "target_microbatch_ms", "tokens_per_step"):
            v = getattr(self, name)
            if v is not None and not v > 0:  # NaN fails here too; training/config.py refuses ±Inf first
                raise ValueError(f"scheduling.{name} must be > 0 (or null), got {v}")
        if self.benchmark_points < 2:
            raise ValueError(f"scheduling.benchmark_points must be ≥ 2, got {self.benchmark_points}")
        if not self.benchmark_time_s > 0:
            raise ValueError(f"scheduling.benchmark_time_s must be > 0, got {self.benchmark_time_s}")
        if self.window < 1:
            raise ValueError(f"scheduling.window must be ≥ 1, got {self.window}")
        if isinstance(self.calibration, str) and self.calibration.lower() == "auto" and self.calibration != "auto":
            raise ValueError(f"scheduling.calibration={self.calibration!r}: write auto (lower case) to have the "
                             "trainer find or measure one; any other value is a file's path")
        if self.planner is not None:
            check_planner(self.planner, self.window)
