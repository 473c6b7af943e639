"""The statistics a step logs, and the decoding states the trajectory estimator keeps, at two ranks, against
values computed by hand.

Two ranks are simulated in one process (as in test_world_size.py): infra/scale's rank, world and collectives are
replaced by a replay in which each collective returns the sum, max or concatenation of this rank's tensor and
the other rank's tensor of the same call in the previous round, until the inputs stop changing.

- train.reduce_sums: every sum added over ranks, ratio_max the larger of the two (never their sum);
  train.step_log on top: per-token means divided once, and zero_adv_groups counting a group only when EVERY
  member has advantage 0 (fractional rewards put members exactly at their group's mean without the group
  being equal); the Fast-dLLM sampler's committed_per_step_max likewise a max over ranks.
- importance.trajectory_views: a decoding state in which only the other rank revealed tokens is kept on both
  ranks (T is the same everywhere, and the K/T weight with it); a state no rank used is dropped.

    python -m pytest tests/test_two_rank_stats.py -q
"""
import math
import types

import pytest
import torch

import grpo
import importance
import train
import sample
from infra import scale
from tasks import Batch

COMBINE = {"sum": lambda a, b: a + b, "max": torch.maximum, "cat": lambda a, b: torch.cat([a, b])}


def at_two_ranks(monkeypatch, fn, rounds=5):
    """{rank: fn(rank)} with two simulated ranks (replayed collectives, until a fixed point)."""
    previous = None
    for _ in range(rounds):
        seen, results = {0: [], 1: []}, {}
        for r in (0, 1):
            def collective(kind, t, r=r):
                seen[r].append(t.detach().clone())
                i = len(seen[r]) - 1
                other = previous[1 - r][i] if previous and i < len(previous[1 - r]) else t.detach()
                a, b = (t, other) if r == 0 else (other, t)
                return COMBINE[kind](a, b)
            monkeypatch.setattr(scale, "rank", lambda r=r: r)
            monkeypatch.setattr(scale, "world", lambda: 2)
            monkeypatch.setattr(scale, "all_sum", lambda t: collective("sum", t))
            monkeypatch.setattr(scale, "all_max", lambda t: collective("max", t))
            monkeypatch.setattr(scale, "all_gather_rows", lambda t: collective("cat", t))
            results[r] = fn(r)
        if previous and all(len(seen[r]) == len(previous[r]) and all(torch.equal(a, b) for a, b in
                                                                      zip(seen[r], previous[r])) for r in (0, 1)):
            monkeypatch.undo()
            return results
        previous = seen
    raise AssertionError("the replayed collectives did not settle")


# Each rank's sums of policy_loss for two updates (what backward_loss returns), chosen by hand so that the
# largest ratio is on rank 0 in update 0 and on rank 1 in update 1. As policy_loss returns them: 0-d float64
# tensors (read on the host once per update, by reduce_sums).
SUMS = {r: [{k: torch.tensor(v, dtype=torch.float64) for k, v in s.items()} for s in sums] for r, sums in {
    0: [{"loss": 0.12, "tokens": 10.0, "clipped": 2.0, "kl": 0.5, "ratio": 10.4, "ratio_max": 1.3},
        {"loss": 0.02, "tokens": 10.0, "clipped": 1.0, "kl": 0.7, "ratio": 9.5, "ratio_max": 0.9}],
    1: [{"loss": -0.02, "tokens": 6.0, "clipped": 0.0, "kl": 0.1, "ratio": 5.7, "ratio_max": 1.1},
        {"loss": 0.05, "tokens": 6.0, "clipped": 3.0, "kl": 0.3, "ratio": 6.9, "ratio_max": 1.6}]}.items()}

# 12 rewards, 3 groups of G = 4 (rank 0 holds rows 0-5, rank 1 rows 6-11; every rank sees all 12):
# group 0 has two members exactly at its mean 0.5 but is not equal; group 1 is equal; group 2 has none at 0.5.
REWARDS = [0.25, 0.5, 0.75, 0.5, 0.3, 0.3, 0.3, 0.3, 1.0, 0.0, 1.0, 0.0]


def test_reduced_sums_add_over_ranks_and_take_the_larger_ratio_max(monkeypatch):
    got = at_two_ranks(monkeypatch, lambda r: [train.reduce_sums(s, torch.device("cpu")) for s in SUMS[r]])
    want = [{"loss": 0.10, "tokens": 16.0, "clipped": 2.0, "kl": 0.6, "ratio": 16.1, "ratio_max": 1.3},
            {"loss": 0.07, "tokens": 16.0, "clipped": 4.0, "kl": 1.0, "ratio": 16.4, "ratio_max": 1.6}]
    for r in (0, 1):
        for g, w in zip(got[r], want, strict=True):
            assert g.keys() == w.keys() and all(g[k] == pytest.approx(v, rel=1e-12) for k, v in w.items()), (r, g)


