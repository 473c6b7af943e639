"""MaskGRPO's importance estimator (arXiv:2510.02880 §3, Eqs. 9-10): the sequence likelihood being intractable,
inner iteration j re-masks the finished completion, o^t ~ Rev(o, t_j, S_j) seeded, and scores pi_theta, pi_old,
pi_ref on that input. VIEWS[cfg.estimator] builds one task's views (inputs, the positions each scores),
token_logprobs scores them; "trajectory" and decoding_logprob score the exact l_pi(o). See docs/differences.md.
Shapes: B sequences, P prompt, N window, S suffix (<|eoi|>), L = P + N + S.
"""
import hashlib
import math
import struct
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sample import chunks, derive_seed

MASK_ESTIMATORS = ("maskgrpo", "d1", "unigrpo")  # the ones that draw masks (build_masks)
ESTIMATORS = MASK_ESTIMATORS + ("trajectory",)  # the sampler's own states
UNIGRPO_T = 1000  # UniGRPO's number of discrete timesteps; MMaDA (arXiv:2505.15809) does not state it


class Views(NamedTuple):
    """One task's views: K inputs (B, L), the positions each scores (K, B, L), update j's views."""
    inputs: list
    loss_masks: torch.Tensor
    updates: list
    norm: torch.Tensor | None = None  # --trajectory_states: this rank's loss normaliser


def maskgrpo_views(batch, order, cfg, *, image, step, seq_index, mask_id, **_) -> Views:
    """Step 4 (Alg. 5): view j = o^t_j ~ Rev(o, t_j, S_j) (text: Alg. 1 or --text_reversing; images: Alg. 2) for
    update j. seq_index: each row's GLOBAL index. Every VIEWS function also takes eos_id and all_max."""
    mode, gamma = ("random", cfg.gamma_image) if image else (cfg.text_reversing, cfg.gamma_text)
    (B, L), P, N, seed = batch.x.shape, batch.prompt_len, batch.window, derive_seed(cfg.seed, "masks", batch.task)
    prompt_len, window = batch.attention_mask[:, :P].bool().sum(1).tolist(), torch.ones(B, N, dtype=torch.bool)
    masks = torch.zeros(cfg.mu, B, L, dtype=torch.bool, device=batch.x.device)  # never the prompt (§3)
    for j, t in enumerate(mask_ratios(cfg.mu, gamma)):
        seeds = [mask_seed(seed, step, int(i), j) for i in seq_index]
        masks[j, :, P:P + N] = reverse_mask(window, [t] * B, seeds, mode, prompt_len=prompt_len)
    return Views([batch.x.masked_fill(m, mask_id) for m in masks], masks, [[j] for j in range(cfg.mu)])


def mask_ratios(mu: int, gamma: float) -> list[float]:
    """t_j = gamma + (1-gamma)(j+1)/mu, j < mu (Alg. 5; Fig. 5a: low ratios teach little), 1.0 clamped (official)."""
    assert mu >= 1 and 0.0 <= gamma < 1.0, f"mu {mu} >= 1, gamma {gamma} in [0, 1)"
    return [min(gamma + (1.0 - gamma) * (j + 1) / mu, 0.999) for j in range(mu)]


def packed_seed(tag: bytes, *ints: int) -> int:
    """The estimator's seeds: the top 63 bits of blake2b over a tag and int64-packed ints."""
    data = tag + struct.pack(f"<{len(ints)}q", *ints)  # the same bytes in every process
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def mask_seed(seed: int, step: int, seq_index: int, j: int) -> int:
    """Seed S_j of a sequence's mask in iteration j of `step` from its GLOBAL index (the controlled seed)."""
    assert all(type(v) is int and 0 <= v < 2**63 for v in (seed, step, seq_index, j)), f"{seed, step, seq_index, j = }"
    return packed_seed(b"maskgrpo/mask", seed, step, seq_index, j)


