"""One RL step on 2 processes equals it on 1, for every estimator and for LoRA (the fast, in-process sibling of
test_distributed.py's slow two-process runs): the world size must change nothing.

Two ranks are simulated in one process: infra/scale's rank, world and collectives (all_sum, all_max,
all_gather_rows) are replaced by a replay. Each rank's step runs alone; a collective returns the sum, max or
concatenation of this rank's tensor and the other rank's tensor of the same call in the previous round;
rounds repeat until every collective's inputs stop changing (a fixed point: both ranks then saw exactly what
real collectives would have given them). The optimiser records gradients and does not step, so each update
is at the same weights; FSDP2 sums the ranks' gradients (infra/scale.shard), so the 2-process gradient is the
sum of the two recorded ones. A float64 model, so that a batch of
4 rows (one rank's) and of 8 cannot flip a near-tie in the sampler.

    python -m pytest tests/test_world_size.py -q
"""
import copy

import pytest
import torch

import tasks
import train
from infra import hf, load, scale

from test_trajectory import base, fake_score  # noqa: F401 (base: the tiny random smoke model, a fixture)
from test_rl_step import save_tiny_checkpoint
from test_trajectory_states import MU_FLAG, Recorder

COMBINE = {"sum": lambda a, b: a + b, "max": torch.maximum, "cat": lambda a, b: torch.cat([a, b])}


@pytest.fixture(scope="module")
def model64(base):
    return copy.deepcopy(base[2]).double()


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory):
    """A LoRA policy as train.main loads it (adapters on a tiny checkpoint), in one process, float64."""
    ckpt = save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    cfg = train.parse_args(["--preset=smoke", f"--init_from={ckpt}", *LORA])
    policy, _, _, _, _ = load.load_policy(cfg, torch.device("cpu"), torch.float32, sft=None)
    with torch.no_grad():  # B = 0 at init would give A no gradient: the adapters of a trained policy
        for name, p in policy.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return policy.double(), ckpt


LORA = ["--lora_rank=4", "--lora_alpha=8"]


def one_step(base, model64, flags, lora_policy=None):
    """(log, gradients of the mu updates) of one train.rl_step at step 2 (the one call into the step)."""
    tok, ids, _ = base
    cfg = train.parse_args(["--preset=smoke", "--prompts_per_step=2", "--group_size=4", f"{MU_FLAG}=2",
                            "--grad_clip=1e9", *flags])
    if cfg.lora_rank:  # as train.main: the reference is the policy with its adapters off
        policy = copy.deepcopy(lora_policy[0])
        ref = hf.AdaptersOff(policy)
    else:
        policy, ref = copy.deepcopy(model64), copy.deepcopy(model64)
    opt = Recorder(hf.trainable_parameters(policy))
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    log, _ = train.rl_step(policy, ref, opt, ctx, 2, tasks.step_prompts(ctx, 2))
    return log, opt.grads


def two_ranks(base, model64, monkeypatch, flags, lora_policy, rounds=6):
    previous = None
    for _ in range(rounds):
        seen, results = {0: [], 1: []}, {}
        for r in (0, 1):
            def collective(kind, t, r=r):
                seen[r].append(t.detach().clone())
                i = len(seen[r]) - 1
                other = previous[1 - r][i] if previous and i < len(previous[1 - r]) else t.detach()
                if other.shape != t.shape:
                    other = t.detach()
                a, b = (t, other) if r == 0 else (other, t)
                return COMBINE[kind](a.to(t.device, t.dtype), b.to(t.device, t.dtype))
            monkeypatch.setattr(scale, "rank", lambda r=r: r)
            monkeypatch.setattr(scale, "world", lambda: 2)
            monkeypatch.setattr(scale, "all_sum", lambda t: collective("sum", t))
            monkeypatch.setattr(scale, "all_max", lambda t: collective("max", t))
            monkeypatch.setattr(scale, "all_gather_rows", lambda t: collective("cat", t))
            results[r] = one_step(base, model64, flags, lora_policy)
        if previous and all(len(seen[r]) == len(previous[r]) and all(torch.equal(a, b) for a, b in zip(seen[r], previous[r]))
                            for r in (0, 1)):
            monkeypatch.undo()
            return results
        previous = seen
    raise AssertionError("the replayed collectives did not settle")


@pytest.mark.parametrize("flags", [
    ["--tasks=text", *LORA, "--init_from={ckpt}"],
    ["--tasks=text"],
    ["--tasks=image", "--cfg_scale=2"],
    ["--tasks=text", "--estimator=d1"],
    ["--tasks=image", "--estimator=unigrpo"],
    ["--tasks=text", "--estimator=trajectory", "--trajectory_states=3", "--device_batch_size=3", "--threshold=0.0101"],
], ids=["lora-text", "maskgrpo-text", "maskgrpo-image-cfg", "d1", "unigrpo-image", "trajectory-K3-chunks-threshold"])
def test_two_processes_give_the_one_process_step(base, model64, lora_policy, monkeypatch, flags):
    flags = [f.format(ckpt=lora_policy[1]) for f in flags]
    monkeypatch.setattr(tasks, "score", fake_score)
    want_log, want = one_step(base, model64, flags, lora_policy)
    ranks = two_ranks(base, model64, monkeypatch, flags, lora_policy)
    (log0, g0), (log1, g1) = ranks[0], ranks[1]
    assert len(g0) == len(g1) == len(want) == 2
    for j in range(2):
        got = g0[j] + g1[j]
        assert want[j].abs().max() > 0
        torch.testing.assert_close(got, want[j], rtol=1e-4, atol=1e-6 * want[j].abs().max().item())  # float32 log-probs
    task = flags[0].split("=")[1]
    for k in ("loss", "kl", "ratio_mean", "ratio_max", "num_tokens", "reward", "adv_abs_mean", "zero_adv_groups"):
        key = f"{task}/{k}"
        assert log0[key] == log1[key] == pytest.approx(want_log[key], rel=1e-5, abs=1e-7), key  # the loss is ~0 at ratio 1
