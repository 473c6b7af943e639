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
import math

import pytest
import torch
import torch.nn.functional as F

import importance
import sample
import tasks
import train
from infra import lora, rng


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
    opt = GradRecorder(torch.optim.AdamW(lora.trainable_parameters(policy), lr=cfg.lr), policy.parameters())
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


def naive_full_gradient(base, r, ctx) -> torch.Tensor:
    """The full trajectory objective's gradient at theta = pi_old, written out per (sequence, token): the
    decoding order from an independent rollout, one single-sequence forward on the state x^(s) (every
    position revealed at step s or later masked), the clipped surrogate and k3 term, the token mean."""
    tok, ids, model = base
    cfg, b = ctx.cfg, r.batch
    fresh = tasks.make_batch("text", b.examples, tok, ids, cfg, ctx.device, with_targets=False)
    gens = [rng.generator("cpu", cfg.seed, "rollout", "text", 0, i) for i in range(len(b.examples))]
    x, order, _ = tasks.rollout(model, fresh, ctx, gens, cfg.temperature, allow_fast=True)
    assert torch.equal(x.x, b.x)
    theta, old = copy.deepcopy(model).train(), copy.deepcopy(model).eval()

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
    """Tokens committed per step and row, counted by the sampler, against the decoding order it returns
    (each committed position once; a row's steps are the distinct steps in its order), in blocks of 4,
    greedy; on the random smoke model (100 tokens) the argmax has probability just above 1/100."""
    tok, ids, model = base
    cfg = train.parse_args(["--preset=smoke", "--tasks=text", "--block_length=4", f"--kv_cache={kv_cache}",
                            f"--threshold={threshold}"])
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    exs = tasks.make_batch("text", [tasks.make_example("text", __import__("random").Random(i), cfg, "test", 0.0)
                                    for i in range(6)], tok, ids, cfg, ctx.device, with_targets=False)
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    _, order, log = tasks.rollout(model, exs, ctx, gens, 0.0, allow_fast=True)
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
    # The exact sampler (evaluation, or no fast option) reports nothing.
    assert tasks.rollout(model, exs, ctx, gens, 0.0)[2] == {} and sample.fast_summary("text", None, ctx.device) == {}
