"""Tests for infra/latex.py: MATH answer normalisation, constant evaluation and equivalence.

Each kind of equivalence has positive cases (right answers written another way, as LLaDA-8B-Instruct writes
them on MATH500) and negative cases (a wrong answer in the same form): a reward must never accept a wrong
answer. The MATH500 self-match and perturbation tests are in test_rewards.py (they go through math_reward).

Run: python -m pytest tests/test_latex.py -q
"""
from fractions import Fraction

import pytest

import rewards
from conftest import cpu_budget
from infra.latex import MAX_ANSWER_CHARS, math_equiv, normalize_math, value
import math
from infra.latex import math_equiv, value


def test_rewards_reexports():
    assert rewards.math_equiv is math_equiv and rewards.normalize_math is normalize_math


@pytest.mark.parametrize("raw, expected", [
    ("\\left( \\dfrac12, 3 \\right)", "(\\frac{1}{2},3)"),
    ("90^\\circ", "90"),
    ("x = 10,\\!080.", "10080"),
    ("11,\\! 111,\\! 111,\\! 100", "11111111100"),
    ("58,500", "58500"),
    ("3, 500", "3,500"),  # a list of two numbers, not 3500
    ("\\frac9{19}", "\\frac{9}{19}"),
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}"),
    ("11\\sqrt2", "11\\sqrt{2}"),
    ("15\\mbox{ cm}^2", "15"),
    ("12 cm", "12"),
    ("864 square inches", "864"),
    ("\\frac{1}{2} feet", "\\frac{1}{2}"),
    ("5 m", "5m"),  # one letter may be a variable: only listed unit words go
    ("2xy", "2xy"),
    ("\\$32,\\!348", "32348"),
    ("\\text{(B)}", "B"),
    ("\\text{Evelyn}", "evelyn"),
    ("4210_{5}", "4210_5"),
    ("x \\in [-2,7]", "[-2,7]"),
    ("50\\%", "50"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),  # keep row breaks
])
def test_normalize_math(raw, expected):
    assert normalize_math(raw) == expected


@pytest.mark.parametrize("s, expected", [
    ("10080", (10080, 0)),
    ("7!\\times2!", (10080, 0)),
    ("7i-2", (-2, 7)),
    ("\\frac{1+i}{1-i}", (0, 1)),
    ("(1+2i)(3-i)", (5, 5)),
    ("2^{10}", (1024, 0)),
    ("(-1)^{\\frac{1}{2}}", (0, 1)),
    ("10^{-3}", (Fraction(1, 1000), 0)),
    ("\\sqrt{16}", (4, 0)),
    ("\\sqrt{-9}", (0, 3)),
    ("\\sqrt[3]{-8}", (-2, 0)),
    ("\\binom{5}{2}", (10, 0)),
    ("\\frac{3}{4}\\div\\frac{1}{2}", (Fraction(3, 2), 0)),
    ("2\\cdot3+4*5-6/4", (Fraction(49, 2), 0)),
    ("137\\frac{1}{2}", (Fraction(275, 2), 0)),  # a mixed number
])
def test_value_exact(s, expected):
    assert value(s) == tuple(Fraction(x) for x in expected)


@pytest.mark.parametrize("s, expected", [
    ("\\sqrt{3}/3", 3 ** 0.5 / 3),
    ("\\frac{\\pi}{2}", 1.5707963267948966),
    ("\\sqrt{2+\\sqrt{3}}", (2 + 3 ** 0.5) ** 0.5),
    ("2^{\\frac{1}{3}}", 2 ** (1 / 3)),
])
def test_value_irrational(s, expected):
    v = value(s)
    assert isinstance(v, complex) and abs(v - expected) < 1e-12


