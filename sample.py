"""Reverse-process samplers: generate is LLaDA's (arXiv:2502.09992, token for token at temperature 0),
fast_generate runs its denoise_step under Fast-dLLM; generate_image is MaskGRPO's emerge (Alg. 4) or MMaDA's
MaskGIT, with optional CFG. Both return the decoding order importance.py rebuilds states from. Random numbers
come from `generator` (one, or one per row); callers validate settings, the samplers assert preconditions.
Shapes: B batch, P prompt, N gen_length, L sequence (P + N for text), V vocabulary, n image slots, C codes.
"""
import dataclasses
import hashlib
import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

from infra import scale

REMASKING = ("low_confidence", "random")
IMAGE_SAMPLERS = ("emerge", "maskgit")
KV_CACHES = ("none", "prefix", "dual")  # Fast-dLLM block KV cache: off, or what a step recomputes
MIN_HEAD_ROWS = 32  # the head's least rows (FullRows.head)
CHUNK = 1 << 24  # elements per draw as uniform walks a row's stream (128 MB in float64)


def derive_seed(*parts) -> int:
    """A 63-bit seed from (run seed, purpose, step, ...): blake2b of repr(parts)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def generator(device, *parts) -> torch.Generator:
    """A torch.Generator on `device` seeded with derive_seed(*parts)."""
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))


def chunks(n: int, size: int) -> list[slice]:
    """Slices of `size` rows (device_batch_size; 0: all n) for the forward passes."""
    size = size or n
    return [slice(s, s + size) for s in range(0, n, size)]


@torch.no_grad()
def rollout(model, prompts, ctx, gens: list, temperature: float, text_sampler=None):
    """Step 1: (prompts with samples in their windows, order (B, L): the step that revealed each, -1 the prompt)."""
    cfg, ids, out = ctx.cfg, ctx.ids, []
    with scale.full_weights(model):  # FSDP2 gathers the weights once for the whole rollout
        for rows in chunks(len(gens), cfg.device_batch_size):
            c, g = prompts.rows(rows), gens[rows]
            if c.uncond is not None:  # an image batch (CFG's empty caption: tasks.make_batch)
                x, order = generate_image(
                    model, c.x, image_start=c.prompt_len, num_tokens=c.window, steps=cfg.image_steps,
                    sampler=cfg.image_sampler, cfg_scale=cfg.cfg_scale, uncond_input_ids=c.uncond, generator=g,
                    attention_mask=c.attention_mask, uncond_attention_mask=c.uncond_mask,
                    code_offset=ids.image_token_offset, codebook_size=ids.codebook_size, mask_id=ids.mask,
                    return_order=True)
            else:
                x, order = (text_sampler or generate)(
                    model, c.x[:, : c.prompt_len], gen_length=c.window, block_length=cfg.block_length, steps=cfg.steps,
                    temperature=temperature, mask_id=ids.mask, generator=g,
                    attention_mask=c.attention_mask[:, : c.prompt_len], return_order=True)
            out.append((x, order))
    return dataclasses.replace(prompts, x=torch.cat([x for x, _ in out])), torch.cat([o for _, o in out])


def uniform(shape, generator, device, dtype=torch.float64, active=None, cols=None) -> torch.Tensor:
    """U[0, 1) draws of `shape` on the generator's device (one, or one per row), moved to `device`. active: the
    rows that draw (others get 0.5). cols: the columns of dim 1 returned, all drawn as the full draw would."""
    if generator is None:
        raise ValueError("this call samples at random but generator is None; pass e.g. generator="
                         "torch.Generator().manual_seed(0) (a CPU generator gives the same samples on every device)")
    rows = generator if isinstance(generator, (list, tuple)) else None
    if rows is not None and len(rows) != shape[0]:
        raise ValueError(f"got {len(rows)} per-row generators for a batch of {shape[0]} rows")
    if rows is None and cols is None:
        return torch.rand(shape, generator=generator, device=generator.device, dtype=dtype).to(device)
    lo, hi = (0, shape[1]) if cols is None else (cols.start, cols.stop)
    out = torch.empty((shape[0], hi - lo, *shape[2:]), dtype=dtype, device=device)
    step = max(1, CHUNK // max(1, math.prod(shape[2:])))  # columns per draw
    for i, g in enumerate(rows or [generator] * shape[0]):
        if rows is not None and active is not None and not active[i]:
            out[i] = 0.5
            continue
        for c in range(0, shape[1], step):
            draw = torch.rand((min(step, shape[1] - c), *shape[2:]), generator=g, device=g.device, dtype=dtype)
            a, b = max(lo, c), min(hi, c + step)  # the kept columns of this draw
            if a < b:
                out[i, a - lo:b - lo] = draw[a - c:b - c]
    return out


# --- text: LLaDA's semi-autoregressive sampler, exact and under Fast-dLLM

@torch.no_grad()
def generate(model, prompt_ids, *, gen_length, block_length, steps, temperature=0.0, cfg_scale=0.0,
             remasking="low_confidence", mask_id, generator=None, attention_mask=None, return_order=False,
             progress=False):
    """LLaDA's sampler (arXiv:2502.09992 §2.4): prompt_ids (B, P) left-padded -> x (B, P + N) [, order: the step
    that revealed each position, -1 the prompt]. Blocks left to right, steps // blocks steps each revealing
    transfer_schedule's count. cfg_scale w: CFG (arXiv:2410.18514) against the prompt masked."""
    num_blocks, spb = blocks(gen_length, block_length, steps, remasking)
    x, order, attention_mask, prompt_index, fwd = canvas(prompt_ids, gen_length, mask_id, attention_mask,
                                                         cfg_scale, return_order)
    P = prompt_ids.shape[1]
    bar = tqdm(total=spb * num_blocks, desc="denoising", disable=not progress, leave=False)
    for blk in range(num_blocks):
        end = P + (blk + 1) * block_length
        # one host read per block, not per step (each waits for the device)
        counts = transfer_schedule((x[:, end - block_length:end] == mask_id).sum(1), spb)  # (B, spb)
        distinct = [sorted(set(c)) for c in counts.T.tolist()]  # [spb] each step's counts
        for i in range(spb):
            # A predicted mask id stays masked and competes again, even past its block (as LLaDA): the step
            # chooses among the positions from the first masked one to the block end.
            any_masked = (x[:, :end] == mask_id).any(0)  # (end,)
            lo = int(torch.where(any_masked, torch.arange(end, device=x.device), end).min())  # one host read
            xx = x if cfg_scale == 0 else torch.cat([x, x.masked_fill(prompt_index, mask_id)])  # (B or 2B, L)
            logits = _forward(model, xx, attention_mask, lo, end, **fwd)  # (B or 2B, l, V)
            if cfg_scale:  # l_u + (w + 1)(l_c - l_u), in this order so that bf16 rounds as LLaDA
                cond, uncond = logits.chunk(2)
                logits = uncond + (cfg_scale + 1) * (cond - uncond)  # (B, l, V)
            denoise_step(x, order, blk * spb + i, logits, lo, end, counts[:, i], distinct[i],
                         temperature=temperature, remasking=remasking, mask_id=mask_id, generator=generator)
            bar.update()
    bar.close()
    return (x, order) if return_order else x


