"""Tests for data.py: each public format on a tiny fixture, malformed files reported as file:line, the real
benchmark files in ../shared/data (skipped when absent), and the prompt contracts the rewards rely on.

Run: python -m pytest tests/test_data.py -q
"""
import re
from pathlib import Path

import pytest
from conftest import shared_path

from infra import data
from types import SimpleNamespace


FIX = Path(__file__).parent / "fixtures" / "data"

# fields each task's reward function reads from the example, with their types
REWARD_FIELDS = {
    "gsm8k": {"answer": str}, "math": {"answer": str}, "countdown": {"numbers": list, "target": int},
    "sudoku": {"puzzle": str, "solution": str}, "mbpp": {"test_list": list, "test_setup_code": str},
    "geneval": {"spec": dict},
}


def check_schema(ex: dict, task: str) -> None:
    assert ex["task"] == task and isinstance(ex["prompt"], str) and ex["prompt"].strip(), ex
    for name, typ in REWARD_FIELDS[task].items():
        assert isinstance(ex[name], typ), (name, ex)


# -----------------------------------------------------------------------------------------------------
# each reader on its fixture

def test_gsm8k_final_answer_after_hashes_without_commas():
    exs = data.load_dataset("gsm8k", FIX / "gsm8k.jsonl")
    assert [ex["answer"] for ex in exs] == ["8", "1200", "-2"]
    assert exs[0]["question"].startswith("Mia has 5 pens")
    for ex in exs:
        check_schema(ex, "gsm8k")


def test_math_answer_is_last_boxed_of_solution_or_the_answer_field():
    pytest.importorskip("rewards", reason="rewards.py (extract_boxed) not written yet")
    exs = data.load_dataset("math", FIX / "math.jsonl")
    assert [ex["answer"] for ex in exs] == ["\\frac{1}{2}", "1024", "2"]
    for ex in exs:
        check_schema(ex, "math")


def test_humaneval_rows_become_one_check_test():
    exs = data.load_dataset("mbpp", FIX / "humaneval.jsonl")
    assert [ex["entry_point"] for ex in exs] == ["add", "double"]
    test = exs[0]["test_list"][0]
    assert "def check(candidate):" in test and test.rstrip().endswith("check(add)")
    namespace = {}
    exec("def add(a, b):\n    return a + b\n" + test, namespace)  # our own fixture: the test must pass
    assert "def add(a: int, b: int) -> int:" in exs[0]["prompt"]
    for ex in exs:
        check_schema(ex, "mbpp")


def test_mbpp_fixture():
    exs = data.load_dataset("mbpp", FIX / "mbpp.jsonl")
    assert exs[0]["test_list"] == ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]
    assert exs[1]["test_setup_code"].startswith("class N:")
    for ex in exs:
        check_schema(ex, "mbpp")


def test_countdown_string_or_list_input():
    exs = data.load_dataset("countdown", FIX / "countdown.jsonl")
    assert [(ex["numbers"], ex["target"]) for ex in exs] == [([30, 100, 93], 23), ([3, 5, 7], 22), ([2, 4], 8)]
    for ex in exs:
        check_schema(ex, "countdown")


def test_sudoku_csv():
    exs = data.load_dataset("sudoku", FIX / "sudoku.csv")
    assert exs[0]["puzzle"] == "3102200002100320" and exs[0]["solution"] == "3142243142131324"
    for ex in exs:
        check_schema(ex, "sudoku")


def test_sudoku_csv_with_bom_and_lowercase_header(tmp_path):
    path = tmp_path / "s.csv"
    path.write_bytes(b"\xef\xbb\xbfpuzzle,solution\r\n3102200002100320,3142243142131324\r\n")
    assert data.load_dataset("sudoku", path)[0]["solution"] == "3142243142131324"


def test_geneval_keeps_prompt_and_spec():
    exs = data.load_dataset("geneval", FIX / "geneval.jsonl")
    assert exs[1]["prompt"] == "a photo of two clocks"
    assert exs[1]["spec"] == {"tag": "counting", "include": [{"class": "clock", "count": 2}],
                              "exclude": [{"class": "clock", "count": 3}]}
    for ex in exs:
        check_schema(ex, "geneval")


