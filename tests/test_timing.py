"""train.timed: each phase's seconds reach times.jsonl, and the loop starts them from zero every step."""
import time

import pytest

import train

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels


def test_timed_adds_every_block():
    def nap(s):
        with train.timed("nap"):
            time.sleep(s)
        return s

    train._SECONDS.clear()
    assert nap(0.02) == 0.02 and nap(0.03) == 0.03
    took = dict(train._SECONDS)
    assert set(took) == {"nap_s", "nap_cpu_s"}
    assert 0.05 <= took["nap_s"] < 1.0 and took["nap_cpu_s"] < took["nap_s"]  # sleeping spends no CPU


def test_a_phase_that_raises_is_still_counted():
    def boom():
        with train.timed("boom"):
            raise RuntimeError("x")

    train._SECONDS.clear()
    try:
        boom()
    except RuntimeError:
        pass
    assert "boom_s" in train._SECONDS


def test_the_step_writes_each_phase(tmp_path):
    """A smoke run's times.jsonl: the four phases of every step, each within the step's wall time."""
    import json

    train.main(["--preset=smoke", "--tasks=text", "--sft_steps=2", "--rl_steps=2", "--eval_prompts=0", "--threads=1",
                f"--out_dir={tmp_path / 'run'}"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "times.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert train._SECONDS == {}  # the loop hands each step's phases on and starts the next step's from zero
    for r in rows:
        phases = [r[f"{p}_s"] for p in ("rollout", "reward", "logprob", "update")]
        assert all(p > 0 for p in phases) and sum(phases) <= r["seconds"]
