"""Reverse-process samplers for masked diffusion models: text (LLaDA) and images (MMaDA / MaskGRPO).

MaskGRPO (arXiv:2510.02880) rolls out with these samplers:
  generate        LLaDA's semi-autoregressive block sampler with low-confidence or random remasking (LLaDA
                  arXiv:2502.09992 and its public generate.py); at temperature 0 it reproduces the public
                  generate() token for token. Opt-in approximations for fast rollouts: kv_cache="prefix"/"dual"
                  and threshold (Fast-dLLM, arXiv:2505.22618; infra/bench.py measures them), stop_at_eos.
  generate_image  over the image slots of an MMaDA sequence `... <|soi|> n slots <|eoi|>`: MaskGRPO's "emerge"
                  sampler (MDLM ancestral sampling on a cosine schedule, paper Alg. 4) or MMaDA's MaskGIT
                  confidence sampler, both with optional classifier-free guidance.
Both can return the decoding order (return_order=True): the step at which each position was revealed, from
which the states the sampler saw are rebuilt (importance.py scores trajectories that way).

Randomness is explicit: every random number comes from the `generator` argument (one, or one per row), drawn
on the generator's own device; a CPU generator gives identical samples on CPU and GPU. The global RNG is never
used; a stochastic call without a generator is an error.

    python sample.py --ckpt /path/to/LLaDA-8B-Instruct --prompt "What is 7 * 8?" --chat

Shapes: B batch, P prompt length, N gen_length, L sequence length (P + N for text), V vocabulary,
n image slots, C codebook size.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

REMASKING = ("low_confidence", "random")
KV_CACHES = (None, "prefix", "dual")
IMAGE_SAMPLERS = ("emerge", "maskgit")
# BLAS takes another kernel (other rounding) for a GEMM of a few rows (on our 2-thread CPU, fewer than 12).
# With the head on at least this many rows, every row gets the same bits as in the full-sequence GEMM.
MIN_HEAD_ROWS = 32


# -----------------------------------------------------------------------------------------------------
# shared pieces


def _skip(g, n, dtype):
    """Advance CPU generator g past n uniforms of `dtype` without keeping them. Its Mersenne Twister spends
    two 32-bit words on a float64 and one on a float32 or a uint8 randint, so 1-byte draws replay the stream
    in an eighth of the memory (tests/test_sample.py checks this against the full draw)."""
    words = n * (2 if dtype == torch.float64 else 1)
    for i in range(0, words, 1 << 24):
        torch.randint(0, 2, (min(1 << 24, words - i),), generator=g, dtype=torch.uint8)


def _uniform(shape, generator, device, dtype=torch.float64, active=None, cols=None):
    """U[0, 1) draws of `shape`, made on the generator's device and moved to `device`. generator may be a list
    of shape[0] generators, one per row: row i then depends on its own generator only, so a sequence gets the
    same sample in any batch, process or world size (train.py).
    active: with per-row generators, the rows that draw (the others get 0.5 and leave their stream alone).
    cols: a slice of dim 1; only those columns are returned and drawn. A CPU generator still advances as if
    the whole shape were drawn (same numbers as the full draw, without its memory); another device's
    generator draws the columns alone (its numbers depend on the draw size anyway)."""
    if generator is None:
        raise ValueError("this call samples at random but generator is None; pass e.g. "
                         "generator=torch.Generator().manual_seed(0) (a CPU generator gives the same samples "
                         "on every device)")
    rows = generator if isinstance(generator, (list, tuple)) else None
    if rows is not None and len(rows) != shape[0]:
        raise ValueError(f"got {len(rows)} per-row generators for a batch of {shape[0]} rows")
    if rows is None and cols is None:
        return torch.rand(shape, generator=generator, device=generator.device, dtype=dtype).to(device)
    lo, hi = (0, shape[1]) if cols is None else (cols.start, cols.stop)
    out = torch.empty((shape[0], hi - lo, *shape[2:]), dtype=dtype, device=device)
    per_col = math.prod(shape[2:])
    for i, g in enumerate(rows or [generator] * shape[0]):
        if rows is not None and active is not None and not active[i]:
            out[i] = 0.5
            continue
        cpu = g.device.type == "cpu"
        _skip(g, lo * per_col * cpu, dtype)
        out[i] = torch.rand(out.shape[1:], generator=g, device=g.device, dtype=dtype)
        _skip(g, (shape[1] - hi) * per_col * cpu, dtype)
    return out


def _forward(model, x, attention_mask, lo=0, end=None, **kw):
    """Logits (B, end - lo, V) at positions [lo, end) of x from a full forward pass. The head runs on those
    positions only (widened to MIN_HEAD_ROWS rows, see above) when the model takes logits_at (model.py).
    kw (return_kv) makes it return (logits, kv)."""
    B, L = x.shape
    end = L if end is None else end
    if not getattr(model, "accepts_cache_kwargs", False):
        logits = model(x) if attention_mask is None else model(x, attention_mask=attention_mask)
        assert logits.shape[:2] == x.shape, f"model returned logits {tuple(logits.shape)} for input {tuple(x.shape)}"
        return logits[:, lo:end]
    w = min(L, max(end - lo, -(-MIN_HEAD_ROWS // B)))
    a = min(lo, L - w)                                                             # [a, a + w) holds [lo, end)
    out = model(x, attention_mask, logits_at=slice(a, a + w), **kw)
    return (out[0][:, lo - a:end - a], out[1]) if kw.get("return_kv") else out[:, lo - a:end - a]


def transfer_schedule(num_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to reveal at each of `steps` steps: num_masked (B,) int64 -> (B, steps) int64, rows summing
    to num_masked. LLaDA Eq. (8): with its linear noise schedule the expected number of tokens revealed
    per step is constant, so c tokens over s steps get c // s each, the remainder going one apiece to the
    earliest steps."""
    if steps < 1:
        raise ValueError(f"steps ({steps}) must be >= 1")
    i = torch.arange(steps, device=num_masked.device)                              # (S,)
    c = num_masked.long()[:, None]                                                 # (B, 1)
    return c // steps + (i[None, :] < c % steps).long()                            # (B, S)


