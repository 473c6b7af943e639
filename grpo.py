"""GRPO objective: group-normalised advantages and the clipped per-token surrogate with a k3 KL penalty.

GRPO: DeepSeekMath (arXiv:2402.03300) §4.1; applied to masked diffusion as in MaskGRPO (arXiv:2510.02880,
method.md §2.1, §5). Pure functions on tensors: no optimizer, logging or torch.distributed here.

Public API
    group_advantages(rewards, group_size=None, eps=1e-4, scale_by_std=True)   (R - mean_g) / (std_g + eps)
    policy_loss(logp, logp_old, adv, mask, clip_eps=..., beta=0.0, logp_ref=None, norm="token")
        -> (loss, stats): clipped surrogate + beta * k3 KL, normalised per token or per sequence

Differences from the paper and the official code (method.md §9), and why:
 1. Ratios are per token, exp(logp - logp_old) at each masked position, clipped per token (official code).
    The paper as summarised writes one sequence-level ratio exp(l_theta - l_old); with hundreds of scored
    tokens that product is almost always outside [1-eps, 1+eps], so every token would be clipped.
 2. PPO clipping is applied although the summarised paper objective (Eq. 11) shows none; the code clips.
 3. norm="sequence" is the paper's A_i / |o_i| (per-sequence mean); norm="token" is the official code's
    sum over all masked tokens / their count (DAPO-style token mean, arXiv:2503.14476). Both are offered.
 4. Advantage eps 1e-4 (TRL's value) instead of the official 1e-5; equal-reward groups are forced to an
    exact 0 advantage instead of relying on eps.
 5. The loss weight is the current inner iteration's mask only; the official HEAD weights by the sum of
    all mu masks (method.md §9 item 5). That is the caller's job: pass loss_masks[j] from importance.py.

Shapes: B sequences (num_groups x G), G group size, N scored length (the generation window, or the full
sequence L if the caller keeps prompt columns with mask False).
"""
import torch

NORMS = ("token", "sequence")


# -----------------------------------------------------------------------------
# advantages

def group_advantages(rewards: torch.Tensor, group_size: int | None = None, eps: float = 1e-4,
                     scale_by_std: bool = True) -> torch.Tensor:
    """Group-relative advantages (GRPO outcome supervision, arXiv:2402.03300 §4.1).

    rewards: (num_groups, G), or flat (num_groups * G,) with group_size given (members of a group
    consecutive, as the sampler repeats each prompt G times). Returns float advantages of the same shape.
    std is unbiased (N - 1), like torch.std and the official code (method.md §5.2).
    scale_by_std=False returns R - mean only (d1 drops the std; Dr. GRPO argues for it).
    """
    flat = rewards.dim() == 1
    if flat:
        if group_size is None or group_size < 1 or rewards.numel() % group_size:
            raise ValueError(f"flat rewards of length {rewards.numel()} need a group_size that divides it "
                             f"(got {group_size}); or pass rewards shaped (num_groups, G)")
        R = rewards.reshape(-1, group_size)  # (num_groups, G)
    else:
        assert rewards.dim() == 2, f"rewards must be (num_groups, G) or flat, got {tuple(rewards.shape)}"
        R = rewards
    G = R.shape[1]
    if G < 2:
        raise ValueError(f"group size ({G}) must be >= 2: GRPO compares completions within a group; "
                         f"try --group_size=4")
    R = R.float() if not R.is_floating_point() else R  # integer rewards -> float32
    bad = ~torch.isfinite(R)  # (num_groups, G)
    if bad.any():
        where = [tuple(ix) for ix in bad.nonzero().tolist()[:5]]
        raise ValueError(f"{int(bad.sum())} non-finite reward(s) at (group, member) {where}"
                         f"{' ...' if bad.sum() > 5 else ''}; fix the reward function (it should return a "
                         f"float, 0.0 for unparsable output) rather than letting them be averaged away")
    mean = R.mean(dim=1, keepdim=True)  # (num_groups, 1)
    adv = R - mean  # (num_groups, G)
    if scale_by_std:
        std = R.std(dim=1, keepdim=True)  # (num_groups, 1), unbiased
        adv = adv / (std + eps)  # GRPO: (R - mean) / (std + eps)
    # A group whose members all got the same reward carries no signal. R - mean is not exactly 0 in
    # floating point (e.g. 0.1 * 3 / 3 != 0.1), so after dividing by a tiny std it would be noise:
    # set it to exactly 0, never NaN.
    equal = (R == R[:, :1]).all(dim=1, keepdim=True)  # (num_groups, 1)
    adv = torch.where(equal, torch.zeros_like(adv), adv)  # (num_groups, G)
    return adv.reshape(rewards.shape) if flat else adv


