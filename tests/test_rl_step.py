"""The RL step end to end, checked against quantities computed here from the paper's equations.

Every test drives train.rl_step (through `run_step`, the one helper that knows its signature) on a tiny
random checkpoint loaded through infra/load.load_policy, with mu >= 3 inner iterations, text and image.
Expected values never come from the code under test: log-probs are a plain log_softmax of the model's
logits written below (over the image codes for image positions), advantages are GRPO's
(R - mean) / (std + eps) per group, and the loss is MaskGRPO's clipped per-token surrogate plus beta times
the k3 KL (arXiv:2510.02880 Eqs. 9-11, token normalisation as the official code), differentiated by
autograd on a copy of the weights the update saw. The SFT loss is in tests/test_diffusion_loss.py, the
settings a step reads in tests/test_step_config.py.

    python -m pytest tests/test_rl_step.py -q
"""
import copy
import functools
import math
import random
from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import grpo
import rewards
import tasks
import train
from infra import budget, hf, load, toy
from model import Transformer
from infra import hf


CPU = torch.device("cpu")


# -----------------------------------------------------------------------------------------------------
# the two helpers that touch train.py / infra: building a policy, and running one RL step


def save_tiny_checkpoint(path, seed=0):
    """A randomly initialised toy-vocabulary model (d 32, 2 layers) and the toy tokenizer, written as a
    checkpoint directory that --init_from can load, as a pretrained LLaDA / MMaDA would be."""
    tok = toy.build_tokenizer()
    cfg = train.parse_args(["--preset=smoke"])
    model = Transformer(budget.scratch_config(cfg, **tasks.model_config_overrides(tok)))
    model.init_weights(torch.Generator().manual_seed(seed))
    hf.save_pretrained(model, path)
    tok.save(str(path / "tokenizer.json"))
    return path


def build(ckpt, *flags, float64=False, device=CPU, dtype=torch.float32):
    """(cfg, policy, ref, opt, tok, ids) exactly as train.main sets them up, from `ckpt` and smoke-preset flags.
    float64: cast policy and reference to float64, for tests that compare token choices across batch
    compositions (float32 kernels of other row counts round differently and can flip a near-tie).
    device / dtype: as train.main's setup() returns them (tests/test_cuda.py passes cuda and bfloat16)."""
    cfg = train.parse_args(["--preset=smoke", f"--init_from={ckpt}", "--prompts_per_step=2", "--group_size=4",
                            "--mu=3", *flags])
    policy, ref, tok, ids, _ = load.load_policy(cfg, device, dtype, sft=None)
    if float64:
        policy = policy.double()
        ref = None if ref is None else ref.double()
    opt = torch.optim.AdamW(hf.trainable_parameters(policy), lr=cfg.lr, betas=(0.9, 0.99),
                            weight_decay=cfg.weight_decay)
    return cfg, policy, ref, opt, tok, ids


def fake_score(b, verify, tok, ids, scorer=None):
    """A reward in {0, 0.5, 1} from the sampled window: an untrained model's groups then carry signal."""
    return (b.x[:, b.window_slice].sum(1) % 3).float() / 2


@dataclass
class Update:
    """What inner iteration j of a step saw: its logged statistics, the gradients the optimizer was about
    to apply (after clipping), and the weights they were computed at."""
    stats: dict
    grads: dict = field(default_factory=dict)
    weights: nn.Module | None = None
    j: int = 0


def run_step(cfg, policy, ref, opt, tok, ids, step, *, prompts=None, device=CPU, keep_weights=True):
    """One train.rl_step at `step`: (log, rollouts, [Update per inner iteration]). prompts: a fixed list
    of examples used instead of the step's own draw (to see the rollout noise alone). keep_weights: copy
    the weights each update saw (not possible for an FSDP2 module, which cannot be deep-copied)."""
    updates = []

    def before_step(optimizer, args, kwargs):
        # The optimizer runs after backward and clipping, before the weights move: the state of update j.
        u = updates[-1]
        u.weights = copy.deepcopy(policy) if keep_weights else None
        u.grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}

    def spy_backward(model, e, j, ctx):  # once per task and inner update, after its backward passes
        s = real_backward(model, e, j, ctx)
        if not updates or updates[-1].j != j:
            updates.append(Update(stats={}, j=j))
        # s: this update's sums over the batch (one process: every rank's); as one update's statistics
        updates[-1].stats.update({f"{e.batch.task}/{k}": v for k, v in train.step_stats([s]).items()})
        return s

    real_backward, real_score, real_draw = train.backward_loss, tasks.score, tasks.draw_prompts
    handle = opt.register_step_pre_hook(before_step)
    train.backward_loss, tasks.score = spy_backward, fake_score
    if prompts is not None:
        tasks.draw_prompts = lambda task, cfg_, step_, datasets: prompts
    try:
        ctx = tasks.Ctx(cfg, tok, ids, device, {})
        log, rolls = train.rl_step(policy, ref, opt, ctx, step, tasks.step_prompts(ctx, step))
    finally:
        train.backward_loss, tasks.score, tasks.draw_prompts = real_backward, real_score, real_draw
        handle.remove()
    return log, rolls, updates


