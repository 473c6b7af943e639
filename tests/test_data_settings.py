"""infra/data.py paths the fixture files do not reach: empty answers and number lists, a solution with a
digit outside 1-4, the TASK=PATH lists of train_data / eval_data, and load_data's train/test pairing.

    python -m pytest tests/test_data_settings.py -q
"""
from types import SimpleNamespace

import pytest

from conftest import ROOT
from infra import data

FIX = ROOT / "tests" / "fixtures" / "data"


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