# -----------------------------------------------------------------------------------------------------
# malformed files: the error names the file and the 1-based line (blank lines count)

GOOD_GSM8K = '{"question": "q", "answer": "#### 3"}\n'
SUDOKU_HEADER = "Puzzle,Solution\n3102200002100320,3142243142131324\n"
MALFORMED = [
    ("gsm8k", "a.jsonl", GOOD_GSM8K + '{"question": "q", "answer": "#### 3"\n', 2, "bad JSON"),
    ("gsm8k", "a.jsonl", "\n\n" + GOOD_GSM8K + '{"question": "q"}\n', 4, "missing field 'answer'"),
    ("gsm8k", "a.jsonl", '{"question": "q", "answer": "so about five"}\n', 1, "'#### <number>'"),
    ("gsm8k", "a.jsonl", '{"question": "q", "answer": 3}\n', 1, "field 'answer' should be str, got int"),
    ("gsm8k", "a.jsonl", "[1, 2]\n", 1, "expected a JSON object, got list"),
    ("gsm8k", "a.jsonl", b'{"question": "\xff", "answer": "#### 3"}\n', 1, "not UTF-8"),
    ("math", "m.jsonl", '{"answer": "2"}\n', 1, "missing field 'problem'"),
    ("math", "m.jsonl", '{"problem": "p", "level": 1}\n', 1, "missing field 'answer' or 'solution'"),
    ("mbpp", "p.jsonl", '{"text": "t", "test_list": []}\n', 1, "non-empty list of str"),
    ("mbpp", "h.jsonl", '{"prompt": "def f():", "entry_point": "f"}\n', 1, "missing field 'test'"),
    ("countdown", "c.jsonl", '{"input": "12,x,5", "output": "3"}\n', 1, "each number should be an integer"),
    ("countdown", "c.jsonl", '{"input": "1,2", "output": "three"}\n', 1, "the target should be an integer"),
    ("sudoku", "s.csv", SUDOKU_HEADER + "3105200002100320,3142243142131324\n", 3, "16 digits 0-4"),
    ("sudoku", "s.csv", SUDOKU_HEADER + "3102200002100320,3132243142131324\n", 3, "repeats a digit"),
    ("sudoku", "s.csv", SUDOKU_HEADER + "3302200002100320,3142243142131324\n", 3, "contradicts a given digit"),
    ("sudoku", "s.csv", SUDOKU_HEADER.encode() + b"\xff102200002100320,3142243142131324\n", 3,
     "16 digits 0-4"),
    ("sudoku", "s.csv", "Puzzle,Answer\n3102200002100320,3142243142131324\n", 1, "missing column 'solution'"),
    ("geneval", "g.jsonl", '{"tag": "t", "include": [{"class": "cow", "count": 1}]}\n', 1, "missing field 'prompt'"),
    ("geneval", "g.jsonl", '{"tag": "t", "include": [], "prompt": "p"}\n', 1, "non-empty list"),
]


@pytest.mark.parametrize("task,name,content,line,problem", MALFORMED)
def test_malformed_row_names_file_and_line(tmp_path, task, name, content, line, problem):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as e:
        data.load_dataset(task, path)
    assert f"{path}:{line}: " in str(e.value) and problem in str(e.value), str(e.value)


def test_math_solution_without_box(tmp_path):
    pytest.importorskip("rewards", reason="rewards.py (extract_boxed) not written yet")
    path = tmp_path / "m.jsonl"
    path.write_text((FIX / "math.jsonl").read_text().splitlines()[0] + '\n{"problem": "p", "solution": "it is 4"}\n')
    with pytest.raises(ValueError) as e:
        data.load_dataset("math", path)
    assert f"{path}:2: field 'solution' has no closed \\boxed" in str(e.value)


@pytest.mark.parametrize("task,content", [("gsm8k", ""), ("gsm8k", "\n  \n"), ("sudoku", ""),
                                          ("sudoku", "Puzzle,Solution\n")])
def test_empty_file(tmp_path, task, content):
    path = tmp_path / "empty.data"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: the file is empty"):
        data.load_dataset(task, path)