# -----------------------------------------------------------------------------------------------------
# independent re-implementations of the paper's quantities


def naive_logp(model, r, j):
    """log pi(o_k | c, o^{t_j}) at the positions scored in iteration j, 0 elsewhere: (B, L) float32. Image
    positions are scored over the codebook columns only, since the sampler draws codes only (MMaDA)."""
    b = r.batch
    with torch.no_grad():
        logits = model(r.views.inputs[j], b.attention_mask).float()                      # (B, L, V)
    lo, hi = (0, logits.shape[-1]) if b.task == "text" else image_columns()
    lp = F.log_softmax(logits[..., lo:hi], dim=-1)                                 # (B, L, V')
    tgt = (b.x - lo).clamp(0, hi - lo - 1)                                         # (B, L)
    out = lp.gather(-1, tgt[..., None])[..., 0]
    return torch.where(r.views.loss_masks[j], out, torch.zeros_like(out))


@functools.cache
def image_columns():
    # The image codes: the toy tokenizer appends them after the text vocabulary (tasks.py), as MMaDA appends
    # its VQ codes; a window position holds offset + code.
    ids = tasks.token_ids(toy.build_tokenizer())
    return ids.image_token_offset, ids.image_token_offset + toy.CODEBOOK_SIZE


def naive_advantages(rewards, G):
    """GRPO (arXiv:2402.03300 §4.1.2): (R - mean) / (std + 1e-4) per group of G, unbiased std; exactly 0
    for a group whose rewards are all equal."""
    out = []
    for g in rewards.view(-1, G).tolist():
        mean = sum(g) / G
        std = math.sqrt(sum((v - mean) ** 2 for v in g) / (G - 1))
        out += [0.0 if max(g) == min(g) else (v - mean) / (std + 1e-4) for v in g]
    return torch.tensor(out)


def naive_loss(logp, old, ref, adv, mask, eps, beta):
    """MaskGRPO's per-token objective (Eqs. 9-11; the official code's PPO clip and token mean):
    -min(rho A, clip(rho, 1 - eps, 1 + eps) A) + beta (exp(ref - logp) - (ref - logp) - 1), averaged over
    the tokens masked in this iteration."""
    terms = []
    for b, k in mask.nonzero().tolist():
        rho = torch.exp(logp[b, k] - old[b, k])
        A = adv[b]
        term = -torch.minimum(rho * A, rho.clamp(1 - eps, 1 + eps) * A)
        d = ref[b, k] - logp[b, k]
        terms.append(term + beta * (torch.exp(d) - d - 1))
    return torch.stack(terms).mean()


def naive_grads(u, r, j, old, ref, adv, cfg):
    """Autograd of naive_loss at the weights update j saw: (gradients, their global norm), before clipping."""
    model = copy.deepcopy(u.weights)
    model.zero_grad(set_to_none=True)
    b = r.batch
    logits = model(r.views.inputs[j], b.attention_mask).float()                          # (B, L, V)
    lo, hi = (0, logits.shape[-1]) if b.task == "text" else image_columns()
    lp = F.log_softmax(logits[..., lo:hi], dim=-1).gather(-1, (b.x - lo).clamp(0, hi - lo - 1)[..., None])[..., 0]
    naive_loss(lp, old, ref, adv, r.views.loss_masks[j], cfg.clip_eps, cfg.beta).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return grads, math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))


def naive_update_grads(u, r, j, old, ref, adv, cfg):
    """naive_grads clipped to cfg.grad_clip by the global norm."""
    grads, norm = naive_grads(u, r, j, old, ref, adv, cfg)
    scale = min(1.0, cfg.grad_clip / (norm + 1e-6))  # clip_grad_norm_'s rule: max_norm / (norm + 1e-6)
    return {n: g * scale for n, g in grads.items()}