def test_step_log_at_two_ranks_by_hand(monkeypatch):
    rewards = torch.tensor(REWARDS)
    adv = grpo.group_advantages(rewards, 4)
    exp = types.SimpleNamespace(batch=types.SimpleNamespace(task="text"), rewards=rewards, adv=adv)
    cfg = train.parse_args(["--preset=smoke", "--group_size=4", "--tasks=text"])

    def step(r):
        updates = [{"text": train.reduce_sums(s, torch.device("cpu")), "grad_norm": g, "skipped": False}
                   for s, g in zip(SUMS[r], (0.4, 0.8))]
        return train.step_log(3, [exp], updates, cfg)
    logs = at_two_ranks(monkeypatch, step)
    assert logs[0] == logs[1]
    log = logs[0]
    # group 0: deviations (-0.25, 0, 0.25, 0), unbiased std sqrt(0.125 / 3); group 2: (0.5, -0.5, 0.5, -0.5),
    # std sqrt(1 / 3); the eps of grpo.group_advantages is 1e-4; group 1 is 0.
    a0, a2 = 0.25 / (math.sqrt(0.125 / 3) + 1e-4), 0.5 / (math.sqrt(1 / 3) + 1e-4)
    want = {"step": 3, "skipped_updates": 0, "text/reward": 5.2 / 12, "text/solved": 2 / 12,
            "text/zero_adv_groups": 1 / 3,
            "text/loss": (0.10 + 0.07) / 2, "text/clipfrac": (2 / 16 + 4 / 16) / 2,
            "text/kl": (0.6 / 16 + 1.0 / 16) / 2,
            "text/ratio_mean": (16.1 / 16 + 16.4 / 16) / 2, "text/ratio_max": 1.6, "text/num_tokens": 32.0,
            "text/adv_abs_mean": (2 * a0 + 4 * a2) / 12, "grad_norm_mean": 0.6, "grad_norm_max": 0.8}
    assert log.keys() == want.keys()
    for k, v in want.items():
        assert log[k] == pytest.approx(v, rel=1e-5), k


def test_committed_per_step_max_is_a_max_over_ranks(monkeypatch):
    """Fast-dLLM statistics (sample.FastSampler.take_log): rank 0 committed 12 tokens in 10 row-steps, at
    most 3 at once; rank 1 6 tokens in 6 row-steps, 1 at a time."""
    stats = {0: {"row_steps": 10, "tokens": 12, "conf_sum": 6.0, "max": 3},
             1: {"row_steps": 6, "tokens": 6, "conf_sum": 4.5, "max": 1}}

    def take_log(r):
        sampler = sample.FastSampler("prefix", 0.0)
        sampler.stats = dict(stats[r])
        return sampler.take_log(torch.device("cpu"))
    logs = at_two_ranks(monkeypatch, take_log)
    assert logs[0] == logs[1] == pytest.approx({"text/committed_per_step": 18 / 16, "text/committed_per_step_max": 3.0,
                                                "text/committed_conf": 10.5 / 18})


# -----------------------------------------------------------------------------
# trajectory_views at two ranks: 2 prompt positions, a window of 5, 5 decoding steps; each rank holds 2 rows.
# order: the step each window position was revealed at. Rank 0 revealed nothing at step 2, rank 1 did; nobody
# revealed anything at step 4. So T = 4 on both ranks (states 0, 1, 2, 3).

ORDER = {0: [[0, 1, 1, 3, 3], [0, 0, 1, 3, 3]], 1: [[0, 2, 2, 1, 3], [1, 2, 3, 0, 0]]}
MASK_ID = 99


def rank_batch(r):
    window = torch.tensor(ORDER[r])
    order = torch.cat([torch.full((2, 2), -1), window], 1)                    # (2, 7): the prompt is never masked
    x = torch.arange(14).reshape(2, 7) + 20 * r                               # distinct tokens, none MASK_ID
    b = Batch("text", x, torch.ones(2, 7, dtype=torch.long), prompt_len=2, window=5, examples=[{}, {}],
              index=[2 * r, 2 * r + 1])
    return b, order


def trajectory_cfg(k):
    return train.parse_args(["--preset=smoke", "--tasks=text", "--estimator=trajectory", "--gen_length=5",
                             "--block_length=5", "--steps=5", "--mu=2", f"--trajectory_states={k}"])


def views_at_two_ranks(monkeypatch, k):
    cfg = trajectory_cfg(k)

    def views(r):
        b, order = rank_batch(r)
        return importance.VIEWS[cfg.estimator](b, order, cfg, image=False, step=1, seq_index=b.index, eos_id=-1,
                                               mask_id=MASK_ID, all_max=lambda t: scale.all_max(t))
    return at_two_ranks(monkeypatch, views)


def test_a_state_only_the_other_rank_used_is_kept_on_both(monkeypatch):
    v = views_at_two_ranks(monkeypatch, 0)
    for r in (0, 1):
        b, order = rank_batch(r)
        assert len(v[r].inputs) == 4 and v[r].updates == [range(4)] * 2 and v[r].norm is None
        for s in range(4):  # by hand: the state the sampler saw at step s, and the tokens it revealed
            assert torch.equal(v[r].inputs[s], b.x.masked_fill(order >= s, MASK_ID)), (r, s)
            assert torch.equal(v[r].loss_masks[s], order == s), (r, s)
    assert not v[0].loss_masks[2].any() and v[1].loss_masks[2].any()  # rank 0 scores nothing in state 2


@pytest.mark.parametrize("k", [2, 6])
def test_the_k_over_t_weight_uses_the_states_of_every_rank(monkeypatch, k):
    """Each rank's share of the normaliser: its 10 revealed tokens times K / T with T = 4 (states of both ranks),
    K clamped to T (K = 6 > T: every state, weight 1)."""
    v = views_at_two_ranks(monkeypatch, k)
    kk = min(k, 4)
    for r in (0, 1):
        assert float(v[r].norm) == pytest.approx(10 * kk / 4)
        assert len(v[r].updates) == 2 and all(len(u) == kk for u in v[r].updates)
        if k >= 4:  # every state, in the sampler's order, in both updates
            assert v[r].updates == [[0, 1, 2, 3]] * 2 and len(v[r].inputs) == 4
