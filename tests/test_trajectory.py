"""The exact-trajectory estimator (--estimator=trajectory) through train.rl_step: every completion token is
scored under the state in which the sampler revealed it, with the current policy.

- At theta = pi_old (the first update) every ratio is exactly 1: the old and current passes score the same
  states with the same weights, by construction.
- With mu = 1 the gradient rl_step accumulates equals the gradient of a naive re-implementation of the
  objective: the decoding order taken from an independent rollout, one single-sequence forward per
  (sequence, token) on the state x^(s) = x with every position revealed at step s or later masked, the
  clipped surrogate and k3 term written out by hand, and the token mean.

    python -m pytest tests/test_trajectory.py -q
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import sample
import tasks

import train
from infra import budget, hf, load, toy
from model import Transformer


def fake_score(b, tok, ids, scorer=None, shaping="none", text_reward="answer"):
    """A deterministic reward in {0, 0.5, 1} per row, from the sampled window: groups get spread."""
    return (b.x[:, b.window_slice].sum(1) % 3).float() / 2


class GradRecorder:
    """An optimizer that records each parameter's gradient when asked to step, then steps."""

    def __init__(self, opt, params):
        self.opt, self.params, self.grads = opt, list(params), []

    def __getattr__(self, name):
        return getattr(self.opt, name)

    def step(self):
        self.grads.append([p.grad.clone() for p in self.params])
        self.opt.step()


@pytest.fixture(scope="module")
def base():
    tok = toy.build_tokenizer()
    ids = tasks.token_ids(tok)
    cfg = train.parse_args(["--preset=smoke", "--tasks=text,image"])
    model = Transformer(budget.scratch_config(cfg, **tasks.model_config_overrides(tok)))
    model.init_weights(torch.Generator().manual_seed(0))
    return tok, ids, model.eval()


def run_step(base, monkeypatch, task, *flags):
    """One trajectory rl_step on `task` from a fresh copy of the base model: (log, rollout, recorder, ctx)."""
    tok, ids, model = base
    monkeypatch.setattr(tasks, "score", fake_score)
    cfg = train.parse_args(["--preset=smoke", f"--tasks={task}", "--prompts_per_step=2", "--group_size=4",
                            "--estimator=trajectory", "--cfg_scale=0", *flags])
    policy, ref = copy.deepcopy(model), copy.deepcopy(model)
    params = hf.trainable_parameters(policy)
    opt = GradRecorder(torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99)), policy.parameters())
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    log, (r,) = train.rl_step(policy, ref, opt, ctx, 0, tasks.step_prompts(ctx, 0))
    return log, r, opt, ctx


@pytest.mark.parametrize("task", ["text", "image"])
def test_first_ratio_is_exactly_one(base, monkeypatch, task):
    log, r, _, _ = run_step(base, monkeypatch, task, "--mu=1")
    assert r.adv.abs().sum() > 0
    # Bit-exact by construction: the same weights score the same states in the same batches. (The logged
    # mean is a share-weighted sum over steps and chunks, which rounds at float64 precision.)
    assert log[f"{task}/ratio_max"] == 1.0 and log[f"{task}/clipfrac"] == 0.0
    assert log[f"{task}/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    # Every revealed window position is scored exactly once, at the step that revealed it (LLaDA's sampler
    # may leave a predicted mask id in place: that position was never revealed and is not scored).
    scored, b = r.views.loss_masks.sum(0), r.batch                                     # (B, L)
    revealed = torch.zeros_like(scored, dtype=torch.bool)
    revealed[:, b.window_slice] = b.x[:, b.window_slice] != tasks.token_ids(base[0]).mask
    assert torch.equal(scored, revealed.long())
    # Later updates score a moved policy: the ratios leave 1.
    log3, _, _, _ = run_step(base, monkeypatch, task, "--mu=3", "--lr=1e-2")
    assert log3[f"{task}/ratio_max"] > 1.0


@pytest.mark.parametrize("task", ["text", "image"])
def test_gradient_equals_a_naive_per_step_computation(base, monkeypatch, task):
    tok, ids, model = base
    _, r, opt, ctx = run_step(base, monkeypatch, task, "--mu=1", "--beta=0.05")
    cfg, b = ctx.cfg, r.batch
    # The decoding order from an independent rollout with rl_step's generators (same tokens, same order).
    fresh = tasks.make_batch(task, b.examples, tok, ids, cfg, ctx.device, with_targets=False)
    gens = [sample.generator("cpu", cfg.seed, "rollout", task, 0, i) for i in range(len(b.examples))]
    x, order = sample.rollout(model, fresh, ctx, gens, cfg.temperature, ctx.text_sampler)
    assert torch.equal(x.x, b.x)
    lo, hi = (ids.image_token_offset, ids.image_token_offset + ids.codebook_size) if task == "image" else (0, None)

    def token_logp(m, i, k):  # log pi_m(x_ik | x_i with every position revealed at order[i, k] or later masked)
        state = b.x[i].masked_fill(order[i] >= order[i, k], ids.mask)[None]
        logits = m(state, b.attention_mask[i][None])[0, k, lo:hi]
        return F.log_softmax(logits.float(), -1)[b.x[i, k] - lo]

    theta, old = copy.deepcopy(model).train(), copy.deepcopy(model).eval()
    terms = []
    for i in range(b.x.shape[0]):
        for k in order[i].ge(0).nonzero().flatten().tolist():
            lp = token_logp(theta, i, k)
            with torch.no_grad():
                lp_old = token_logp(old, i, k)
            ratio = torch.exp(lp - lp_old)
            A = r.adv[i]
            surrogate = -torch.minimum(ratio * A, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * A)
            d = lp_old - lp  # the reference is the initial model, here pi_old
            terms.append(surrogate + cfg.beta * (torch.exp(d) - d - 1))
    (torch.stack(terms).sum() / len(terms)).backward()
    for p, got in zip(theta.parameters(), opt.grads[0]):
        want = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * max(1.0, want.abs().max().item()))
    assert any(g.abs().max() > 0 for g in opt.grads[0])


def test_dry_run_counts_a_forward_per_decoding_step():
    """FLOPs at 8B: scoring takes `steps` forwards per sequence instead of mu, each update `steps`
    forward-backwards instead of one (infra/budget.flops)."""
    exact = train.main(["--preset=llada8b", "--dry_run"])
    traj = train.main(["--preset=llada8b", "--dry_run", "--estimator=trajectory"])
    cfg = train.parse_args(["--preset=llada8b", "--dry_run"])
    assert traj["flops"]["rollout"] == exact["flops"]["rollout"]
    assert traj["flops"]["scoring"] == pytest.approx(exact["flops"]["scoring"] * cfg.steps / cfg.mu)
    assert traj["flops"]["update"] == pytest.approx(exact["flops"]["update"] * cfg.steps)