@torch.no_grad()
def fast_generate(model, prompt_ids, *, gen_length, block_length, steps, temperature=0.0, cfg_scale=0.0,
                  remasking="low_confidence", mask_id, generator=None, attention_mask=None, kv_cache="none",
                  threshold=0.0, return_order=False, progress=False, stats=None):
    """generate under Fast-dLLM (arXiv:2505.22618): kv_cache caches at a block start, then recomputes the block and
    after ("prefix") or the block ("dual"); threshold tau > 0 also reveals all above tau. stats: FastSampler's."""
    if kv_cache == "none" and threshold <= 0:
        return generate(model, prompt_ids, gen_length=gen_length, block_length=block_length, steps=steps,
                        temperature=temperature, cfg_scale=cfg_scale, remasking=remasking, mask_id=mask_id,
                        generator=generator, attention_mask=attention_mask, return_order=return_order,
                        progress=progress)
    num_blocks, spb = blocks(gen_length, block_length, steps, remasking)
    assert kv_cache in KV_CACHES and (kv_cache == "none" or getattr(model, "accepts_cache_kwargs", False)), \
        f"kv_cache={kv_cache!r} needs model.Transformer's kv / start / return_kv forward arguments, in {KV_CACHES}"
    assert threshold == 0 or remasking == "low_confidence", "threshold compares model confidences"
    x, order, attention_mask, prompt_index, fwd = canvas(prompt_ids, gen_length, mask_id, attention_mask,
                                                         cfg_scale, return_order)
    L, P = x.shape[1], prompt_ids.shape[1]
    bar = tqdm(total=spb * num_blocks, desc="denoising", disable=not progress, leave=False)
    for blk in range(num_blocks):
        start, end = P + blk * block_length, P + (blk + 1) * block_length
        kv = None
        for i in range(spb):
            left = (x[:, start:end] == mask_id).sum(1).tolist()  # the step's one host read
            if not any(left):  # the threshold finished this block early
                break
            xx = x if cfg_scale == 0 else torch.cat([x, x.masked_fill(prompt_index, mask_id)])  # (B or 2B, L)
            if kv is None:  # a full forward (at a block start it stores the keys and values)
                logits, kv = _forward(model, xx, attention_mask, start, end, return_kv=True, **fwd) \
                    if kv_cache != "none" else (_forward(model, xx, attention_mask, start, end, **fwd), None)
            else:
                stop = L if kv_cache == "prefix" else end
                logits = model(xx[:, start:stop], attention_mask, kv=kv, start=start, logits_at=slice(0, end - start),
                               **fwd)
            if cfg_scale:  # as generate
                cond, uncond = logits.chunk(2)
                logits = uncond + (cfg_scale + 1) * (cond - uncond)  # (B, K, V)
            logits[..., mask_id] = -math.inf
            k = [(n + spb - i - 1) // (spb - i) for n in left]  # the fixed schedule if nothing extra
            active = [n > 0 for n in left]
            revealed, conf = denoise_step(x, order, blk * spb + i, logits, start, end, torch.tensor(k, device=x.device),
                                          sorted(set(k)), temperature=temperature, remasking=remasking,
                                          mask_id=mask_id, generator=generator, active=active, threshold=threshold)
            if stats is not None:  # kept on the device: a read per step would stall
                stats.setdefault("steps", []).append((revealed, conf, active))
            bar.update()
    bar.close()
    return (x, order) if return_order else x


def denoise_step(x, order, s, logits, lo, end, k, distinct=None, *, temperature, remasking, mask_id, generator,
                 active=None, threshold=0.0):
    """Step s on x[:, lo:end] in place from logits (B, l, V): row j reveals its k[j] masked positions most confident
    in their Gumbel-max x0 (p(x0); "random": uniform), and any above threshold > 0 -> (revealed, conf) (B, l)."""
    m = x[:, lo:end] == mask_id  # (B, l)
    rows = FullRows(x, lo, end, generator, active)  # LLaDA bit parity
    x0 = gumbel_argmax(logits, temperature, rows.noise(logits.shape[-1]) if temperature > 0 else None)  # (B, l)
    if remasking == "low_confidence":  # in the logits' dtype, as LLaDA (float32 breaks bf16 ties)
        conf = F.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)  # (B, l)
    else:
        conf = rows.noise(dtype=torch.float32)  # (B, l)
    revealed = rows.top_k(torch.where(m, conf, -math.inf), k, distinct) & m  # (B, l)
    if threshold > 0:
        revealed |= m & (conf > threshold)
    new = torch.where(revealed, x0, x[:, lo:end])  # (B, l)
    if order is not None:
        order[:, lo:end] = torch.where(m & (new != mask_id), s, order[:, lo:end])
    x[:, lo:end] = new
    return revealed, conf


