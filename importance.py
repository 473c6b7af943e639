"""MaskGRPO importance estimator: seeded re-masking of finished completions + per-token log-probs.

MaskGRPO (arXiv:2510.02880; method.md §1.5, §2). GRPO needs pi_theta(o) / pi_old(o), but the sequence
likelihood of a masked diffusion model is intractable. MaskGRPO re-masks the *finished* completion with a
seeded "reversing" operator o^t ~ Rev(o, t, S), scores pi_theta, pi_old and pi_ref on that same masked
input, and uses the per-token log-prob differences at the masked completion positions as log importance
ratios. The three policies must see bit-identical masked inputs, so every mask here is a deterministic
function of (seed, ratio, N) and nothing else.

Public API
    mask_ratios(num_iterations, gamma)      ratio of inner iteration j: min(gamma + (1-gamma)(j+1)/mu, 0.999)
    mask_seed(seed, step, seq_index, j)     stable 63-bit seed of one (sequence, inner iteration)
    reverse_mask(completion_mask, ratio, seeds, mode)   AR-like ("arlike") or uniform ("random") reversing
    build_masks(prompt_mask, completion_mask, ...)      the mu (input mask, loss mask) pairs of a rollout step,
                                                        for estimator = "maskgrpo" | "d1" | "unigrpo"
    apply_mask(input_ids, mask, mask_id)    put the mask token at masked positions
    token_logprobs(model, x_masked, targets, positions, ...)   float32 log pi(target | masked input)

Seeds: a sequence's global index is global_prompt_index * group_size + member (member = 0..G-1). Masks
depend only on (run seed, step, global sequence index, j), and uniforms come from a CPU torch.Generator
per row, moved to the target device afterwards (CPU and CUDA streams differ). So masks do not depend on
device, world size or batch composition, and the global RNG is never touched (style.md §3.3, §3.7).

Usage per rollout step (train.py), j = inner iteration:
    in_masks, loss_masks = build_masks(prompt_mask, completion_mask, seed=..., step=..., seq_index=...,
                                       num_iterations=mu, gamma=..., estimator=..., mode=...)  # (mu, B, L)
    x_j = apply_mask(x, in_masks[j], mask_id)                  # same x_j for old, ref and current policy
    logp_old[j] = token_logprobs(model, x_j, x, loss_masks[j])  # torch.no_grad, model.eval()
    logp = token_logprobs(model, x_j, x, loss_masks[j])         # inner iteration j, with grad
    grpo.policy_loss(logp, logp_old[j], adv, loss_masks[j], ...)  # weight = THIS iteration's mask only
Old (and ref) log-probs must come from the model in eval mode: dropout during the old pass makes the j = 0
ratios differ from 1 (official-code bug, method.md §9 item 19). The official HEAD weights the loss by the
sum of all mu masks (method.md §9 item 5); loss_masks[j] fixes that.

Differences from the official code (method.md §9), and why:
 1. Seeds are hashed per (run seed, step, global sequence, j) and drawn on private CPU generators, not
    per-process randint(0, 4096) + global set_seed (item 17): world-size independent, no RNG side effects.
 2. mu = 1 works (item 14); any mode other than arlike/random raises instead of crashing later (item 15).
 3. log_softmax in float32 (item 20). No 1/t weight, as in the code (the paper's use of it is unclear).
 4. UniGRPO's r_1 is drawn per sequence with T = 1000 levels; MMaDA states neither (method.md §2.7).

Shapes: B sequences (prompts x group), P prompt length, N generation window, S suffix after the window
(e.g. <|eoi|> for images, usually 0), L = P + N + S, V vocab, mu inner iterations, T selected positions.
"""
import hashlib
import math
import struct

import torch
import torch.nn.functional as F

