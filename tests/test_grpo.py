"""Tests for grpo.py (group advantages and the clipped GRPO loss).

Run: python -m pytest tests/test_grpo.py -q
"""
import math

import pytest
import torch

import grpo
import train
from grpo import group_advantages, policy_loss


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -----------------------------------------------------------------------------
# advantages

def test_advantages_zero_mean_unit_std_per_group():
    R = torch.rand(5, 6, generator=gen(0), dtype=torch.float64)  # 5 groups of 6, flattened: consecutive members
    flat = group_advantages(R.flatten(), group_size=6, eps=0.0)
    assert flat.shape == (30,) and flat.dtype == torch.float64
    A = flat.view(5, 6)
    assert torch.allclose(A.mean(1), torch.zeros(5, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(A.std(1), torch.ones(5, dtype=torch.float64), atol=1e-12)  # unbiased std
    centred = group_advantages(R.flatten(), 6, scale_by_std=False).view(5, 6)
    assert torch.allclose(centred, R - R.mean(1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_rewards_give_exact_zero(dtype):
    R = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [3.0, 3.0, 3.0]], dtype=dtype)
    for scale in (True, False):
        A = group_advantages(R.flatten(), 3, scale_by_std=scale).view(4, 3)
        assert not torch.isnan(A).any()
        assert torch.equal(A[[0, 2, 3]], torch.zeros(3, 3, dtype=dtype))  # exactly zero, not ~1e-13
        assert (A[1] != 0).all()
    assert group_advantages(torch.tensor([1, 1, 0, 1]), 2).dtype == torch.float32  # int rewards


def test_d1_advantages_are_reward_minus_group_mean():
    # d1's diffu-grpo/diffu_grpo_trainer.py, _generate_and_score_completions: advantages = rewards - the group
    # mean, repeated over the group; the group std is computed for logging only.
    G = 6
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0,   # mixed group
                            0.0, 0.0, 0.0, 0.0, 0.0, 2.0,   # one success
                            0.3, 0.9, 0.1, 0.2, 0.7, 0.4])  # (3 * G,) consecutive groups
    d1 = rewards - rewards.view(-1, G).mean(dim=1).repeat_interleave(G)
    A = group_advantages(rewards, group_size=G, scale_by_std=False)
    assert torch.equal(A, d1)
    assert not torch.allclose(group_advantages(rewards, group_size=G), d1)  # the std division differs


def test_preconditions_are_asserted():
    """Settings are validated at the command line (infra/cli.validate) and rewards checked by train.rl_step
    before they get here; the maths asserts what it needs: finite rewards and groups of >= 2 that tile."""
    R = torch.zeros(12)
    R[6] = float("nan")
    for bad in (dict(rewards=R, group_size=4), dict(rewards=torch.zeros(4), group_size=1),
                dict(rewards=torch.zeros(2, 5), group_size=5), dict(rewards=torch.zeros(10), group_size=4)):
        with pytest.raises(AssertionError):
            group_advantages(**bad)


# -----------------------------------------------------------------------------
# policy loss

def naive_loss(logp, logp_old, adv, mask, eps, beta, logp_ref, norm):
    """Per-token Python loop, written independently of the vectorised version."""
    B, N = mask.shape
    seq_losses, tok_sum, tok_n = [], 0.0, 0
    for b in range(B):
        s, n = 0.0, 0
        for k in range(N):
            if not mask[b, k]:
                continue
            r = torch.exp(logp[b, k] - logp_old[b, k])
            l_tok = -torch.min(r * adv[b], torch.clamp(r, 1 - eps, 1 + eps) * adv[b])
            if beta:
                d = logp_ref[b, k] - logp[b, k]
                l_tok = l_tok + beta * (torch.exp(d) - d - 1)
            s, n = s + l_tok, n + 1
        tok_sum, tok_n = tok_sum + s, tok_n + n
        if n:
            seq_losses.append(s / n)
    if norm == "token":
        return tok_sum / tok_n
    return sum(seq_losses) / len(seq_losses)


def random_inputs(seed, B=6, N=10):
    g = gen(seed)
    logp_old = -torch.rand(B, N, generator=g) * 3  # (B, N)
    logp = (logp_old + 0.3 * torch.randn(B, N, generator=g)).requires_grad_()  # some ratios clipped
    logp_ref = logp_old + 0.2 * torch.randn(B, N, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, N, generator=g) < 0.6
    mask[0] = False  # one sequence with no scored token
    return logp, logp_old, adv, mask, logp_ref


