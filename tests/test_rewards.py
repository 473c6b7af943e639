"""Tests for rewards.py: extraction, GSM8K / MATH / countdown / sudoku rewards, shaped rewards, score() dispatch.

The MATH, countdown, sudoku and MBPP cases read the real benchmark files through conftest.shared_path (skipped when
absent). LaTeX equivalence is tested in test_latex.py, the code sandbox in test_sandbox.py, the remote image
scorer in test_scorer.py, hostile completions and adversarial answers in test_rewards_hostile.py.

Run: python -m pytest tests/test_rewards.py -q
"""
import csv
import itertools
import json
import operator
import re
from fractions import Fraction

import pytest

from conftest import shared_path
import tasks
from rewards import (REWARDS, SHAPED, SHAPED_MAX, countdown_reward, extract_answer,
                     extract_boxed, extract_code, gsm8k_reward, gsm8k_shaped_reward, math_reward, math_shaped_reward,
                     reasoning_format_reward, sudoku_reward)
import torch
import rewards
from infra import sandbox


def read_jsonl(*parts):
    with open(shared_path(*parts)) as f:
        return [json.loads(line) for line in f]


# -----------------------------------------------------------------------------------------------------
# extraction


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{5}", "5"),
    ("a \\boxed{1} b \\boxed{2} c", "2"),
    ("\\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{a{b{c}}d}", "a{b{c}}d"),
    ("\\boxed{\\boxed{7}}", "7"),  # the last opener wins
    ("\\fbox{3}", "3"),
    ("\\boxed {4}", "4"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces do not count
    ("\\boxed{\\}}", "\\}"),
    ("\\boxed{}", ""),
    ("\\boxed{x}}", "x"),
    ("\\boxed{5", None),
    ("\\boxed{1} then \\boxed{2", None),  # a truncated final box is no answer
    ("\\boxed5", None),
    ("no box at all", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{72}", "72"),
    ("so #### 1,000\nbye", "1,000"),
    ("#### 5\n#### 6", "6"),
    ("#### 5 then \\boxed{7}", "7"),
    ("nothing", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Here:\n```python\ndef f():\n    return 1\n```\nDone", "def f():\n    return 1\n"),
    ("```python\nx = 1\n```\n```python\ny = 2\n```", "x = 1\n"),
    ("```python\nx = 1", "x = 1"),  # an unclosed block runs to the end
    ("def f(): pass", "def f(): pass"),
])
def test_extract_code(text, expected):
    assert extract_code(text) == expected


# -----------------------------------------------------------------------------------------------------
# GSM8K


@pytest.mark.parametrize("completion, answer, expected", [
    ("\\boxed{72}", "#### 72", 1.0),
    ("\\boxed{$1,000.00}", "Natalia ... <<48/2=24>> ...\n#### 1000", 1.0),
    ("#### +72 dollars", "72", 1.0),
    ("\\boxed{72.0}", "72", 1.0),
    ("\\boxed{\\$72}", "72", 1.0),
    ("\\boxed{72\\%}", "72", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{0.5}", ".5", 1.0),
    ("\\boxed{71}", "72", 0.0),
    ("\\boxed{7 2}", "72", 0.0),
    ("\\boxed{1e9}", "1", 0.0),  # a one-letter "unit" is not a unit
    ("the answer is 72", "72", 0.0),  # no box, no ####
    ("\\boxed{72", "72", 0.0),
    ("\\boxed{" + "9" * 10**6 + "}", "72", 0.0),  # never int() a million digits
])
def test_gsm8k_reward(completion, answer, expected):
    assert gsm8k_reward(completion, answer) == expected


@pytest.mark.parametrize("answer", ["#### seventy", "", None])
def test_gsm8k_bad_reference_raises(answer):
    with pytest.raises(ValueError, match="gsm8k reference"):
        gsm8k_reward("\\boxed{1}", answer)


# -----------------------------------------------------------------------------------------------------
# MATH


@pytest.mark.parametrize("completion, answer, expected", [
    ("... \\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{5}", "We find ... so the answer is $\\boxed{5}$.", 1.0),  # a full solution as reference
    ("the answer is 2", "2", 0.0),
    ("\\boxed{3}", "2", 0.0),
])
def test_math_reward(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_math500_every_answer_matches_itself():
    rows = read_jsonl("data", "math500.jsonl")
    assert len(rows) == 500
    failed = [r["answer"] for r in rows if math_reward(f"\\boxed{{{r['answer']}}}", r["answer"]) != 1.0]
    assert not failed, f"{len(failed)} answers do not match themselves: {failed[:5]}"


def bump_first_digit(answer):
    """Add 1 (mod 10) to the first digit: always a different value (a leading 9 -> 0 drops a digit)."""
    m = re.search(r"[0-9]", answer)
    return None if m is None else answer[:m.start()] + str((int(m.group()) + 1) % 10) + answer[m.end():]


def test_math500_perturbed_answers_score_zero():
    # Appending "+1" changes every answer (number, tuple, interval, text, equation); bumping the first digit
    # changes every answer that has a digit (the last digit would not do: "15\mbox{ cm}^2" -> "^3" is a unit).
    rows = read_jsonl("data", "math500.jsonl")
    plus_one = [r["answer"] for r in rows if math_reward(f"\\boxed{{{r['answer']}+1}}", r["answer"]) != 0.0]
    bumped = [(r["answer"], bump_first_digit(r["answer"])) for r in rows if bump_first_digit(r["answer"])]
    wrong = [pair for pair in bumped if math_reward(f"\\boxed{{{pair[1]}}}", pair[0]) != 0.0]
    assert not plus_one, f"answer+1 still scores for {plus_one[:5]}"
    assert not wrong, f"bumped digit still scores for {wrong[:5]}"
    assert len(bumped) == 489  # the other 11 answers (\pi, \text{east}, p - q, ...) have no digit


# -----------------------------------------------------------------------------------------------------
# countdown

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def solve_countdown(numbers, target, want=True):
    """Brute force over orders, operators and both bracketings: an equation equal (or, want=False, not) to target."""
    for a, b, c in itertools.permutations(numbers):
        for o1, o2 in itertools.product(OPS, repeat=2):
            for expr, value in ((f"({a} {o1} {b}) {o2} {c}", lambda: OPS[o2](OPS[o1](Fraction(a), b), c)),
                                (f"{a} {o1} ({b} {o2} {c})", lambda: OPS[o1](Fraction(a), OPS[o2](Fraction(b), c)))):
                try:
                    if (value() == target) == want:
                        return expr
                except ZeroDivisionError:
                    continue
    return None


def countdown_rows(n=8):
    rows = read_jsonl("data", "countdown_cd3_test.jsonl")[:n]
    return [([int(x) for x in r["input"].split(",")], int(r["output"])) for r in rows]


def test_countdown_real_rows():
    for numbers, target in countdown_rows():
        right, wrong = solve_countdown(numbers, target), solve_countdown(numbers, target, want=False)
        assert right is not None, f"no solution found for {numbers} -> {target}"
        assert countdown_reward(f"<reasoning>...</reasoning><answer>{right}</answer>", numbers, target) == 1.0
        assert countdown_reward(f"<answer>{right} = {target}</answer>", numbers, target) == 1.0
        assert countdown_reward(f"so \\boxed{{{right}}}", numbers, target) == 1.0
        assert countdown_reward(f"<answer>{wrong}</answer>", numbers, target) == 0.1
        assert countdown_reward(f"I think it is {right}", numbers, target) == 0.0
        assert REWARDS["countdown"](f"<answer>{right}</answer>", {"numbers": numbers, "target": target}) == 1.0


@pytest.mark.parametrize("completion, numbers, target, expected", [
    ("<answer>1 + 2</answer>", [1, 2], 3, 1.0),
    ("<answer>6 / 4 * 2</answer>", [6, 4, 2], 3, 1.0),  # exact fractions, not floats
    ("<answer>2 \\times (1 + 2)</answer>", [2, 1, 2], 6, 1.0),
    ("<answer>-(1 - 4)</answer>", [1, 4], 3, 1.0),
    ("<answer>1 + 2 + 2</answer>", [1, 2], 5, 0.1),  # a number used twice
    ("<answer>3</answer>", [1, 2], 3, 0.1),  # numbers not used
    ("<answer>1 / (2 - 2)</answer>", [1, 2, 2], 3, 0.1),
    ("<answer>2 ** 3</answer>", [2, 3], 8, 0.1),
    ("<answer>1.5 * 2</answer>", [2], 3, 0.1),
    ("<answer>١ + ٢</answer>", [1, 2], 3, 0.1),  # unicode digits are not numbers here
    ("<answer>" + "(" * 30 + "1 + 2" + ")" * 30 + "</answer>", [1, 2], 3, 0.1),  # nested too deeply
    ("<answer>" + "1 + 2" + " " * 300 + "</answer>", [1, 2], 3, 0.1),  # over 200 characters
    ("<answer>1 + 2</answer> <answer>1 - 2</answer>", [1, 2], 3, 0.1),  # the last block counts
    ("<answer> </answer>", [1, 2], 3, 0.0),
    ("1 + 2", [1, 2], 3, 0.0),
])
def test_countdown_table(completion, numbers, target, expected):
    assert countdown_reward(completion, numbers, target) == expected


@pytest.mark.parametrize("payload", [
    "__import__('os').system('touch {marker}')",
    "open('{marker}', 'w')",
    "(lambda: __import__('os').system('touch {marker}'))()",
    "1 + 2; import os; os.system('touch {marker}')",
    "[c for c in ().__class__.__base__.__subclasses__()]",
])
def test_countdown_injection_is_never_executed(payload, tmp_path):
    marker = tmp_path / "pwned"
    assert countdown_reward(f"<answer>{payload.format(marker=marker)}</answer>", [1, 2], 3) == 0.1
    assert countdown_reward(f"\\boxed{{{payload.format(marker=marker)}}}", [1, 2], 3) == 0.1
    assert not marker.exists()


@pytest.mark.parametrize("numbers, target", [("1,2", 3), ([1, "2"], 3), ([], 3), ([1, 2], "3"), ([True], 1)])
def test_countdown_bad_config_raises(numbers, target):
    with pytest.raises(ValueError, match="countdown"):
        countdown_reward("<answer>1+2</answer>", numbers, target)


# -----------------------------------------------------------------------------------------------------
# sudoku and format rewards


def sudoku_rows(n=50):
    with open(shared_path("data", "sudoku_4x4_test.csv")) as f:
        return list(csv.DictReader(f))[:n]


def test_sudoku_real_rows():
    for row in sudoku_rows():
        puzzle, solution = row["Puzzle"], row["Solution"]
        grid = " | ".join(solution[i:i + 4] for i in range(0, 16, 4))
        empty = [i for i, c in enumerate(puzzle) if c == "0"]
        one_wrong = list(solution)
        one_wrong[empty[0]] = str(int(solution[empty[0]]) % 4 + 1)
        assert sudoku_reward(f"<answer>\n{grid}\n</answer>", puzzle, solution) == 1.0
        assert sudoku_reward(f"\\boxed{{{solution}}}", puzzle, solution) == 1.0
        assert sudoku_reward(f"<answer>{puzzle}</answer>", puzzle, solution) == 0.0
        assert sudoku_reward(f"<answer>{''.join(one_wrong)}</answer>", puzzle, solution) == pytest.approx(
            (len(empty) - 1) / len(empty))
        assert sudoku_reward(f"<answer>{solution[:15]}</answer>", puzzle, solution) == 0.0
        assert REWARDS["sudoku"](f"<answer>{solution}</answer>", {"puzzle": puzzle, "solution": solution}) == 1.0


@pytest.mark.parametrize("puzzle, solution", [("0" * 15, "1" * 16), ("0" * 16, "5" * 16), (1234, "1" * 16)])
def test_sudoku_bad_config_raises(puzzle, solution):
    with pytest.raises(ValueError, match="sudoku"):
        sudoku_reward("<answer>1</answer>", puzzle, solution)


@pytest.mark.parametrize("fn, text, expected", [
    (reasoning_format_reward, "<reasoning>2+2=4</reasoning> \\boxed{4}", 1.0),
    (reasoning_format_reward, "<reasoning>\nmulti\nline\n</reasoning>", 1.0),
    (reasoning_format_reward, "</reasoning><reasoning>", 0.0),
    (reasoning_format_reward, "\\boxed{4}", 0.0),
])
def test_format_rewards(fn, text, expected):
    assert fn(text) == expected


# -----------------------------------------------------------------------------------------------------
# shaped rewards, as the official MaskGRPO runs compute them (github.com/martian422/MaskGRPO, commit b74ba3c):
#   grpo/mask_grpo_train.py picks the reward functions per dataset, each with weight 1 (GRPOConfig reward_weights
#   default None; grpo/mask_grpo_trainer.py sums them with nansum):
#   * gsm8k: soft_format_reward_func + int_reward_func + correctness_reward_func (grpo/reward_func.py), max 3.0
#     - soft_format_reward_func: 0.5 if re.search("<reasoning>.*?</reasoning>", DOTALL) finds a match, else 0
#     - int_reward_func: 0.5 if the answer .isdigit(), else 0 (we accept ASCII digits only; str.isdigit also
#       takes e.g. superscripts). The answer is remove_boxed(last_boxed_only_string(text)), from
#       grpo/math500_utils.py: the last closed \boxed{...} content, or the whole text when there is none.
#     - correctness_reward_func: 2.0 if that answer == the text after "####" (exact strings), else 0. We
#       compare numbers: "72.0" and "1,000" count, as they would not there.
#   * math500: correctness_reward_func_math + boxed_and_answer_tags_format_reward (grpo/reward_func.py), max 2.5
#     - correctness_reward_func_math: 2.0 if is_equiv(last boxed answer, last boxed answer of the reference
#       solution) (grpo/math500_utils.py), else 0; we use math_equiv.
#     - boxed_and_answer_tags_format_reward: 0.5 * boxed_in_answer, and boxed_in_answer (grpo/math500_utils.py)
#       is 1.0 if the substring "\boxed" occurs in the completion, else 0.5: so 0.5 or 0.25.
#   d1 (github.com/dllm-reasoning/d1, diffu-grpo/reward_func.py) has the same weights but reads the answer from
#   <answer> tags and its soft format needs <reasoning>..</reasoning> then <answer>..</answer> (re.match, at
#   the start); MaskGRPO's text rewards read \boxed{} instead, as here.

R, B = "<reasoning>\nwork\n</reasoning>\n", "\\boxed"


@pytest.mark.parametrize("completion, answer, total", [
    (f"{R}{B}{{72}}", "72", 3.0),  # format + integer + correct
    (f"{R}{B}{{72}}", "#### 72", 3.0),  # a raw GSM8K solution as reference
    (f"{B}{{72}}", "72", 2.5),  # no reasoning tags
    (f"<reasoning>a\nb</reasoning>{B}{{71}}", "72", 1.0),  # format and integer, wrong
    (f"{R}{B}{{72.0}}", "72", 2.5),  # correct number, not an integer string
    (f"{R}{B}{{-3}}", "-3", 2.5),  # negative: .isdigit() is False
    (f"{R}{B}{{1,000}}", "1000", 2.5),
    (f"{R}{B}{{ 72}}", "72", 2.5),  # the box content is not stripped before the digit test
    (f"{R}the answer is 72", "72", 0.5),  # no box: the whole text is the answer, not digits
    (f"{R}#### 72", "72", 0.5),  # "####" is not read (gsm8k_reward reads it)
    ("72", "72", 2.5),  # ... so a bare "72" is an integer answer, and correct
    (f"{R}{B}{{72}} {B}{{71}}", "72", 1.0),  # the last box counts
    (f"{R}{B}{{72", "72", 0.5),  # unclosed box: no answer
    (f"</reasoning><reasoning>{B}{{72}}", "72", 2.5),  # tags in the wrong order are no format
    ("", "72", 0.0),
])
def test_gsm8k_shaped(completion, answer, total):
    assert gsm8k_shaped_reward(completion, answer) == pytest.approx(total / 3.0)
    assert SHAPED["gsm8k"](completion, {"answer": answer}) == pytest.approx(total / 3.0)


@pytest.mark.parametrize("completion, answer, total", [
    (f"{R}{B}{{\\frac{{\\sqrt{{3}}}}{{3}}}}", "\\frac{\\sqrt{3}}{3}", 2.5),
    (f"so {B}{{\\sqrt{{3}}/3}}", "\\frac{\\sqrt{3}}{3}", 2.5),
    (f"so {B}{{\\sqrt{{3}}/2}}", "\\frac{\\sqrt{3}}{3}", 0.5),  # wrong, boxed
    (f"so {B}{{5}}", "We find ... so the answer is $\\boxed{5}$.", 2.5),  # a full solution as reference
    ("so the answer is 5", "5", 0.25),  # correct but not boxed: no correctness, half format
    (f"so {B}{{5", "5", 0.5),  # an unclosed box still contains "\\boxed"
    (f"{B} 5", "5", 0.5),
    ("", "5", 0.25),  # the minimum is 0.25 / 2.5 = 0.1, never 0
])
def test_math_shaped(completion, answer, total):
    assert math_shaped_reward(completion, answer) == pytest.approx(total / 2.5)
    assert SHAPED["math"](completion, {"answer": answer}) == pytest.approx(total / 2.5)


def test_shaped_registry():
    assert set(SHAPED) == {"gsm8k", "math"} and SHAPED_MAX == {"gsm8k": 3.0, "math": 2.5}
    rows = read_jsonl("data", "math500.jsonl")
    right = [SHAPED["math"](f"{R}{B}{{{r['answer']}}}", r) for r in rows]
    assert right == [1.0] * len(rows)
    assert SHAPED["math"](f"{B}{{{rows[0]['answer']}+1}}", rows[0]) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="gsm8k reference"):
        SHAPED["gsm8k"](f"{B}{{72}}", {"answer": "seventy-two"})
    with pytest.raises(ValueError, match="example needs"):
        SHAPED["math"](f"{B}{{1}}", {"question": "?"})


# -----------------------------------------------------------------------------------------------------
# the registry on real benchmark rows


def test_registry_on_real_examples():
    math_row = read_jsonl("data", "math500.jsonl")[0]
    mbpp_row = read_jsonl("data", "mbpp.jsonl")[0]
    assert REWARDS["gsm8k"]("\\boxed{72}", {"answer": "#### 72"}) == 1.0
    assert REWARDS["math"](f"\\boxed{{{math_row['answer']}}}", math_row) == 1.0
    assert REWARDS["mbpp"](f"```python\n{mbpp_row['code']}\n```", mbpp_row) == 1.0
    with pytest.raises(ValueError, match="example needs"):
        REWARDS["gsm8k"]("\\boxed{72}", {"question": "?"})



# -----------------------------------------------------------------------------
# The score() dispatch at its non-default options.


def test_a_verifier_a_task_lacks_is_an_error_never_another():
    """No shaped reward exists for countdown: --reward_shaping=official is refused at start-up with a line naming
    the flag and the choice, instead of scoring with the correctness verifier; the toy image task has its one
    verifier whatever --text_reward and --reward_shaping say, geneval none (the remote scorer)."""
    import train

    want = "--reward_shaping=official names no verifier of task countdown: pass --reward_shaping=none, or drop"
    with pytest.raises(ValueError, match=want):
        tasks.verifier("countdown", reward_shaping="official")
    with pytest.raises(ValueError, match=want):
        train.parse_args(["--tasks=countdown", "--reward_shaping=official", "--init_from=/nowhere",
                          "--train_data=countdown=/nowhere.jsonl"])
    assert tasks.verifier("countdown") is rewards.REWARDS["countdown"]
    assert tasks.verifier("image", "solution", "official") is rewards.image_reward
    assert tasks.verifier("geneval", "solution", "official") is None


def test_score_dispatch_at_non_default_options():
    """shaping="official" uses the official format + correctness terms for gsm8k; text_reward="solution" scores the
    toy text task by its whole solution, "answer" by its box."""
    ex = {"answer": "7"}
    outs = ["<reasoning>x</reasoning> \\boxed{7}", "\\boxed{7}", "\\boxed{8}"]
    b = tasks.Batch("gsm8k", torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1), 0, 1, examples=[ex] * 3)
    decoded = lambda *_: outs
    orig, tasks.decode_window = tasks.decode_window, decoded
    try:
        assert tasks.score(b, tasks.verifier("gsm8k"), None, None).tolist() == [1.0, 1.0, 0.0]
        official = tasks.verifier("gsm8k", reward_shaping="official")
        assert tasks.score(b, official, None, None).tolist() == pytest.approx([3 / 3, 2.5 / 3, 0.5 / 3])
        t = tasks.Batch("text", b.x, b.attention_mask, 0, 1, examples=[
            {"answer": "7", "solution": "3 + 4 = 7 . \\boxed{7}"}] * 2)
        outs[:] = ["3 + 4 = 7 . \\boxed{7}", "3 + 5 = 7 . \\boxed{7}"]
        assert tasks.score(t, tasks.verifier("text"), None, None).tolist() == [1.0, 1.0]
        assert tasks.score(t, tasks.verifier("text", "solution"), None, None).tolist() == [1.0, 0.0]
        no_shaping = tasks.verifier("text", reward_shaping="official")  # no shaped toy reward: --text_reward picks
        assert tasks.score(t, no_shaping, None, None).tolist() == [1.0, 1.0]
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