def masked_mean(values, mask):
    return float(values[mask].double().mean())


# -----------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


TASK_FLAGS = {"text": ["--tasks=text"], "image": ["--tasks=image"]}


# -----------------------------------------------------------------------------------------------------
# ratios at lr ~ 0 and at a real learning rate


@pytest.mark.parametrize("task", ["text", "image"])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_ratios_are_exactly_one_when_the_weights_do_not_move(ckpt, task, lora_rank):
    """At lr 1e-30 AdamW's steps (about lr per weight) round away in float32, so every inner iteration
    re-scores pi_old itself: each update's ratio statistics are exactly 1, nothing is clipped, and the KL
    to the reference (which the policy still is) is exactly 0. Exact by construction: the update scores
    the same weights on the same masked input in the same chunks as the old pass did, with deterministic
    CPU kernels, and the ratio is exp(0). A pass that rescored another iteration's input, or scored image
    positions over another vocabulary than the old pass, moves the ratio off 1."""
    flags = [*TASK_FLAGS[task], "--lr=1e-30", "--device_batch_size=3"]
    if lora_rank:
        flags += [f"--lora_rank={lora_rank}", "--lora_alpha=8"]
    cfg, policy, ref, opt, tok, ids = build(ckpt, *flags)
    start = copy.deepcopy(policy.state_dict())
    log, (r,), updates = run_step(cfg, policy, ref, opt, tok, ids, 0)
    assert len(updates) == cfg.mu == 3
    assert r.adv.abs().sum() > 0, "the stand-in rewards must give the groups signal"
    for j, u in enumerate(updates):
        s = u.stats
        assert s[f"{task}/num_tokens"] > 0
        assert (s[f"{task}/ratio_max"], s[f"{task}/clipfrac"], s[f"{task}/kl"]) == (1.0, 0.0, 0.0), j
        # The logged mean is a sum over chunks weighted by their share of the tokens (3 + 3 + 2 rows): the
        # shares' float rounding, not the ratios, can leave it 1e-8 off. A wrong input moves it by >> 1e-3.
        assert s[f"{task}/ratio_mean"] == pytest.approx(1.0, abs=1e-6), j
    # The premise: no weight moved by more than a few lr (LoRA's B starts at exactly 0, so it does take
    # steps of ~1e-30, which vanish next to the base layer's outputs of order 1).
    for k, v in policy.state_dict().items():
        assert (v - start[k]).abs().max() <= 1e-28, k