@pytest.mark.parametrize("norm", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_vectorised_matches_naive_loop(norm, beta):
    logp, logp_old, adv, mask, logp_ref = random_inputs(1)
    loss, stats = policy_loss(logp, logp_old, adv, mask, clip_eps=0.2, beta=beta, logp_ref=logp_ref, norm=norm)
    (g_vec,) = torch.autograd.grad(loss, logp)
    ref = naive_loss(logp, logp_old, adv, mask, 0.2, beta, logp_ref, norm)
    (g_ref,) = torch.autograd.grad(ref, logp)
    assert abs(loss.item() - ref.item()) < 1e-6
    assert torch.allclose(g_vec, g_ref, atol=1e-6)
    assert 0 < stats["clipped"] < stats["tokens"] == mask.sum().item() and stats["kl"] > 0
    assert stats["loss"] == loss.item()


def test_ratio_one_gives_minus_mean_advantage():
    logp_old = -torch.rand(4, 8, generator=gen(2))
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[0, :2] = mask[1, :6] = mask[2, :1] = True  # sequence 3 has no scored token
    counts = mask.sum(1).float()
    loss, stats = policy_loss(logp_old.clone().requires_grad_(), logp_old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-(adv * counts).sum().item() / counts.sum().item(), abs=1e-7)
    loss_seq, _ = policy_loss(logp_old.clone().requires_grad_(), logp_old, adv, mask, clip_eps=0.2, norm="sequence")
    assert loss_seq.item() == pytest.approx(-adv[:3].mean().item(), abs=1e-7)  # 3 sequences in the denominator
    assert stats["ratio"] == stats["tokens"] == 9.0  # 2 + 6 + 1 scored tokens, each of ratio exactly 1
    assert stats["ratio_max"] == 1.0 and stats["clipped"] == 0.0


def test_clipped_tokens_get_zero_grad():
    # columns: ratio 1.5, 0.5, 1.5, 0.5, 1.1 ; rows: A = +1, -1
    r = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1])
    logp_old = torch.full((2, 5), -1.0)
    logp = (logp_old + torch.log(r)).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 5, dtype=torch.bool)
    loss, stats = policy_loss(logp, logp_old, adv, mask, clip_eps=0.2)
    loss.backward()
    g = logp.grad
    assert g[0, 0] == 0 and g[0, 2] == 0  # A > 0, ratio 1.5 > 1.2: clipped
    assert g[1, 1] == 0 and g[1, 3] == 0  # A < 0, ratio 0.5 < 0.8: clipped
    assert (g[0, [1, 3, 4]] != 0).all() and (g[1, [0, 2, 4]] != 0).all()  # clip side not reached
    assert (stats["clipped"], stats["tokens"]) == (4.0, 10.0)
    assert stats["ratio_max"] == pytest.approx(1.5, rel=1e-6)


def test_kl_zero_when_ref_equals_policy():
    logp, logp_old, adv, mask, _ = random_inputs(3)
    ref = logp.detach().clone()
    with_kl, stats = policy_loss(logp, logp_old, adv, mask, clip_eps=0.2, beta=0.1, logp_ref=ref)
    without, _ = policy_loss(logp, logp_old, adv, mask, clip_eps=0.2)
    assert stats["kl"] == 0.0 and with_kl.item() == without.item()


def test_padding_gets_zero_grad_and_no_nan():
    logp, logp_old, adv, mask, logp_ref = random_inputs(4)
    with torch.no_grad():
        logp[~mask] = 1000.0  # garbage at unscored positions must not leak (exp(1000) * 0 = inf * 0 = NaN)
    for norm in ("token", "sequence"):
        logp.grad = None
        loss, stats = policy_loss(logp, logp_old, adv, mask, clip_eps=0.2, beta=0.1, logp_ref=logp_ref, norm=norm)
        loss.backward()
        assert math.isfinite(loss.item()) and math.isfinite(stats["ratio_max"])
        assert not logp.grad[~mask].any() and logp.grad[mask].abs().sum() > 0


