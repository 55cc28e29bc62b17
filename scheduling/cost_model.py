"""Cost and memory models of one micro-batch, fitted to measured training steps (docs/contracts.md §6).

Time of forward + backward of a micro-batch of B samples of S tokens (text length L):
    power      t = a + b·B·S^p                               the paper's form; nonlinear least squares
    quadratic  t = a + b0·B + b1·B·S + b2·B·S² [+ b3·B·S·L]  the FLOP shape: projections/MLP ∝ S, self-attention
                                                             ∝ S², cross-attention ∝ S·L; non-negative LS
               t = a + b0·B + b1·B·(S+L) + b2·B·(S+L)²       joint attention (MMDiT): text joins the sequence
           b0: work each sample costs whatever its S (its text tokens' projections, its conditioning); the paper's
           form has none. Without it the H200 scans fit worse and under-predict the short bucket at large B (the
           memory probe) by an order of magnitude more (results/calibration_h200.md, Notes); on a scan with few
           lengths the probe is what pins b0.
           b0 is fitted from B0_MIN_POINTS points on, and only where B varies apart from S (else 0).
    auto       whichever of the two has the lower leave-one-out relative error
    floor      either form as t = max(floor, f(B, S)): a small micro-batch costs at least the host's time to launch
               its kernels (eager on a GPU: ~0.45 s for 30 Wan-1.3B blocks whatever its B·S under ~10k tokens,
               results/calibration_h200.md; a CUDA graph takes that floor away). Fitted like the memory model's: each
               measured time is tried as the floor, the points at or under it (within FLOOR_TOL_T) are the floor's,
               f is fitted to the rest, and the floor is kept only where it explains two or more points (or one launch
               point: a plain step at B = 1 timed outside a slice's scan, launch-bound by construction) and halves
               the error over every point; it is then the geometric mean of its points' times. Every point stays in the fit.
Every fit minimises relative residuals, Σ((t̂ − t)/t)² (weights 1/t): a 60 ms and a 1 s point count alike.
The power form is fitted by variable projection: for fixed p the problem is a non-negative LS in (a, b), so p
is found by a grid and a golden-section search over the projected residual. Plain numpy throughout (the GPU
image has no scipy): with ≤ 5 coefficients, exact NNLS is the best of the supports' least-squares solutions.

Peak memory of a training step:
    peak_bytes ≈ max(floor, c0 + c1·B·S + c2·B)   c0: weights, gradients, optimizer state, workspace; c1: activations
                                                  a token; c2: a sample's beyond its tokens (its text); floor: the
                                                  optimizer step's peak, where small micro-batches peak
    m_mem = ⌊(budget − c0) / (c1 + c2/S_min)⌋     the token bound B·S ≤ m_mem of the dual-constraint and cost rules,
                                                  safe for every bucket from the shortest (S_min) up
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np

FORMS = ("power", "quadratic")
P_RANGE = (0.5, 3.0)  # the search interval of the power form's exponent


def _as_arrays(*xs):
    return [np.asarray(x, dtype=np.float64).reshape(-1) for x in xs]


@dataclass
class CostModel:
    """Predicted forward+backward ms of a micro-batch; `params` by form (see the module docstring)."""
    form: str
    params: dict
    rel_rmse: float = float("nan")       # in-sample relative RMS error
    loo_rel_rmse: float = float("nan")   # leave-one-out relative RMS error
    max_rel_err: float = float("nan")
    n_points: int = 0
    joint: bool = False                  # quadratic only: attention over S + L tokens
    L: Optional[float] = None            # text length used when predict() is not given one
    residuals: list = field(default_factory=list)  # in-sample relative residuals (t̂ − t)/t

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"cost model form must be one of {FORMS}, got {self.form!r}")

    def predict(self, B, S, L=None):
        """ms for B samples of S tokens (scalars → float, arrays → array)."""
        scalar = np.ndim(B) == 0 and np.ndim(S) == 0
        B, S = np.asarray(B, dtype=np.float64), np.asarray(S, dtype=np.float64)
        L = self.L if L is None else L
        L = 0.0 if L is None else np.asarray(L, dtype=np.float64)
        q = self.params
        if self.form == "power":
            t = q["a"] + q["b"] * B * S ** q["p"]
        elif self.joint:
            T = S + L
            t = q["a"] + q.get("b0", 0.0) * B + q["b1"] * B * T + q["b2"] * B * T * T
        else:
            t = (q["a"] + q.get("b0", 0.0) * B + q["b1"] * B * S + q["b2"] * B * S * S
                 + q.get("b3", 0.0) * B * S * L)
        if q.get("floor"):
            t = np.maximum(q["floor"], t)
        return float(t) if scalar else t

    __call__ = predict

    def scaled(self, factor: float) -> "CostModel":
        """The same model with every term × factor (k timed blocks → the full depth)."""
        q = {k: (v if k == "p" else v * factor) for k, v in self.params.items()}
        return CostModel(self.form, q, self.rel_rmse, self.loo_rel_rmse, self.max_rel_err, self.n_points,
                         self.joint, self.L, list(self.residuals))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def _b0(self) -> str:
        b0 = self.params.get("b0", 0.0)
        return f" + {b0:.4g}·B" if b0 else ""

    def describe(self) -> str:
        q = self.params
        if self.form == "power":
            s = f"t = {q['a']:.4g} + {q['b']:.4g}·B·S^{q['p']:.4f}"
        elif self.joint:
            s = f"t = {q['a']:.4g}{self._b0()} + {q['b1']:.4g}·B·(S+L) + {q['b2']:.4g}·B·(S+L)²"
        else:
            s = f"t = {q['a']:.4g}{self._b0()} + {q['b1']:.4g}·B·S + {q['b2']:.4g}·B·S²"
            if "b3" in q:
                s += f" + {q['b3']:.4g}·B·S·L"
        if q.get("floor"):
            s = f"t = max({q['floor']:.4g}, {s[4:]})"
        return f"{s} ms  (rel RMSE {100 * self.rel_rmse:.2f} %, leave-one-out {100 * self.loo_rel_rmse:.2f} %)"


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of columns: the best of the least-squares solutions on every
    support whose coefficients come out ≥ 0 (2^k small solves; no scipy, which the GPU image lacks)."""
    k = A.shape[1]
    best, best_res = np.zeros(k), float(np.sum(y * y))
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            c, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
            if np.all(c >= 0):
                res = float(np.sum((A[:, cols] @ c - y) ** 2))
                if res < best_res:
                    best, best_res = np.zeros(k), res
                    best[list(cols)] = c
    return best