def gumbel_argmax(logits: torch.Tensor, temperature: float, u=None) -> torch.Tensor:
    """A sample of softmax(logits / temperature) for every row: (..., V) -> (...) int64, given float64
    uniforms u of the logits' shape; plain argmax at temperature 0. LLaDA's form exp(l) / (-log u)^tau has
    the argmax of l / tau + Gumbel; the same expression makes the same uniforms pick the same tokens."""
    if temperature == 0:
        return logits.argmax(-1)
    # float64: float32 uniforms truncate the Gumbel tail, which lowers the effective temperature and the
    # diversity of masked-diffusion samples (arXiv:2409.02908); the official trainer uses bf16
    # (docs/differences.md).
    return (logits.double().exp() / (-torch.log(u)) ** temperature).argmax(-1)


def select_top_k(confidence: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bool (B, L): row j marks the counts[j] positions that torch.topk(confidence[j], counts[j]) returns.

    Same rule as LLaDA's per-row topk loop, ties included: one batched topk per distinct count. A stable
    argsort rank would not do: CPU topk breaks ties in no fixed index order, and bf16 confidences near p = 1
    tie often, so exact reproduction needs topk's own choice, on the same full-length row.
    Batched == per-row topk is checked on CPU by tests/test_sample.py; not verified on CUDA."""
    select = torch.zeros_like(confidence, dtype=torch.bool)                        # (B, L)
    for k in counts.unique().tolist():
        rows = (counts == k).nonzero().squeeze(1)                                  # (b,)
        idx = torch.topk(confidence[rows], k, dim=-1).indices                      # (b, k)
        select[rows[:, None], idx] = True
    return select


def _record(order, before, after, mask_id, s):
    """order[i, j] = s where position j was masked in `before` and is not in `after` (in place, views too)."""
    if order is not None:
        order[(before == mask_id) & (after != mask_id)] = s


# -----------------------------------------------------------------------------------------------------
# text: LLaDA semi-autoregressive low-confidence sampler


def _check_text_args(prompt_ids, attention_mask, gen_length, block_length, steps, temperature, cfg_scale,
                     remasking, mask_id, model, kv_cache, threshold):
    if prompt_ids.dim() != 2 or prompt_ids.is_floating_point():
        raise ValueError(f"prompt_ids must be a (B, P) integer tensor, got {prompt_ids.dtype} "
                         f"{tuple(prompt_ids.shape)}")
    for name, v in (("gen_length", gen_length), ("block_length", block_length), ("steps", steps)):
        if v < 1:
            raise ValueError(f"{name} ({v}) must be >= 1")
    if gen_length % block_length:
        divisor = max(d for d in range(1, block_length + 1) if gen_length % d == 0)
        raise ValueError(f"gen_length ({gen_length}) must be divisible by block_length ({block_length}); try "
                         f"block_length={divisor} or gen_length={-(-gen_length // block_length) * block_length}")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        lower = steps // num_blocks * num_blocks
        hint = f"steps={lower} or " if lower else ""
        raise ValueError(f"steps ({steps}) must be a multiple of the number of blocks, gen_length // "
                         f"block_length = {num_blocks}, since every block gets the same number of steps; "
                         f"try {hint}steps={lower + num_blocks}")
    if steps > gen_length:
        raise ValueError(f"steps ({steps}) > gen_length ({gen_length}): the extra steps would reveal nothing "
                         f"and only cost forward passes; use steps <= {gen_length}")
    if temperature < 0:
        raise ValueError(f"temperature ({temperature}) must be >= 0 (0 = greedy)")
    if cfg_scale < 0:
        raise ValueError(f"cfg_scale ({cfg_scale}) must be >= 0 (0 = no guidance)")
    if remasking not in REMASKING:
        raise ValueError(f"remasking ({remasking!r}) must be one of {REMASKING}")
    real = torch.ones_like(prompt_ids, dtype=torch.bool)
    if attention_mask is not None:
        if attention_mask.shape != prompt_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have the prompt's shape "
                             f"{tuple(prompt_ids.shape)} (1 = real token, 0 = left padding)")
        real = attention_mask.bool()
        if (prompt_ids[~real] == mask_id).any():
            raise ValueError(f"the prompt padding uses the mask id ({mask_id}): padding would be generated "
                             "over; pad with the EOS id, as LLaDA does")
    hits = ((prompt_ids == mask_id) & real).nonzero()
    if len(hits):
        raise ValueError(f"prompt_ids contains the mask id ({mask_id}) at (row, position) "
                         f"{hits[:4].tolist()}; LLaDA would silently generate a token there. Remove it, or "
                         "check that mask_id and the tokenizer come from the same checkpoint")
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache ({kv_cache!r}) must be one of {KV_CACHES} (None = exact)")
    if kv_cache is not None and not getattr(model, "accepts_cache_kwargs", False):
        raise ValueError(f"kv_cache={kv_cache!r} needs a model whose forward takes the kv / start / return_kv "
                         f"arguments (model.Transformer); {type(model).__name__} does not: use kv_cache=None")
    if threshold is not None and not threshold >= 0:
        raise ValueError(f"threshold ({threshold}) must be a confidence >= 0 (Fast-dLLM uses 0.9), or None "
                         "for the fixed schedule")
    if threshold is not None and remasking != "low_confidence":
        raise ValueError(f"threshold compares model confidences, but remasking={remasking!r} ranks by a "
                         "uniform draw; use remasking='low_confidence' or threshold=None")
    return num_blocks, steps // num_blocks


def _guide(cond, uncond, cfg_scale):
    # l_u + (w + 1)(l_c - l_u), evaluated in this order so bf16 rounding matches the reference.
    return uncond + (cfg_scale + 1) * (cond - uncond)


def _block(model, x, attention_mask, prompt_index, start, end, steps, order, s0, *, kv_cache, threshold,
           temperature, cfg_scale, remasking, mask_id, generator, eos_id, eot_id, logits_eos_inf,
           confidence_eos_eot_inf, bar):
    """Denoise x[:, start:end] in `steps` steps (at most, on the fast paths), in place: (b, L) -> (b, L).
    The exact sampler is LLaDA's generate() inner loop; order (b, L) gets step s0 + i for what step i reveals."""
    B, L = x.shape
    exact = kv_cache is None and threshold is None
    counts = transfer_schedule((x[:, start:end] == mask_id).sum(1), steps) if exact else None  # (b, steps)
    mask2 = attention_mask if cfg_scale == 0 or attention_mask is None else attention_mask.repeat(2, 1)
    kv = None
    for i in range(steps):
        masked = x == mask_id                                                      # (b, L)
        # The exact sampler lets a predicted mask id stay masked, and it competes again later, even from an
        # earlier block: its choices run from the first masked position to the block end. The fast paths
        # never commit the mask id, so everything before the block is decoded.
        cols = masked[:, :end].any(0).nonzero() if exact else None
        lo = (int(cols[0]) if len(cols) else end) if exact else start
        # CFG (arXiv:2410.18514, as LLaDA's generate.py): the unconditional half has the prompt masked.
        xx = x if cfg_scale == 0 else torch.cat([x, x.masked_fill(prompt_index, mask_id)])  # (b or 2b, L)
        if kv is None:
            # A full forward with the head only where a choice is made. With a cache, this block-start pass
            # is exact and stores every layer's keys and values for the steps below.
            out = _forward(model, xx, mask2, lo, end, return_kv=kv_cache is not None)  # (b or 2b, l, V)
            out, kv = out if kv_cache is not None else (out, None)
        else:
            # Fast-dLLM (arXiv:2505.22618) prefix cache: recompute the block and everything after it; dual
            # cache: the block alone. The rest is read from the cache of the block start, so it is stale.
            stop = L if kv_cache == "prefix" else end
            out = model(xx[:, start:stop], mask2, kv=kv, start=start, logits_at=slice(0, end - start))
        logits = out if cfg_scale == 0 else _guide(*out.chunk(2), cfg_scale)        # (b, l, V)
        if not exact:  # never commit the mask id: a block is done when it has no mask left
            logits[..., mask_id] = -math.inf
        if logits_eos_inf:
            logits[..., eos_id] = -math.inf
        # The exact sampler draws every row's noise over the whole sequence (LLaDA's generator stream); the
        # fast paths draw over the block, and a row whose block is done draws nothing, so with per-row
        # generators a row's stream advances as when it is decoded alone.
        draw = dict(cols=slice(lo, end)) if exact else dict(active=masked[:, start:end].any(1).tolist())
        width = L if exact else end - start
        u = _uniform((B, width, logits.shape[-1]), generator, x.device, **draw) if temperature > 0 else None
        x0 = gumbel_argmax(logits, temperature, u)                                 # (b, l)
        if confidence_eos_eot_inf:
            # LLaDA sets the noisy logits' EOS and the clean logits' EOT to -inf *after* choosing x0, so only
            # the confidence changes; at temperature 0 the noisy logits are the same tensor, so EOS is hit too.
            logits[..., eot_id] = -math.inf
            if temperature == 0:
                logits[..., eos_id] = -math.inf
        if remasking == "low_confidence":
            # Softmax in the logits' own dtype (bf16 for LLaDA-8B), as the reference: a float32 softmax would
            # break bf16 ties differently and change the output.
            conf = F.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)  # (b, l)
        else:
            conf = _uniform((B, width), generator, x.device, torch.float32, **draw)  # (b, l)
        m = masked[:, lo:end]                                                      # (b, l)
        # topk over full-length rows with -inf elsewhere, as LLaDA: confidences tie (at p = 1, in bf16) and
        # topk breaks ties by the row it is given (select_top_k).
        full = torch.full((B, L), -math.inf, dtype=conf.dtype, device=x.device)   # (b, L)
        full[:, lo:end] = torch.where(m, conf, -math.inf)
        # Fast paths: at least what the fixed schedule still needs, ceil(masked left / steps left), which is
        # transfer_schedule when nothing extra was committed, and every mask by the last step.
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
    """LLaDA's semi-autoregressive sampler (LLaDA arXiv:2502.09992; MaskGRPO's text rollouts).

    prompt_ids (B, P) int64, left-padded; attention_mask (B, P) with 1 = real token (optional; it is passed
    to the model extended with ones for the completion). Returns x (B, P + N), prompt included, and with
    return_order=True also order (B, P + N) int64: the step s at which each position was revealed, counted
    across blocks (block b's step i is b * steps // num_blocks + i), -1 where no step revealed anything (the
    prompt). The state before step s is x with every position of order >= s masked.

    The completion is split into gen_length / block_length blocks, denoised left to right with
    steps / num_blocks steps each. Every step predicts x0 (Gumbel-max at temperature > 0) and reveals, in the
    current block, the transfer_schedule count of masked positions with the highest confidence: p(x0) for
    "low_confidence", a uniform draw for "random". Positions whose x0 is the mask id stay masks, as in the
    reference. The model should be in eval mode. The output head runs only where a choice is made.

    With the defaults this is the exact sampler, the reference. The options below are opt-in approximations
    for fast rollouts (infra/bench.py measures them). They change only the behaviour policy: the MaskGRPO
    estimator recomputes log-probabilities under its own masks (importance.py). They never commit the mask id.

    Args:
        cfg_scale: guidance weight w; logits = l_u + (w + 1)(l_c - l_u), l_u with the prompt masked.
        generator: torch.Generator for the Gumbel noise (temperature > 0) and "random" confidences, or a
            list of B generators, one per row (a row's sample then does not depend on its batch).
        logits_eos_inf: never predict EOS (eos_id, default model.config.eos_token_id).
        confidence_eos_eot_inf: give EOT predictions (eot_id) confidence 0, and EOS ones too at
            temperature 0, exactly as LLaDA's flag does.
        kv_cache: None (exact), "prefix" or "dual": Fast-dLLM's block-wise KV cache (arXiv:2505.22618). At
            each block start one full forward caches every layer's keys and values; the block's later steps
            then recompute only the block and the suffix after it ("prefix") or only the block ("dual"),
            reading the other keys from that cache. Needs a model.Transformer (forward's kv arguments).
        threshold: None (fixed schedule) or tau: each step also commits every masked position of the block
            whose confidence exceeds tau (Fast-dLLM's parallel decoding; 0.9 there), so a block may finish
            in fewer steps. `steps` stays an upper bound: each step commits at least ceil(masked left / steps
            left). tau >= 1 never fires. low_confidence remasking only.
        stop_at_eos: once a finished block leaves a row with an EOS (eos_id) in its completion, fill the rest
            of that row with EOS and drop it from later forward passes (early rejection). Tokens up to the
            first EOS are those of a full run (at temperature 0 up to kernel rounding on the smaller batch; at
            temperature > 0 in distribution); exact for a consumer that cuts at the first EOS.
    """
    num_blocks, steps_per_block = _check_text_args(prompt_ids, attention_mask, gen_length, block_length, steps,
                                                   temperature, cfg_scale, remasking, mask_id, model, kv_cache,
                                                   threshold)
    if eos_id is None:
        eos_id = getattr(getattr(model, "config", None), "eos_token_id", None)
    if (logits_eos_inf or confidence_eos_eot_inf or stop_at_eos) and eos_id is None:
        raise ValueError("logits_eos_inf / confidence_eos_eot_inf / stop_at_eos need eos_id, and the model has "
                         "no config.eos_token_id to default to")
    if confidence_eos_eot_inf and eot_id is None:
        raise ValueError("confidence_eos_eot_inf needs eot_id, the <|eot_id|> token id (126348 for LLaDA)")
    if stop_at_eos and return_order:
        raise ValueError("stop_at_eos fills rows with EOS that no step decoded, so they have no order; "
                         "use return_order with stop_at_eos=False")
    B, P = prompt_ids.shape
    x = torch.full((B, P + gen_length), mask_id, dtype=torch.long, device=prompt_ids.device)  # (B, L)
    x[:, :P] = prompt_ids
    order = torch.full_like(x, -1) if return_order else None                      # (B, L)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, gen_length)], dim=1)  # (B, L)
    # Computed once, before anything is revealed: CFG's unconditional input masks exactly these positions.
    prompt_index = x != mask_id                                                    # (B, L)
    sampling = dict(kv_cache=kv_cache, threshold=threshold, temperature=temperature, cfg_scale=cfg_scale,
                    remasking=remasking, mask_id=mask_id, generator=generator, eos_id=eos_id, eot_id=eot_id,
                    logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf)
    finished = torch.zeros(B, dtype=torch.bool, device=x.device)  # stop_at_eos: rows that ended

    bar = tqdm(total=steps, desc="denoising", disable=not progress, leave=False)
    for b in range(num_blocks):
        start, end = P + b * block_length, P + (b + 1) * block_length
        rows = (~finished).nonzero().squeeze(1)                                   # (b,)
        if len(rows) == 0:
            break
        if len(rows) == B:
            _block(model, x, attention_mask, prompt_index, start, end, steps_per_block, order,
                   b * steps_per_block, bar=bar, **sampling)
        else:  # stop_at_eos only: the unfinished rows run alone, per-row generators following their rows
            gens = [generator[i] for i in rows.tolist()] if isinstance(generator, (list, tuple)) else generator
            x[rows] = _block(model, x[rows], None if attention_mask is None else attention_mask[rows],
                             prompt_index[rows], start, end, steps_per_block, None, 0, bar=bar,
                             **{**sampling, "generator": gens})
        if stop_at_eos:
            finished |= (x[:, P:end] == eos_id).any(1)
            x[finished, end:] = eos_id
    bar.close()
    return (x, order) if return_order else x


