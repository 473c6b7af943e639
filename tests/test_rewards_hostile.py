"""Reward verifiers under attack: hostile completions against every registered text reward (a float in [0, 1],
quickly, never an exception), and the GSM8K / MATH parsers on adversarial answers, expected values by hand.

Run: python -m pytest tests/test_rewards_hostile.py -q
"""
import pytest

from conftest import cpu_budget
import tasks
import rewards


# -----------------------------------------------------------------------------------------------------
# hostile completions against every registered reward: a float in [0, 1], quickly, never an exception

EXAMPLES = {
    "gsm8k": {"answer": "#### 72"},
    "math": {"answer": "\\frac{1}{2}"},
    "countdown": {"numbers": [30, 100, 93], "target": 37},
    "sudoku": {"puzzle": "3102200002100320", "solution": "3142243142131324"},
    "mbpp": {"test_list": ["assert f(1) == 1"], "test_setup_code": ""},
    "text": {"answer": "7", "solution": "3 + 4 = 7 . \\boxed{7}"},
}
HOSTILE = {
    "1e6 chars": "x" * 10**6,
    "box openers": "\\boxed{" * 100000,
    "answer openers": "<answer>" * 100000 + "</answer>",
    "reasoning openers": "<reasoning>" * 100000,
    "1e6-digit box": "\\boxed{" + "9" * 10**6 + "}",
    "9**9999-sized number": "#### " + "9" * 9543 + "\n<answer>" + "9" * 9543 + "</answer>",
    "deep parens": "<answer>" + "(" * 100000 + "1" + ")" * 100000 + "</answer>",
    "deep braces": "\\boxed{" + "{" * 100000 + "}" * 100000 + "}",
    "many fracs": "\\boxed{" + "\\frac12" * 50000 + "}",
    "near-limit tuple": "\\boxed{(" + "(1," * 300 + "1" + ")" * 301 + "}",
    "unicode": "\\boxed{٣} <answer>١+٢+٣</answer> 🙂 \u202e \ufeff Ω ∑ \\boxed{½}",
    "null bytes": "\\boxed{\x00}\x00<answer>1\x00+2</answer>\x00```python\n\x00\n```",
    "lone surrogate": "\\boxed{\ud800} <answer>\udfff</answer> ```python\nx='\ud800'\n```",
    "unclosed code": "```python\n" + "(" * 100000,
}


# Every text task's verifiers, as the RL step reaches them (tasks.TASKS).
ALL_REWARDS = {f"{task}/{name}": fn for task, t in tasks.TASKS.items() if t.modality == "text"
               for name, fn in t.reward.items()}
EXAMPLES.update({key: EXAMPLES[key.split("/")[0]] for key in ALL_REWARDS if "/" in key})


@pytest.mark.parametrize("name", sorted(ALL_REWARDS))
@pytest.mark.parametrize("label", sorted(HOSTILE))
def test_hostile_completions(name, label):
    with cpu_budget(3.0):  # hang guard (mbpp's programs run in sandbox processes, bounded by its timeouts)
        value = ALL_REWARDS[name](HOSTILE[label], EXAMPLES[name])
    assert isinstance(value, float) and 0.0 <= value <= 1.0


# -----------------------------------------------------------------------------------------------------
# Reward parsers on adversarial answers (thousands separators, decimals, signs, LaTeX, units, spaces).
# Every expected value is written by hand from what the answer means.


@pytest.mark.parametrize("completion, answer, expected", [
    ("\\boxed{1,2}", "12", 0.0),            # a comma that is no thousands separator is not dropped
    ("\\boxed{1,2}", "1", 0.0),
    ("\\boxed{1,23}", "123", 0.0),
    ("\\boxed{1,2345}", "12345", 0.0),
    ("\\boxed{0,5}", "0.5", 0.0),            # a decimal comma is not a decimal point
    ("\\boxed{1,234}", "1234", 1.0),
    ("\\boxed{12,345,678}", "12345678", 1.0),
    ("\\boxed{1,000.5}", "1000.5", 1.0),
    ("\\boxed{-1,200}", "-1200", 1.0),
    ("\\boxed{2,100}", "#### 2,100", 1.0),   # the reference's separators too
    ("\\boxed{(2,100)}", "2100", 0.0),       # a pair, not a number
    ("\\boxed{1\\,000}", "1000", 1.0),       # LaTeX thin space as separator
    ("\\boxed{1 000}", "1000", 0.0),
    ("\\boxed{1.000}", "1000", 0.0),         # a point is always decimal
    ("\\boxed{-5}", "5", 0.0),
    ("\\boxed{+5}", "5", 1.0),
    ("\\boxed{\\$-4}", "-4", 1.0),
    ("\\boxed{--4}", "4", 0.0),
    ("\\boxed{4-}", "4", 0.0),
    ("\\boxed{3.50}", "3.5", 1.0),
    ("\\boxed{3.05}", "3.5", 0.0),
    ("\\boxed{5.}", "5", 1.0),
    ("\\boxed{-0.25}", "-.25", 1.0),
    ("\\boxed{0.1}", "0.10", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 0.0),   # GSM8K answers are plain numbers
    ("\\boxed{18 dollars}", "18", 1.0),
    ("\\boxed{\\text{18 dollars}}", "18", 1.0),
    ("\\boxed{7 m}", "7", 0.0),              # one letter is not a unit word
    ("\\boxed{ 42 }", "42", 1.0),
    ("\\boxed{10%}", "10", 1.0),
    ("\\boxed{1,000}", "1", 0.0),
    ("#### 1,000\n#### 2,000", "2000", 1.0),  # the last #### line
    ("\\boxed{3} #### 4", "3", 1.0),          # a box wins over ####
])
def test_gsm8k_adversarial_answers(completion, answer, expected):
    assert rewards.gsm8k_reward(completion, answer) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
    ("\\boxed{0.75}", "\\tfrac{3}{4}", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{\\frac{-1}{2}}", "-\\frac12", 1.0),
    ("\\boxed{\\frac{1}{2}}", "-0.5", 0.0),
    ("\\boxed{-3}", "3", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1,2}", "12", 0.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{\\$5.00}", "5", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{\\left(1,2\\right)}", "(1,2)", 1.0),
    ("\\boxed{(2,1)}", "(1,2)", 0.0),        # an ordered pair keeps its order
    ("\\boxed{3.0}", "3", 1.0),
])
def test_math_adversarial_answers(completion, answer, expected):
    assert rewards.math_reward(completion, answer) == expected