ESTIMATORS = ("maskgrpo", "d1", "unigrpo")
MODES = ("arlike", "random")
MAX_RATIO = 0.999  # official schedule clamps the last ratio 1.0 -> 0.999 (method.md §2.2)
# UniGRPO discretises t into T levels (method.md §2.7). MMaDA does not state T for RL; we take 1000
# (the usual diffusion step count) so that t_n / T is a fine-grained ratio independent of N.
UNIGRPO_T = 1000


# -----------------------------------------------------------------------------
# ratio schedule and seeds

def mask_ratios(num_iterations: int, gamma: float) -> list[float]:
    """Mask ratio of each inner iteration j = 0..mu-1 (method.md §2.2, paper Alg. 5 as summarised)."""
    if num_iterations < 1:
        raise ValueError(f"num_iterations ({num_iterations}) must be >= 1; try --num_iterations=12 (paper)")
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"gamma ({gamma}) must be in [0, 1); the paper uses 0.6 (text) and 0.8 (images)")
    mu = num_iterations
    # method.md §2.3 timestep truncation (paper Alg. 5 as summarised): t_j = gamma + (1-gamma) j/mu with
    # j = 1..mu, so the smallest ratio is gamma + (1-gamma)/mu (never gamma itself); the last one is
    # clamped to 0.999 as in the code.
    # mu = 1 gives [0.999] (the official code crashes there, method.md §9 item 14).
    return [min(gamma + (1.0 - gamma) * (j + 1) / mu, MAX_RATIO) for j in range(mu)]


def _stable_seed(tag: bytes, *ints: int) -> int:
    # blake2b of the packed ints, not hash(): stable across processes, Python versions and machines,
    # and well mixed, so neighbouring (step, seq_index, j) give unrelated generator states.
    digest = hashlib.blake2b(tag + struct.pack(f"<{len(ints)}q", *ints), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: fits torch.Generator.manual_seed


def _check_ints(**kwargs: int) -> None:
    for name, v in kwargs.items():
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
            raise ValueError(f"{name} ({v!r}) must be a non-negative int < 2**63")


def mask_seed(seed: int, step: int, seq_index: int, j: int) -> int:
    """Seed S_j of one sequence's mask in inner iteration j of rollout `step` (method.md §2.4).

    seq_index is the GLOBAL sequence index (global_prompt_index * group_size + member), never the rank,
    so the mask is the same whichever process holds the sequence. Replaces the official per-process
    randint(0, 4096) seeds and global set_seed (method.md §9 item 17).
    """
    _check_ints(seed=seed, step=step, seq_index=seq_index, j=j)
    return _stable_seed(b"maskgrpo/mask", seed, step, seq_index, j)


def _per_row(values, B: int, name: str, cast) -> list:
    # Accept a scalar (broadcast), a list or a 1-D tensor with one entry per row.
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        return [cast(values)] * B
    values = values.tolist() if torch.is_tensor(values) else list(values)
    if len(values) != B:
        raise ValueError(f"{name} has {len(values)} entries but the batch has {B} rows")
    return [cast(v) for v in values]


# -----------------------------------------------------------------------------
# reversing operators (which completion tokens get masked)

def _arlike_keep(N: int, ratio: float) -> torch.Tensor:
    # method.md §2.5, paper Alg. 1 as summarised (AR-like / fading-out reversing): d_n = 1 - n/(N-1)
    # falls linearly over the whole generation window, keep_n = min(1, d_n (1-r) N / sum(d)) = min(1, 2(1-r) d_n).
    # Late tokens (where semi-AR rollouts diverge) are masked more often; for r >= 0.5 the expected
    # masked fraction is exactly r, below 0.5 the clamp raises it (r = 0.3 -> ~0.357).
    # N == 1: d = [1], sum(d) = 1, so keep = 1 - r and the lone token is masked with prob r.
    if N == 1:
        d = torch.ones(1, dtype=torch.float64)  # (1,)
    else:
        d = 1.0 - torch.arange(N, dtype=torch.float64) / (N - 1)  # (N,), d[-1] == 0 exactly
    return (d * (1.0 - ratio) * N / d.sum()).clamp(max=1.0)  # (N,)


def reverse_mask(completion_mask: torch.Tensor, ratio, seeds, mode: str = "arlike") -> torch.Tensor:
    """Seeded reversing o^t ~ Rev(o, r, S) of the completion block (method.md §2.5).

    completion_mask: bool (B, N), True at completion positions that may be masked (N = generation
    window). ratio: float or one per row. seeds: one int per row (list or LongTensor (B,)).
    Returns bool (B, N), True = replace by the mask token; always False where completion_mask is False.
    Row b depends only on (seeds[b], ratio[b], N): uniforms come from a fresh CPU generator per row.
    """
    if mode not in MODES:
        raise ValueError(f"mode ({mode!r}) must be one of {MODES}")
    assert completion_mask.dtype == torch.bool and completion_mask.dim() == 2, \
        f"completion_mask must be bool (B, N), got {completion_mask.dtype} {tuple(completion_mask.shape)}"
    B, N = completion_mask.shape
    seeds = _per_row(seeds, B, "seeds", int)
    ratios = _per_row(ratio, B, "ratio", float)
    for r in ratios:
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"mask ratio ({r}) must be in [0, 1]")
    mask = torch.zeros(B, N, dtype=torch.bool)  # (B, N), built on CPU
    for b in range(B):
        g = torch.Generator(device="cpu").manual_seed(seeds[b])
        u = torch.rand(N, generator=g, dtype=torch.float64)  # (N,) U[0, 1)
        if mode == "random":
            # method.md §2.5, paper Alg. 2 as summarised (random reversing, used for images):
            # P(mask) = r at every position
            mask[b] = u < ratios[b]
        else:
            # mask iff U >= keep_n, so P(mask_n) = 1 - keep_n; keep = 0 (last token) masks surely
            mask[b] = u >= _arlike_keep(N, ratios[b])
    # Prompt/padding live outside this block, so they can never be masked here; inside it, positions
    # the caller marked invalid stay visible as well.
    return mask.to(completion_mask.device) & completion_mask  # (B, N)


