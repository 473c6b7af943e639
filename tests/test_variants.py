"""Every non-default training path of train.rl_step, end to end at smoke size (seconds each): the d1 and
UniGRPO estimators, random reversing, per-sequence loss normalisation, chunked forwards and beta = 0.
Each test asserts something the named bug would break. Rewards come from a stand-in scorer (a function
of the sampled tokens), so that groups carry signal on an untrained model.

    python -m pytest tests/test_variants.py -q
"""
import copy
import math

import pytest
import torch

import tasks

import train
from infra import budget, data, hf, load, toy
from model import Transformer


def fake_score(b, tok, ids, scorer=None, shaping="none", text_reward="answer"):
    """A deterministic reward in {0, 0.5, 1} per row, from the sampled window: groups get spread."""
    return (b.x[:, b.window_slice].sum(1) % 3).float() / 2


@pytest.fixture(scope="module")
def base():
    """A random toy-vocabulary model in float64: tests here compare runs whose passes split the batch
    differently, and float32 kernels of other shapes round differently enough (~1e-7) to flip a near-tie in
    the sampler on some CPU; at float64 the same sequences come out on any CPU and thread count."""
    tok = toy.build_tokenizer()
    ids = tasks.token_ids(tok)
    cfg = train.parse_args(["--preset=smoke", "--tasks=text"])
    model = Transformer(budget.scratch_config(cfg, **tasks.model_config_overrides(tok)))
    model.init_weights(torch.Generator().manual_seed(0))
    return tok, ids, model.double().eval()


def rl_step(base, monkeypatch, *flags, grads=None):
    """One rl_step from a fresh copy of the base model: (log, rollouts, trained model). grads: a list that
    receives, for each inner update, the gradients the optimizer is about to apply."""
    tok, ids, model = base
    monkeypatch.setattr(tasks, "score", fake_score)
    cfg = train.parse_args(["--preset=smoke", "--tasks=text", "--prompts_per_step=2", "--group_size=4", *flags])
    policy = copy.deepcopy(model)
    ref = copy.deepcopy(model) if cfg.beta > 0 else None
    opt = torch.optim.AdamW(hf.trainable_parameters(policy), lr=cfg.lr, betas=(0.9, 0.99))
    if grads is not None:
        opt.register_step_pre_hook(lambda o, a, k: grads.append([p.grad.clone() for p in policy.parameters()]))
    ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
    log, rolls = train.rl_step(policy, ref, opt, ctx, 0, tasks.step_prompts(ctx, 0))
    return log, rolls, policy


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_logged_loss_is_the_objective(base, monkeypatch, norm):
    """With mu = 1 the update scores pi_old itself on pi_old's input: every ratio is 1 and, at the first
    step, the policy is the reference, so each token's term is -min(1 A, clip(1) A) + beta k3(0) = -A_i.
    By hand, the loss is then -sum_i n_i A_i / sum_i n_i with "token" normalisation (n_i: tokens of sequence
    i scored in the iteration) and -mean_{i: n_i > 0} A_i with "sequence"; A_i = (R_i - mean) / (std + 1e-4)
    per group. Chunks of 3 rows (an uneven split) must give the same number, which a wrong chunk weight
    would break."""
    for dbs in ("0", "3"):
        log, (r,), _ = rl_step(base, monkeypatch, "--mu=1", f"--loss_norm={norm}",
                               f"--device_batch_size={dbs}")
        adv = []
        for g in r.rewards.view(-1, 4).tolist():
            mean = sum(g) / 4
            std = math.sqrt(sum((v - mean) ** 2 for v in g) / 3)
            adv += [0.0 if max(g) == min(g) else (v - mean) / (std + 1e-4) for v in g]
        n = r.views.loss_masks[0].sum(1).tolist()
        assert any(adv) and all(n), "the stand-in rewards must give the groups some signal"
        want = -sum(a * k for a, k in zip(adv, n)) / sum(n) if norm == "token" else -sum(adv) / len(adv)
        assert log["text/loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_device_batch_size_gives_the_same_update(base, monkeypatch):
    """Rollouts, scoring and updates in chunks of 2 rows: the same samples and log as one pass, and the same
    gradients before every optimizer step. Gradients, not the weights after AdamW: AdamW divides by
    sqrt(v), which magnifies rounding differences in gradients near zero up to a whole step (~lr), so its
    weights agree only to about lr, while the gradients agree to float rounding, relative to their size."""
    g1, g2 = [], []
    one, (r1,), w1 = rl_step(base, monkeypatch, grads=g1)
    two, (r2,), w2 = rl_step(base, monkeypatch, "--device_batch_size=2", grads=g2)
    assert torch.equal(r1.batch.x, r2.batch.x)  # the same rollouts (float64 model: no near-tie can flip)
    assert one.keys() == two.keys()
    for k in one:
        if k != "seconds" and not k.endswith("_s"):
            assert two[k] == pytest.approx(one[k], rel=1e-4, abs=1e-6), k
    assert len(g1) == len(g2) == 2
    for j, (a, b) in enumerate(zip(g1, g2)):
        top = max(float(g.abs().max()) for g in a)
        assert top > 0
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5 * top, msg=f"update {j}")
    lr = train.parse_args(["--preset=smoke"]).lr
    for a, b in zip(w1.parameters(), w2.parameters()):  # each of the 2 AdamW steps moves a weight by <~ lr
        torch.testing.assert_close(a, b, rtol=0, atol=4 * lr)