@pytest.mark.parametrize("s", [
    "2x", "e", "\\infty", "1,2", "(1,2]", "\\pm1", "x^2", "2\\frac{1}{2}+1", "\\frac{1}{0}", "0^{-1}",
    "1000!", "201!", "2^{5000}", "9^{9^{9}}", "2^{2^{2^{2^{2}}}}", "10^{10^{10}}", "2^10",
    "\\sqrt[4]{-16}", "\\pi^{1000}", "-" * 999 + "1", "(" * 400 + "1" + ")" * 400, "\\sqrt" * 190 + "2",
    "!" * 999, "2^" * 400 + "2", "9" * (MAX_ANSWER_CHARS + 1), "٣", "",
])
def test_value_refuses(s):
    """Not a constant, undefined, or too large: no value (so the answer is compared as a string)."""
    with cpu_budget(2.0):  # hang guard: milliseconds normally
        assert value(s) is None


# each kind: (right answer as the model wrote it, reference) pairs accepted, wrong answers in the same form not
KINDS = {
    "slash fraction": (
        [("\\sqrt{3}/3", "\\frac{\\sqrt{3}}{3}"), ("1/5", "\\frac{1}{5}"), ("\\pi/2", "\\frac{\\pi}{2}"),
         ("2\\sqrt{3}/3", "\\frac{2\\sqrt3}{3}"), ("(\\sqrt{2}/2, 1)", "\\left(\\frac{\\sqrt2}{2}, 1\\right)")],
        [("\\sqrt{3}/2", "\\frac{\\sqrt{3}}{3}"), ("3/\\sqrt{3}", "\\frac{\\sqrt{3}}{3}"), ("1/5", "\\frac{1}{6}"),
         ("\\pi/3", "\\frac{\\pi}{2}"), ("0.5773502691896258", "\\frac{\\sqrt{3}}{3}")]),  # a decimal is not exact
    "complex order": (
        [("7i - 2", "-2 + 7i"), ("274i+1", "1+274i"), ("-12i + 1", "1 - 12i"), ("i(7+2i)", "-2+7i")],
        [("7i + 2", "-2 + 7i"), ("-7i - 2", "-2 + 7i"), ("2 - 7i", "-2 + 7i"), ("7 - 2i", "-2 + 7i"),
         ("-2", "-2 + 7i")]),
    "trailing units": (
        [("12 cm", "12"), ("12\\text{ cm}", "12"), ("864 square inches", "864 \\mbox{ inches}^2"),
         ("5.4 cents", "5.4 \\text{ cents}"), ("45 degrees", "45^\\circ"), ("3 hours", "3")],
        [("12 cm", "13"), ("12 cm", "120"), ("864 square inches", "865"), ("5 x", "5"), ("5m", "5")]),
    "unordered list": (
        [("3, 7, 5", "3, 5, 7"), ("-2, 1", "1,-2"), ("x = 7, 3, 5", "3, 5, 7"),
         ("\\{-2, 1\\pm\\sqrt{5}\\}", "\\{1\\pm\\sqrt{5},-2\\}"),
         ("(3,\\infty)\\cup(-\\infty,2)", "(-\\infty, 2) \\cup (3, \\infty)")],
        [("3, 7", "3, 5, 7"), ("3, 5, 5", "3, 5, 7"), ("3, 5, 7, 7", "3, 5, 7"), ("(3,5)", "(5,3)"),
         ("(3,5,7)", "(3,7,5)"), ("[3,5]", "[5,3]"), ("(3,5]", "(3,5)"), ("3500", "3, 500"),
         ("(3,\\infty)\\cup(-\\infty,2]", "(-\\infty, 2) \\cup (3, \\infty)")]),
    "factorial arithmetic": (
        [("7! \\times 2!", "10,\\!080"), ("7!\\cdot 2", "10080"), ("\\frac{10!}{3!\\,7!}", "120"),
         ("\\binom{10}{3}", "120"), ("2^{10}", "1024"), ("5 \\cdot 4 \\cdot 3", "60")],
        [("7! \\times 3!", "10,\\!080"), ("7!", "10080"), ("8! \\times 2!", "10080"), ("\\binom{10}{4}", "120"),
         ("2^{11}", "1024"), ("7! \\times 2! + 1", "10080")]),
    "leading lhs": (
        [("\\text{proj}_{\\mathbf b} \\mathbf a = \\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}",
          "\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}"),
         ("\\mathbf{v} = \\begin{pmatrix} \\frac{16}{49} \\\\ \\frac{48}{49} \\\\ \\frac{24}{49} \\end{pmatrix}",
          "\\begin{pmatrix} 16/49 \\\\ 48/49 \\\\ 24/49 \\end{pmatrix}"),
         ("f(3) = 12", "12"), ("a_1 = 5", "5"), ("AB = 2\\sqrt{5}", "2 \\sqrt{5}")],
        [("\\text{proj}_{\\mathbf b} \\mathbf a = \\begin{pmatrix} 1/5 \\\\ 18/5 \\end{pmatrix}",
          "\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}"),
         ("2x = 6", "6"), ("x + y = 5", "5"), ("x^2 = 9", "9"), ("y = 5 = z", "5"), ("f(3) = 12", "13"),
         ("5x - 7y + 11z + 4 = 0", "0"),
         ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}"),
         ("\\begin{pmatrix} 1 & 2 \\\\ 3 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 & 3 \\end{pmatrix}")]),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_equivalence_kinds(kind):
    right, wrong = KINDS[kind]
    for pred, gold in right:
        assert math_equiv(pred, gold) and math_equiv(gold, pred), f"{kind}: {pred!r} should equal {gold!r}"
    for pred, gold in wrong:
        assert not math_equiv(pred, gold) and not math_equiv(gold, pred), f"{kind}: {pred!r} != {gold!r}"


