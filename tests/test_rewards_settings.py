"""Reward parsers on adversarial answers (thousands separators, decimals, signs, LaTeX, units, spaces), the
score() dispatch at its non-default options, and the sandbox's per-test timeout and memory accounting.
Every expected value is written by hand from what the answer means.

    python -m pytest tests/test_rewards_settings.py -q
"""
import pytest
import torch

import rewards
import tasks
from infra import sandbox


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


def test_score_dispatch_at_non_default_options():
    """shaping="official" uses the official format + correctness terms for gsm8k; text_reward="solution" scores the
    toy text task by its whole solution, "answer" by its box."""
    ex = {"answer": "7"}
    outs = ["<reasoning>x</reasoning> \\boxed{7}", "\\boxed{7}", "\\boxed{8}"]
    b = tasks.Batch("gsm8k", torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), 0, 1, examples=[ex] * 3)
    decoded = lambda *_: outs
    orig, tasks.decode_window = tasks.decode_window, decoded
    try:
        assert tasks.score(b, None, None).tolist() == [1.0, 1.0, 0.0]
        assert tasks.score(b, None, None, shaping="official").tolist() == pytest.approx([3 / 3, 2.5 / 3, 0.5 / 3])
        t = tasks.Batch("text", b.x, b.attention_mask, 0, 1, examples=[
            {"answer": "7", "solution": "3 + 4 = 7 . \\boxed{7}"}] * 2)
        outs[:] = ["3 + 4 = 7 . \\boxed{7}", "3 + 5 = 7 . \\boxed{7}"]
        assert tasks.score(t, None, None).tolist() == [1.0, 1.0]
        assert tasks.score(t, None, None, text_reward="solution").tolist() == [1.0, 0.0]
        assert tasks.score(t, None, None, shaping="official").tolist() == [1.0, 1.0]  # no shaped toy reward
    finally:
        tasks.decode_window = orig


# -----------------------------------------------------------------------------------------------------
# sandbox: each test has its own timeout, whatever the tests before it did


def test_timeouts_are_per_test_over_several_tests(monkeypatch):
    """Hangs before and between slow-but-passing tests: each test gets the whole timeout (a deadline shared
    across tests would fail the later ones), and the supervisor, not the backstop, ends every hang."""
    backstop = []
    kill = sandbox._kill_everything
    monkeypatch.setattr(sandbox, "_kill_everything", lambda *a: (backstop.append(a), kill(*a)))
    tests = ["while True: pass", "import time\ntime.sleep(0.3)", "import time\ntime.sleep(100)",
             "import time\ntime.sleep(0.3)\nassert f() == 1", "assert f() == 2"]
    assert rewards.run_code("def f():\n    return 1", tests, timeout=0.8) == pytest.approx(2 / 5)
    assert not backstop


@pytest.mark.parametrize("memory_mb, expected", [(128, 0.0), (1024, 1.0)])
def test_memory_limit_is_the_given_one(memory_mb, expected):
    assert sandbox.run_code("x = bytearray(300 * 2**20)", ["assert len(x) > 0"], timeout=5.0,
                            memory_mb=memory_mb) == expected


def test_sandbox_refuses_to_run_as_a_script():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, sandbox.__file__], capture_output=True, text=True)
    assert r.returncode == 1 and "is started by run_code" in r.stderr