def reverse_mask(completion_mask: torch.Tensor, ratios, seeds, mode: str = "arlike", prompt_len=None) -> torch.Tensor:
    """Rev(o, t, S) (REVERSING[mode]): bool (B, N), True = masked, within completion_mask; one ratio, seed (and
    prompt length) per row: its own CPU generator makes it depend on them and N alone."""
    assert mode in REVERSING and completion_mask.dtype == torch.bool and completion_mask.dim() == 2, f"{mode=}"
    assert len(ratios) == len(seeds) == len(completion_mask) and all(0 <= t <= 1 for t in ratios), f"{ratios=} {seeds=}"
    mask = torch.zeros(completion_mask.shape, dtype=torch.bool)  # (B, N)
    for b, (t, s) in enumerate(zip(ratios, seeds)):
        u = torch.rand(mask.shape[1], generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64)  # (N,)
        mask[b] = REVERSING[mode](u, float(t), None if prompt_len is None else int(prompt_len[b]))
    return mask.to(completion_mask.device) & completion_mask  # (B, N)


# Reversing operators Rev(o, t, S): the tokens masked, given a seeded uniform per token (u: (N,)).
REVERSING = {"arlike": lambda u, t, P: u >= _arlike_keep(len(u), t),  # Alg. 1: late tokens first
             "random": lambda u, t, P: u < t,  # Alg. 2: each with probability t
             "arlike_official": lambda u, t, P: u >= _arlike_official_keep(P, len(u), t)}  # the official code
MODES = tuple(REVERSING)  # --text_reversing


def _arlike_keep(N: int, ratio: float) -> torch.Tensor:
    # Alg. 1: token n stays visible with prob min(1, d_n (1-r) N / sum(d)), d_n = 1 - n/(N-1): late tokens,
    # where semi-AR rollouts differ, are masked most (Fig. 2). Masked fraction r if r >= 0.5, else more.
    d = torch.ones(1, dtype=torch.float64) if N == 1 else 1.0 - torch.arange(N, dtype=torch.float64) / (N - 1)
    return (d * (1.0 - ratio) * N / d.sum()).clamp(max=1.0)  # (N,); N = 1 keeps with prob 1 - r


def _arlike_official_keep(P: int, N: int, ratio: float) -> torch.Tensor:
    # The official trainer takes the prompt length to be 1 (docs/differences.md): the ramp spans the prompt too,
    # which uses up its high-keep start, so the window's masked share grows with P.
    assert P is not None and P >= 0, f"arlike_official masks need prompt_len, each row's prompt length >= 0: got {P}"
    head = min(P, 1)  # the official prompt length: 1 (0 only if there were no prompt at all)
    return _arlike_keep(P + N - head, ratio)[P - head:]  # (N,)


def official_completion_ratio(P: int, N: int, ratio: float) -> float:
    """Expected masked fraction of an N-token window behind a P-token prompt under "arlike_official"."""
    return float((1.0 - _arlike_official_keep(P, N, ratio)).mean())


