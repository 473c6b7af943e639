"""Rollout noise through train.rl_step depends on (seed, step, global sequence index) only (the fast sibling of
test_rl_step.py's slow test): with the same weights and the same prompts, another step draws other
completions, the same step the same ones, in a fresh call and in a batch of another size; and every row's
completion is the sampler's with the generator (seed, "rollout", task, step, index). The tiny random smoke
model in float64, so that another batch size cannot flip a near-tie in the sampler.

    python -m pytest tests/test_rollout_seeds.py -q
"""
import copy
import random

import pytest
import torch

import sample
import tasks
import train
from infra import hf

from test_trajectory import base, fake_score  # noqa: F401 (base: a fixture)
from test_trajectory_states import Recorder

MU_FLAG = "--mu"


@pytest.fixture(scope="module")
def model64(base):
    return copy.deepcopy(base[2]).double()


def windows(base, model64, monkeypatch, task, step, n_prompts, *flags):
    """The completions (B, N) of one train.rl_step at `step` on the first n_prompts fixed prompts."""
    tok, ids, _ = base
    monkeypatch.setattr(tasks, "score", fake_score)
    cfg = train.parse_args(["--preset=smoke", f"--tasks={task}", "--group_size=4", f"--prompts_per_step={n_prompts}",
                            f"{MU_FLAG}=1", "--beta=0", *flags])
    exs = [tasks.make_example(task, random.Random(i), cfg, "train") for i in range(n_prompts)]
    prompts = tasks.make_batch(task, [e for e in exs for _ in range(4)], tok, ids, cfg, torch.device("cpu"),
                               with_targets=False).rows(slice(None))
    policy = copy.deepcopy(model64)
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    _, (exp,) = train.rl_step(policy, None, Recorder(hf.trainable_parameters(policy)), ctx, step, [prompts])
    return exp.batch.x[:, exp.batch.window_slice], (prompts, ctx)


@pytest.mark.parametrize("task", ["text", "image"])
def test_rollout_noise_depends_on_step_and_sequence_only(base, model64, monkeypatch, task):
    first, (prompts, ctx) = windows(base, model64, monkeypatch, task, 3, 2)
    assert torch.equal(windows(base, model64, monkeypatch, task, 3, 2)[0], first)      # a fresh call
    assert torch.equal(windows(base, model64, monkeypatch, task, 3, 1)[0], first[:4])  # half the batch
    assert torch.equal(windows(base, model64, monkeypatch, task, 3, 2, "--device_batch_size=3")[0], first)
    other, _ = windows(base, model64, monkeypatch, task, 4, 2)
    assert (other != first).any(1).all(), "another step must draw other noise for every sequence"
    assert len({tuple(w) for w in first[:4].tolist()}) == 4, "members of a group draw different noise"
    # The expectation: the sampler on this batch with one generator per row, seeded (seed, rollout, task, 3, i).
    gens = [sample.generator("cpu", ctx.cfg.seed, "rollout", task, 3, i) for i in range(8)]
    want, _ = sample.rollout(model64, prompts, ctx, gens, ctx.cfg.temperature, ctx.text_sampler)
    assert torch.equal(want.x[:, want.window_slice], first)
