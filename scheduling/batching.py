"""Batch size per bucket, per strategy: pure functions of numbers (tokens S, budgets, a cost model).

    equal_token:      B = max(1, ⌊m_tokens / S⌋)                                  (the usual baseline)
    dual_constraint:  B = max(1, min(⌊m_mem / S⌋, ⌊m_comp / S^p⌋))                (AdaptiveLoad, the paper)
    cost:             the largest B with B·S ≤ m_mem and cost_model.predict(B, S) ≤ target_ms (at least 1)
"""
from __future__ import annotations

import math

STRATEGIES = ("equal_token", "dual_constraint", "cost", "balanced")


def _check_positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def equal_token_batch_size(S: int, m_tokens: int) -> int:
    _check_positive("S", S)
    _check_positive("scheduling.m_tokens", m_tokens)
    return max(1, int(m_tokens // S))


def dual_constraint_batch_size(S: int, m_mem: float, m_comp: float, p: float) -> int:
    _check_positive("S", S)
    _check_positive("scheduling.m_mem", m_mem)
    _check_positive("scheduling.m_comp", m_comp)
    _check_positive("scheduling.p", p)
    return max(1, min(int(m_mem // S), int(m_comp // S ** p)))


def cost_batch_size(S: int, cost_model, target_ms: float, m_mem: float, max_B: int = 4096) -> int:
    """Largest B with B·S ≤ m_mem and predicted forward+backward ms ≤ target_ms; 1 when even B=1 exceeds it."""
    _check_positive("S", S)
    _check_positive("scheduling.target_microbatch_ms", target_ms)
    _check_positive("scheduling.m_mem", m_mem)
    hi = max(1, min(max_B, int(m_mem // S)))
    if cost_model.predict(1, S) > target_ms:
        return 1
    lo = 1  # predict is non-decreasing in B: binary search the last B within the target
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost_model.predict(mid, S) <= target_ms:
            lo = mid
        else:
            hi = mid - 1
    return lo