def _full_rank(X: np.ndarray) -> bool:
    """Are X's columns linearly independent (each scaled to unit norm first, so that units do not matter)?"""
    n = np.linalg.norm(X, axis=0)
    return bool(np.all(n > 0) and np.linalg.matrix_rank(X / n, tol=1e-9) == X.shape[1])


def _weighted_nnls(X: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, float]:
    """min Σ((X·c − t)/t)² over c ≥ 0; columns scaled for conditioning. Returns (c, residual norm)."""
    A = X / t[:, None]
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    c = _nnls(A / scale, np.ones_like(t))
    res = float(np.linalg.norm((A / scale) @ c - 1.0))
    return c / scale, res


def _golden(f, lo: float, hi: float, tol: float = 1e-7) -> float:
    """Minimum of a unimodal f on [lo, hi] by golden-section search."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


B0_MIN_POINTS = 5  # the per-sample term b0 is fitted from this many points (one more than a + b0 + b1 + b2)


def _quadratic_features(B, S, L, joint, per_sample):
    first = ([np.ones_like(B), B], ["a", "b0"]) if per_sample else ([np.ones_like(B)], ["a"])
    if joint:
        T = S + L
        return np.stack(first[0] + [B * T, B * T * T], axis=1), tuple(first[1] + ["b1", "b2"])
    cols, names = first[0] + [B * S, B * S * S], first[1] + ["b1", "b2"]
    if L is not None:
        cols.append(B * S * L)
        names.append("b3")
    return np.stack(cols, axis=1), tuple(names)


def _fit_quadratic(B, S, t, L, joint, per_sample) -> dict:
    X, names = _quadratic_features(B, S, L, joint, per_sample)
    c, _ = _weighted_nnls(X, t)
    return dict(zip(names, (float(v) for v in c)))


def _fit_power(B, S, t) -> dict:
    def project(p):
        X = np.stack([np.ones_like(B), B * S ** p], axis=1)
        c, res = _weighted_nnls(X, t)
        return c, res

    grid = np.linspace(*P_RANGE, 51)
    errs = [project(p)[1] for p in grid]
    i = int(np.argmin(errs))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    p = _golden(lambda q: project(q)[1], lo, hi)
    c, _ = project(p)
    return {"a": float(c[0]), "b": float(c[1]), "p": float(p)}


FLOOR_TOL_T = 0.05   # a point within 5 % of a candidate floor (or under it) is the floor's
FLOOR_GAIN_T = 0.5   # a floor is kept only where it halves the error over every point
FLOOR_MIN_LINE = 4   # points the fit above the floor needs (its own parameters, plus one)
FLOOR_MIN_POINTS = 2  # points a floor must explain


def _fit_plain(form, B, S, t, L, joint, per_sample) -> CostModel:
    params = _fit_power(B, S, t) if form == "power" else _fit_quadratic(B, S, t, L, joint, per_sample)
    model = CostModel(form, params, joint=joint and form == "quadratic")
    model.L = None  # arrays of L are used while fitting; a scalar default is set by the caller
    return model


def _rel_rmse(model: CostModel, B, S, t, L) -> float:
    return float(np.sqrt(np.mean(((_predict_with(model, B, S, L) - t) / t) ** 2)))


def _fit(form, B, S, t, L, joint, per_sample=False, floor=False, floor_points=FLOOR_MIN_POINTS,
         launch=None, keep_floor=False) -> CostModel:
    """The form fitted to every point; with `floor`, max(floor, form) where a floor explaining `floor_points` or
    more points (or one of the `launch` points: a mask of points measured launch-bound by construction) halves the
    error; with `keep_floor` (a leave-one-out refit of a fit that has one) the best floor whatever its gain."""
    best = _fit_plain(form, B, S, t, L, joint, per_sample)
    if not floor:
        return best
    plain_err = _rel_rmse(best, B, S, t, L)
    best_err = math.inf if keep_floor else plain_err
    gain = math.inf if keep_floor else FLOOR_GAIN_T
    for F in sorted(set(t.tolist())):
        line = t > F * (1 + FLOOR_TOL_T)
        if line.sum() < FLOOR_MIN_LINE + per_sample or line.sum() == len(t):
            continue
        Ll = None if L is None else L[line]
        cand = _fit_plain(form, B[line], S[line], t[line], Ll, joint,
                          per_sample and _full_rank(_quadratic_features(B[line], S[line], Ll, joint, True)[0]))
        under = ~line | (_predict_with(cand, B, S, L) < F)  # the points the floor explains
        # one slow point is noise, not a floor, unless it is a launch point (measured so at two depths)
        if under.sum() < floor_points and not (launch is not None and bool(np.any(under & launch))):
            continue
        cand.params["floor"] = float(np.exp(np.mean(np.log(t[under]))))
        err = _rel_rmse(cand, B, S, t, L)
        if err < best_err and err < plain_err * gain:
            best, best_err = cand, err
    return best


def _predict_with(model: CostModel, B, S, L):
    return model.predict(B, S, L if L is not None else 0.0)


def fit_cost_model(B: Sequence[float], S: Sequence[float], t: Sequence[float], form: str = "auto",
                   L: Optional[Sequence[float]] = None, joint: bool = False, floor: bool = False,
                   launch: Optional[Sequence[bool]] = None) -> CostModel:
    """Fit t (ms) ≈ f(B, S[, L]) on relative residuals; form ∈ power | quadratic | auto (lower leave-one-out error).

    L: text lengths per point (a cross-attention term b3·B·S·L, or joint attention over S + L when joint=True);
    the returned model predicts with L = the mean of these unless predict() is given another. floor: allow a
    launch floor, t = max(floor, f) (module docstring); leave-one-out refits it too. launch: which points are
    launch-bound by construction (a plain step at B = 1 of the shortest bucket, timed outside a slice's scan):
    such a point may carry the floor alone.
    """
    if form not in FORMS + ("auto",):
        raise ValueError(f"form must be one of {FORMS + ('auto',)}, got {form!r}")
    B, S, t = _as_arrays(B, S, t)
    Lv = None if L is None else _as_arrays(L)[0] * np.ones_like(B)
    if not (len(B) == len(S) == len(t)) or len(t) == 0:
        raise ValueError(f"B, S and t must be equally long and non-empty, got {len(B)}, {len(S)}, {len(t)}")
    if np.any(t <= 0) or np.any(B < 1) or np.any(S < 1):
        raise ValueError("every measured time must be > 0 and every B, S ≥ 1")
    if joint and Lv is None:
        raise ValueError("joint attention needs the text lengths L")
    launch = None if launch is None else np.asarray(launch, dtype=bool)
    if launch is not None and launch.shape != t.shape:
        raise ValueError(f"launch marks {launch.shape[0]} points, not {len(t)}")
    forms = FORMS if form == "auto" else (form,)
    # b0 only where the points tell it from the intercept (B varies, not only with S); the leave-one-out fits keep
    # the full fit's terms
    per_sample = len(t) >= B0_MIN_POINTS and _full_rank(_quadratic_features(B, S, Lv, joint, True)[0])
    n_params = {"power": 3, "quadratic": 3 + per_sample + (Lv is not None and not joint)}
    fits = {}
    for f in forms:
        if len(t) < n_params[f]:
            raise ValueError(f"{len(t)} points cannot fit the {f} form ({n_params[f]} parameters)")
        model = _fit(f, B, S, t, Lv, joint, per_sample, floor, launch=launch)
        rel = (_predict_with(model, B, S, Lv) - t) / t
        model.residuals = [float(r) for r in rel]
        model.rel_rmse = float(np.sqrt(np.mean(rel ** 2)))
        model.max_rel_err = float(np.max(np.abs(rel)))
        model.n_points = len(t)
        k = n_params[f] + ("floor" in model.params)
        model.loo_rel_rmse = (_loo(f, B, S, t, Lv, joint, per_sample, "floor" in model.params, launch) if len(t) > k
                              else float("nan"))
        model.L = None if Lv is None else float(np.mean(Lv))
        fits[f] = model
    return fits[form] if form != "auto" else best_fit(fits)


def best_fit(fits: dict[str, "CostModel"]) -> "CostModel":
    """form="auto"'s choice among fitted forms: the lower leave-one-out relative error (the in-sample one where
    there are too few points to leave one out)."""
    return min(fits.values(), key=lambda m: m.loo_rel_rmse if math.isfinite(m.loo_rel_rmse) else m.rel_rmse)


def fit_both(B, S, t, L=None, joint=False, floor=False, launch=None) -> dict[str, CostModel]:
    """Both forms, for the calibration file (auto keeps the better one; the other is kept for comparison)."""
    return {f: fit_cost_model(B, S, t, form=f, L=L, joint=joint, floor=floor, launch=launch) for f in FORMS}


def _loo(form, B, S, t, L, joint, per_sample, floor=False, launch=None) -> float:
    """Leave-one-out relative RMS error. The refits keep the full fit's terms: a floor the full fit found is
    refitted from the points left (one is enough: the full fit already showed there is a floor). Launch points
    are never left out: a floor resting on one alone has nothing else to be predicted from."""
    errs = []
    for i in range(len(t)):
        if launch is not None and launch[i]:
            continue
        keep = np.arange(len(t)) != i
        m = _fit(form, B[keep], S[keep], t[keep], None if L is None else L[keep], joint, per_sample, floor,
                 floor_points=1, launch=None if launch is None else launch[keep], keep_floor=floor)
        pred = _predict_with(m, B[i:i + 1], S[i:i + 1], None if L is None else L[i:i + 1])
        errs.append(float((pred[0] - t[i]) / t[i]))
    return float(np.sqrt(np.mean(np.square(errs))))


# --------------------------------------------------------------------------------------------- memory model
@dataclass
class MemoryModel:
    """peak_bytes ≈ max(floor, c0 + c1·B·S + c2·B) of one training step (optimizer state included).

    c1: bytes a token (the saved activations); c2: bytes a sample beyond its tokens (the text tokens' activations,
    which every sample carries whatever its S). floor: a peak that does not grow with the micro-batch — the
    optimizer step's (fp32 states, gradients and the update's temporaries); a small micro-batch peaks there, not in
    backward. A line through such points as well as the large ones bends towards them and under-states c1: on the
    H200 (Wan 1.3B, 30 blocks) every B = 1 point up to S = 46,800 peaked at the same 26.6 GiB
    (results/calibration_h200.md)."""
    c0: float
    c1: float
    rel_rmse: float = float("nan")
    n_points: int = 0
    measured: bool = True  # False: an estimate, not a fit to measurements (the file says how)
    c2: float = 0.0
    floor: float = 0.0
    max_rel_err: float = float("nan")

    def predict(self, B, S):
        B, S = np.asarray(B, dtype=np.float64), np.asarray(S, dtype=np.float64)
        return np.maximum(self.floor, self.c0 + self.c1 * B * S + self.c2 * B)

    def max_batch(self, S: float, budget_bytes: float) -> int:
        """Largest B whose predicted peak at sequence length S stays within budget_bytes (0 when none does)."""
        if self.c1 <= 0:
            raise ValueError("the memory model has no per-token cost (c1 ≤ 0): it cannot bound B·S")
        if self.floor > budget_bytes:
            return 0
        return max(0, math.floor((budget_bytes - self.c0) / (self.c1 * S + self.c2) * (1 + 1e-12)))

    def m_mem(self, budget_bytes: float, S_min: Optional[float] = None) -> int:
        """Largest token count B·S whose predicted peak stays within budget_bytes for every bucket with S ≥ S_min
        (0 when none does). The per-sample term weighs most on the shortest sequences, so a model with c2 > 0
        needs S_min, the shortest bucket's S."""
        if self.c1 <= 0:
            raise ValueError("the memory model has no per-token cost (c1 ≤ 0): it cannot bound B·S")
        if self.c2 > 0 and not S_min:
            raise ValueError("this memory model has a per-sample term: m_mem needs the shortest bucket's S (S_min)")
        if self.floor > budget_bytes:
            return 0
        per_token = self.c1 + (self.c2 / S_min if self.c2 > 0 else 0.0)
        return max(0, math.floor((budget_bytes - self.c0) / per_token * (1 + 1e-12)))  # 1e-12: float round-off

    def describe(self) -> str:
        s = f"{self.c0 / 2**30:.1f} GiB + {self.c1 / 2**10:.0f} KiB per token"
        if self.c2:
            s += f" + {self.c2 / 2**20:.1f} MiB per sample"
        if self.floor:
            s += f", at least {self.floor / 2**30:.1f} GiB (the optimizer step)"
        return s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MemoryModel":
        return cls(**d)


