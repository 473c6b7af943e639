"""infra/latex.py's evaluator on the roots, powers and refusals that tests/test_latex.py does not reach, each
value derived by hand (128 = 2^7, 4^(-1/2) = 1/2, sqrt(-2) = sqrt(2) i, ...).

    python -m pytest tests/test_latex_settings.py -q
"""
import math
from fractions import Fraction

import pytest

from conftest import cpu_budget
from infra.latex import math_equiv, value


@pytest.mark.parametrize("s, expected", [
    ("\\sqrt[7]{128}", 2), ("4^{-\\frac{1}{2}}", Fraction(1, 2)), ("4^{\\frac{1}{2}}", 2), ("(2)3", 6), ("-(3)", -3),
])
def test_exact_roots_and_powers(s, expected):
    assert value(s) == (Fraction(expected), Fraction(0))


@pytest.mark.parametrize("s, expected", [
    ("\\sqrt{-2}", 2 ** 0.5 * 1j), ("\\sqrt{\\pi}", math.pi ** 0.5), ("\\pi^{\\pi}", math.pi ** math.pi),
    ("\\sqrt{2}\\cdot\\sqrt{2}", 2.0),
])
def test_irrational_values(s, expected):
    v = value(s)
    assert isinstance(v, complex) and abs(v - expected) < 1e-12


@pytest.mark.parametrize("s", ["\\sqrt{-\\pi}", "\\sqrt{1+i}", "\\sqrt[1]{4}", "\\sqrt[99]{2}", "(-2)^{\\pi}",
                               "\\frac{1}{2", "(1+2", "\\pi^{10^{5}}", "\\binom{2.5}{1}", "10^{400}\\pi"])
def test_refusals(s):
    """Complex or negative irrational roots, root indices outside 2.., non-positive bases of irrational powers,
    unclosed groups, overflowing powers, non-natural binomials: no value."""
    with cpu_budget(2.0):
        assert value(s) is None


@pytest.mark.parametrize("a, b, expected", [
    ("3 \\cdot 2^{\\frac{1}{2}}", "\\sqrt{18}", True), ("\\sqrt{-2}", "\\sqrt{2}i", True), ("\\sqrt{-2}", "\\sqrt{2}", False),
    ("4^{-\\frac{1}{2}}", "0.5", True), ("\\sqrt[7]{128}", "2", True), ("\\sqrt[7]{128}", "3", False),
])
def test_equivalence(a, b, expected):
    assert math_equiv(a, b) is expected
