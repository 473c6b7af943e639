"""--trajectory_states=K at K < T, mu >= 2 and several rows in several chunks: the exact expected gradient by
enumeration (the fast, exact sibling of the slow statistical test in test_trajectory_states.py).

The setting: T = 4 decoding states (12 tokens, 3 per step), K = 2, mu = 2, 8 rows scored 3 at a time. The
draw of a row is a permutation of its T states; update j scores positions jK .. jK+K-1 of it. The
gradient of an update is linear in which (row, state) pairs it scores, so its expectation over the draw
depends only on each pair's probability of being scored, K/T. Enumerating the C(4, 2) = 6 subsets (row b
takes subset (i + b) mod 6 in outcome i, the complement in update 1) gives every pair exactly that
probability; the average gradient over the 6 outcomes is then exactly the expected one, and must equal the
full trajectory's gradient. The optimiser does not step (a recorder), so both updates are at theta = pi_old.

The expectation comes from a naive re-implementation: one single-sequence forward and backward per (row,
revealed token) on the state x^(s) (every position revealed at step s or later masked), the clipped
surrogate and k3 term written out, and the token mean over the whole trajectory; a drawn state weighs T/K.

    python -m pytest tests/test_trajectory_states_exact.py -q
"""
import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

import importance
import tasks
import train
from infra import lora, rng

from test_trajectory import base, fake_score  # noqa: F401 (base: the tiny random smoke model, a fixture)

T, K, MU, B = 4, 2, 2, 8
MU_FLAG = "--mu"
FLAGS = ["--preset=smoke", "--tasks=text", "--prompts_per_step=2", "--group_size=4", "--estimator=trajectory",
         "--gen_length=12", "--block_length=12", f"--steps={T}", f"{MU_FLAG}={MU}", "--grad_clip=1e9",
         "--device_batch_size=3", "--beta=0.05"]


class Recorder:
    """An optimiser that records the gradient at each step and never moves the weights."""

    def __init__(self, params):
        self.param_groups, self.grads = [{"params": list(params)}], []

    def zero_grad(self, set_to_none=True):
        for p in self.param_groups[0]["params"]:
            p.grad = None

    def step(self):
        self.grads.append(torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten()
                                     for p in self.param_groups[0]["params"]]).double())


def rl_step_grads(base, monkeypatch, flags, step=0):
    """(gradient of each of the mu updates, the experience, ctx) of one train.rl_step at step 0: the one call
    into the step's internals, kept here so that a change of its signature is adapted in one place."""
    tok, ids, model = base
    monkeypatch.setattr(tasks, "score", fake_score)
    cfg = train.parse_args(flags)
    policy, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = Recorder(lora.trainable_parameters(policy))
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    _, (exp,) = train.rl_step(policy, ref, opt, ctx, step, tasks.step_prompts(ctx, step))
    return opt.grads, exp, ctx


def naive_pair_gradients(base, exp, ctx):
    """{(row, state): gradient of the sum of that row's terms revealed at that state}, and the number of
    scored tokens over the whole trajectory; the decoding order from an independent rollout."""
    tok, ids, model = base
    cfg, b = ctx.cfg, exp.batch
    fresh = tasks.make_batch("text", b.examples, tok, ids, cfg, ctx.device, with_targets=False)
    gens = [rng.generator("cpu", cfg.seed, "rollout", "text", 0, i) for i in range(len(b.examples))]
    x, order, _ = tasks.rollout(model, fresh, ctx, gens, cfg.temperature, allow_fast=True)
    assert torch.equal(x.x, b.x)
    theta, old = copy.deepcopy(model).train(), copy.deepcopy(model).eval()
    params = lora.trainable_parameters(theta)

    def state_logp(m, i, s):  # log pi_m(x_i | x^(s)) at every position: one forward on row i's state s
        state = b.x[i].masked_fill(order[i] >= s, ids.mask)[None]
        return F.log_softmax(m(state, b.attention_mask[i][None])[0].float(), -1).gather(-1, b.x[i][:, None])[:, 0]

    pairs, count = {}, 0
    for i in range(b.x.shape[0]):
        for s in range(T):
            revealed = order[i] == s                                                   # (L,)
            count += int(revealed.sum())
            lp = state_logp(theta, i, s)[revealed]
            with torch.no_grad():
                lp_old = state_logp(old, i, s)[revealed]
            ratio, A, d = torch.exp(lp - lp_old), exp.adv[i], lp_old - lp  # the reference is pi_old here
            terms = (-torch.minimum(ratio * A, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * A)
                     + cfg.beta * (torch.exp(d) - d - 1))
            for p in params:
                p.grad = None
            terms.sum().backward()
            pairs[i, s] = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten()
                                     for p in params]).double()
    return pairs, count