# -----------------------------------------------------------------------------
# policy loss

def policy_loss(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
                clip_eps: float, beta: float = 0.0, logp_ref: torch.Tensor | None = None,
                norm: str = "token") -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped GRPO surrogate with optional k3 KL (method.md §5.3), to be minimised.

    logp: float32 (B, N) current policy with grad; logp_old, logp_ref: (B, N) without grad; adv: (B,);
    mask: bool (B, N), True at the tokens masked in the current inner iteration (loss_masks[j]).
    norm="token": sum over the batch's masked tokens / their count. norm="sequence": mean over each
    sequence's masked tokens (the paper's 1/|o_i|), then mean over sequences that have at least one
    masked token (a sequence with none contributes 0 and is left out of the denominator).
    With no masked token at all the loss is 0 and still backpropagates (zero grads).
    Returns (loss scalar, stats of detached python floats: clipfrac, kl, ratio_mean, ratio_max,
    adv_abs_mean, num_tokens). clipfrac counts tokens whose gradient the clip removes.
    """
    if clip_eps <= 0:
        raise ValueError(f"clip_eps ({clip_eps}) must be > 0; the official text recipe uses 0.2")
    if beta < 0:
        raise ValueError(f"beta ({beta}) must be >= 0; the official recipe uses 0.01")
    if beta > 0 and logp_ref is None:
        raise ValueError(f"beta ({beta}) > 0 needs logp_ref; compute reference log-probs or set --beta=0")
    if norm not in NORMS:
        raise ValueError(f"norm ({norm!r}) must be one of {NORMS}")
    assert logp.shape == logp_old.shape == mask.shape and mask.dtype == torch.bool, \
        f"logp {tuple(logp.shape)}, logp_old {tuple(logp_old.shape)}, bool mask {tuple(mask.shape)} must match"
    assert adv.shape == logp.shape[:1], f"adv must be (B,) = ({logp.shape[0]},), got {tuple(adv.shape)}"
    assert logp_ref is None or logp_ref.shape == logp.shape, f"logp_ref {tuple(logp_ref.shape)} != logp"

    m = mask.float()  # (B, N)
    A = adv.to(logp.dtype).unsqueeze(1)  # (B, 1)
    # Unscored positions get log-ratio 0 before exp: their logp values are arbitrary (0 from
    # token_logprobs), and exp(huge) * 0 would turn the masked sum into NaN.
    log_ratio = torch.where(mask, logp - logp_old.detach(), torch.zeros_like(logp))  # (B, N)
    ratio = torch.exp(log_ratio)  # (B, N)  per-token importance ratio (note 1 in the docstring)
    # GRPO clipped surrogate (arXiv:2402.03300 §4.1): -min(r A, clip(r, 1-eps, 1+eps) A).
    # When the clipped branch is the minimum the token's gradient is exactly 0.
    surr = torch.minimum(ratio * A, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * A)  # (B, N)
    per_token = -surr  # (B, N)
    kl = None
    if logp_ref is not None:
        # k3 estimator of KL(pi_theta || pi_ref) (Schulman, "Approximating KL Divergence"; method.md §1.5,
        # §5.3): exp(d) - d - 1 with d = logp_ref - logp, >= 0 and exactly 0 when d == 0.
        d = torch.where(mask, logp_ref.detach() - logp, torch.zeros_like(logp))  # (B, N)
        kl = torch.exp(d) - d - 1.0  # (B, N)
        if beta > 0:
            per_token = per_token + beta * kl  # (B, N)

    per_seq_count = m.sum(dim=1)  # (B,)
    if norm == "token":
        # official code: every masked token of the batch weighs the same
        loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
    else:
        # paper Eq. 11 (as summarised): A_i / |o_i|, here |o_i| = number of scored tokens of sequence i
        seq_loss = (per_token * m).sum(dim=1) / per_seq_count.clamp(min=1.0)  # (B,)
        has_tokens = (per_seq_count > 0).float()  # (B,)
        loss = (seq_loss * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)

    with torch.no_grad():
        n = float(m.sum())
        clipped = ((A > 0) & (ratio > 1.0 + clip_eps)) | ((A < 0) & (ratio < 1.0 - clip_eps))  # (B, N)
        stats = {
            "clipfrac": float((clipped.float() * m).sum()) / n if n else 0.0,
            "kl": float((kl * m).sum()) / n if (n and kl is not None) else 0.0,
            "ratio_mean": float((ratio * m).sum()) / n if n else 1.0,  # 1.0 = neutral when nothing scored
            "ratio_max": float(ratio[mask].max()) if n else 1.0,
            "adv_abs_mean": float(adv.abs().float().mean()) if adv.numel() else 0.0,
            "num_tokens": n,
        }
    return loss, stats