@pytest.mark.parametrize("task", ["text", "image"])
def test_update_follows_the_paper_objective(ckpt, task):
    """Two RL steps at a real learning rate (1e-2, so that ratios move and some clip) with beta 0.5 (so that
    the KL term is a visible part of the gradient). For every step and inner iteration j = 0..2:
      - the masked input is the clean sequence with exactly the scored positions masked, prompt untouched;
      - the old log-probs are the rollout policy's and the reference log-probs the initial model's,
        recomputed here (at step 1 the two differ: the policy has moved);
      - the logged ratio and KL statistics are those of the weights update j saw;
      - the gradient the optimizer applies is autograd of the paper's objective at those weights;
      - the first update of a step has ratio 1; later ones do not (the update uses pi_old's log-probs,
        not its own)."""
    cfg, policy, ref, opt, tok, ids = build(ckpt, *TASK_FLAGS[task], "--lr=1e-2", "--beta=0.5")
    initial = hf.from_pretrained(ckpt)  # the reference policy: the starting checkpoint
    for step in (0, 1):
        rollout_policy = copy.deepcopy(policy).eval()
        log, (r,), updates = run_step(cfg, policy, ref, opt, tok, ids, step)
        b = r.batch
        adv = naive_advantages(r.rewards, cfg.group_size)
        torch.testing.assert_close(r.adv, adv, rtol=1e-5, atol=1e-5)
        assert adv.abs().sum() > 0
        for j, u in enumerate(updates):
            mask = r.views.loss_masks[j]
            assert mask.any() and not mask[:, : b.prompt_len].any()
            assert torch.equal(r.views.inputs[j], b.x.masked_fill(mask, ids.mask))
            old, ref_lp = naive_logp(rollout_policy, r, j), naive_logp(initial, r, j)
            torch.testing.assert_close(r.logp_old[j], old, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(r.logp_ref[j], ref_lp, rtol=1e-5, atol=1e-5)
            if step == 1:
                assert (old - ref_lp).abs().max() > 1e-3, "after an update pi_old is not the reference"
            cur = naive_logp(u.weights, r, j)
            ratio = torch.exp(cur - old)
            s = u.stats
            assert s[f"{task}/ratio_mean"] == pytest.approx(masked_mean(ratio, mask), rel=1e-4)
            d = ref_lp - cur
            assert s[f"{task}/kl"] == pytest.approx(masked_mean(torch.exp(d) - d - 1, mask), rel=1e-3, abs=1e-7)
            if j == 0 and step == 0:
                assert s[f"{task}/ratio_max"] == 1.0  # untouched weights, same input: exactly exp(0)
            if j >= 1:
                assert abs(s[f"{task}/ratio_mean"] - 1) > 1e-4 or abs(s[f"{task}/ratio_max"] - 1) > 1e-3, j
            want = naive_update_grads(u, r, j, old, ref_lp, adv, cfg)
            assert want.keys() == u.grads.keys()
            top = max(float(g.abs().max()) for g in want.values())
            assert top > 0
            for n, g in want.items():
                # Tolerance relative to the largest gradient entry: float32 sums in another order.
                torch.testing.assert_close(u.grads[n], g, rtol=1e-3, atol=1e-4 * top, msg=f"{task} step {step} j {j} {n}")
        assert sum(u.stats[f"{task}/clipfrac"] for u in updates) > 0, "lr 1e-2 should clip some tokens"


@pytest.mark.parametrize("task", ["text", "image"])
def test_step_statistics_by_hand_at_mu_3_and_three_chunks(ckpt, task):
    """log.jsonl's statistics of one step against a hand computation from the weights each update saw, at
    mu = 3 and device_batch_size 3 (8 rows: chunks of 3, 3 and 2): ratio_max is the largest ratio of any token
    in any update; num_tokens the tokens scored by all updates together; loss, kl, clipfrac and ratio_mean are
    each update's full-batch value (per scored token) averaged over the updates; grad_norm_max and
    grad_norm_mean the largest and mean of the updates' gradient norms before clipping."""
    cfg, policy, ref, opt, tok, ids = build(ckpt, *TASK_FLAGS[task], "--lr=1e-2", "--beta=0.5",
                                            "--device_batch_size=3")
    initial = hf.from_pretrained(ckpt)
    rollout_policy = copy.deepcopy(policy).eval()
    log, (r,), updates = run_step(cfg, policy, ref, opt, tok, ids, 0)
    assert cfg.mu == len(updates) == 3 and r.batch.x.shape[0] == 8
    adv = naive_advantages(r.rewards, cfg.group_size)
    per = []
    for j, u in enumerate(updates):
        mask = r.views.loss_masks[j]
        old, ref_lp, cur = naive_logp(rollout_policy, r, j), naive_logp(initial, r, j), naive_logp(u.weights, r, j)
        ratio, d = torch.exp(cur - old)[mask].double(), (ref_lp - cur)[mask].double()  # (T,) each
        A = adv[mask.nonzero()[:, 0]].double()                                         # (T,)
        clipped = ((A > 0) & (ratio > 1 + cfg.clip_eps)) | ((A < 0) & (ratio < 1 - cfg.clip_eps))
        per.append({"tokens": int(mask.sum()), "ratio_max": float(ratio.max()), "ratio_mean": float(ratio.mean()),
                    "kl": float((torch.exp(d) - d - 1).mean()), "clipfrac": float(clipped.double().mean()),
                    "loss": float(naive_loss(cur, old, ref_lp, adv, mask, cfg.clip_eps, cfg.beta)),
                    "norm": naive_grads(u, r, j, old, ref_lp, adv, cfg)[1]})
    mean = lambda k: sum(p[k] for p in per) / len(per)
    assert log[f"{task}/num_tokens"] == sum(p["tokens"] for p in per) > max(p["tokens"] for p in per)
    assert log[f"{task}/ratio_max"] == pytest.approx(max(p["ratio_max"] for p in per), rel=1e-5)
    assert max(p["ratio_max"] for p in per) > mean("ratio_max") + 1e-4, "the maximum must differ from the mean"
    for k in ("ratio_mean", "kl", "clipfrac", "loss"):
        assert log[f"{task}/{k}"] == pytest.approx(mean(k), rel=1e-3, abs=1e-6), k
    assert log["grad_norm_max"] == pytest.approx(max(p["norm"] for p in per), rel=1e-3)
    assert log["grad_norm_mean"] == pytest.approx(mean("norm"), rel=1e-3)
    assert max(p["norm"] for p in per) > mean("norm") * (1 + 1e-3), "the maximum must differ from the mean"


@pytest.mark.parametrize("task", ["text", "image"])
def test_update_at_non_default_settings_with_a_binding_clip(ckpt, task):
    """The paper objective again, one step at settings none of the defaults share: G = 3, mu = 2, eps 0.05,
    beta 0.3, gamma 0.3 and a gradient clip of 0.05, which binds: the gradient of the naive loss (clipped
    by hand to 0.05 / (norm + 1e-6), clip_grad_norm_'s rule) is what the optimizer applies, its norm is
    0.05, and the unclipped norm is above it. A clip that ignored --grad_clip (1.0, the default) would
    apply the unclipped gradient."""
    gamma = "--gamma_text=0.3" if task == "text" else "--gamma_image=0.3"
    cfg, policy, ref, opt, tok, ids = build(ckpt, *TASK_FLAGS[task], "--lr=1e-2", "--group_size=3",
                                            "--mu=2", "--clip_eps=0.05", "--beta=0.3", gamma,
                                            "--grad_clip=0.05", "--prompts_per_step=3")
    assert (cfg.group_size, cfg.mu, cfg.grad_clip) == (3, 2, 0.05)
    initial = hf.from_pretrained(ckpt)
    rollout_policy = copy.deepcopy(policy).eval()
    log, (r,), updates = run_step(cfg, policy, ref, opt, tok, ids, 0)
    assert len(updates) == 2 and r.rewards.shape == (9,)
    adv = naive_advantages(r.rewards, 3)
    torch.testing.assert_close(r.adv, adv, rtol=1e-5, atol=1e-5)
    for j, u in enumerate(updates):
        old, ref_lp = naive_logp(rollout_policy, r, j), naive_logp(initial, r, j)
        want = naive_update_grads(u, r, j, old, ref_lp, adv, cfg)
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in want.values()))
        got = math.sqrt(sum(float(g.double().pow(2).sum()) for g in u.grads.values()))
        assert norm == pytest.approx(0.05, rel=1e-4) and got == pytest.approx(0.05, rel=1e-4), (norm, got)
        unclipped = naive_update_grads(u, r, j, old, ref_lp, adv, replace(cfg, grad_clip=1e9))
        assert math.sqrt(sum(float(g.double().pow(2).sum()) for g in unclipped.values())) > 0.1
        top = max(float(g.abs().max()) for g in want.values())
        for n, g in want.items():
            torch.testing.assert_close(u.grads[n], g, rtol=1e-3, atol=1e-4 * top, msg=f"{task} j {j} {n}")
    # the mask ratio of iteration j is gamma + (1 - gamma)(j + 1) / mu (Alg. 5): 0.65 and 1 (kept below 1)
    win = r.views.loss_masks[:, :, r.batch.window_slice].float()
    if task == "image":  # random reversing: each code masked with probability t_j
        for j, t in enumerate((0.65, 1.0)):
            n = win[j].numel()
            assert abs(float(win[j].mean()) - t) <= 5 * math.sqrt(max(t * (1 - t), 1e-3) / n) + 1 / n, (j, t)


