"""Reverse-process samplers for masked diffusion models: text (LLaDA) and images (MMaDA / MaskGRPO).

MaskGRPO (arXiv:2510.02880) rolls out with these samplers:
  generate        LLaDA's semi-autoregressive block sampler (LLaDA arXiv:2502.09992 and its public
                  generate.py, reproduced token for token at temperature 0), with opt-in fast approximations:
                  kv_cache, threshold (Fast-dLLM, arXiv:2505.22618; infra/bench.py measures them), stop_at_eos.
  generate_image  over the image slots of an MMaDA sequence `... <|soi|> n slots <|eoi|>`: MaskGRPO's "emerge"
                  sampler (MDLM ancestral sampling, paper Alg. 4) or MMaDA's MaskGIT sampler, with optional CFG.
Both can return the decoding order (return_order=True), from which importance.py rebuilds every state.
Every random number comes from the `generator` argument (one, or one per row), drawn on its own device, so
a CPU generator gives identical samples on CPU and GPU; the global RNG is never used.

    python sample.py --ckpt /path/to/LLaDA-8B-Instruct --prompt "What is 7 * 8?" --chat

Shapes: B batch, P prompt, N gen_length, L sequence (P + N for text), V vocabulary, n image slots, C codes.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

REMASKING = ("low_confidence", "random")
KV_CACHES = (None, "prefix", "dual")
IMAGE_SAMPLERS = ("emerge", "maskgit")
# BLAS takes another kernel (other rounding) for a GEMM of a few rows (on our 2-thread CPU, fewer than 12),
# which can flip a near-tie. A head over at least this many rows gives each row the full head's bits.
MIN_HEAD_ROWS = 32


def _need(ok, message):
    if not ok:
        raise ValueError(message)


def _skip(g, n, dtype):
    """Advance CPU generator g past n uniforms of `dtype` unkept: its Mersenne Twister spends two 32-bit words
    on a float64 and one on a float32 or a uint8 (tests/test_sample.py checks it against the full draw)."""
    words = n * (2 if dtype == torch.float64 else 1)
    for i in range(0, words, 1 << 24):
        torch.randint(0, 2, (min(1 << 24, words - i),), generator=g, dtype=torch.uint8)


def _uniform(shape, generator, device, dtype=torch.float64, active=None, cols=None):
    """U[0, 1) draws of `shape`, made on the generator's device, moved to `device`. generator may be a list
    of shape[0] generators: row i then depends on its own only, so a sequence gets the same sample in any
    batch, process or world size. active: with per-row generators, the rows that draw (others get 0.5 and
    leave their stream alone). cols: a slice of dim 1, the only columns returned; a CPU generator advances
    past the others as if it drew them (the full draw's numbers without its memory), another device's
    generator skips them (its numbers depend on the draw's size anyway)."""
    _need(generator is not None, "this call samples at random but generator is None; pass e.g. generator="
          "torch.Generator().manual_seed(0) (a CPU generator gives the same samples on every device)")
    rows = generator if isinstance(generator, (list, tuple)) else None
    _need(rows is None or len(rows) == shape[0], f"got {len(rows or [])} per-row generators for a batch of "
          f"{shape[0]} rows")
    if rows is None and cols is None:
        return torch.rand(shape, generator=generator, device=generator.device, dtype=dtype).to(device)
    lo, hi = (0, shape[1]) if cols is None else (cols.start, cols.stop)
    out = torch.empty((shape[0], hi - lo, *shape[2:]), dtype=dtype, device=device)
    per_col = math.prod(shape[2:])
    for i, g in enumerate(rows or [generator] * shape[0]):
        if rows is not None and active is not None and not active[i]:
            out[i] = 0.5
            continue
        _skip(g, lo * per_col * (g.device.type == "cpu"), dtype)
        out[i] = torch.rand(out.shape[1:], generator=g, device=g.device, dtype=dtype)
        _skip(g, (shape[1] - hi) * per_col * (g.device.type == "cpu"), dtype)
    return out


def _forward(model, x, attention_mask, lo, end, **kw):
    """Logits (B, end - lo, V) at positions [lo, end) of a full forward pass, the head on those positions
    only (widened to MIN_HEAD_ROWS rows) if the model takes logits_at. return_kv=True adds the cache."""
    B, L = x.shape
    if not getattr(model, "accepts_cache_kwargs", False):
        logits = model(x) if attention_mask is None else model(x, attention_mask=attention_mask)
        assert logits.shape[:2] == x.shape, f"model returned logits {tuple(logits.shape)} for input {tuple(x.shape)}"
        return logits[:, lo:end]
    w = min(L, max(end - lo, -(-MIN_HEAD_ROWS // B)))
    a = min(lo, L - w)                                                             # [a, a + w) holds [lo, end)
    out = model(x, attention_mask, logits_at=slice(a, a + w), **kw)
    return (out[0][:, lo - a:end - a], out[1]) if kw.get("return_kv") else out[:, lo - a:end - a]


def transfer_schedule(num_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to reveal at each step: num_masked (B,) -> (B, steps) int64, rows summing to num_masked.
    LLaDA Eq. (8): its linear schedule reveals a constant expected number per step, so c tokens over s steps
    get c // s each, the remainder going one apiece to the earliest steps."""
    _need(steps >= 1, f"steps ({steps}) must be >= 1")
    i = torch.arange(steps, device=num_masked.device)                              # (S,)
    c = num_masked.long()[:, None]                                                 # (B, 1)
    return c // steps + (i[None, :] < c % steps).long()                            # (B, S)


def gumbel_argmax(logits: torch.Tensor, temperature: float, u=None) -> torch.Tensor:
    """A sample of softmax(logits / temperature) per row, given float64 uniforms u of the logits' shape:
    (..., V) -> (...) int64; argmax at temperature 0. LLaDA's form exp(l) / (-log u)^tau (the argmax of
    l / tau + Gumbel), so the same uniforms pick the same tokens. float64: float32 uniforms truncate the
    Gumbel tail and lower the effective temperature (arXiv:2409.02908); the official trainer uses bf16."""
    if temperature == 0:
        return logits.argmax(-1)
    return (logits.double().exp() / (-torch.log(u)) ** temperature).argmax(-1)


def select_top_k(confidence: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool (B, L): row j marks the counts[j] positions that torch.topk(confidence[j], counts[j]) returns,
    as LLaDA's per-row topk loop, ties included (CPU topk breaks them in no fixed index order, and bf16
    confidences near p = 1 tie often), with one batched topk per distinct count. Checked on CPU only."""
    select = torch.zeros_like(confidence, dtype=torch.bool)                        # (B, L)
    for k in counts.unique().tolist():
        rows = (counts == k).nonzero().squeeze(1)                                  # (b,)
        select[rows[:, None], torch.topk(confidence[rows], k, dim=-1).indices] = True
    return select


def _record(order, before, after, mask_id, s):
    """order = s (in place) where `before` was masked and `after` is not; order None: nothing to do."""
    if order is not None:
        order[(before == mask_id) & (after != mask_id)] = s


# -----------------------------------------------------------------------------------------------------
# text: LLaDA semi-autoregressive sampler


def _check_text_args(prompt_ids, attention_mask, gen_length, block_length, steps, temperature, cfg_scale,
                     remasking, mask_id, model, kv_cache, threshold):
    _need(prompt_ids.dim() == 2 and not prompt_ids.is_floating_point(), f"prompt_ids must be a (B, P) integer "
          f"tensor, got {prompt_ids.dtype} {tuple(prompt_ids.shape)}")
    for name, v in (("gen_length", gen_length), ("block_length", block_length), ("steps", steps)):
        _need(v >= 1, f"{name} ({v}) must be >= 1")
    divisor = max(d for d in range(1, block_length + 1) if gen_length % d == 0)
    _need(gen_length % block_length == 0, f"gen_length ({gen_length}) must be divisible by block_length "
          f"({block_length}); try block_length={divisor} or gen_length={-(-gen_length // block_length) * block_length}")
    num_blocks, lower = gen_length // block_length, steps // (gen_length // block_length) * (gen_length // block_length)
    _need(steps % num_blocks == 0, f"steps ({steps}) must be a multiple of the number of blocks, gen_length // "
          f"block_length = {num_blocks}, since every block gets the same number of steps; try "
          f"{f'steps={lower} or ' if lower else ''}steps={lower + num_blocks}")
    _need(steps <= gen_length, f"steps ({steps}) > gen_length ({gen_length}): the extra steps would reveal "
          f"nothing and only cost forward passes; use steps <= {gen_length}")
    _need(temperature >= 0, f"temperature ({temperature}) must be >= 0 (0 = greedy)")
    _need(cfg_scale >= 0, f"cfg_scale ({cfg_scale}) must be >= 0 (0 = no guidance)")
    _need(remasking in REMASKING, f"remasking ({remasking!r}) must be one of {REMASKING}")
    real = torch.ones_like(prompt_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    _need(real.shape == prompt_ids.shape, f"attention_mask {tuple(real.shape)} must have the prompt's shape "
          f"{tuple(prompt_ids.shape)} (1 = real token, 0 = left padding)")
    _need(not (prompt_ids[~real] == mask_id).any(), f"the prompt padding uses the mask id ({mask_id}): padding "
          "would be generated over; pad with the EOS id, as LLaDA does")
    hits = ((prompt_ids == mask_id) & real).nonzero()[:4].tolist()
    _need(not hits, f"prompt_ids contains the mask id ({mask_id}) at (row, position) {hits}; LLaDA would "
          "silently generate a token there. Remove it, or check that mask_id and the tokenizer match")
    _need(kv_cache in KV_CACHES, f"kv_cache ({kv_cache!r}) must be one of {KV_CACHES} (None = exact)")
    _need(kv_cache is None or getattr(model, "accepts_cache_kwargs", False), f"kv_cache={kv_cache!r} needs a "
          f"model whose forward takes the kv / start / return_kv arguments (model.Transformer); "
          f"{type(model).__name__} does not: use kv_cache=None")
    _need(threshold is None or threshold >= 0, f"threshold ({threshold}) must be a confidence >= 0 (Fast-dLLM "
          "uses 0.9), or None for the fixed schedule")
    _need(threshold is None or remasking == "low_confidence", f"threshold compares model confidences, but "
          f"remasking={remasking!r} ranks by a uniform draw; use remasking='low_confidence' or threshold=None")
    return num_blocks, steps // num_blocks


def _block(model, x, attention_mask, prompt_index, start, end, steps, order, s0, *, kv_cache, threshold,
           temperature, cfg_scale, remasking, mask_id, generator, eos_id, eot_id, logits_eos_inf,
           confidence_eos_eot_inf, bar):
    """Denoise x[:, start:end] (b, L) in place in `steps` steps (at most, on the fast paths); order gets
    s0 + i where step i reveals. The exact sampler is LLaDA's generate() inner loop."""
    B, L = x.shape
    exact = kv_cache is None and threshold is None
    counts = transfer_schedule((x[:, start:end] == mask_id).sum(1), steps) if exact else None  # (b, steps)
    mask2 = attention_mask if cfg_scale == 0 or attention_mask is None else attention_mask.repeat(2, 1)
    kv = None
    for i in range(steps):
        masked = x == mask_id                                                      # (b, L)
        # LLaDA lets a predicted mask id stay masked to compete again, even past its block, so the exact
        # sampler chooses from the first masked position on; the fast paths never commit the mask id.
        lo = start
        if exact:
            cols = masked[:, :end].any(0).nonzero()
            lo = int(cols[0]) if len(cols) else end
        # CFG (arXiv:2410.18514, as LLaDA's generate.py): the unconditional half has the prompt masked.
        xx = x if cfg_scale == 0 else torch.cat([x, x.masked_fill(prompt_index, mask_id)])  # (b or 2b, L)
        if kv is None:  # a full forward (with a cache, the block start's, which stores the keys and values)
            logits = _forward(model, xx, mask2, lo, end, return_kv=kv_cache is not None)  # (b or 2b, l, V)
            logits, kv = logits if kv_cache is not None else (logits, None)
        else:  # Fast-dLLM: recompute the block and what follows (prefix) or the block alone (dual)
            stop = L if kv_cache == "prefix" else end
            logits = model(xx[:, start:stop], mask2, kv=kv, start=start, logits_at=slice(0, end - start))
        if cfg_scale:  # l_u + (w + 1)(l_c - l_u), in this order so bf16 rounds as the reference
            cond, uncond = logits.chunk(2)
            logits = uncond + (cfg_scale + 1) * (cond - uncond)                   # (b, l, V)
        if not exact:
            logits[..., mask_id] = -math.inf
        if logits_eos_inf:
            logits[..., eos_id] = -math.inf
        # Exact: each row's noise over the whole sequence, LLaDA's stream. Fast: over the block, and a row
        # whose block is done draws nothing (its per-row stream advances as when decoded alone).
        draw = dict(cols=slice(lo, end)) if exact else dict(active=masked[:, start:end].any(1).tolist())
        width = L if exact else end - start
        u = _uniform((B, width, logits.shape[-1]), generator, x.device, **draw) if temperature > 0 else None
        x0 = gumbel_argmax(logits, temperature, u)                                 # (b, l)
        if confidence_eos_eot_inf:  # LLaDA: after x0, on the clean logits (the noisy ones at temperature 0)
            logits[..., eot_id] = -math.inf
            if temperature == 0:
                logits[..., eos_id] = -math.inf
        if remasking == "low_confidence":  # in the logits' dtype, as LLaDA: float32 breaks bf16 ties otherwise
            conf = F.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)  # (b, l)
        else:
            conf = _uniform((B, width), generator, x.device, torch.float32, **draw)  # (b, l)
        m = masked[:, lo:end]                                                      # (b, l)
        full = torch.full((B, L), -math.inf, dtype=conf.dtype, device=x.device)   # topk on LLaDA's full rows
        full[:, lo:end] = torch.where(m, conf, -math.inf)
        # Fast: at least ceil(masked left / steps left), the fixed schedule when nothing extra was committed.
        left = masked[:, start:end].sum(1)                                         # (b,)
        select = select_top_k(full, counts[:, i] if exact else (left + steps - i - 1) // (steps - i))[:, lo:end]
        if threshold is not None:  # Fast-dLLM's parallel decoding: also every masked position beyond tau
            select |= m & (conf > threshold)
        new = torch.where(select & m, x0, x[:, lo:end])                            # (b, l)
        _record(None if order is None else order[:, lo:end], x[:, lo:end], new, mask_id, s0 + i)
        x[:, lo:end] = new
        bar.update()
        if not exact and not (x[:, start:end] == mask_id).any():
            break
    return x


@torch.no_grad()
def generate(model, prompt_ids, *, gen_length, block_length, steps, temperature=0.0, cfg_scale=0.0,
             remasking="low_confidence", mask_id, generator=None, attention_mask=None, logits_eos_inf=False,
             confidence_eos_eot_inf=False, eos_id=None, eot_id=None, kv_cache=None, threshold=None,
             stop_at_eos=False, return_order=False, progress=False):
    """LLaDA's semi-autoregressive sampler: prompt_ids (B, P) int64, left-padded, attention_mask (B, P) 1 =
    real token (optional) -> x (B, P + N), prompt included. return_order=True also returns order (B, P + N)
    int64: the step at which each position was revealed, counted across blocks (block b's step i is
    b * steps // num_blocks + i), -1 where none was (the prompt). The state before step s is x with every
    position of order >= s masked.

    gen_length / block_length blocks are denoised left to right, steps / num_blocks steps each. Every step
    predicts x0 (Gumbel-max at temperature > 0) and reveals, in the block, the transfer_schedule count of
    masked positions with the highest confidence: p(x0) for "low_confidence", a uniform draw for "random".
    A position whose x0 is the mask id stays masked, as in LLaDA. The model should be in eval mode.

    The defaults are the exact sampler. The fast options approximate the behaviour policy only (MaskGRPO
    rescores under its own masks, importance.py); they never commit the mask id.

    Args:
        cfg_scale: guidance weight w; logits = l_u + (w + 1)(l_c - l_u), l_u with the prompt masked.
        generator: torch.Generator for the Gumbel noise (temperature > 0) and "random" confidences, or a
            list of B generators, one per row (a row's sample then does not depend on its batch).
        logits_eos_inf: never predict EOS (eos_id, default model.config.eos_token_id).
        confidence_eos_eot_inf: give EOT (eot_id) predictions confidence 0, and EOS ones at temperature 0,
            as LLaDA's flag does.
        kv_cache: None, "prefix" or "dual" (Fast-dLLM's block cache): a full forward at each block start
            caches every layer's keys and values; later steps recompute the block and the suffix ("prefix")
            or the block alone ("dual") against that cache. Needs model.Transformer's kv arguments.
        threshold: None or tau: each step also commits every masked position of the block more confident
            than tau (Fast-dLLM's parallel decoding, 0.9 there), at least ceil(masked left / steps left);
            a block may end early. tau >= 1 never fires. low_confidence only.
        stop_at_eos: once a block leaves an EOS in a row's completion, fill the rest of the row with EOS and
            drop it from later passes. Exact up to the first EOS (at temperature 0 up to kernel rounding on
            the smaller batch, at temperature > 0 in distribution).
    """
    num_blocks, spb = _check_text_args(prompt_ids, attention_mask, gen_length, block_length, steps, temperature,
                                       cfg_scale, remasking, mask_id, model, kv_cache, threshold)
    eos_id = getattr(getattr(model, "config", None), "eos_token_id", None) if eos_id is None else eos_id
    _need(eos_id is not None or not (logits_eos_inf or confidence_eos_eot_inf or stop_at_eos), "logits_eos_inf / "
          "confidence_eos_eot_inf / stop_at_eos need eos_id, and the model has no config.eos_token_id")
    _need(eot_id is not None or not confidence_eos_eot_inf, "confidence_eos_eot_inf needs eot_id, the "
          "<|eot_id|> token id (126348 for LLaDA)")
    _need(not (stop_at_eos and return_order), "stop_at_eos writes EOS that no step decoded, so it has no order")
    B, P = prompt_ids.shape
    x = torch.cat([prompt_ids.long(), prompt_ids.new_full((B, gen_length), mask_id).long()], 1)  # (B, L)
    order = torch.full_like(x, -1) if return_order else None                      # (B, L)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, gen_length)], dim=1)  # (B, L)
    prompt_index = x != mask_id  # before anything is revealed: what CFG's unconditional input masks
    sampling = dict(kv_cache=kv_cache, threshold=threshold, temperature=temperature, cfg_scale=cfg_scale,
                    remasking=remasking, mask_id=mask_id, eos_id=eos_id, eot_id=eot_id,
                    logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf)
    finished = torch.zeros(B, dtype=torch.bool, device=x.device)  # stop_at_eos: rows that ended
    bar = tqdm(total=steps, desc="denoising", disable=not progress, leave=False)
    for b in range(num_blocks):
        start, end = P + b * block_length, P + (b + 1) * block_length
        rows = (~finished).nonzero().squeeze(1)                                   # (b,)
        if len(rows) == B:
            _block(model, x, attention_mask, prompt_index, start, end, spb, order, b * spb, bar=bar,
                   generator=generator, **sampling)
        elif len(rows):  # stop_at_eos: the unfinished rows alone, per-row generators following their rows
            gens = [generator[i] for i in rows.tolist()] if isinstance(generator, (list, tuple)) else generator
            x[rows] = _block(model, x[rows], None if attention_mask is None else attention_mask[rows],
                             prompt_index[rows], start, end, spb, None, 0, bar=bar, generator=gens, **sampling)
        if stop_at_eos:
            finished |= (x[:, P:end] == eos_id).any(1)
            x[finished, end:] = eos_id
    bar.close()
    return (x, order) if return_order else x


# -----------------------------------------------------------------------------------------------------
# images: emerge (MaskGRPO Alg. 4) and MaskGIT (MMaDA t2i_generate)


def _cosine(u: float) -> float:  # masked fraction at time u in [0, 1]: kappa(u) = cos(pi u / 2) (Alg. 4)
    return math.cos(math.pi * u / 2)


def _sample_categorical(probs, generator):
    """One draw per row of probs (..., C) float64 by inverse CDF: (...,) int64. One uniform per draw (Gumbel
    would need C), so a CPU generator stays cheap for 1024 x 8192 probabilities; float64 sums keep the bins
    exact to ~1e-16, and scaling u by the total keeps it inside the last bin."""
    cdf = probs.cumsum(-1)                                                         # (..., C)
    u = _uniform(probs.shape[:-1], generator, probs.device) * cdf[..., -1]         # (...,)
    return torch.searchsorted(cdf, u[..., None], right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def _image_probs(model, x, span, codes, attention_mask, uncond_ids, uncond_mask, cfg_scale):
    """float64 probabilities (B, n, C) over the codebook at the image slots, with CFG when cfg_scale > 0."""
    if cfg_scale == 0:
        logits = _forward(model, x, attention_mask, span.start, span.stop)[..., codes]  # (B, n, C)
    else:  # the unconditional input is the empty-caption prompt around the *current* image (MMaDA)
        x_u = uncond_ids.clone()
        x_u[:, span] = x[:, span]
        masks = None if attention_mask is None and uncond_mask is None else torch.cat(
            [m if m is not None else torch.ones_like(x) for m in (attention_mask, uncond_mask)])
        cond, uncond = _forward(model, torch.cat([x, x_u]), masks, span.start, span.stop)[..., codes].chunk(2)
        logits = (1 + cfg_scale) * cond - cfg_scale * uncond  # MMaDA's (1 + w) l_c - w l_u, in its order
    # float64 (MMaDA samples from bf16 probabilities): with 8192 codes, bf16 rounds away the tail.
    return F.softmax(logits.double(), dim=-1)


@torch.no_grad()
def generate_image(model, input_ids, *, image_start, num_tokens, steps, sampler="emerge", cfg_scale=0.0,
                   uncond_input_ids=None, generator=None, attention_mask=None, uncond_attention_mask=None,
                   temperature=1.0, code_offset=None, codebook_size=None, mask_id=None, return_order=False,
                   progress=False):
    """Fill the image slots input_ids[:, image_start : image_start + num_tokens] (all mask ids on entry) with
    image tokens (code + code_offset): (B, L) -> (B, L) [, order (B, L) as generate's, -1 off the slots].

    "emerge" (MaskGRPO Alg. 4): MDLM ancestral sampling with kappa(u) = cos(pi u / 2): a masked slot is
    revealed at step s with probability (kappa_t - kappa_s) / kappa_t, drawn from p, then frozen. Temperature
    must stay 1 (the official sampler takes one and ignores it, docs/differences.md).
    "maskgit" (MMaDA t2i_generate): sample every unknown slot, then re-mask the floor(n cos(pi/2 (s+1)/T))
    least confident; temperature scales the Gumbel choice noise.

    Args:
        uncond_input_ids, uncond_attention_mask: the unconditional prompt (B, L) and its padding mask for CFG;
            its slots take the current image at every step. Unused at cfg_scale 0.
        code_offset, codebook_size, mask_id: default to model.config's image_token_offset, codebook_size and
            mask_token_id.
        generator: torch.Generator for every draw (required), or a list of B generators, one per row.
    """
    config = getattr(model, "config", None)
    code_offset = getattr(config, "image_token_offset", None) if code_offset is None else code_offset
    codebook_size = getattr(config, "codebook_size", None) if codebook_size is None else codebook_size
    mask_id = getattr(config, "mask_token_id", None) if mask_id is None else mask_id
    _need(code_offset is not None and codebook_size and mask_id is not None, f"code_offset ({code_offset}), "
          f"codebook_size ({codebook_size}) and mask_id ({mask_id}) are needed: pass them, or use a model whose "
          "config has image_token_offset, codebook_size and mask_token_id (an MMaDA checkpoint)")
    _need(sampler in IMAGE_SAMPLERS, f"sampler ({sampler!r}) must be one of {IMAGE_SAMPLERS}")
    _need(steps >= 1, f"steps ({steps}) must be >= 1; MaskGRPO uses 12 for rollouts, 32 for evaluation")
    _need(temperature >= 0 and (sampler == "maskgit" or temperature == 1.0), f"temperature ({temperature}) must "
          "be >= 0 for maskgit and 1.0 for emerge, which samples from the model's distribution (paper Alg. 4)")
    _need(cfg_scale >= 0, f"cfg_scale ({cfg_scale}) must be >= 0 (0 = no guidance; MaskGRPO uses 3.0-3.5)")
    shape = None if uncond_input_ids is None else tuple(uncond_input_ids.shape)
    _need(cfg_scale == 0 or shape == tuple(input_ids.shape), f"cfg_scale {cfg_scale} > 0 needs uncond_input_ids "
          f"of shape {tuple(input_ids.shape)} (got {shape}): the empty-caption prompt in the same layout")
    B, L = input_ids.shape
    for name, m in (("attention_mask", attention_mask), ("uncond_attention_mask", uncond_attention_mask)):
        _need(m is None or m.shape == input_ids.shape, f"{name} {tuple(m.shape) if m is not None else ''} must "
              f"have the shape of input_ids {(B, L)} (1 = real token, 0 = padding)")
    n, span = num_tokens, slice(image_start, image_start + num_tokens)
    _need(0 <= image_start and n >= 1 and image_start + n <= L, f"image slots [{image_start}, {image_start + n}) "
          f"do not fit in a sequence of length {L}")
    _need((input_ids[:, span] == mask_id).all(), f"input_ids[:, {image_start}:{image_start + n}] must all be the "
          f"mask id ({mask_id}); check image_start / num_tokens against the <|soi|> position")
    _need((input_ids == mask_id).sum() == B * n, f"input_ids holds mask ids ({mask_id}) outside the image slots, "
          "which would never be filled; check image_start / num_tokens")
    codes = slice(code_offset, code_offset + codebook_size)
    x = input_ids.clone()                                                          # (B, L)
    order = torch.full_like(x, -1) if return_order else None                      # (B, L)
    for s in tqdm(range(steps), desc="image steps", disable=not progress, leave=False):
        probs = _image_probs(model, x, span, codes, attention_mask, uncond_input_ids, uncond_attention_mask,
                             cfg_scale)                                            # (B, n, C)
        masked = x[:, span] == mask_id                                             # (B, n)
        code = torch.where(masked, _sample_categorical(probs, generator), x[:, span] - code_offset)  # (B, n)
        stay = torch.zeros_like(masked)  # the last step decodes every slot (MMaDA returns the sample)
        if s < steps - 1 and sampler == "emerge":
            # Alg. 4's (C+1)-way categorical [p(v) (k_t - k_s)/k_t ..., masked: k_s/k_t], drawn as "reveal?"
            # and the code apart: the same distribution.
            k_t, k_s = _cosine(s / steps), _cosine((s + 1) / steps)
            stay = masked & (_uniform((B, n), generator, x.device) >= (k_t - k_s) / k_t)
        elif s < steps - 1:
            logp = probs.gather(-1, code[..., None]).squeeze(-1).log()             # (B, n); p > 0
            # Annealed choice temperature tau (1 - (s+1)/T), canonical MaskGIT; MMaDA's compounds across
            # steps (docs/differences.md). float64 Gumbel (arXiv:2409.02908).
            tau = temperature * (1 - (s + 1) / steps)
            if tau > 0:
                logp = logp + tau * -torch.log(-torch.log(_uniform((B, n), generator, x.device)))
            conf = torch.where(masked, logp, math.inf)  # known slots are never re-masked
            # floor(n cos(pi/2 (s+1)/T)) stay masked, clamped to [1, unknown - 1] (MMaDA's clamp); exactly
            # that many by stable rank (MMaDA's "< cutoff" re-masks fewer on exact ties).
            num_remask = (masked.sum(1) - 1).clamp(max=math.floor(n * _cosine((s + 1) / steps))).clamp(min=1)
            stay = conf.argsort(dim=-1, stable=True).argsort(dim=-1) < num_remask[:, None]  # (B, n)
        new = torch.where(stay, mask_id, code + code_offset)                       # (B, n)
        _record(None if order is None else order[:, span], x[:, span], new, mask_id, s)
        x[:, span] = new
    return (x, order) if return_order else x


# -----------------------------------------------------------------------------------------------------
# command line


@dataclass
class Options:
    """python sample.py --ckpt DIR --prompt TEXT [--image] [--field=value ...]. A checkpoint written by
    train.py carries its generation settings (generation.json), used unless a flag overrides them; the
    rest default to LLaDA's own (64 tokens in blocks of 16, 64 steps, greedy)."""
    ckpt: str = ""              # directory with config.json, *.safetensors, tokenizer.json
    prompt: str = ""
    image: bool = False         # text-to-image (toy checkpoints of train.py): fill the image slots
    gen_length: int = 64
    block_length: int = 16
    steps: int = 64
    temperature: float = 0.0
    seed: int = 0               # seeds the sampling generator (temperature > 0, images)
    prompt_format: str = "auto"  # auto (as train.py trained the checkpoint, else raw) | toy | chat | raw
    prompt_prefill: str = ""    # text that opens the assistant turn (chat format)
    kv_cache: str = "none"      # none (exact) | prefix | dual: Fast-dLLM block KV cache (approximate)
    threshold: float = 0.0      # > 0: also commit every masked token more confident than this
    image_steps: int = 12
    image_sampler: str = "emerge"
    cfg_scale: float = 0.0      # classifier-free guidance weight (images)
    image_width: int = 4        # images are image_width x image_width tokens
    image_text_len: int = 0     # caption part of the t2i prompt (0: the longest toy caption)


def main(argv=None):
    from infra import cli
    from infra.run import read_generation_settings
    from model import Transformer, chat_prompt, load_tokenizer
    import tasks

    first = cli.parse(Options, argv, description="Sample from a LLaDA/MMaDA-style checkpoint.")
    saved = read_generation_settings(first.ckpt) if first.ckpt else {}
    toy = any(t in ("text", "image") for t in saved.pop("tasks", "").split(","))
    known = {k: v for k, v in saved.items() if k in Options.__dataclass_fields__ and k != "temperature"}
    o = cli.parse(Options, argv, description="Sample from a LLaDA/MMaDA-style checkpoint.", defaults=known)
    if not (o.ckpt and o.prompt):
        raise SystemExit("error: pass --ckpt DIR --prompt TEXT")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    model = Transformer.from_pretrained(o.ckpt, device=device, dtype=dtype)
    tok = load_tokenizer(o.ckpt, model.config)
    gen = torch.Generator(device).manual_seed(o.seed)
    if o.image:
        return _sample_image(model, tok, o, gen, device)
    # auto: as the checkpoint was trained (toy tasks, or chat for benchmarks); raw for any other checkpoint.
    fmt = o.prompt_format if o.prompt_format != "auto" else "raw" if not saved else "toy" if toy else "chat"
    if fmt == "toy":  # as train.py's toy text task: BOS + question (tasks.encode_text)
        ids = [tasks.specials(tok).bos] + tok.encode(o.prompt, add_special_tokens=False).ids
    elif fmt in ("chat", "raw"):  # the chat template already holds BOS
        text = chat_prompt([{"role": "user", "content": o.prompt}]) + o.prompt_prefill if fmt == "chat" else o.prompt
        ids = tok.encode(text, add_special_tokens=False).ids
    else:
        raise SystemExit(f"error: prompt_format ({o.prompt_format!r}) must be auto, toy, chat or raw")
    prompt = torch.tensor([ids], device=device)                                          # (1, P)
    out = generate(model, prompt, gen_length=o.gen_length, block_length=o.block_length, steps=o.steps,
                   temperature=o.temperature, mask_id=model.config.mask_token_id, generator=gen,
                   kv_cache=None if o.kv_cache == "none" else o.kv_cache, threshold=o.threshold or None,
                   progress=True)
    completion = tok.decode(out[0, prompt.shape[1]:].tolist(), skip_special_tokens=True)
    print(completion)
    return completion


def _sample_image(model, tok, o, gen, device):
    # The toy's MMaDA-style t2i layout and grid rendering live in tasks.py.
    import tasks

    cfg = model.config
    if cfg.image_token_offset is None:
        raise SystemExit(f"error: {o.ckpt} has no image tokens (image_token_offset is unset in config.json); "
                         "--image needs a multimodal checkpoint such as train.py's toy output")
    n = o.image_width ** 2
    text_len = o.image_text_len or tasks.image_text_len(tok)
    ids, start, att = tasks.encode_image_prompt(tok, o.prompt, text_len, n)
    uids, _, uatt = tasks.encode_image_prompt(tok, "", text_len, n)
    def t(v):
        return torch.tensor([v], device=device)                                        # (1, L)
    out = generate_image(model, t(ids), image_start=start, num_tokens=n, steps=o.image_steps,
                         sampler=o.image_sampler, cfg_scale=o.cfg_scale, uncond_input_ids=t(uids), generator=gen,
                         attention_mask=t(att), uncond_attention_mask=t(uatt),
                         code_offset=cfg.image_token_offset, codebook_size=cfg.codebook_size,
                         mask_id=cfg.mask_token_id, progress=True)
    codes = [c - cfg.image_token_offset for c in out[0, start:start + n].tolist()]
    print(tasks.render_image(codes, o.image_width))
    return codes


if __name__ == "__main__":
    main()