def test_many_problems_reported_together(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("{oops\n" * 7)
    with pytest.raises(ValueError) as e:
        data.load_dataset("gsm8k", path)
    msg = str(e.value)
    assert msg.startswith(f"7 malformed row(s) in {path}")
    assert all(f"{path}:{i}: bad JSON" in msg for i in range(1, 6)) and f"{path}:6:" not in msg
    assert "and 2 more" in msg


def test_missing_file_and_unknown_task(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nope.jsonl"))):
        data.load_dataset("gsm8k", tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        data.load_dataset("sudoku", tmp_path / "nope.csv")
    with pytest.raises(ValueError, match="valid tasks: gsm8k, math, mbpp, countdown, sudoku, geneval"):
        data.load_dataset("gsm8", FIX / "gsm8k.jsonl")


# -----------------------------------------------------------------------------------------------------
# the real benchmark files in ../shared/data

REAL = [("math", "math500.jsonl", 500), ("mbpp", "mbpp.jsonl", 974), ("countdown", "countdown_cd3_test.jsonl", 256),
        ("sudoku", "sudoku_4x4_test.csv", 500), ("geneval", "geneval_prompts.jsonl", 553)]


@pytest.mark.parametrize("task,name,count", REAL)
def test_real_files(task, name, count):
    exs = data.load_dataset(task, shared_path("data", name))
    assert len(exs) == count
    for ex in exs:
        check_schema(ex, task)
    if task == "countdown":
        assert exs[0]["numbers"] == [30, 100, 93] and exs[0]["target"] == 23
        assert all(len(ex["numbers"]) == 3 for ex in exs)
    if task == "mbpp":
        assert exs[0]["test_list"][0].startswith("assert min_cost(")
        assert sum(bool(ex["test_setup_code"]) for ex in exs) >= 1


# -----------------------------------------------------------------------------------------------------
# prompt contracts

def test_prompt_contracts():
    math_ex = data.load_dataset("gsm8k", FIX / "gsm8k.jsonl")[0]
    p = math_ex["prompt"]
    assert "<reasoning>" in p and "</reasoning>" in p and "\\boxed{" in p and p.endswith(math_ex["question"])
    mbpp = data.load_dataset("mbpp", FIX / "mbpp.jsonl")[0]
    assert "Your code should pass these tests:" in mbpp["prompt"] and "assert add(1, 2) == 3" in mbpp["prompt"]
    assert "```python" in mbpp["prompt"] and "Write a function to add two numbers." in mbpp["prompt"]
    cd = data.load_dataset("countdown", FIX / "countdown.jsonl")[0]
    assert "<answer>" in cd["prompt"] and "[30, 100, 93]" in cd["prompt"] and "23" in cd["prompt"]
    sd = data.load_dataset("sudoku", FIX / "sudoku.csv")[0]
    assert "<answer>" in sd["prompt"] and "3102\n2000\n0210\n0320" in sd["prompt"]
    ge = data.load_dataset("geneval", FIX / "geneval.jsonl")[0]  # a text-to-image caption is its own prompt
    assert ge["prompt"] == "a photo of a cow"
    with pytest.raises(ValueError, match="valid tasks"):
        data.load_dataset("chess", FIX / "gsm8k.jsonl")


# -----------------------------------------------------------------------------------------------------
# the examples are what rewards.REWARDS expects (skipped until rewards.py has its registry)

def rewards_registry():
    rewards = pytest.importorskip("rewards", reason="rewards.py not written yet")
    if not hasattr(rewards, "REWARDS"):
        pytest.skip("rewards.REWARDS not defined yet")
    return rewards.REWARDS


def test_examples_fit_reward_functions():
    rewards = rewards_registry()
    gold = {"gsm8k": lambda ex: f"<reasoning>ok</reasoning>\n\\boxed{{{ex['answer']}}}",
            "sudoku": lambda ex: f"<reasoning>ok</reasoning>\n<answer>\n{ex['solution']}\n</answer>"}
    wrong = {"gsm8k": "<reasoning>ok</reasoning>\n\\boxed{12345}", "sudoku": "<answer>\n1111\n</answer>"}
    for task, path in [("gsm8k", FIX / "gsm8k.jsonl"), ("sudoku", FIX / "sudoku.csv")]:
        for ex in data.load_dataset(task, path):
            assert rewards[task](gold[task](ex), ex) > rewards[task](wrong[task], ex), (task, ex)
    cd = data.load_dataset("countdown", FIX / "countdown.jsonl")
    for ex, expr in zip(cd, ["30 - (100 - 93)", "3 * 5 + 7", "2 * 4"]):
        assert rewards["countdown"](f"<answer>{expr}</answer>", ex) > rewards["countdown"]("<answer>1</answer>", ex)


def test_real_math_answers_fit_math_reward():
    rewards = rewards_registry()
    for ex in data.load_dataset("math", shared_path("data", "math500.jsonl"))[:100]:
        gold = f"<reasoning>ok</reasoning>\n\\boxed{{{ex['answer']}}}"
        assert rewards["math"](gold, ex) > rewards["math"]("\\boxed{\\text{no idea}}", ex), ex


def test_code_examples_run_under_mbpp_reward():
    rewards = rewards_registry()
    add = data.load_dataset("mbpp", FIX / "humaneval.jsonl")[0]  # check(add) must really call the candidate
    assert rewards["mbpp"]("```python\ndef add(a, b):\n    return a + b\n```", add) == 1.0
    assert rewards["mbpp"]("```python\ndef add(a, b):\n    return a - b\n```", add) == 0.0
    node = data.load_dataset("mbpp", FIX / "mbpp.jsonl")[1]  # its asserts need test_setup_code
    assert rewards["mbpp"]("```python\ndef val(n):\n    return n.v\n```", node) == 1.0


# -----------------------------------------------------------------------------
# infra/data.py paths the fixture files do not reach: empty answers and number lists, a solution with a
# digit outside 1-4, the TASK=PATH lists of train_data / eval_data, and load_data's train/test pairing.
#
#     python -m pytest tests/test_data.py -q


@pytest.mark.parametrize("task, content, problem", [
    ("math", '{"problem": "p", "answer": "  "}\n', "the answer is empty"),
    ("countdown", '{"nums": [], "target": 3}\n', "the list of numbers is empty"),
    ("countdown", '{"nums": [1, 2], "target": 3.5}\n', "field 'target' should be str or int"),
    ("sudoku", "puzzle,solution\n3102200002100320,3142243142131325\n", "should be 16 digits 1-4"),
])
def test_more_malformed_rows(tmp_path, task, content, problem):
    f = tmp_path / ("s.csv" if task == "sudoku" else "d.jsonl")
    f.write_text(content)
    with pytest.raises(ValueError, match=f"{f}:\\d+: .*{problem}"):
        data.load_dataset(task, f)


def test_countdown_nums_and_target_fields(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"nums": [3, "5", 7], "target": "15"}\n')
    (ex,) = data.load_dataset("countdown", f)
    assert (ex["numbers"], ex["target"]) == ([3, 5, 7], 15) and "[3, 5, 7]" in ex["prompt"] and "15" in ex["prompt"]


def test_data_paths_and_load_data():
    assert data.data_paths("gsm8k=a.jsonl,,math=b/c.jsonl", "train_data") == {"gsm8k": "a.jsonl", "math": "b/c.jsonl"}
    for bad in ("gsm8k", "gsm8k=", "chess=a.jsonl"):
        with pytest.raises(ValueError, match=f"eval_data entry '{bad}' must be TASK=PATH"):
            data.data_paths(bad, "eval_data")
    cfg = SimpleNamespace(train_data=f"gsm8k={FIX / 'gsm8k.jsonl'},countdown={FIX / 'countdown.jsonl'}",
                          eval_data=f"gsm8k={FIX / 'gsm8k.jsonl'}")
    out = data.load_data(cfg)
    assert sorted(out) == ["countdown", "gsm8k"] and out["countdown"]["test"] == []
    assert out["gsm8k"]["test"] == out["gsm8k"]["train"] and len(out["gsm8k"]["train"]) > 0
