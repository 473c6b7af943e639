"""GRPO objective (DeepSeekMath, arXiv:2402.03300 §4.1) as MaskGRPO uses it (arXiv:2510.02880 Eq. 11): group
advantages, and the clipped surrogate + k3 KL as one mean over the batch however it is chunked.
Departures: docs/differences.md. Shapes: B sequences (num_groups x G), G group size, N columns.
"""
import math

import torch

NORMS = ("token", "sequence")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4, scale_by_std: bool = True):
    """(R - mean_g) / (std_g + eps) per group of group_size (§4.1), std unbiased (official); or R - mean_g (d1)."""
    assert rewards.dim() == 1 and group_size >= 2 and len(rewards) % group_size == 0, f"{rewards.shape=} {group_size=}"
    R = (rewards if rewards.is_floating_point() else rewards.float()).reshape(-1, group_size)  # (num_groups, G)
    assert torch.isfinite(R).all(), "GRPO compares finite rewards"
    adv = R - R.mean(dim=1, keepdim=True)  # (num_groups, G)
    if scale_by_std:
        adv = adv / (R.std(dim=1, keepdim=True) + eps)
    # An equal-reward group carries no signal: exactly 0, never NaN.
    adv = torch.where((R == R[:, :1]).all(dim=1, keepdim=True), torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *, clip_eps: float,
                beta: float = 0.0, logp_ref=None, norm: str = "token", total=None) -> tuple[torch.Tensor, dict]:
    """Clipped GRPO surrogate + beta * k3 KL (Eqs. 9-11) on one chunk: (its share S_c / total of the batch mean, its
    sums). total: the terms (tokens, or sequences with one) of every chunk, view and rank (default: this chunk's).
    mask: the tokens THIS update scores; logp (with grad), logp_old, logp_ref, mask: (B, N); adv: (B,)."""
    assert clip_eps > 0 and beta >= 0 and norm in NORMS, f"{clip_eps=} > 0, {beta=} >= 0, {norm=} in {NORMS}"
    assert mask.dtype == torch.bool and (beta == 0 or logp_ref is not None), "a bool mask; beta > 0 needs logp_ref"
    assert {t.shape for t in (logp, logp_old, mask, logp_ref) if t is not None} == {adv.shape + mask.shape[1:]}, "(B,N)"
    total = (mask.sum() if norm == "token" else mask.any(-1).sum()).float().clamp(min=1) if total is None else total
    m, A, zero = mask.float(), adv.to(logp.dtype).unsqueeze(1), torch.zeros_like(logp)  # (B, N), (B, 1), (B, N)
    # Eqs. 9-10's ratio per token; log-ratio 0 where unscored (exp(huge) * 0 would be NaN).
    ratio = torch.exp(torch.where(mask, logp - logp_old.detach(), zero))  # (B, N)
    # Clipped surrogate -min(r A, clip(r, 1-eps, 1+eps) A): the clipped branch gets zero gradient.
    per_token = -torch.minimum(ratio * A, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * A)  # (B, N)
    # k3 estimate of KL(pi_theta || pi_ref) (Schulman): exp(d) - d - 1 >= 0, d = logp_ref - logp.
    d = zero if logp_ref is None else torch.where(mask, logp_ref.detach() - logp, zero)  # (B, N)
    kl = torch.exp(d) - d - 1.0  # (B, N)
    per_token = per_token + beta * kl if beta > 0 else per_token
    # "token": every scored token of the batch weighs the same (the official code; DAPO, arXiv:2503.14476);
    # "sequence": Eq. 11's A_i / |o_i|, |o_i| the tokens this update scores; a sequence without any adds 0.
    S = (per_token * m).sum() if norm == "token" else ((per_token * m).sum(1) / m.sum(1).clamp(min=1.0)).sum()
    loss = S / total
    with torch.no_grad():  # 0-d float64 tensors on the device: no host sync per chunk
        clipped = ((A > 0) & (ratio > 1.0 + clip_eps)) | ((A < 0) & (ratio < 1.0 - clip_eps))  # (B, N)
        top = torch.where(mask.any(), ratio.masked_fill(~mask, -math.inf).max(), 1.0)  # neutral if none scored
        sums = {k: v.double() for k, v in (("loss", loss.detach()), ("tokens", m.sum()),
                                           ("clipped", (clipped.float() * m).sum()), ("kl", (kl * m).sum()),
                                           ("ratio", (ratio * m).sum()), ("ratio_max", top))}
    return loss, sums