@pytest.mark.parametrize("a, b, expected", [
    ("0.5", "\\frac12", True),
    ("\\frac{1}{2}", "1/2", True),
    ("-\\frac{3}{8}", "-0.375", True),
    ("\\frac{-3}{8}", "-\\frac38", True),
    ("137 \\frac{1}{2}", "137.5", True),
    ("\\left(3, \\frac{\\pi}{2}\\right)", "(3,\\frac\\pi2)", True),
    ("(0.5, 3]", "(\\frac{1}{2}, 3]", True),
    ("(-\\infty, 2) \\cup (3, \\infty)", "(-\\infty,2)\\cup(3,\\infty)", True),
    ("y = 2x + 3", "2x+3", True),
    ("\\text{East}", "east", True),
    ("\\sqrt{12}", "2\\sqrt{3}", True),
    ("\\begin{bmatrix} 1 \\\\ 2 \\end{bmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
    ("2", "3", False),
    ("0.33", "\\frac13", False),  # no tolerance: only exact values are equal
    ("1.414", "\\sqrt{2}", False),  # a decimal never equals an irrational
    ("(3,4]", "(3,4)", False),  # interval ends matter
    ("(1,2)", "(2,1)", False),  # tuples are ordered
    ("1,2", "1,2,3", False),
    ("\\frac{1}{0}", "0", False),
    ("\\sqrt{2}", "2", False),
    ("2\\frac{1}{2}", "1", False),  # a mixed number, not 2 * 1/2
    ("\\pi", "3.141592653589793", False),
])
def test_math_equiv(a, b, expected):
    assert math_equiv(a, b) is expected


def test_long_answers_compare_verbatim():
    long = "1+" * (MAX_ANSWER_CHARS // 2) + "1"
    assert math_equiv(long, long) and not math_equiv(long, str(MAX_ANSWER_CHARS // 2 + 1))


def test_cpu_budget_fails_a_hang_even_inside_except_exception():
    """The hang guard above has teeth: a busy loop that swallows every Exception is still stopped."""
    from conftest import OverBudget
    with pytest.raises(OverBudget):
        with cpu_budget(0.2):
            while True:
                try:
                    pass
                except Exception:
                    pass


# -----------------------------------------------------------------------------
# infra/latex.py's evaluator on the roots, powers and refusals that tests/test_latex.py does not reach, each
# value derived by hand (128 = 2^7, 4^(-1/2) = 1/2, sqrt(-2) = sqrt(2) i, ...).
#
#     python -m pytest tests/test_latex.py -q


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
