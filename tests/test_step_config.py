"""The settings one RL step reads: train.StepConfig lists them, and rl_step reads no other Config field; the
official config's name for mu is refused.

    python -m pytest tests/test_step_config.py -q
"""
import dataclasses

import pytest

import tasks
import train
from test_rl_step import CPU, build, ckpt, fake_score  # noqa: F401 (ckpt: a fixture)


# -----------------------------------------------------------------------------
# The settings one RL step reads: train.StepConfig lists them, and rl_step reads no other Config field.


class ReadRecorder:
    """A Config stand-in that records every setting read through it."""
    def __init__(self, cfg):
        object.__setattr__(self, "cfg", cfg)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        prop = getattr(type(self.cfg), name, None)
        if isinstance(prop, property):  # a derived setting (StepConfig.adv_scaled): record the fields it reads
            return prop.fget(self)
        self.read.add(name)
        return getattr(self.cfg, name)


STEP_VARIANTS = [["--tasks=text,image"], ["--tasks=text", "--estimator=d1", "--adv_std=on"],
                 ["--tasks=text", "--estimator=trajectory", "--trajectory_states=2", "--loss_norm=token"],
                 ["--tasks=text", "--estimator=unigrpo", "--threshold=0.9", "--kv_cache=dual"],
                 ["--tasks=image", "--cfg_scale=1.5", "--image_sampler=maskgit"]]


def test_a_step_reads_only_the_step_settings(ckpt):
    """train.StepConfig lists the settings one RL step reads, so that its reader need not scan the run's
    settings: every Config field read during rl_step (rollouts, rewards, views, log-probs, updates), over
    every estimator and both modalities, is one of them, and each of them is read by some variant."""
    step_fields, seen = {f.name for f in dataclasses.fields(train.StepConfig)}, set()
    for flags in STEP_VARIANTS:
        cfg, policy, ref, opt, tok, ids = build(ckpt, *flags)
        rec = ReadRecorder(cfg)
        prompts = tasks.step_prompts(tasks.Ctx(cfg, tok, ids, CPU, {}), 0)
        real_score = tasks.score
        tasks.score = fake_score
        try:
            train.rl_step(policy, ref, opt, tasks.Ctx(rec, tok, ids, CPU, {}), 0, prompts)
        finally:
            tasks.score = real_score
        assert rec.read <= step_fields, (flags, sorted(rec.read - step_fields))
        seen |= rec.read
    assert seen == step_fields, sorted(step_fields - seen)


def test_num_iterations_is_refused_with_the_name_of_mu():
    """The inner updates per rollout batch are --mu (the paper's name); the official config's name is refused
    in one line that names the flag to use, never taken silently."""
    for argv in (["--num_iterations=3"], ["--preset=smoke", "--num_iterations", "3"]):
        with pytest.raises(ValueError, match=r"--num_iterations.*--mu"):
            train.parse_args(argv)
    assert train.parse_args(["--preset=smoke", "--mu=3"]).mu == 3