def test_lora_reference_is_the_base_with_adapters_off(ckpt):
    """With LoRA the reference is the base network (the checkpoint), not the adapted policy. The adapters
    are given nonzero B first, so the policy differs from the base already at the first step."""
    cfg, policy, ref, opt, tok, ids = build(ckpt, "--tasks=text", "--lora_rank=4", "--lora_alpha=8", "--beta=0.5")
    assert isinstance(ref, hf.AdaptersOff) and ref.policy is policy  # the policy with its adapters off
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in policy.modules():
            if isinstance(m, hf.LoRALinear):
                m.lora_B.copy_(0.5 * torch.randn(m.lora_B.shape, generator=g))
    base = hf.from_pretrained(ckpt)
    adapted = copy.deepcopy(policy).eval()
    _, (r,), updates = run_step(cfg, policy, ref, opt, tok, ids, 0)
    for j in range(cfg.mu):
        ref_lp, old = naive_logp(base, r, j), naive_logp(adapted, r, j)
        assert (ref_lp - old).abs().max() > 1e-2, "the adapters must change the log-probs for this test"
        torch.testing.assert_close(r.logp_ref[j], ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r.logp_old[j], old, rtol=1e-5, atol=1e-5)
    d = ref_lp - naive_logp(updates[-1].weights, r, cfg.mu - 1)
    want = masked_mean(torch.exp(d) - d - 1, r.views.loss_masks[-1])
    assert updates[-1].stats["text/kl"] == pytest.approx(want, rel=1e-3)
    assert policy.training is False  # rl_step leaves the policy in eval mode


