"""Batch size per bucket, per strategy: pure functions of numbers (tokens S, budgets, a cost model).

    equal_token:      B = max(1, ⌊m_tokens / S⌋)                                  (the usual baseline)
    dual_constraint:  B = max(1, min(⌊m_mem / S⌋, ⌊m_comp / S^p⌋))                (AdaptiveLoad, the paper)
    cost, balanced:   the largest B with B·S ≤ m_mem and cost_model.predict(B, S) ≤ target_ms (at least 1)

`batch_sizes` applies one rule to every bucket and refuses settings that cannot work (a bucket longer than the
memory bound, non-positive budgets) with a message naming the field; the policy (training) and the cluster
simulator both call it.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

STRATEGIES = ("equal_token", "dual_constraint", "cost", "balanced")


def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not (value is not None and value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_fits(S: int, m_mem: float, name: str = "scheduling.m_mem",
                remedy: str = "raise the memory budget, turn on model.checkpointing, or drop the bucket") -> None:
    if S > m_mem:
        raise ValueError(f"{name}={m_mem:g} tokens is below a bucket's S={S}: the bound admits no sample of it; "
                         f"{remedy}")


def equal_token_batch_size(S: int, m_tokens: int) -> int:
    _check_positive("S", S)
    _check_positive("scheduling.m_tokens", m_tokens)
    return max(1, int(m_tokens // S))


def dual_constraint_batch_size(S: int, m_mem: float, m_comp: float, p: float) -> int:
    _check_positive("S", S)
    _check_positive("scheduling.m_mem", m_mem)
    _check_positive("scheduling.m_comp", m_comp)
    _check_positive("scheduling.p", p)
    _check_fits(S, m_mem)
    # ⌊m_comp / S^p⌋ with a relative tolerance: m_comp = k·S^p (the simulator's knob, factor · S_max^p) divides in
    # floating point to k − 1 + 0.99999… (or `//` rounds down below k) for about one k in six
    return max(1, min(int(m_mem // S), math.floor(m_comp / S ** p * (1 + 1e-12))))


def _predictor(cost_model) -> Callable[[int, int], float]:
    return cost_model.predict if hasattr(cost_model, "predict") else cost_model


def cost_batch_size(S: int, cost_model, target_ms: float, m_mem: float, max_B: int = 4096) -> int:
    """Largest B with B·S ≤ m_mem and predicted forward+backward ms ≤ target_ms; 1 when even B=1 exceeds it.

    cost_model: an object with predict(B, S) or a function (B, S) → ms, non-decreasing in B.
    """
    _check_positive("S", S)
    _check_positive("scheduling.target_microbatch_ms", target_ms)
    _check_positive("scheduling.m_mem", m_mem)
    _check_fits(S, m_mem)
    predict = _predictor(cost_model)
    hi = max(1, min(max_B, int(m_mem // S)))
    if predict(1, S) > target_ms:
        return 1
    lo = 1  # binary search the last B within the target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if predict(mid, S) <= target_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo


def batch_sizes(strategy: str, S: Sequence[int], *, m_tokens: Optional[float] = None,
                m_mem: Optional[float] = None, m_comp: Optional[float] = None, p: Optional[float] = None,
                cost_model: Union[Callable, object, None] = None, target_ms: Optional[float] = None) -> list[int]:
    """B for every bucket of tokens S under `strategy`; the knobs it needs must be given (named in the error)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"scheduling.strategy must be one of {STRATEGIES}, got {strategy!r}")
    need = {"equal_token": ("m_tokens",), "dual_constraint": ("m_mem", "m_comp", "p"),
            "cost": ("m_mem", "target_microbatch_ms"), "balanced": ("m_mem", "target_microbatch_ms")}[strategy]
    given = {"m_tokens": m_tokens, "m_mem": m_mem, "m_comp": m_comp, "p": p, "target_microbatch_ms": target_ms}
    missing = [f"scheduling.{k}" for k in need if given[k] is None]
    if missing:
        raise ValueError(f"scheduling.strategy={strategy} needs {', '.join(missing)} "
                         f"(set it, or point scheduling.calibration at a file that holds it)")
    if strategy == "equal_token":
        return [equal_token_batch_size(s, m_tokens) for s in S]
    if strategy == "dual_constraint":
        return [dual_constraint_batch_size(s, m_mem, m_comp, p) for s in S]
    if cost_model is None:
        raise ValueError(f"scheduling.strategy={strategy} needs a cost model (scheduling.calibration)")
    return [cost_batch_size(s, cost_model, target_ms, m_mem) for s in S]