def _d1_prompt_mask(prompt_mask: torch.Tensor, p_mask_prompt: float, seeds: list[int]) -> torch.Tensor:
    # diffu-GRPO (method.md §2.7): each real prompt token is masked with prob p_mask_prompt. The k-th
    # uniform goes to the k-th REAL token, so the draw ignores how much padding the batch added (P
    # differs between batches when prompts are padded to the longest one).
    pm = prompt_mask.cpu()  # (B, P)
    out = torch.zeros_like(pm)  # (B, P) bool
    for b in range(pm.shape[0]):
        real = pm[b].nonzero().squeeze(1)  # (num_real,) positions of real prompt tokens
        g = torch.Generator(device="cpu").manual_seed(seeds[b])
        u = torch.rand(real.numel(), generator=g, dtype=torch.float64)  # (num_real,)
        out[b, real[u < p_mask_prompt]] = True
    return out.to(prompt_mask.device)  # (B, P), False at every padding position


def _unigrpo_ratios(seed: int, step: int, seq_index: int, mu: int) -> list[float]:
    # MMaDA UniGRPO (method.md §2.7): r_1 ~ U(0,1), t_1 = floor(r_1 T),
    # t_n = floor((n-1)/(mu-1) (T - t_1) + t_1) for n = 1..mu: evenly spaced from a random start to T.
    # r_1 is drawn per sequence from its own seed (not per batch), so it is world-size independent.
    g = torch.Generator(device="cpu").manual_seed(_stable_seed(b"maskgrpo/unigrpo-t1", seed, step, seq_index))
    t1 = math.floor(torch.rand((), generator=g, dtype=torch.float64).item() * UNIGRPO_T)
    if mu == 1:
        return [t1 / UNIGRPO_T]  # only t_1 is defined when mu = 1
    ts = [math.floor((n - 1) / (mu - 1) * (UNIGRPO_T - t1) + t1) for n in range(1, mu + 1)]
    return [t / UNIGRPO_T for t in ts]