def test_beta_zero_skips_the_reference(base, monkeypatch):
    log, (r,), _ = rl_step(base, monkeypatch, "--beta=0")
    assert r.logp_ref is None and log["text/kl"] == 0.0


@pytest.mark.parametrize("mode", ["arlike", "random"])
def test_reversing_mode_reaches_the_masks(base, monkeypatch, mode):
    """AR-like reversing keeps the last completion token with probability 0, so it is masked in every
    iteration of every row; random reversing masks it with probability t_j < 1 only."""
    _, (r,), _ = rl_step(base, monkeypatch, f"--text_reversing={mode}", "--mu=4")
    last = r.batch.prompt_len + r.batch.window - 1
    always = bool(r.views.loss_masks[:, :, last].all())
    assert always == (mode == "arlike")


def test_unigrpo_ratios_differ_per_sequence(base, monkeypatch):
    """UniGRPO draws its first ratio per sequence, so masked fractions differ across rows in iteration 0;
    the MaskGRPO schedule gives every row the same ratio (counts vary only by chance, much less)."""
    _, (r,), _ = rl_step(base, monkeypatch, "--estimator=unigrpo", "--mu=2")
    counts = r.views.loss_masks[0].sum(1).float()
    assert counts.max() - counts.min() >= 3
    window = torch.zeros_like(r.views.loss_masks[0])
    window[:, r.batch.window_slice] = True
    assert not (r.views.loss_masks & ~window).any()  # only completion positions are ever scored


def test_reward_shaping_reaches_the_benchmark_rewards(monkeypatch):
    """--reward_shaping=official scores GSM8K with the official format + correctness terms (divided by
    their maximum, rewards.SHAPED); the default keeps the 0/1 correctness reward."""
    texts = ["<reasoning>3 + 4 = 7</reasoning> \\boxed{7}", "\\boxed{8}", "no answer"]
    monkeypatch.setattr(tasks, "decode_window", lambda b, tok, ids: texts)
    b = tasks.Batch("gsm8k", torch.zeros(3, 4, dtype=torch.long), torch.ones(3, 4), 2, 2,
                       examples=[{"prompt": "q", "answer": "7"}] * 3)
    assert tasks.score(b, tasks.verifier("gsm8k"), None, None).tolist() == [1.0, 0.0, 0.0]
    official = tasks.verifier("gsm8k", reward_shaping="official")
    assert tasks.score(b, official, None, None).tolist() == pytest.approx([1.0, 0.5 / 3, 0.0])


