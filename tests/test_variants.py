"""Every non-default training path of train.rl_step, end to end at smoke size (seconds each): the d1 and
UniGRPO estimators, random reversing, per-sequence loss normalisation, chunked forwards and beta = 0.
Each test asserts something the named bug would break. Rewards come from a stand-in scorer (a function
of the sampled tokens), so that groups carry signal on an untrained model.

    python -m pytest tests/test_variants.py -q
"""
import copy

import pytest
import torch

import grpo
import tasks
import rewards
import train
from infra import lora, run
from model import Transformer


def fake_score(b, tok, ids, scorer=None, shaped=False):
    """A deterministic reward in {0, 0.5, 1} per row, from the sampled window: groups get spread."""
    return (b.x[:, b.window_slice].sum(1) % 3).float() / 2


@pytest.fixture(scope="module")
def base():
    tok = tasks.build_tokenizer()
    ids = tasks.token_ids(tok)
    cfg = train.parse_args(["--preset=smoke", "--tasks=text"])
    model = Transformer(run.scratch_config(cfg, **tasks.model_config_overrides(tok)))
    model.init_weights(torch.Generator().manual_seed(0))
    return tok, ids, model.eval()


def rl_step(base, monkeypatch, *flags):
    """One rl_step from a fresh copy of the base model: (log, rollouts, trained model)."""
    tok, ids, model = base
    monkeypatch.setattr(rewards, "score", fake_score)
    cfg = train.parse_args(["--preset=smoke", "--tasks=text", "--prompts_per_step=2", "--group_size=4", *flags])
    policy = copy.deepcopy(model)
    ref = copy.deepcopy(model) if cfg.beta > 0 else None
    opt = torch.optim.AdamW(lora.trainable_parameters(policy), lr=cfg.lr, betas=(0.9, 0.99))
    log, rolls = train.rl_step(policy, ref, opt, train.Ctx(cfg, tok, ids, torch.device("cpu"), {}), 0)
    return log, rolls, policy


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_logged_loss_is_the_objective(base, monkeypatch, norm):
    """With mu = 1 the update scores the policy pi_old itself (ratio 1), so the logged loss must equal
    grpo.policy_loss over the whole batch with this normalisation; chunks of 3 rows (an uneven split)
    must give the same number, which a wrong chunk weight would break."""
    for dbs in ("0", "3"):
        log, (r,), _ = rl_step(base, monkeypatch, "--num_iterations=1", f"--loss_norm={norm}",
                               f"--device_batch_size={dbs}")
        want, _ = grpo.policy_loss(r.logp_old[0], r.logp_old[0], r.adv, r.loss_masks[0], clip_eps=0.2,
                                   beta=0.01, logp_ref=r.logp_ref[0], norm=norm)
        assert r.adv.abs().sum() > 0, "the stand-in rewards must give the groups some signal"
        assert log["text/loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)


def test_device_batch_size_gives_the_same_update(base, monkeypatch):
    """Rollouts, scoring and updates in chunks of 2 rows: the same samples, log and weights as one pass."""
    one, _, w1 = rl_step(base, monkeypatch)
    two, _, w2 = rl_step(base, monkeypatch, "--device_batch_size=2")
    assert one.keys() == two.keys()
    for k in one:
        if k != "seconds" and not k.endswith("_s"):
            assert two[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6), k
    for a, b in zip(w1.parameters(), w2.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_beta_zero_skips_the_reference(base, monkeypatch):
    log, (r,), _ = rl_step(base, monkeypatch, "--beta=0")
    assert r.logp_ref is None and log["text/kl"] == 0.0


@pytest.mark.parametrize("mode", ["arlike", "random"])
def test_reversing_mode_reaches_the_masks(base, monkeypatch, mode):
    """AR-like reversing keeps the last completion token with probability 0, so it is masked in every
    iteration of every row; random reversing masks it with probability t_j < 1 only."""
    _, (r,), _ = rl_step(base, monkeypatch, f"--text_reversing={mode}", "--num_iterations=4")
    last = r.batch.prompt_len + r.batch.window - 1
    always = bool(r.loss_masks[:, :, last].all())
    assert always == (mode == "arlike")


def test_unigrpo_ratios_differ_per_sequence(base, monkeypatch):
    """UniGRPO draws its first ratio per sequence, so masked fractions differ across rows in iteration 0;
    the MaskGRPO schedule gives every row the same ratio (counts vary only by chance, much less)."""
    _, (r,), _ = rl_step(base, monkeypatch, "--estimator=unigrpo", "--num_iterations=2")
    counts = r.loss_masks[0].sum(1).float()
    assert counts.max() - counts.min() >= 3
    window = torch.zeros_like(r.loss_masks[0])
    window[:, r.batch.window_slice] = True
    assert not (r.loss_masks & ~window).any()  # only completion positions are ever scored


def test_reward_shaping_reaches_the_benchmark_rewards(monkeypatch):
    """--reward_shaping=official scores GSM8K with the official format + correctness terms (divided by
    their maximum, rewards.SHAPED); the default keeps the 0/1 correctness reward."""
    import rewards
    import tasks
    texts = ["<reasoning>3 + 4 = 7</reasoning> \\boxed{7}", "\\boxed{8}", "no answer"]
    monkeypatch.setattr(tasks, "decode_window", lambda b, tok, ids: texts)
    b = tasks.Batch("gsm8k", torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4), 2, 2,
                       examples=[{"prompt": "q", "answer": "7"}] * 3)
    assert rewards.score(b, None, None).tolist() == [1.0, 0.0, 0.0]
    assert rewards.score(b, None, None, shaped=True).tolist() == pytest.approx([1.0, 0.5 / 3, 0.0])


def test_d1_is_d1(base, monkeypatch):
    """--estimator=d1 as d1's diffu-GRPO trainer: the whole completion masked in the input, some prompt
    tokens masked (p 0.15), the loss mask ending at the first EOS, and advantages r - mean (no std)."""
    _, (r,), _ = rl_step(base, monkeypatch, "--estimator=d1", "--num_iterations=2")
    tok, ids, _ = base
    b = r.batch
    win = b.window_slice
    for j in range(2):
        assert (r.inputs[j][:, win] == ids.mask).all()
    assert (torch.stack(r.inputs)[:, :, : b.prompt_len] == ids.mask).any()
    tokens = b.x[:, win]
    is_eos = tokens == ids.eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], b.window, dtype=torch.long))
    want = torch.arange(b.window)[None] <= first[:, None]          # up to and including the first EOS
    assert (~is_eos.any(1)).any() or is_eos.sum() > is_eos.any(1).sum(), "need rows with EOS padding"
    for j in range(2):
        assert torch.equal(r.loss_masks[j][:, win], want)
    groups = r.rewards.view(-1, 4)
    assert torch.allclose(r.adv.view(-1, 4), groups - groups.mean(1, keepdim=True), atol=1e-6)
    # The same flags with --adv_std=on divide by the group std again.
    _, (s,), _ = rl_step(base, monkeypatch, "--estimator=d1", "--num_iterations=2", "--adv_std=on")
    assert not torch.allclose(s.adv, r.adv)