def build_masks(prompt_mask: torch.Tensor, completion_mask: torch.Tensor, *, seed: int, step: int,
                seq_index, num_iterations: int, gamma: float = 0.6, estimator: str = "maskgrpo",
                mode: str = "arlike", p_mask_prompt: float = 0.15,
                suffix_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """All mu masks of one rollout step, over the full sequence [prompt (P) | window (N) | suffix (S)].

    prompt_mask: bool (B, P), True at real prompt tokens (False at padding). completion_mask: bool
    (B, N), True at completion positions that may be masked and scored. seq_index: global sequence
    index per row (list or LongTensor (B,)). Returns (in_masks, loss_masks), both bool (mu, B, L):
    in_masks[j] says which tokens to replace by the mask token in inner iteration j; loss_masks[j]
    says which positions enter the loss (always completion positions masked in iteration j).
    estimator: "maskgrpo" (gamma schedule, `mode` reversing), "d1" (gamma and mode unused), "unigrpo"
    (random reversing at UniGRPO ratios; gamma and mode unused).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator ({estimator!r}) must be one of {ESTIMATORS}")
    if mode not in MODES:
        raise ValueError(f"mode ({mode!r}) must be one of {MODES}")
    if not 0.0 <= p_mask_prompt <= 1.0:
        raise ValueError(f"p_mask_prompt ({p_mask_prompt}) must be in [0, 1]; d1 uses 0.15")
    if num_iterations < 1:
        raise ValueError(f"num_iterations ({num_iterations}) must be >= 1; try --num_iterations=12 (paper)")
    assert prompt_mask.dtype == torch.bool and completion_mask.dtype == torch.bool, "masks must be bool"
    assert prompt_mask.shape[0] == completion_mask.shape[0], \
        f"batch mismatch: prompt_mask {tuple(prompt_mask.shape)} vs completion_mask {tuple(completion_mask.shape)}"
    (B, P), N, mu = prompt_mask.shape, completion_mask.shape[1], num_iterations
    L = P + N + suffix_len
    idx = _per_row(seq_index, B, "seq_index", int)
    if estimator == "maskgrpo":
        ratios = [[r] * B for r in mask_ratios(mu, gamma)]  # [mu][B], same ratio for every row
    elif estimator == "unigrpo":
        per_seq = [_unigrpo_ratios(seed, step, i, mu) for i in idx]  # [B][mu]
        ratios = [[per_seq[b][j] for b in range(B)] for j in range(mu)]  # [mu][B]
    in_masks = torch.zeros(mu, B, L, dtype=torch.bool, device=completion_mask.device)  # (mu, B, L)
    loss_masks = torch.zeros_like(in_masks)  # (mu, B, L)
    window = slice(P, P + N)
    for j in range(mu):
        seeds = [mask_seed(seed, step, i, j) for i in idx]  # one S_j per sequence
        if estimator == "d1":
            in_masks[j, :, :P] = _d1_prompt_mask(prompt_mask, p_mask_prompt, seeds)  # (B, P)
            # d1 scores the fully masked completion (t = 1): the whole window is masked in the input,
            # including positions the caller excludes from the loss (otherwise visible trailing EOS
            # would leak the answer length).
            in_masks[j, :, window] = True
            loss_masks[j, :, window] = completion_mask
        else:
            # method.md §1.5 (implication 2): the prompt is never masked; only the completion is reversed.
            rev_mode = mode if estimator == "maskgrpo" else "random"  # UniGRPO masks uniformly
            m = reverse_mask(completion_mask, ratios[j], seeds, rev_mode)  # (B, N)
            in_masks[j, :, window] = m
            loss_masks[j, :, window] = m  # only tokens masked in THIS iteration carry a ratio
    return in_masks, loss_masks


def apply_mask(input_ids: torch.Tensor, mask: torch.Tensor, mask_id: int) -> torch.Tensor:
    """input_ids (B, L) with positions where mask (B, L) is True replaced by mask_id."""
    assert mask.dtype == torch.bool and mask.shape == input_ids.shape, \
        f"mask must be bool with the shape of input_ids {tuple(input_ids.shape)}, got {mask.dtype} {tuple(mask.shape)}"
    return input_ids.masked_fill(mask, mask_id)  # (B, L)


# -----------------------------------------------------------------------------
# per-token log-probs

def token_logprobs(model, input_ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor, *,
                   attention_mask: torch.Tensor | None = None, vocab_slice: tuple[int, int] | None = None,
                   device_batch_size: int | None = None) -> torch.Tensor:
    """log pi(targets | masked input) at `positions`, 0 elsewhere: float32 (B, L).

    input_ids: (B, L) with the mask already applied; targets: (B, L) clean tokens; positions: bool
    (B, L). vocab_slice=(lo, hi) restricts the softmax to columns [lo, hi) and scores targets - lo
    (images: the codebook columns, method.md §2.6). device_batch_size splits the rows into forward
    passes of at most that many sequences. Works with grad (current policy) and under torch.no_grad
    (old/ref). No 1/t ELBO weight, as in the official code (method.md §2.6, §9 item 2).
    """
    assert input_ids.shape == targets.shape == positions.shape and positions.dtype == torch.bool, \
        f"input_ids {tuple(input_ids.shape)}, targets {tuple(targets.shape)} and bool positions " \
        f"{tuple(positions.shape)} must share one (B, L) shape"
    B, L = input_ids.shape
    if device_batch_size is not None and device_batch_size < 1:
        raise ValueError(f"device_batch_size ({device_batch_size}) must be >= 1 (or None for one pass)")
    mbs = device_batch_size or max(B, 1)
    lo, hi = vocab_slice if vocab_slice is not None else (0, None)
    tgt = targets - lo  # (B, L) indices into the (possibly sliced) vocabulary
    chunks = []
    for s in range(0, B, mbs):
        rows = slice(s, s + mbs)
        # Positional attention mask so both `attention_mask=` and `attn_mask=` model signatures work.
        am = None if attention_mask is None else attention_mask[rows]
        logits = model(input_ids[rows]) if am is None else model(input_ids[rows], am)  # (b, L, V)
        b = logits.shape[0]
        assert logits.shape[:2] == (b, L) and b == input_ids[rows].shape[0], \
            f"model returned logits {tuple(logits.shape)} for input {tuple(input_ids[rows].shape)}"
        pos = positions[rows]  # (b, L)
        # Keep only the scored rows before the float32 upcast: (T, V) instead of a (b, L, V) fp32 copy.
        sel = logits[pos][:, lo:hi]  # (T, V') in model dtype
        t = tgt[rows][pos]  # (T,)
        if t.numel() and (t.min() < 0 or t.max() >= sel.shape[-1]):
            bad = int(((t < 0) | (t >= sel.shape[-1])).sum())
            raise ValueError(f"{bad} target(s) fall outside the scored vocabulary {vocab_slice or (0, sel.shape[-1])}")
        # float32 before log_softmax: bf16 log-probs carry ~1e-2 error, which would dominate
        # importance ratios that should sit within 1 +- 0.2 (official code uses bf16, method.md §9 item 20).
        lp = F.log_softmax(sel.float(), dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)  # (T,)
        out = torch.zeros(b, L, dtype=torch.float32, device=logits.device)  # (b, L)
        out[pos] = lp  # differentiable scatter; unscored positions stay exactly 0 with zero grad
        chunks.append(out)
    if not chunks:
        return torch.zeros(B, L, dtype=torch.float32, device=input_ids.device)  # (0, L)
    return torch.cat(chunks, dim=0)  # (B, L)