def completion_mask_until_eos(window_tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """bool (B, N): True up to and including each row's first EOS, all True without one."""
    is_eos = window_tokens == eos_id  # (B, N)
    return (is_eos.long().cumsum(1) - is_eos.long()) == 0  # no EOS strictly before this position


def _unigrpo_ratios(seed: int, step: int, seq_index: int, mu: int) -> list[float]:
    # UniGRPO (arXiv:2505.15809): t_1 = floor(r_1 T), r_1 ~ U(0,1) per sequence, then mu steps evenly to T.
    g = torch.Generator().manual_seed(packed_seed(b"maskgrpo/unigrpo-t1", seed, step, seq_index))
    t1 = math.floor(torch.rand((), generator=g, dtype=torch.float64).item() * UNIGRPO_T)
    return [math.floor((n - 1) / max(mu - 1, 1) * (UNIGRPO_T - t1) + t1) / UNIGRPO_T for n in range(1, mu + 1)]


def unigrpo_views(batch, order, cfg, *, step, seq_index, mask_id, **_) -> Views:
    """UniGRPO (arXiv:2505.15809): mu random-reversing views at its ratios, one per update."""
    window = torch.ones(batch.x.shape[0], batch.window, dtype=torch.bool, device=batch.x.device)  # (B, N)
    masks, _ = build_masks(batch.prompt_mask, window, seed=derive_seed(cfg.seed, "masks", batch.task), step=step,
                           seq_index=seq_index, mu=cfg.mu, estimator="unigrpo",
                           suffix_len=batch.x.shape[1] - batch.prompt_len - batch.window)  # (mu, B, L)
    return Views([batch.x.masked_fill(m, mask_id) for m in masks], masks, [[j] for j in range(cfg.mu)])


def d1_views(batch, order, cfg, *, image, step, seq_index, eos_id, mask_id, **_) -> Views:
    """d1 (arXiv:2504.12216): view j = d1_masks' j, scoring text up to its first EOS, every image slot."""
    x, window = batch.x, batch.x[:, batch.window_slice]  # (B, L), (B, N)
    scored = torch.ones_like(window, dtype=torch.bool) if image else completion_mask_until_eos(window, eos_id)
    ins, loss_masks = d1_masks(batch.prompt_mask, scored, seed=derive_seed(cfg.seed, "masks", batch.task), step=step,
                               seq_index=seq_index, mu=cfg.mu, p_mask_prompt=cfg.p_mask_prompt,
                               suffix_len=x.shape[1] - batch.window_slice.stop)  # (mu, B, L) each
    return Views([x.masked_fill(m, mask_id) for m in ins], loss_masks, [[j] for j in range(cfg.mu)])


def trajectory_views(batch, order, cfg, *, image, step, seq_index, mask_id, all_max, **_) -> Views:
    """The exact decoding path: the T sampler states where any rank revealed a token, each scoring what it
    revealed, all in every update (--trajectory_states=K: K)."""
    x, B = batch.x, batch.x.shape[0]
    in_masks, loss_masks = trajectory_masks(order, cfg.image_steps if image else cfg.steps)
    keep = all_max(loss_masks.flatten(1).any(1).to(x.device, torch.float32)).bool().cpu()
    in_masks, loss_masks = in_masks[keep], loss_masks[keep]  # (T, B, L) each
    T = len(in_masks)
    if not cfg.trajectory_states:
        return Views([x.masked_fill(m, mask_id) for m in in_masks], loss_masks, [range(T)] * cfg.mu)
    K = min(cfg.trajectory_states, T)
    states, updates = draw_states(T, K, cfg.mu, step=step, seq_index=seq_index,
                                  seed=derive_seed(cfg.seed, "trajectory-states", batch.task))  # (U, B)
    pick = states.to(x.device), torch.arange(B, device=x.device)  # view u of row b: state u of b
    norm = loss_masks.sum().float() * (K / T)  # K = T: exactly the full count
    in_masks, loss_masks = in_masks[pick], loss_masks[pick]  # (U, B, L) each
    return Views([x.masked_fill(m, mask_id) for m in in_masks], loss_masks, updates, norm)


# --estimator's views functions, called by train.rl_step
VIEWS = {"maskgrpo": maskgrpo_views, "d1": d1_views, "unigrpo": unigrpo_views, "trajectory": trajectory_views}


def d1_masks(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, *, seed: int, step: int, seq_index,
             mu: int, p_mask_prompt: float, suffix_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """d1's (arXiv:2504.12216) mu (input mask, loss mask) pairs, bool (mu, B, L) each: the whole window masked (a
    visible trailing EOS gives the length away), each real prompt token with prob p_mask_prompt."""
    assert 0.0 <= p_mask_prompt <= 1.0, f"{p_mask_prompt=} in [0, 1]"
    (B, P), N = prompt_mask.shape, completion_mask.shape[1]
    in_masks = torch.zeros(mu, B, P + N + suffix_len, dtype=torch.bool, device=completion_mask.device)
    loss_masks = torch.zeros_like(in_masks)  # (mu, B, L)
    real = [m.nonzero().squeeze(1) for m in prompt_mask.cpu()]  # each row's real prompt positions
    for j in range(mu):
        for b, i in enumerate(seq_index):  # the k-th uniform masks the k-th REAL token: padding changes nothing
            g = torch.Generator().manual_seed(mask_seed(seed, step, int(i), j))
            u = torch.rand(real[b].numel(), generator=g, dtype=torch.float64)
            in_masks[j, b, real[b][u < p_mask_prompt].to(in_masks.device)] = True
        in_masks[j, :, P:P + N] = True
        loss_masks[j, :, P:P + N] = completion_mask
    return in_masks, loss_masks


def build_masks(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, *, seed: int, step: int,
                seq_index, mu: int, gamma: float = 0.6, estimator: str = "maskgrpo", mode: str = "arlike",
                p_mask_prompt: float = 0.15, suffix_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A mask estimator's mu (input mask, loss mask) pairs, bool (mu, B, L) each."""
    assert estimator in MASK_ESTIMATORS and mode in MODES, f"{estimator=} in {MASK_ESTIMATORS}, {mode=} in {MODES}"
    assert mu >= 1 and prompt_mask.dtype == completion_mask.dtype == torch.bool, f"{mu=} >= 1; bool (B, P), (B, N)"
    idx = [int(i) for i in seq_index]
    assert len(idx) == prompt_mask.shape[0], f"seq_index has {len(idx)} entries for {prompt_mask.shape[0]} rows"
    if estimator == "d1":
        return d1_masks(prompt_mask, completion_mask, seed=seed, step=step, seq_index=idx,
                        mu=mu, p_mask_prompt=p_mask_prompt, suffix_len=suffix_len)
    if estimator == "maskgrpo":
        ratios = [[r] * len(idx) for r in mask_ratios(mu, gamma)]  # [mu][B]
    else:
        ratios, mode = list(zip(*[_unigrpo_ratios(seed, step, i, mu) for i in idx])), "random"
    (B, P), N = prompt_mask.shape, completion_mask.shape[1]
    prompt_len = prompt_mask.sum(1).tolist()  # [B] each row's real prompt length (arlike_official's P)
    masks = torch.zeros(mu, B, P + N + suffix_len, dtype=torch.bool, device=completion_mask.device)  # (mu, B, L)
    for j, r in enumerate(ratios):  # o^t_j ~ Rev(o, r, S_j), never the prompt (§3)
        seeds = [mask_seed(seed, step, i, j) for i in idx]
        masks[j, :, P:P + N] = reverse_mask(completion_mask, r, seeds, mode, prompt_len=prompt_len)  # (B, N)
    return masks, masks.clone()


# Settings that only some estimators read: (flag, the estimators that read it).
READ_BY = (("gamma_text", ("maskgrpo",)), ("gamma_image", ("maskgrpo",)), ("text_reversing", ("maskgrpo",)),
           ("p_mask_prompt", ("d1",)))


def ignored_settings(cfg, defaults) -> list[str]:
    """The flags set away from their default that cfg.estimator does not read."""
    return [k for k, users in READ_BY if cfg.estimator not in users and getattr(cfg, k) != getattr(defaults, k)]


# --- log-probs: the estimator's terms and the exact decoding log-likelihood

def token_logprobs(model, input_ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor, *,
                   attention_mask=None, vocab_slice: tuple[int, int] | None = None, device_batch_size: int = 0):
    """float32 (B, L): log pi(targets | input_ids) at `positions`, 0 elsewhere; vocab_slice=(lo, hi): targets - lo
    over the columns [lo, hi) (image codes). No 1/t ELBO weight (official code)."""
    assert input_ids.shape == targets.shape == positions.shape and positions.dtype == torch.bool, "(B, L), bool"
    assert device_batch_size >= 0, f"{device_batch_size=} >= 0"
    (B, L), (lo, hi) = input_ids.shape, vocab_slice or (0, None)
    out = torch.zeros(B, L, dtype=torch.float32, device=input_ids.device)  # unscored: exactly 0
    # one host read per call: each row's first and last scored column, and its padding
    cols = torch.arange(L, device=positions.device)
    first, last = torch.where(positions, cols, L).min(1).values, torch.where(positions, cols, -1).max(1).values
    pad = torch.zeros_like(first, dtype=torch.bool) if attention_mask is None else (attention_mask == 0).any(1)
    first, last, padded = torch.stack([first, last, pad.long()]).tolist()
    outside = torch.zeros((), dtype=torch.bool, device=input_ids.device)  # a scored target outside [lo, hi)
    for rows in chunks(B, device_batch_size):
        # the head over the scored columns only: (b, L, V) logits would fill memory at 8B
        win = slice(min(first[rows], default=L), max(last[rows], default=-1) + 1)  # empty if none
        am = () if attention_mask is None else (attention_mask[rows],)  # positional: any model's name
        if getattr(model, "accepts_cache_kwargs", False):
            # float32 head: bf16 rounds a logit by up to 0.06; an update moves log pi by ~1e-3 (Eq. 9)
            logits = model(input_ids[rows], *am, logits_at=win, vocab_slice=vocab_slice, float32_head=True,
                           padded=any(padded[rows]))
        else:  # any other model: the full logits (b, L, V), then the same window and columns
            win = slice(0, L)
            logits = model(input_ids[rows], *am)[..., lo:hi].float()
        pos, t, width = positions[rows, win], targets[rows, win] - lo, logits.shape[-1]  # (b, l) each
        outside = outside | (((t < 0) | (t >= width)) & pos).any()
        # unscored targets outside [lo, hi) (prompt tokens): clamped, then dropped (zero gradient)
        lp = F.log_softmax(logits, dim=-1).gather(-1, t.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)  # (b, l)
        out[rows, win] = lp.masked_fill(~pos, 0.0)
    assert not bool(outside), f"targets outside the vocabulary [{lo}, {hi if hi is not None else 'V'})"
    return out


def trajectory_masks(order: torch.Tensor, num_steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input mask x^(s): revealed at s or later, loss mask: revealed at s), bool (T, B, L) each, per step
    s < T (num_steps; default: the last + 1). order: (B, L), the step that revealed each, -1 the prompt."""
    assert not order.is_floating_point() and bool((order >= -1).all()), "order: integer (B, L), -1 = never masked"
    steps = torch.arange(int(order.max()) + 1 if num_steps is None else num_steps, device=order.device)
    return order >= steps[:, None, None], order == steps[:, None, None]  # (T, B, L) each


def draw_states(num_states: int, k: int, mu: int, *, seed: int, step: int,
                seq_index) -> tuple[torch.Tensor, list[list[int]]]:
    """(states (U, B), U = min(mu K, T); updates: mu lists of K views): update j takes positions jK .. jK+K-1 of
    each row's seeded permutation of its T states, cyclically: a uniform K-subset (unbiased)."""
    assert k >= 1 and mu >= 1 and num_states >= 1, f"{k=}, {mu=}, {num_states=} must be >= 1"
    T, K = num_states, min(k, num_states)
    perms = [torch.arange(T) if K == T else torch.randperm(T, generator=torch.Generator().manual_seed(
        packed_seed(b"maskgrpo/trajectory-states", seed, step, int(i)))) for i in seq_index]
    # View u holds permutation position u; positions past T wrap to u mod T (U = T then).
    updates = [[(j * K + s) % T for s in range(K)] for j in range(mu)]
    return torch.stack(perms, 1)[: min(mu * K, T)], updates  # (U, B)


@torch.no_grad()  # a measurement: a graph kept across all the steps would hold every step's activations
def decoding_logprob(model, x: torch.Tensor, order: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                     vocab_slice: tuple[int, int] | None = None, mask_id: int) -> torch.Tensor:
    """Exact decoding log-likelihood l_pi(o) = sum_s sum_{k revealed at s} log pi(o_k | c, x^(s)), (B,) fp32 (§3),
    x^(s) the state the sampler saw at step s (trajectory_masks). One batched forward per step."""
    assert order.shape == x.shape, "order: (B, L), the step each position was revealed at"
    total = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)  # (B,)
    for state, revealed in zip(*trajectory_masks(order)):
        if revealed.any():
            total = total + token_logprobs(model, x.masked_fill(state, mask_id), x, revealed,
                                           attention_mask=attention_mask, vocab_slice=vocab_slice).sum(-1)
    return total