def test_text_reward_setting_reaches_rollouts_and_evaluation(base, monkeypatch):
    """--text_reward picks the toy text verifier for the RL rewards and for the held-out scores alike: a
    completion with a wrong step and the right box earns 1 under `answer` and 0 under `solution`."""
    tok, ids, model = base
    solution = "4 + 3 = 7 , 7 - 5 = 2 . \\boxed{2}"
    example = {"prompt": "amy has 4 pens", "answer": "2", "completion": solution, "solution": solution}
    monkeypatch.setattr(tasks, "decode_window", lambda b, tok, ids: ["4 + 3 = 8 , 8 - 5 = 2 . \\boxed{2}"] * len(b.x))
    monkeypatch.setattr(data, "eval_examples", lambda task, cfg, datasets: [example] * 3)
    monkeypatch.setattr(tasks, "draw_prompts", lambda task, cfg, step, datasets: [example] * cfg.prompts_per_step)
    for name, want in (("answer", 1.0), ("solution", 0.0)):
        cfg = train.parse_args(["--preset=smoke", "--tasks=text", "--prompts_per_step=2", "--group_size=4",
                                "--mu=1", "--gen_length=16", "--block_length=16", "--steps=16",
                                f"--text_reward={name}"])
        ctx = tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {})
        assert data.evaluate(copy.deepcopy(model), ctx, "text", 0.0) == want
        policy = copy.deepcopy(model)
        opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr)
        _, (r,) = train.rl_step(policy, copy.deepcopy(model), opt, ctx, 0, tasks.step_prompts(ctx, 0))
        assert r.rewards.tolist() == [want] * 8


def test_evaluate_prompt_means_average_each_prompts_samples(base):
    """data.evaluate's prompt_means: held-out prompt j's mean over its eval_samples completions, which are
    rows j * k .. j * k + k - 1 of its records (toy images: rewards are fractions, so prompts differ)."""
    tok, ids, model = base
    cfg = train.parse_args(["--preset=smoke", "--tasks=image", "--eval_prompts=6", "--eval_samples=3"])
    records, means = [], []
    mean = data.evaluate(model, tasks.Ctx(cfg, tok, ids, torch.device("cpu"), {}), "image", 1.0, records,
                          prompt_means=means)
    want = [sum(r["reward"] for r in records if r["index"] // 3 == j) / 3 for j in range(6)]
    assert len(records) == 18 and means == pytest.approx(want, abs=1e-12) and len(set(want)) > 1
    assert mean == pytest.approx(sum(want) / 6, rel=1e-6)  # the mean sums float32 rewards


def test_d1_is_d1(base, monkeypatch):
    """--estimator=d1 as d1's diffu-GRPO trainer: the whole completion masked in the input, some prompt
    tokens masked (p 0.15), the loss mask ending at the first EOS, and advantages r - mean (no std)."""
    _, (r,), _ = rl_step(base, monkeypatch, "--estimator=d1", "--mu=2")
    tok, ids, _ = base
    b = r.batch
    win = b.window_slice
    for j in range(2):
        assert (r.views.inputs[j][:, win] == ids.mask).all()
    assert (torch.stack(r.views.inputs)[:, :, : b.prompt_len] == ids.mask).any()
    tokens = b.x[:, win]
    is_eos = tokens == ids.eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], b.window, dtype=torch.long))
    want = torch.arange(b.window)[None] <= first[:, None]          # up to and including the first EOS
    assert (~is_eos.any(1)).any() or is_eos.sum() > is_eos.any(1).sum(), "need rows with EOS padding"
    for j in range(2):
        assert torch.equal(r.views.loss_masks[j][:, win], want)
    groups = r.rewards.view(-1, 4)
    assert torch.allclose(r.adv.view(-1, 4), groups - groups.mean(1, keepdim=True), atol=1e-6)
    # The same flags with --adv_std=on divide by the group std again.
    _, (s,), _ = rl_step(base, monkeypatch, "--estimator=d1", "--mu=2", "--adv_std=on")
    assert not torch.allclose(s.adv, r.adv)