# -----------------------------------------------------------------------------------------------------
# images: emerge (MaskGRPO Alg. 4) and MaskGIT (MMaDA t2i_generate)


def _cosine(u: float) -> float:
    """Masked fraction at normalised time u in [0, 1]: kappa(u) = cos(pi u / 2) (paper Alg. 4)."""
    return math.cos(math.pi * u / 2)


def _sample_categorical(probs, generator):
    """One draw per row of probs (..., C) float64 by inverse CDF: (...,) int64. One uniform per draw, so a
    CPU generator stays cheap for 1024 x 8192 image probabilities (Gumbel-max would need (..., C) noise) and
    gives the same codes on every device; float64 cumulative sums keep the 8192 bins exact to ~1e-16."""
    cdf = probs.cumsum(-1)                                                         # (..., C)
    # Scale by the total so rounding in the sum cannot leave u past the last bin.
    u = _uniform(probs.shape[:-1], generator, probs.device) * cdf[..., -1]         # (...,)
    idx = torch.searchsorted(cdf, u[..., None], right=True).squeeze(-1)           # first bin with cdf > u
    return idx.clamp_max(probs.shape[-1] - 1)


def _image_probs(model, x, span, codes, attention_mask, uncond_ids, uncond_mask, cfg_scale):
    """float64 probabilities (B, n, C) over the codebook at the image slots, with CFG when cfg_scale > 0."""
    if cfg_scale == 0:
        logits = _forward(model, x, attention_mask, span.start, span.stop)[..., codes]  # (B, n, C)
    else:
        # The unconditional input is the empty-caption prompt around the *current* image (MMaDA).
        x_u = uncond_ids.clone()
        x_u[:, span] = x[:, span]
        masks = None
        if attention_mask is not None or uncond_mask is not None:
            masks = torch.cat([m if m is not None else torch.ones_like(x) for m in (attention_mask, uncond_mask)])
        out = _forward(model, torch.cat([x, x_u]), masks, span.start, span.stop)[..., codes]  # (2B, n, C)
        cond, uncond = out.chunk(2)
        logits = (1 + cfg_scale) * cond - cfg_scale * uncond  # MMaDA's (1 + w) l_c - w l_u, in its order
    # Softmax in float64 (MMaDA samples from bf16 probabilities): with 8192 codes, bf16 rounds away the tail.
    return F.softmax(logits.double(), dim=-1)


