"""Balance and throughput metrics from plans and measurements (docs/contracts.md §9).

    compute_cv          CV over ranks of Σ_k t_rk (each rank's work this step)
    idle_fraction       1 − Σ_r Σ_k t_rk / (R · Σ_k max_r t_rk)   (FSDP synchronises every slot; padding idle)
    step_time           Σ_k max_r t_rk
    mfu                 B·(6·P_matmul·S + 12·layers·D·S² + 12·layers·D·S·L_text) summed over micro-batches
                        / (step seconds · world · peak FLOP/s)
"""
from __future__ import annotations

import numpy as np


def compute_cv(t_RM: np.ndarray) -> float:
    per_rank = np.asarray(t_RM, dtype=np.float64).sum(axis=1)
    mean = per_rank.mean()
    return float(per_rank.std() / mean) if mean > 0 else 0.0


def idle_fraction(t_RM: np.ndarray, real_RM: np.ndarray | None = None) -> float:
    """real_RM (optional, bool): padding slots (False) take their time but count as idle (docs/contracts.md §9)."""
    t = np.asarray(t_RM, dtype=np.float64)
    denom = t.shape[0] * t.max(axis=0).sum()
    busy = t.sum() if real_RM is None else t[np.asarray(real_RM, dtype=bool)].sum()
    return float(1 - busy / denom) if denom > 0 else 0.0


def step_time(t_RM: np.ndarray) -> float:
    """FSDP synchronises every slot: a step lasts Σ_k max_r t_rk."""
    return float(np.asarray(t_RM, dtype=np.float64).max(axis=0).sum())


def cv(values) -> float:
    v = np.asarray(list(values), dtype=np.float64)
    return float(v.std() / v.mean()) if len(v) > 1 and v.mean() > 0 else 0.0


def model_flops(B: int, S: int, L_text: int, p_matmul: int, layers: int, dim: int) -> float:
    """Training FLOPs (forward + backward, no recompute) of one micro-batch."""
    return B * (6.0 * p_matmul * S + 12.0 * layers * dim * S * S + 12.0 * layers * dim * S * L_text)