def test_empty_mask_and_errors():
    logp = torch.zeros(2, 3, requires_grad=True)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for norm in ("token", "sequence"):
        loss, stats = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), empty, clip_eps=0.2, norm=norm)
        loss.backward()
        assert loss.item() == 0.0 and loss.requires_grad and not logp.grad.any()
        assert stats["tokens"] == 0.0 and stats["clipped"] == 0.0 and stats["ratio_max"] == 1.0
    args = (logp, torch.zeros(2, 3), torch.ones(2), empty)
    for bad in (dict(clip_eps=0.0), dict(clip_eps=0.2, beta=0.1), dict(clip_eps=0.2, norm="group")):
        with pytest.raises(AssertionError):
            policy_loss(*args, **bad)


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_chunks_with_the_global_normaliser_add_up_to_the_full_batch_mean(norm):
    """policy_loss on row chunks 0:3, 3:5, 5: with total = the whole batch's terms: the chunks' losses and
    gradients add up to the naive full-batch loss's, and their sums (add_sums) to hand-counted totals."""
    logp, logp_old, adv, mask, logp_ref = random_inputs(5)
    total = (mask.sum() if norm == "token" else mask.any(-1).sum()).float()  # the whole batch's terms
    losses, sums = [], {}
    for rows in (slice(0, 3), slice(3, 5), slice(5, None)):
        loss, s = policy_loss(logp[rows], logp_old[rows], adv[rows], mask[rows], clip_eps=0.2, beta=0.05,
                              logp_ref=logp_ref[rows], norm=norm, total=total)
        losses.append(loss)
        sums = train.add_sums(sums, s)
    (g,) = torch.autograd.grad(sum(losses), logp)
    ref = naive_loss(logp, logp_old, adv, mask, 0.2, 0.05, logp_ref, norm)
    (g_ref,) = torch.autograd.grad(ref, logp)
    assert sum(losses).item() == pytest.approx(ref.item(), abs=1e-6) and torch.allclose(g, g_ref, atol=1e-6)
    assert sums["loss"] == pytest.approx(ref.item(), abs=1e-6)
    ratio = torch.exp(logp.detach() - logp_old)
    d = logp_ref - logp.detach()
    assert sums["tokens"] == int(mask.sum())
    assert sums["ratio"] == pytest.approx(sum(float(ratio[b, n]) for b, n in mask.nonzero().tolist()), rel=1e-5)
    assert sums["ratio_max"] == pytest.approx(max(float(ratio[b, n]) for b, n in mask.nonzero().tolist()), rel=1e-6)
    assert sums["kl"] == pytest.approx(sum(float(torch.exp(d[b, n]) - d[b, n] - 1) for b, n in mask.nonzero().tolist()),
                                       rel=1e-5)
    clipped = sum(1 for b, n in mask.nonzero().tolist()
                  if (adv[b] > 0 and ratio[b, n] > 1.2) or (adv[b] < 0 and ratio[b, n] < 0.8))
    assert sums["clipped"] == clipped > 0


def test_step_stats_divide_once_by_hand():
    """Two updates' sums, by hand: loss, clipfrac, kl and ratio_mean are each update's per-token value averaged
    over the updates; ratio_max is the largest of any update; num_tokens the step's total."""
    u1 = {"loss": 0.5, "tokens": 4.0, "clipped": 1.0, "kl": 0.2, "ratio": 4.4, "ratio_max": 1.3}
    u2 = {"loss": -0.1, "tokens": 6.0, "clipped": 3.0, "kl": 0.6, "ratio": 5.4, "ratio_max": 1.1}
    got = train.step_stats([u1, u2])
    want = {"loss": 0.2, "clipfrac": (1 / 4 + 3 / 6) / 2, "kl": (0.2 / 4 + 0.6 / 6) / 2,
            "ratio_mean": (4.4 / 4 + 5.4 / 6) / 2, "ratio_max": 1.3, "num_tokens": 10.0}
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(v, rel=1e-12) for k, v in want.items())
    empty = dict(u2, tokens=0.0, clipped=0.0, kl=0.0, ratio=0.0, ratio_max=1.0)  # an update that scored nothing
    assert train.step_stats([u1, empty])["ratio_mean"] == pytest.approx((1.1 + 1.0) / 2)