def close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.abs().max().item())


def test_expected_gradient_by_enumeration_is_the_full_trajectory_gradient(base, monkeypatch):
    subsets = list(itertools.combinations(range(T), K))                            # the 6 outcomes of a row
    real_draw = importance.draw_states
    outcomes = []
    for i in range(len(subsets)):
        perms = [list(subsets[(i + b) % len(subsets)]) for b in range(B)]
        perms = [p + [s for s in range(T) if s not in p] for p in perms]          # update 1: the complement

        def draw(*a, perms=perms, **kw):  # the real updates (which positions update j takes), our permutations
            states, updates = real_draw(*a, **kw)
            assert states.shape == (T, B) and updates == [[0, 1], [2, 3]]
            return torch.tensor(perms).T.contiguous(), updates
        monkeypatch.setattr(importance, "draw_states", draw)
        grads, exp, ctx = rl_step_grads(base, monkeypatch, [*FLAGS, f"--trajectory_states={K}"])
        outcomes.append((perms, grads))
    pairs, count = naive_pair_gradients(base, exp, ctx)
    # Every window position the sampler filled with a token (not a predicted mask id) is revealed once.
    assert count == int((exp.batch.x[:, exp.batch.window_slice] != base[1].mask).sum()) > B * T
    assert exp.adv.abs().sum() > 0
    full = sum(pairs.values()) / count
    assert full.abs().max() > 0
    for perms, grads in outcomes:  # every outcome: each drawn state weighs T / K
        for j in range(MU):
            drawn = sum(pairs[b, s] for b in range(B) for s in perms[b][j * K:(j + 1) * K])
            close(grads[j], drawn * (T / K) / count)
    for j in range(MU):  # the average over the enumeration: the full trajectory's gradient, at every update
        close(sum(g[j] for _, g in outcomes) / len(outcomes), full)
    monkeypatch.setattr(importance, "draw_states", real_draw)
    every, _, _ = rl_step_grads(base, monkeypatch, FLAGS)  # K = 0: every state in every update
    for j in range(MU):
        close(every[j], full)


@pytest.mark.parametrize("k", [1, 3])
def test_the_normaliser_is_k_over_t_of_the_trajectory_tokens(base, monkeypatch, k):
    """The loss normaliser by hand: the trajectory's scored tokens (every window position the sampler
    filled with a token, not a predicted mask id), times K / T."""
    tok, ids, _ = base
    _, exp, _ = rl_step_grads(base, monkeypatch, [*FLAGS, f"--trajectory_states={k}"])
    tokens = int((exp.batch.x[:, exp.batch.window_slice] != ids.mask).sum())
    assert float(exp.views.norm) == pytest.approx(tokens * k / T)


def test_the_draw_is_seeded_by_the_step_and_the_global_index(base, monkeypatch):
    """The step's draw reaches draw_states with this step and the rows' global indices (draw_states itself
    depends on them alone: test_trajectory_states.py), and with a seed that follows --seed."""
    calls, real_draw = [], importance.draw_states
    monkeypatch.setattr(importance, "draw_states", lambda *a, **kw: calls.append(kw) or real_draw(*a, **kw))
    for seed in (0, 1):
        rl_step_grads(base, monkeypatch, [*FLAGS, f"--trajectory_states={K}", f"--seed={seed}"], step=5)
    assert [(c["step"], list(c["seq_index"])) for c in calls] == [(5, list(range(B)))] * 2
    assert calls[0]["seed"] != calls[1]["seed"]
