"""The mutator of scripts/mutation_check.py (training/mutation.py) on a small source: which mutants it makes, that each changes exactly one spot
and still parses, what it leaves alone, and that its draw is reproducible. (The checker itself is run by hand.)"""
import ast
import os

import pytest

from training.mutation import candidates, covering_tests, draw

SOURCE = '''"""Docstring: x < 1 and y + 2."""
import math

EPS = 1e-6


def norm(x, n: int = 2):
    """Not mutated: a + b."""
    if n > 0 and x is not None:
        x /= n
    total = min(x, 3) + max(x, 0) * 2
    assert total >= 0, f"bad {total + 1}"
    if not math.isfinite(total):
        raise ValueError(f"total {total - 1}")
    print("total", total * 5)
    buf.mul_(0.5)
    return total if total < 1.0 else -total
'''


def mutated_lines(src, m):
    new = m.apply(src)
    return [(a, b) for a, b in zip(src.splitlines(), new.splitlines()) if a != b]


def test_each_mutant_changes_one_line_and_parses():
    ms = candidates(SOURCE, "x.py")
    got = {}
    for m in ms:
        diff = mutated_lines(SOURCE, m)
        assert len(diff) == 1, (m, diff)  # one line changed, the rest byte for byte
        ast.parse(m.apply(SOURCE))
        got.setdefault(diff[0][1].strip(), m.kind)
    want = {
        "EPS = 2e-06": "const",
        "def norm(x, n: int = 3):": "const",  # a default argument is a constant like any other
        "if (n >= 0) and x is not None:": "compare",
        "if n > 0 and (x is None):": "compare",
        "if (n > 0 or x is not None):": "boolop",
        "if (not (n > 0 and x is not None)):": "negate",
        "if n > 1 and x is not None:": "const",
        "x *= n": "arith",
        "pass": "drop",
        "total = (min(x, 3) - max(x, 0) * 2)": "arith",
        "total = min(x, 3) + (max(x, 0) / 2)": "arith",
        "total = max(x, 3) + max(x, 0) * 2": "minmax",
        "total = min(x, 3) + min(x, 0) * 2": "minmax",
        "total = min(x, 4) + max(x, 0) * 2": "const",
        "if (math.isfinite(total)):": "negate",
        "return total if (total <= 1.0) else -total": "compare",
        "return total if total < 0.0 else -total": "const",
        "return total if (not (total < 1.0)) else -total": "negate",
        "return total if total < 1.0 else (total)": "negate",
    }
    for line, kind in want.items():
        assert got.get(line) == kind, (line, kind, sorted(got))
    # the pass that drops a statement is the in-place ones: `x /= n` and `buf.mul_(0.5)`, not the print
    drops = [mutated_lines(SOURCE, m)[0][0].strip() for m in ms if m.kind == "drop"]
    assert drops == ["x /= n", "buf.mul_(0.5)"]


def test_docstrings_fstrings_asserts_raises_and_prints_are_left_alone():
    lines = {mutated_lines(SOURCE, m)[0][0].strip() for m in candidates(SOURCE, "x.py")}
    for untouched in ('"""Docstring: x < 1 and y + 2."""', '"""Not mutated: a + b."""', "import math",
                      'assert total >= 0, f"bad {total + 1}"', 'raise ValueError(f"total {total - 1}")',
                      'print("total", total * 5)'):
        assert untouched not in lines, untouched


def test_skip_functions_and_a_reproducible_draw():
    assert [m.line for m in candidates(SOURCE, "x.py", skip_functions="^norm$")] == [4]  # only EPS
    ms = candidates(SOURCE, "x.py")
    a, b = draw(ms, 6, seed=3, file="x.py"), draw(candidates(SOURCE, "x.py"), 6, seed=3, file="x.py")
    assert [m.id for m in a] == [m.id for m in b] and len(a) == 6
    assert len({m.kind for m in a}) == 6  # the kinds in turn: six draws, six kinds
    assert [m.id for m in draw(ms, 6, seed=4, file="x.py")] != [m.id for m in a]
    assert draw(ms, 0, seed=3, file="x.py") == ms


@pytest.mark.slow
def test_test_map_finds_the_tests_that_import_a_module():
    cover = covering_tests(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "tests/test_cost_model.py" in cover["scheduling/cost_model.py"]
    assert "tests/test_adaln.py" in cover["ops/adaln.py"]  # `from ops import adaln` counts too
    assert "tests/test_step.py" in cover["training/step.py"]
    assert "tests/test_adaln.py" not in cover["scheduling/cost_model.py"]
