"""The fixed-batch protocol's two readings of a batch (scheduling/protocol.py `best_at_g`), fed the one setting each
rule exists to refuse: "steady" never takes a setting whose steps' tokens vary by more than TOKENS_CV, however fast
it is (a CV exactly at the cap is steady); with none steady it takes the steadiest; "expected" judges by the
expectation alone. Balanced is tuned over its windows, the other strategies at window 1."""
from types import SimpleNamespace

import pytest

import scheduling.protocol as protocol
from scheduling.protocol import WINDOWS, Inputs, best_at_g
from scheduling.simulate import TOKENS_CV


def _inputs():
    return Inputs(cost=SimpleNamespace(predict=None), m_mem=1.0, p=1.0, optim_ms=0.0, truth=None)


def _sweeps(monkeypatch, by_window):
    """sweep_at_tokens replaced by given results: window → (tokens/s, tokens CV over steps); the calls are kept."""
    calls = []

    def sweep(cost_fn, mix, strategy, R, g, *, window, tokens_cv, **kwargs):
        calls.append((strategy, window, tokens_cv))
        tps, cv = by_window[window]
        return SimpleNamespace(tokens_per_s=tps, tokens_step_cv=cv, window=window), []

    monkeypatch.setattr(protocol, "sweep_at_tokens", sweep)
    return calls


def test_steady_takes_the_fastest_setting_within_the_tokens_cv_cap_never_a_faster_unsteady_one(monkeypatch):
    calls = _sweeps(monkeypatch, {1: (100.0, 0.05), 2: (300.0, 0.30), 4: (200.0, TOKENS_CV), 8: (150.0, 0.02)})
    best = best_at_g(_inputs(), None, "balanced", 8, 1000.0)
    assert best.window == 4  # 300 tok/s at window 2 is faster, but its steps' tokens vary by 30 %
    assert calls == [("balanced", w, TOKENS_CV) for w in WINDOWS]


def test_with_no_steady_setting_steady_takes_the_steadiest(monkeypatch):
    _sweeps(monkeypatch, {1: (100.0, 0.50), 2: (300.0, 0.30), 4: (200.0, 0.20), 8: (150.0, 0.25)})
    assert best_at_g(_inputs(), None, "balanced", 8, 1000.0).window == 4


def test_expected_judges_by_the_expectation_alone_at_window_1(monkeypatch):
    calls = _sweeps(monkeypatch, {1: (100.0, 0.50)})
    assert best_at_g(_inputs(), None, "balanced", 8, 1000.0, reading="expected").window == 1
    assert calls == [("balanced", 1, None)]


@pytest.mark.parametrize("strategy", ["equal_token", "dual_constraint"])
def test_strategies_without_windows_are_tuned_at_window_1(monkeypatch, strategy):
    calls = _sweeps(monkeypatch, {1: (100.0, 0.01)})
    assert best_at_g(_inputs(), None, strategy, 8, 1000.0).window == 1
    assert calls == [(strategy, 1, TOKENS_CV)]