# -----------------------------------------------------------------------------------------------------
# masks and rollout noise


def arlike_mask_prob(N, t):
    # Alg. 1 (AR-like reversing), closed form: position n of N is masked with 1 - min(1, 2 (1 - t)(1 - n / (N - 1))).
    return [1 - min(1.0, 2 * (1 - t) * (1 - n / (N - 1))) for n in range(N)]


@pytest.mark.parametrize("task", ["text", "image"])
def test_masks_of_inner_iterations_are_independent(ckpt, task):
    """Iteration j masks with its own seed S_j, so masks j < k are independent draws, not nested ones (one
    shared uniform per position would give mask_j within mask_k, since t_j < t_k). The number of positions
    masked in j but not in k must match sum_n p_j(n) (1 - p_k(n)) under independence, within 5 sigma;
    nesting gives exactly 0. gamma 0 spreads t_j = 1/3, 2/3, 0.999."""
    gamma = "--gamma_text=0" if task == "text" else "--gamma_image=0"
    cfg, policy, ref, opt, tok, ids = build(ckpt, *TASK_FLAGS[task], gamma, "--prompts_per_step=4", "--lr=1e-30")
    _, (r,), _ = run_step(cfg, policy, ref, opt, tok, ids, 0)
    B, N = r.batch.x.shape[0], r.batch.window
    win = r.views.loss_masks[:, :, r.batch.window_slice]                                 # (mu, B, N)
    t = [1 / 3, 2 / 3, 0.999]
    p = [arlike_mask_prob(N, tj) if task == "text" else [tj] * N for tj in t]
    for j, k in ((0, 1), (0, 2), (1, 2)):
        q = [p[j][n] * (1 - p[k][n]) for n in range(N)]
        expected = B * sum(q)
        sd = math.sqrt(B * sum(x * (1 - x) for x in q))
        got = int((win[j] & ~win[k]).sum())
        assert abs(got - expected) <= 5 * sd + 1, (j, k, got, expected)
    pairs = win[0] & ~win[1]
    assert pairs.any(), "masks 0 and 1 are nested"


@pytest.mark.slow  # float64 rollouts at several batch sizes
@pytest.mark.parametrize("task", ["text", "image"])
def test_rollout_noise_depends_on_step_and_sequence_only(ckpt, task):
    """Rollouts on fixed prompts with weights that do not move (lr 1e-30): the same (seed, step, sequence)
    gives the same completion in a fresh run and in a batch of another size; another step gives other
    completions, and so do the members of one group. A float64 model, so that another batch size (other
    BLAS kernels) cannot flip a near-tie in the sampler and only the noise decides."""
    smoke = train.parse_args(["--preset=smoke"])
    prompts = [train.make_example(task, random.Random(i), smoke, "train") for i in range(2)]
    flags = [*TASK_FLAGS[task], "--lr=1e-30"]

    def windows(step, prompts_, *extra):
        cfg, policy, ref, opt, tok, ids = build(ckpt, *flags, f"--prompts_per_step={len(prompts_)}", *extra,
                                               float64=True)
        _, (r,), _ = run_step(cfg, policy, ref, opt, tok, ids, step, prompts=prompts_)
        return r.batch.x[:, r.batch.window_slice]

    first = windows(3, prompts)
    assert torch.equal(windows(3, prompts), first)                  # a fresh run: the same completions
    assert torch.equal(windows(3, prompts[:1]), first[:4])          # half the batch: sequences 0..3 alike
    assert torch.equal(windows(3, prompts, "--device_batch_size=3")[4:], first[4:])
    other = windows(4, prompts)
    assert (other != first).any(1).float().mean() >= 0.5, "another step must draw other noise"
    assert len({tuple(w) for w in first[:4].tolist()}) >= 2, "members of a group must draw different noise"
