"""--trajectory_states=K: the trajectory estimator scoring K decoding states per update (importance.draw_states),
weighted T/K so that the update is unbiased; and the step measurements added beside it (CPU seconds per
phase, what fast rollouts commit per step).

- K >= T (every state) gives exactly the gradient of K = 0, the full trajectory.
- The first ratio of an update is exactly 1: old and current passes score the same drawn states.
- Over draws, the mean gradient of an update is the full trajectory's gradient, computed here by a naive
  per-(sequence, token) re-implementation, within its standard error; without the T/K weight it is not.
- The draw of a row depends on its global index only; the updates partition the states.

    python -m pytest tests/test_trajectory_states.py -q
"""
import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import importance
import sample
import tasks
import train
from infra import hf


# The tiny model, the spread-out reward and the gradient recorder of the full-trajectory tests.
from test_trajectory import GradRecorder, base, fake_score  # noqa: E402,F401 (base: a fixture)


FLAGS = ["--preset=smoke", "--tasks=text", "--prompts_per_step=2", "--group_size=4", "--estimator=trajectory",
         "--grad_clip=1e9"]  # no clipping: an unbiased loss gives an unbiased gradient only before it


def run_step(base, monkeypatch, *flags):
    """One rl_step from a fresh copy of the base model: (log, rollout, recorded gradients, ctx)."""
    tok, ids, model = base
    monkeypatch.setattr(tasks, "score", fake_score)
    cfg = train.parse_args([*FLAGS, *flags])
    policy, ref = copy.deepcopy(model), copy.deepcopy(model)
    opt = GradRecorder(torch.optim.AdamW(hf.trainable_parameters(policy), lr=cfg.lr), policy.parameters())
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    log, (r,) = train.rl_step(policy, ref, opt, ctx, 0, tasks.step_prompts(ctx, 0))
    return log, r, opt.grads, ctx


def flat(grads) -> torch.Tensor:
    return torch.cat([g.flatten() for g in grads]).double()


def test_every_state_gives_the_full_trajectory_gradient_exactly(base, monkeypatch):
    _, full, want, _ = run_step(base, monkeypatch, "--mu=2", "--lr=1e-2")
    T = len(full.views.inputs)
    for k in (T,):  # K >= T draws every state (test_draws_... checks the clamp)
        _, r, got, _ = run_step(base, monkeypatch, "--mu=2", "--lr=1e-2", f"--trajectory_states={k}")
        assert r.views.updates == [list(range(T))] * 2 and len(r.views.inputs) == T
        for g_update, w_update in zip(got, want, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(g_update, w_update, strict=True))