def blocks(gen_length, block_length, steps, remasking):
    """(number of blocks, steps per block): LLaDA floors steps // blocks."""
    num_blocks = gen_length // block_length
    spb = steps // max(num_blocks, 1)
    assert gen_length % block_length == 0 and spb >= 1 and remasking in REMASKING, \
        f"gen_length {gen_length} must be a multiple of block_length {block_length}, with steps {steps} >= blocks"
    return num_blocks, spb


def canvas(prompt_ids, gen_length, mask_id, attention_mask, cfg_scale, return_order):
    """The text sampler's start: x = prompt + N mask ids, order, the mask over x (2B for CFG), prompt, padded."""
    B = prompt_ids.shape[0]
    x = torch.cat([prompt_ids.long(), prompt_ids.new_full((B, gen_length), mask_id).long()], 1)  # (B, L)
    order = torch.full_like(x, -1) if return_order else None  # (B, L)
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, gen_length)], 1)  # (B, L)
        if cfg_scale:
            attention_mask = attention_mask.repeat(2, 1)  # (2B, L)
    fwd = {} if attention_mask is None else {"padded": not bool(attention_mask.all())}
    return x, order, attention_mask, x != mask_id, fwd


def transfer_schedule(num_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to reveal at each step: num_masked (B,) -> (B, steps). LLaDA Eq. (8): c tokens over s steps get
    c // s each, the remainder one apiece to the earliest steps."""
    i = torch.arange(steps, device=num_masked.device)  # (S,)
    c = num_masked.long()[:, None]  # (B, 1)
    return c // steps + (i[None, :] < c % steps).long()  # (B, S)


def gumbel_argmax(logits: torch.Tensor, temperature: float, u=None) -> torch.Tensor:
    """A sample of softmax(logits / temperature) (..., V) -> (...) from uniforms u, LLaDA's exp(l) / (-log u)^tau;
    float64, as float32 truncates the Gumbel tail and lowers the temperature (arXiv:2409.02908)."""
    if temperature == 0:
        return logits.argmax(-1)
    return (logits.double().exp() / (-torch.log(u)) ** temperature).argmax(-1)


def _forward(model, x, attention_mask, lo, end, vocab_slice=None, **kw):
    """Logits (B, end - lo, V) at [lo, end), the head on those rows only (FullRows.head) if the model takes
    logits_at; vocab_slice (a, b): those columns only. return_kv=True adds the cache."""
    if not getattr(model, "accepts_cache_kwargs", False):
        logits = model(x) if attention_mask is None else model(x, attention_mask=attention_mask)
        assert logits.shape[:2] == x.shape, f"model returned logits {tuple(logits.shape)} for input {tuple(x.shape)}"
        return logits[:, lo:end] if vocab_slice is None else logits[:, lo:end, vocab_slice[0]:vocab_slice[1]]
    head = FullRows(x, lo, end).head()  # [a, b) holds [lo, end)
    out = model(x, attention_mask, logits_at=head, vocab_slice=vocab_slice, **kw)
    a = head.start
    return (out[0][:, lo - a:end - a], out[1]) if kw.get("return_kv") else out[:, lo - a:end - a]


class FastSampler:
    """RL rollouts' text sampler under --kv_cache / --threshold: fast_generate, keeping statistics."""

    def __init__(self, kv_cache: str, threshold: float):
        self.kv_cache, self.threshold, self.stats = kv_cache, threshold, {}

    def __call__(self, model, prompt_ids, **kw):
        return fast_generate(model, prompt_ids, kv_cache=self.kv_cache, threshold=self.threshold, stats=self.stats,
                             **kw)

    def take_log(self, device) -> dict:
        """Tokens revealed per step and row (mean, max), and their mean probability, since the last call."""
        stats, self.stats = self.stats, {}
        for revealed, conf, active in stats.pop("steps", []):  # each step's (B, K) tensors
            committed = revealed[torch.tensor(active, device=revealed.device)].sum(1)  # per active row
            for k, v in (("row_steps", committed.numel()), ("tokens", int(committed.sum())),
                         ("conf_sum", float(conf[revealed].double().sum()))):
                stats[k] = stats.get(k, 0) + v
            stats["max"] = max(stats.get("max", 0), int(committed.max()) if committed.numel() else 0)
        sums = scale.all_sum(torch.tensor([stats.get(k, 0) for k in ("row_steps", "tokens", "conf_sum")],
                                          dtype=torch.float64, device=device)).tolist()
        top = scale.all_max(torch.tensor([float(stats.get("max", 0))], dtype=torch.float64, device=device)).item()
        return {"text/committed_per_step": sums[1] / max(sums[0], 1), "text/committed_per_step_max": top,
                "text/committed_conf": sums[2] / max(sums[1], 1)}


class FullRows:
    """LLaDA bit parity; a first reading may skip it. LLaDA scores whole rows (B, L), the samplers columns [lo, end);
    this gives each number its whole-row value. head: [lo, end) widened to MIN_HEAD_ROWS rows over the batch (a
    GEMM of few rows may take another BLAS kernel, flipping near-ties). noise: each row's uniforms over its whole
    row (the fast step's active rows: [lo, end) alone). top_k: whole rows, -inf outside (CPU topk's ties vary)."""

    def __init__(self, x, lo, end, generator=None, active=None):
        self.x, self.cols, self.generator, self.active = x, slice(lo, end), generator, active

    def head(self) -> slice:
        (B, L), lo, end = self.x.shape, self.cols.start, self.cols.stop
        w = min(L, max(end - lo, -(-MIN_HEAD_ROWS // B)))
        a = min(lo, L - w)
        return slice(a, a + w)

    def noise(self, *tail, dtype=torch.float64) -> torch.Tensor:
        """U[0, 1) (B, end - lo, *tail) from the generator."""
        (B, L), device = self.x.shape, self.x.device
        if self.active is None:
            return uniform((B, L, *tail), self.generator, device, dtype, cols=self.cols)
        return uniform((B, self.cols.stop - self.cols.start, *tail), self.generator, device, dtype, active=self.active)

    def top_k(self, conf: torch.Tensor, k: torch.Tensor, distinct=None) -> torch.Tensor:
        """bool (B, end - lo): select_top_k of conf (B, end - lo) as a whole row of -inf outside."""
        full = conf.new_full(self.x.shape, -math.inf)  # (B, L)
        full[:, self.cols] = conf
        return select_top_k(full, k, distinct)[:, self.cols]


def select_top_k(confidence: torch.Tensor, counts: torch.Tensor, distinct=None) -> torch.Tensor:
    """bool (B, L): row j marks torch.topk(confidence[j], counts[j]) as LLaDA's per-row loop, ties included
    (bf16 confidences near 1 tie often), with one batched topk per distinct count (None: read, a host sync)."""
    select = torch.zeros_like(confidence, dtype=torch.bool)  # (B, L)
    for k in (counts.unique().tolist() if distinct is None else distinct):
        top = torch.zeros_like(select).scatter_(1, torch.topk(confidence, k, dim=-1).indices, True)  # (B, L)
        select |= top & (counts == k)[:, None]
    return select


# --- images: emerge (MaskGRPO Alg. 4) and MaskGIT (MMaDA)

@torch.no_grad()
def generate_image(model, input_ids, *, image_start, num_tokens, steps, sampler="emerge", cfg_scale=0.0,
                   uncond_input_ids=None, generator=None, attention_mask=None, uncond_attention_mask=None,
                   temperature=1.0, code_offset, codebook_size, mask_id, return_order=False, progress=False):
    """Fill input_ids[:, image_start:][:, :num_tokens] with image tokens [, order] by emerge_step or maskgit_step;
    uncond_*: CFG's prompt; temperature: MaskGIT's (docs/differences.md)."""
    B, n, span = input_ids.shape[0], num_tokens, slice(image_start, image_start + num_tokens)
    assert sampler in IMAGE_SAMPLERS and steps >= 1 and (sampler == "maskgit" or temperature == 1.0), \
        f"sampler {sampler!r}, steps {steps}, temperature {temperature}: emerge samples from p itself (tau = 1)"
    assert (input_ids[:, span] == mask_id).all() and (input_ids == mask_id).sum() == B * n, \
        f"input_ids[:, {image_start}:{image_start + n}] must be the only mask ids ({mask_id})"
    assert cfg_scale == 0 or (uncond_input_ids is not None and uncond_input_ids.shape == input_ids.shape), \
        "cfg_scale > 0 needs uncond_input_ids in the layout of input_ids"
    codes = (code_offset, code_offset + codebook_size)  # the head's rows of the image codes
    # whether any mask the model sees pads: read once, not at every step
    masks = [m for m in (attention_mask, uncond_attention_mask if cfg_scale else None) if m is not None]
    padded = any(not bool(m.all()) for m in masks) if masks else None
    x = input_ids.clone()  # (B, L)
    order = torch.full_like(x, -1) if return_order else None  # (B, L)
    for s in tqdm(range(steps), desc="image steps", disable=not progress, leave=False):
        probs = _image_probs(model, x, span, codes, attention_mask, uncond_input_ids, uncond_attention_mask,
                             cfg_scale, padded)  # (B, n, C)
        slots = x[:, span]  # (B, n)
        if sampler == "emerge":
            new = emerge_step(probs, slots, s, steps, generator, code_offset, mask_id)  # (B, n)
        else:
            new = maskgit_step(probs, slots, s, steps, temperature, generator, code_offset, mask_id)
        if order is not None:
            order[:, span] = torch.where((slots == mask_id) & (new != mask_id), s, order[:, span])
        x[:, span] = new
    return (x, order) if return_order else x


def emerge_step(probs, slots, s, steps, generator, code_offset, mask_id):
    """Step s of T of emerge (Alg. 4): probs (B, n, C), slots (B, n) -> new slots, a masked one revealed with
    probability (kappa_t - kappa_s) / kappa_t as a code drawn from p; the last step reveals all."""
    masked = slots == mask_id  # (B, n)
    code = torch.where(masked, _sample_categorical(probs, generator), slots - code_offset)  # (B, n)
    if s == steps - 1:
        return code + code_offset
    # Alg. 4's (C+1)-way categorical, drawn as "reveal?" and the code apart.
    k_t, k_s = _cosine(s / steps), _cosine((s + 1) / steps)
    stay = masked & (uniform(masked.shape, generator, slots.device) >= (k_t - k_s) / k_t)  # (B, n)
    return torch.where(stay, mask_id, code + code_offset)


def maskgit_step(probs, slots, s, steps, temperature, generator, code_offset, mask_id):
    """Step s of T of MaskGIT as MMaDA's t2i_generate runs it: probs (B, n, C), slots (B, n) -> new slots. Every
    unknown slot is drawn from p, then the floor(n kappa_s) least confident (log p + Gumbel) are masked again."""
    masked = slots == mask_id  # (B, n)
    code = torch.where(masked, _sample_categorical(probs, generator), slots - code_offset)  # (B, n)
    if s == steps - 1:
        return code + code_offset
    logp = probs.gather(-1, code[..., None]).squeeze(-1).log()  # (B, n); p > 0
    # canonical MaskGIT's annealed choice temperature (MMaDA's compounds: docs/differences.md); float64 Gumbel
    tau = temperature * (1 - (s + 1) / steps)
    if tau > 0:
        logp = logp + tau * -torch.log(-torch.log(uniform(masked.shape, generator, slots.device)))
    conf = torch.where(masked, logp, math.inf)  # known slots are never re-masked
    # clamped to [1, unknown - 1] as MMaDA; exactly that many by stable rank (MMaDA's re-masks fewer on ties)
    n = slots.shape[1]
    num_remask = (masked.sum(1) - 1).clamp(max=math.floor(n * _cosine((s + 1) / steps))).clamp(min=1)
    stay = conf.argsort(dim=-1, stable=True).argsort(dim=-1) < num_remask[:, None]  # (B, n)
    return torch.where(stay, mask_id, code + code_offset)


def _cosine(u: float) -> float:  # masked fraction at time u in [0, 1]: kappa(u) = cos(pi u / 2) (Alg. 4)
    return math.cos(math.pi * u / 2)


def _sample_categorical(probs, generator):
    """One draw per row of probs (..., C) float64 by inverse CDF: (...,) int64, one uniform per draw (Gumbel
    needs C); float64 sums keep the bins exact to ~1e-16, and u scaled by the total stays inside."""
    cdf = probs.cumsum(-1)  # (..., C)
    u = uniform(probs.shape[:-1], generator, probs.device) * cdf[..., -1]  # (...,)
    return torch.searchsorted(cdf, u[..., None], right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def _image_probs(model, x, span, codes, attention_mask, uncond_ids, uncond_mask, cfg_scale, padded=None):
    """float64 p (B, n, C) over the codebook at the slots, with CFG if cfg_scale > 0."""
    if cfg_scale == 0:
        logits = _forward(model, x, attention_mask, span.start, span.stop, vocab_slice=codes, padded=padded)
    else:  # the unconditional input is the empty-caption prompt around the *current* image (MMaDA)
        x_u = uncond_ids.clone()
        x_u[:, span] = x[:, span]
        masks = None if attention_mask is None and uncond_mask is None else torch.cat(
            [m if m is not None else torch.ones_like(x) for m in (attention_mask, uncond_mask)])
        cond, uncond = _forward(model, torch.cat([x, x_u]), masks, span.start, span.stop, vocab_slice=codes,
                                padded=padded).chunk(2)
        logits = (1 + cfg_scale) * cond - cfg_scale * uncond  # MMaDA's (1 + w) l_c - w l_u, in its order
    # float64 (MMaDA samples from bf16 probabilities): with 8192 codes, bf16 rounds away the tail.
    return F.softmax(logits.double(), dim=-1)


if __name__ == "__main__":  # the sampling library; the command line is tools/sample.py
    import shlex
    import sys
    sys.exit("sample.py is the sampling library, not a command; to sample from a checkpoint run: "
             + shlex.join(["python", "-m", "tools.sample", *sys.argv[1:]]))