FLOOR_TOL = 0.01  # a point within 1 % of a candidate floor is explained by the floor
FLOOR_GAIN = 0.5  # a floor is kept only where it halves the plain line's error (noise alone does not)


def fit_memory_model(B: Sequence[float], S: Sequence[float], peak_bytes: Sequence[float]) -> MemoryModel:
    """Least squares of peak ≈ max(floor, c0 + c1·B·S + c2·B) on relative residuals, coefficients ≥ 0.

    The floor is tried at 0 and at each measured peak: points within FLOOR_TOL of it are taken as the floor's, the
    line is fitted (NNLS) to the rest, and the candidate with the lowest error over all points wins — a floor only
    where it halves the plain line's error, so that noise at the small end does not pass for one. The per-sample
    term c2 is fitted only with four or more points on the line (three unknowns) whose B is not tied to B·S (all at
    B = 1, c2 would split c0 arbitrarily), else it is 0. Needs two distinct token counts B·S on the line."""
    B, S, y = _as_arrays(B, S, peak_bytes)
    tokens = B * S
    if len(np.unique(tokens)) < 2:
        raise ValueError("the memory model needs points at two or more token counts B·S")
    best = None
    for floor in [0.0, *sorted(set(y.tolist()))]:
        line = y > floor * (1 + FLOOR_TOL)
        if len(np.unique(tokens[line])) < 2:
            continue
        cols = [np.ones(line.sum()), tokens[line]]
        if line.sum() >= 4 and _full_rank(np.stack(cols + [B[line]], axis=1)):
            cols.append(B[line])  # c2 only where B varies apart from B·S
        c, _ = _weighted_nnls(np.stack(cols, axis=1), y[line])
        c0, c1, c2 = float(c[0]), float(c[1]), float(c[2]) if len(c) > 2 else 0.0
        rel = (np.maximum(floor, c0 + c1 * tokens + c2 * B) - y) / y
        rmse = float(np.sqrt(np.mean(rel ** 2)))
        if floor > 0 and best[0] <= 1e-4:  # the plain line fits to 0.01 %: no floor to find
            break
        if best is None or rmse < best[0] * (FLOOR_GAIN if best[1].floor == 0 else 1 - 1e-9):
            best = (rmse, MemoryModel(c0, c1, rmse, len(y), c2=c2, floor=floor,
                                      max_rel_err=float(np.max(np.abs(rel)))))
    return best[1]