@torch.no_grad()
def generate_image(model, input_ids, *, image_start, num_tokens, steps, sampler="emerge", cfg_scale=0.0,
                   uncond_input_ids=None, generator=None, attention_mask=None, uncond_attention_mask=None,
                   temperature=1.0, code_offset=None, codebook_size=None, mask_id=None, return_order=False,
                   progress=False):
    """Fill the image slots input_ids[:, image_start : image_start + num_tokens] (all mask ids on entry)
    with image tokens (code + code_offset): (B, L) -> (B, L), and with return_order=True also order (B, L),
    the step at which each slot was revealed (-1 outside the slots), as generate's. Nothing outside the
    slots changes.

    sampler "emerge" (MaskGRPO Alg. 4): MDLM ancestral sampling with kappa(u) = cos(pi u/2);
    a masked slot is revealed at step s with probability (kappa_t - kappa_s) / kappa_t and then frozen, so
    the expected masked fraction after step s is kappa((s+1)/T). It samples from p itself; temperature must
    stay 1 (the official sampler takes a temperature and ignores it, docs/differences.md).
    sampler "maskgit" (MMaDA t2i_generate): sample every slot, keep the known ones, and
    re-mask the floor(n cos(pi/2 (s+1)/T)) least confident; temperature scales the Gumbel choice noise.

    Args:
        uncond_input_ids: (B, L) unconditional prompt for CFG (cfg_scale > 0); its image slots are replaced
            by the current image at every step. uncond_attention_mask is its padding mask. Both are unused
            at cfg_scale 0, so a caller can sweep w down to 0 without changing its batch.
        code_offset, codebook_size, mask_id: default to model.config.image_token_offset / codebook_size /
            mask_token_id.
        generator: torch.Generator for every draw (required), or a list of B generators, one per row.
    """
    config = getattr(model, "config", None)
    code_offset = code_offset if code_offset is not None else getattr(config, "image_token_offset", None)
    codebook_size = codebook_size if codebook_size is not None else getattr(config, "codebook_size", None)
    mask_id = mask_id if mask_id is not None else getattr(config, "mask_token_id", None)
    if code_offset is None or not codebook_size or mask_id is None:
        raise ValueError(f"code_offset ({code_offset}), codebook_size ({codebook_size}) and mask_id ({mask_id}) "
                         "are needed: pass them, or use a model whose config has image_token_offset, "
                         "codebook_size and mask_token_id (an MMaDA checkpoint)")
    if sampler not in IMAGE_SAMPLERS:
        raise ValueError(f"sampler ({sampler!r}) must be one of {IMAGE_SAMPLERS}")
    if steps < 1:
        raise ValueError(f"steps ({steps}) must be >= 1; MaskGRPO uses 12 for rollouts, 32 for evaluation")
    if temperature < 0 or (sampler == "emerge" and temperature != 1.0):
        raise ValueError(f"temperature ({temperature}) must be >= 0 for maskgit and 1.0 for emerge, which "
                         "samples from the model's distribution itself (paper Alg. 4)")
    if cfg_scale < 0:
        raise ValueError(f"cfg_scale ({cfg_scale}) must be >= 0 (0 = no guidance; MaskGRPO uses 3.0-3.5)")
    if cfg_scale > 0 and (uncond_input_ids is None or uncond_input_ids.shape != input_ids.shape):
        shape = None if uncond_input_ids is None else tuple(uncond_input_ids.shape)
        raise ValueError(f"cfg_scale {cfg_scale} > 0 needs uncond_input_ids of shape {tuple(input_ids.shape)} "
                         f"(got {shape}): the empty-caption prompt in the same layout")
    B, L = input_ids.shape
    for name, m in (("attention_mask", attention_mask), ("uncond_attention_mask", uncond_attention_mask)):
        if m is not None and m.shape != input_ids.shape:
            raise ValueError(f"{name} {tuple(m.shape)} must have the shape of input_ids {(B, L)} "
                             "(1 = real token, 0 = padding)")
    if not (0 <= image_start and num_tokens >= 1 and image_start + num_tokens <= L):
        raise ValueError(f"image slots [{image_start}, {image_start + num_tokens}) do not fit in a sequence of "
                         f"length {L}")
    span = slice(image_start, image_start + num_tokens)
    if not (input_ids[:, span] == mask_id).all():
        raise ValueError(f"input_ids[:, {image_start}:{image_start + num_tokens}] must all be the mask id "
                         f"({mask_id}); check image_start / num_tokens against the <|soi|> position")
    if (input_ids == mask_id).sum() != B * num_tokens:
        raise ValueError(f"input_ids holds mask ids ({mask_id}) outside the image slots, which would never be "
                         "filled; check image_start / num_tokens")
    codes = slice(code_offset, code_offset + codebook_size)
    n = num_tokens

    x = input_ids.clone()                                                          # (B, L)
    order = torch.full_like(x, -1) if return_order else None                      # (B, L)
    for s in tqdm(range(steps), desc="image steps", disable=not progress, leave=False):
        probs = _image_probs(model, x, span, codes, attention_mask, uncond_input_ids, uncond_attention_mask,
                             cfg_scale)                                            # (B, n, C)
        masked = x[:, span] == mask_id                                             # (B, n)
        sampled = _sample_categorical(probs, generator)                            # (B, n)
        if sampler == "emerge":
            if s < steps - 1:
                k_t, k_s = _cosine(s / steps), _cosine((s + 1) / steps)
                # Paper Alg. 4: a masked slot draws from the (C+1)-way categorical
                # [p(v) (k_t - k_s)/k_t ..., stay masked: k_s/k_t]. We draw "reveal?" and the code
                # separately, which is the same distribution: P(code v) = (1 - k_s/k_t) p(v).
                reveal = masked & (_uniform((B, n), generator, x.device) < (k_t - k_s) / k_t)  # (B, n)
            else:
                reveal = masked  # last step: every remaining slot is sampled from p
            new = torch.where(reveal, sampled + code_offset, x[:, span])  # decoded slots stay frozen
            _record(None if order is None else order[:, span], x[:, span], new, mask_id, s)
            x[:, span] = new
            continue
        # maskgit: known slots keep their code; unknown ones take this step's sample.
        sampled = torch.where(masked, sampled, x[:, span] - code_offset)          # (B, n)
        if s == steps - 1:  # the last step decodes everything (MMaDA returns the sample)
            _record(None if order is None else order[:, span], x[:, span], sampled + code_offset, mask_id, s)
            x[:, span] = sampled + code_offset
            break
        logp = probs.gather(-1, sampled[..., None]).squeeze(-1).log()             # (B, n); > -inf: p > 0
        # Annealed choice temperature tau_s = tau (1 - (s+1)/T), canonical MaskGIT. MMaDA re-assigns tau
        # inside the loop, so its annealing compounds across steps (docs/differences.md); not reproduced.
        tau = temperature * (1 - (s + 1) / steps)
        if tau > 0:
            u = _uniform((B, n), generator, x.device)
            logp = logp + tau * -torch.log(-torch.log(u))  # float64 Gumbel (arXiv:2409.02908)
        conf = torch.where(masked, logp, math.inf)  # known slots are never re-masked
        # MaskGIT cosine schedule: floor(n cos(pi/2 (s+1)/T)) stay masked, clamped to [1, unknown - 1] so
        # each step reveals at least one slot and keeps at least one for later (MMaDA's clamp).
        target = math.floor(n * _cosine((s + 1) / steps))
        num_remask = (masked.sum(1) - 1).clamp(max=target).clamp(min=1)                    # (B,)
        # Re-mask exactly num_remask lowest (stable rank; MMaDA's "< cutoff" re-masks fewer on exact ties).
        rank = conf.argsort(dim=-1, stable=True).argsort(dim=-1)                           # (B, n)
        remask = rank < num_remask[:, None]
        new = torch.where(remask, mask_id, sampled + code_offset)
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