def test_first_ratio_is_exactly_one(base, monkeypatch):
    log, r, _, _ = run_step(base, monkeypatch, "--mu=1", "--trajectory_states=2")
    assert r.adv.abs().sum() > 0 and len(r.views.inputs) == 2
    assert log["text/ratio_max"] == 1.0 and log["text/clipfrac"] == 0.0
    # ratio_mean is the mean over the tokens the drawn states score (the loss weighs them by T / K instead)
    assert log["text/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    log3, _, _, _ = run_step(base, monkeypatch, "--mu=3", "--trajectory_states=2", "--lr=1e-2")
    assert log3["text/ratio_max"] > 1.0  # later updates score a moved policy


def replayed_order(base, b, ctx):
    """The decoding order of step 0's rollouts from an independent rollout of the same prompts (which must
    reproduce b's tokens), and two copies of the model: theta (train mode) and pi_old (eval mode)."""
    tok, ids, model = base
    fresh = tasks.make_batch("text", b.examples, tok, ids, ctx.cfg, ctx.device, with_targets=False)
    gens = [sample.generator("cpu", ctx.cfg.seed, "rollout", "text", 0, i) for i in range(len(b.examples))]
    x, order = sample.rollout(model, fresh, ctx, gens, ctx.cfg.temperature, ctx.text_sampler)
    assert torch.equal(x.x, b.x)
    return order, copy.deepcopy(model).train(), copy.deepcopy(model).eval()


def naive_full_gradient(base, r, ctx) -> torch.Tensor:
    """The full trajectory objective's gradient at theta = pi_old, written out per (sequence, token): the
    decoding order from an independent rollout, one single-sequence forward on the state x^(s) (every
    position revealed at step s or later masked), the clipped surrogate and k3 term, the token mean."""
    ids, cfg, b = base[1], ctx.cfg, r.batch
    order, theta, old = replayed_order(base, b, ctx)

    def token_logp(m, i, k):
        state = b.x[i].masked_fill(order[i] >= order[i, k], ids.mask)[None]
        return F.log_softmax(m(state, b.attention_mask[i][None])[0, k].float(), -1)[b.x[i, k]]

    terms = []
    for i in range(b.x.shape[0]):
        for k in order[i].ge(0).nonzero().flatten().tolist():
            lp = token_logp(theta, i, k)
            with torch.no_grad():
                lp_old = token_logp(old, i, k)
            ratio, A = torch.exp(lp - lp_old), r.adv[i]
            d = lp_old - lp
            terms.append(-torch.minimum(ratio * A, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * A)
                         + cfg.beta * (torch.exp(d) - d - 1))
    (torch.stack(terms).sum() / len(terms)).backward()
    return flat([torch.zeros_like(p) if p.grad is None else p.grad for p in theta.parameters()])


def gradients_over_draws(base, monkeypatch, k, draws):
    """Update 0's gradient with `draws` different state draws of one rollout (the draw's seed is offset)."""
    draw_of = importance.draw_states
    out = []
    for n in range(draws):
        monkeypatch.setattr(importance, "draw_states", lambda *a, seed, n=n, **kw: draw_of(*a, seed=seed + 1000 * n, **kw))
        _, r, grads, ctx = run_step(base, monkeypatch, "--mu=1", f"--trajectory_states={k}")
        out.append(flat(grads[0]))
    return torch.stack(out), r, ctx


@pytest.mark.slow  # 48 RL steps: about 15 s on an idle core
def test_expected_gradient_over_draws_is_the_full_trajectory_gradient(base, monkeypatch):
    k, draws = 3, 48
    g, r, ctx = gradients_over_draws(base, monkeypatch, k, draws)
    T = 12  # the smoke preset's decoding steps, one token each: every state reveals something
    assert r.views.updates == [[0, 1, 2]] and r.views.loss_masks.shape[0] == k
    full = naive_full_gradient(base, r, ctx)
    assert len({tuple(x.tolist()) for x in g[:, :50]}) > draws // 2  # the draws differ
    # Projections on the full gradient's direction and on two fixed random directions.
    dirs = torch.cat([(full / full.norm())[None], torch.randn(2, full.numel(), generator=torch.Generator().manual_seed(0),
                                                                dtype=torch.float64)])
    proj, want = g @ dirs.T, dirs @ full                                        # (draws, 3), (3,)
    se = proj.std(0) / math.sqrt(draws)
    assert ((proj.mean(0) - want).abs() < 4 * se).all(), (proj.mean(0), want, se)
    # The weight matters: without T/K the mean is K/T of the full gradient, many standard errors off.
    assert (proj[:, 0].mean() * k / T - want[0]).abs() > 8 * se[0]


def test_draws_depend_on_the_global_index_only_and_partition_the_states():
    kw = dict(seed=7, step=3)
    states, updates = importance.draw_states(12, 3, 4, seq_index=[5, 9, 2], **kw)
    assert states.shape == (12, 3) and updates == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert all(sorted(states[:, b].tolist()) == list(range(12)) for b in range(3))  # each state once per step
    alone, _ = importance.draw_states(12, 3, 4, seq_index=[9], **kw)
    assert torch.equal(alone[:, 0], states[:, 1])                                   # batch mates change nothing
    other, _ = importance.draw_states(12, 3, 4, seq_index=[9], seed=7, step=4)
    assert not torch.equal(other, alone)
    # mu K < T: mu K distinct states; mu K > T: views wrap, each state used floor or ceil(mu K / T) times.
    s2, u2 = importance.draw_states(12, 2, 4, seq_index=[1], **kw)
    assert s2.shape == (8, 1) and len(set(s2[:, 0].tolist())) == 8
    s5, u5 = importance.draw_states(12, 5, 4, seq_index=[1], **kw)
    uses = torch.bincount(s5[torch.tensor(u5).flatten(), 0], minlength=12)
    assert s5.shape == (12, 1) and set(uses.tolist()) == {1, 2} and uses.sum() == 20
    assert all(len(set(s5[v, 0].tolist() for v in u)) == 5 for u in u5)  # no repeat within an update
    s12, u12 = importance.draw_states(12, 15, 2, seq_index=[1], **kw)  # K > T: every state, in order
    assert s12[:, 0].tolist() == list(range(12)) and u12 == [list(range(12))] * 2


@pytest.mark.parametrize("argv, message", [
    (["--trajectory_states=2"], "trajectory_states (2) draws decoding states of --estimator=trajectory"),
    (["--estimator=trajectory", "--trajectory_states=-1"], "trajectory_states (-1) must be >= 0"),
])
def test_bad_trajectory_states(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train.parse_args(["--preset=smoke", *argv])


def test_dry_run_prints_the_flops_next_to_maskgrpo(capsys):
    """At 8B (128 decoding steps, mu = 12), K = 12: each update scores 12 states instead of one mask, and the
    old/ref passes score min(12 x 12, 128) = 128 states instead of 12 masks (infra/budget.flops)."""
    exact = train.main(["--preset=llada8b", "--dry_run"])
    capsys.readouterr()
    traj = train.main(["--preset=llada8b", "--dry_run", "--estimator=trajectory", "--trajectory_states=12"])
    out = capsys.readouterr().out
    assert traj["flops"]["rollout"] == exact["flops"]["rollout"]
    assert traj["flops"]["scoring"] == pytest.approx(exact["flops"]["scoring"] * 128 / 12)
    assert traj["flops"]["update"] == pytest.approx(exact["flops"]["update"] * 12)
    line = next(s for s in out.splitlines() if s.startswith("trajectory estimator"))
    assert f"{traj['flops']['step']:.2e}" in line and f"{exact['flops']['step']:.2e} for MaskGRPO" in line


@pytest.mark.parametrize("kv_cache, threshold", [("dual", 0.0), ("none", 0.0101), ("prefix", 0.0101)])
def test_fast_rollout_statistics_match_the_decoding_order(base, kv_cache, threshold):
    """Tokens committed per step and row, counted by FastSampler over two calls, against the decoding orders
    they return (each committed position once; a row's steps are the distinct steps in its order), in blocks
    of 4, greedy; on the random smoke model (100 tokens) the argmax has probability just above 1/100."""
    tok, ids, model = base
    cfg = train.parse_args(["--preset=smoke", "--tasks=text", "--block_length=4", f"--kv_cache={kv_cache}",
                            f"--threshold={threshold}"])
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    exs = tasks.make_batch("text", [tasks.make_example("text", __import__("random").Random(i), cfg, "test", 0.0)
                                    for i in range(6)], tok, ids, cfg, ctx.device, with_targets=False)
    sampler, P = sample.FastSampler(cfg.kv_cache, cfg.threshold), exs.prompt_len
    order = torch.cat([sampler(model, exs.x[rows, :P], gen_length=exs.window, block_length=cfg.block_length,
                               steps=cfg.steps, mask_id=ids.mask, attention_mask=exs.attention_mask[rows, :P],
                               return_order=True)[1] for rows in (slice(0, 4), slice(4, 6))])  # two calls, summed
    log = sampler.take_log(ctx.device)
    window = order[:, exs.window_slice]
    steps = [len(set(row.tolist())) for row in window]
    per_step = [int((row == s).sum()) for row in window for s in set(row.tolist())]
    assert log["text/committed_per_step"] == pytest.approx(window.numel() / sum(steps))
    assert log["text/committed_per_step_max"] == max(per_step)
    if threshold == 0:  # the fixed schedule: gen_length / steps = 1 token per step
        assert max(per_step) == 1 and sum(steps) == window.numel()
    else:
        assert max(per_step) > 1
    assert 0 < log["text/committed_conf"] <= 1


# -----------------------------------------------------------------------------
# --trajectory_states=K at K < T, mu >= 2 and several rows in several chunks: the exact expected gradient by
# enumeration (the fast, exact sibling of the slow statistical test above).
#
# The setting: T = 4 decoding states (12 tokens, 3 per step), K = 2, mu = 2, 8 rows scored 3 at a time. The
# draw of a row is a permutation of its T states; update j scores positions jK .. jK+K-1 of it. The
# gradient of an update is linear in which (row, state) pairs it scores, so its expectation over the draw
# depends only on each pair's probability of being scored, K/T. Enumerating the C(4, 2) = 6 subsets (row b
# takes subset (i + b) mod 6 in outcome i, the complement in update 1) gives every pair exactly that
# probability; the average gradient over the 6 outcomes is then exactly the expected one, and must equal the
# full trajectory's gradient. The optimiser does not step (a recorder), so both updates are at theta = pi_old.
#
# The expectation comes from a naive re-implementation: one single-sequence forward and backward per (row,
# revealed token) on the state x^(s) (every position revealed at step s or later masked), the clipped
# surrogate and k3 term written out, and the token mean over the whole trajectory; a drawn state weighs T/K.
#


T, K, MU, B = 4, 2, 2, 8
MU_FLAG = "--mu"
EXACT_FLAGS = ["--preset=smoke", "--tasks=text", "--prompts_per_step=2", "--group_size=4",
               "--estimator=trajectory", "--gen_length=12", "--block_length=12", f"--steps={T}", f"{MU_FLAG}={MU}",
               "--grad_clip=1e9", "--device_batch_size=3", "--beta=0.05"]


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
    opt = Recorder(hf.trainable_parameters(policy))
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    _, (exp,) = train.rl_step(policy, ref, opt, ctx, step, tasks.step_prompts(ctx, step))
    return opt.grads, exp, ctx


def naive_pair_gradients(base, exp, ctx):
    """{(row, state): gradient of the sum of that row's terms revealed at that state}, and the number of
    scored tokens over the whole trajectory; the decoding order from an independent rollout."""
    ids, cfg, b = base[1], ctx.cfg, exp.batch
    order, theta, old = replayed_order(base, b, ctx)
    params = hf.trainable_parameters(theta)

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
        grads, exp, ctx = rl_step_grads(base, monkeypatch, [*EXACT_FLAGS, f"--trajectory_states={K}"])
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
    every, _, _ = rl_step_grads(base, monkeypatch, EXACT_FLAGS)  # K = 0: every state in every update
    for j in range(MU):
        close(every[j], full)


@pytest.mark.parametrize("k", [1, 3])
def test_the_normaliser_is_k_over_t_of_the_trajectory_tokens(base, monkeypatch, k):
    """The loss normaliser by hand: the trajectory's scored tokens (every window position the sampler
    filled with a token, not a predicted mask id), times K / T."""
    tok, ids, _ = base
    _, exp, _ = rl_step_grads(base, monkeypatch, [*EXACT_FLAGS, f"--trajectory_states={k}"])
    tokens = int((exp.batch.x[:, exp.batch.window_slice] != ids.mask).sum())
    assert float(exp.views.norm) == pytest.approx(tokens * k / T)


def test_the_draw_is_seeded_by_the_step_and_the_global_index(base, monkeypatch):
    """The step's draw reaches draw_states with this step and the rows' global indices (draw_states itself
    depends on them alone: the tests above), and with a seed that follows --seed."""
    calls, real_draw = [], importance.draw_states
    monkeypatch.setattr(importance, "draw_states", lambda *a, **kw: calls.append(kw) or real_draw(*a, **kw))
    for seed in (0, 1):
        rl_step_grads(base, monkeypatch, [*EXACT_FLAGS, f"--trajectory_states={K}", f"--seed={seed}"], step=5)
    assert [(c["step"], list(c["seq_index"])) for c in calls] == [(5, list(range(B)))] * 2
    assert calls[0]["seed"] != calls[1]["seed"]
