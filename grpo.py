"""GRPO objective (DeepSeekMath, arXiv:2402.03300 §4.1) as MaskGRPO uses it (arXiv:2510.02880 Eq. 11).

group_advantages: rewards -> advantages per group. policy_loss: clipped per-token surrogate + k3 KL on the
log-probs of importance.token_logprobs under one inner iteration's mask, as one mean over the whole batch
however it is chunked; step_stats: the logged statistics. Differences from the paper and the
official code, and why: docs/differences.md. Shapes: B sequences (num_groups x G), G group size, N columns.
"""
import torch

NORMS = ("token", "sequence")


# -----------------------------------------------------------------------------
# advantages

def group_advantages(rewards: torch.Tensor, group_size: int | None = None, eps: float = 1e-4,
                     scale_by_std: bool = True) -> torch.Tensor:
    """(R - mean_g) / (std_g + eps) within each group (outcome supervision, arXiv:2402.03300 §4.1), same shape.
    rewards: (num_groups, G), or flat (num_groups * G,) with group_size (each group's members consecutive).
    std is unbiased (N - 1), as in the official code. scale_by_std=False gives R - mean_g, as d1 does."""
    flat = rewards.dim() == 1
    assert rewards.dim() == 2 or (group_size and rewards.numel() % group_size == 0), \
        f"flat rewards of length {rewards.numel()} need a group_size that divides it, got {group_size}"
    R = rewards.reshape(-1, group_size) if flat else rewards  # (num_groups, G)
    R = R.float() if not R.is_floating_point() else R  # integer rewards -> float32
    assert R.shape[1] >= 2 and torch.isfinite(R).all(), "GRPO compares >= 2 finite rewards within a group"
    mean = R.mean(dim=1, keepdim=True)  # (num_groups, 1)
    adv = R - mean  # (num_groups, G)
    if scale_by_std:
        std = R.std(dim=1, keepdim=True)  # (num_groups, 1), unbiased
        adv = adv / (std + eps)  # GRPO: (R - mean) / (std + eps)
    # An equal-reward group carries no signal, but R - mean is not exactly 0 in floating point (0.1 * 3 / 3
    # != 0.1), and over a tiny std it would be noise: make it exactly 0, never NaN.
    equal = (R == R[:, :1]).all(dim=1, keepdim=True)  # (num_groups, 1)
    adv = torch.where(equal, torch.zeros_like(adv), adv)  # (num_groups, G)
    return adv.reshape(rewards.shape) if flat else adv


# -----------------------------------------------------------------------------
# policy loss

