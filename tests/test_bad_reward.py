"""The bad-reward guard of train.rl_step: a reward that is not a finite number in [0, 1] (NaN, infinite,
negative, or above 1) skips the step with a one-line error naming it; the ends 0 and 1 are rewards.

    python -m pytest tests/test_bad_reward.py -q
"""
import copy
import math

import pytest
import torch

import tasks
import train
from infra import hf

from test_trajectory import base  # noqa: F401 (the tiny random smoke model, a fixture)
from test_trajectory_states import Recorder


def step_with_reward(base, monkeypatch, value):
    """One rl_step whose sequence 5 of 8 gets `value`, the others 0 or 1 (the one call into the step)."""
    tok, ids, model = base

    def score(b, *a, **kw):
        r = (torch.arange(b.x.shape[0]) % 2).float()
        r[5] = value
        return r
    monkeypatch.setattr(tasks, "score", score)
    cfg = train.parse_args(["--preset=smoke", "--tasks=text", "--prompts_per_step=2", "--group_size=4"])
    policy = copy.deepcopy(model)
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    return train.rl_step(policy, copy.deepcopy(model), Recorder(hf.trainable_parameters(policy)), ctx, 0,
                         tasks.step_prompts(ctx, 0))


@pytest.mark.parametrize("value", [1.5, 1.0 + 1e-6, math.nan, math.inf, -0.5, -1e-6])
def test_rewards_outside_zero_one_are_refused(base, monkeypatch, value):
    with pytest.raises(train.BadStep) as e:
        step_with_reward(base, monkeypatch, value)
    msg = str(e.value)
    assert "\n" not in msg and "1 text reward(s) not a finite number in [0, 1]" in msg
    assert f"first {torch.tensor(value).item()} at sequence 5 (prompt 1)" in msg


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_rewards_in_zero_one_are_accepted(base, monkeypatch, value):
    log, _ = step_with_reward(base, monkeypatch, value)
    assert log["text/reward"] == pytest.approx((4 - (5 % 2) + value) / 8)