def num_terms(mask: torch.Tensor, norm: str) -> torch.Tensor:
    """How many terms policy_loss averages over for a bool mask (B, N): scored tokens ("token") or sequences
    with any scored token ("sequence"); an int64 scalar."""
    return mask.sum() if norm == "token" else mask.any(-1).sum()


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                clip_eps: float, beta: float = 0.0, logp_ref: torch.Tensor | None = None, norm: str = "token",
                total: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO surrogate + beta * k3 KL on one chunk of rows: (its share S_c / total of the full-batch mean,
    sums). total: the terms of the whole batch, every chunk, view and rank (default: this chunk's), so the chunks'
    shares add up to the one mean S / total. norm="token": each scored token is a term; "sequence": each sequence
    with one, as its tokens' mean. logp: float32 (B, N) with grad; logp_old, logp_ref: (B, N); adv: (B,); mask:
    bool (B, N), the tokens THIS update scores (none: loss 0, zero grads). sums, to add over chunks, views and
    ranks (step_stats divides): loss, tokens, clipped (gradient removed by the clip), kl, ratio, ratio_max."""
    assert clip_eps > 0 and beta >= 0 and norm in NORMS and (beta == 0 or logp_ref is not None), \
        f"clip_eps {clip_eps} > 0, beta {beta} >= 0 (> 0 needs logp_ref), norm {norm!r} in {NORMS}"
    shapes = [tuple(t.shape) for t in (logp, logp_old, mask, adv) + ((logp_ref,) if logp_ref is not None else ())]
    assert len(set(shapes[:3] + shapes[4:])) == 1 and shapes[3] == shapes[0][:1] and mask.dtype == torch.bool, \
        f"logp, logp_old, bool mask (and logp_ref) must be (B, N) and adv (B,): got {shapes}"
    if total is None:
        total = num_terms(mask, norm).float().clamp(min=1)
    m = mask.float()  # (B, N)
    A = adv.to(logp.dtype).unsqueeze(1)  # (B, 1)
    # Log-ratio 0 at unscored positions before exp: their logp is arbitrary, and exp(huge) * 0 would be NaN.
    log_ratio = torch.where(mask, logp - logp_old.detach(), torch.zeros_like(logp))  # (B, N)
    ratio = torch.exp(log_ratio)  # (B, N) the importance ratio of Eqs. 9-10, one per token
    # Clipped surrogate -min(r A, clip(r, 1-eps, 1+eps) A): a token on the clipped branch gets zero gradient.
    per_token = -torch.minimum(ratio * A, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * A)  # (B, N)
    kl = None
    if logp_ref is not None:
        # k3 estimator of KL(pi_theta || pi_ref) (Eqs. 9-10; Schulman, "Approximating KL Divergence"):
        # exp(d) - d - 1 with d = logp_ref - logp, >= 0 and exactly 0 when d == 0.
        d = torch.where(mask, logp_ref.detach() - logp, torch.zeros_like(logp))  # (B, N)
        kl = torch.exp(d) - d - 1.0  # (B, N)
        if beta > 0:
            per_token = per_token + beta * kl  # (B, N)
    if norm == "token":
        # every scored token of the batch weighs the same (the official code; DAPO, arXiv:2503.14476)
        loss = (per_token * m).sum() / total
    else:
        # Eq. 11's A_i / |o_i|, with |o_i| the tokens scored in this update (not the completion length)
        seq_loss = (per_token * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)  # (B,)
        loss = seq_loss.sum() / total  # a sequence without scored tokens adds 0

    with torch.no_grad():
        clipped = ((A > 0) & (ratio > 1.0 + clip_eps)) | ((A < 0) & (ratio < 1.0 - clip_eps))  # (B, N)
        sums = {"loss": loss.item(), "tokens": float(m.sum()), "clipped": float((clipped.float() * m).sum()),
                "kl": float((kl * m).sum()) if kl is not None else 0.0, "ratio": float((ratio * m).sum()),
                "ratio_max": float(ratio[mask].max()) if mask.any() else 1.0}  # 1.0: neutral when nothing scored
    return loss, sums


def add_sums(a: dict, b: dict) -> dict:
    """Two chunks' (or ranks') sums of policy_loss as one: ratio_max by max, the rest added."""
    return {k: max(a[k], b[k]) if k == "ratio_max" else a[k] + b[k] for k in b} if a else dict(b)


def step_stats(updates: list[dict]) -> dict[str, float]:
    """The logged statistics of one RL step from each update's sums over the whole batch (every rank),
    divided once: loss, clipfrac, kl, ratio_mean are each update's full-batch value (clipfrac, kl,
    ratio_mean per scored token) averaged over the mu updates; ratio_max is the largest ratio of any token in
    any update; num_tokens is the step's scored tokens, over every update."""
    mu = len(updates)
    mean = lambda f: sum(f(u) / mu for u in updates)  # over the updates, in order
    per_token = lambda k, empty=0.0: mean(lambda u: u[k] / u["tokens"] if u["tokens"] else empty)
    return {"loss": mean(lambda u: u["loss"]), "clipfrac": per_token("clipped"), "kl": per_token("kl"),
            "ratio_mean": per_token("ratio", 1.0), "ratio_max": max(u["ratio_max"] for u in updates),
            "num_tokens": sum(u["tokens"] for u in updates)}
