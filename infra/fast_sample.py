"""Fast text rollouts: the Fast-dLLM block KV cache and confidence-threshold decoding (arXiv:2505.22618).

`generate` takes sample.generate's arguments plus two approximations of LLaDA's sampler:
    kv_cache   "prefix" or "dual": a full forward at each block start caches every layer's keys and values;
               later steps of the block recompute the block and what follows it ("prefix") or the block
               alone ("dual") against that cache. Needs model.Transformer's kv arguments.
    threshold  tau > 0: each step also commits every masked position of the block more confident than tau
               (Fast-dLLM uses 0.9), at least ceil(masked left / steps left); a block may end early.
With neither it is sample.generate itself. Both approximate the behaviour policy only: MaskGRPO rescores
every rollout under its own masks (importance.py), so the objective stays the paper's. Unlike the exact
sampler they never commit the mask id, and a row whose block is done draws no noise (its per-row stream
advances as when decoded alone). infra/bench.py measures their speed and agreement with the exact sampler.
"""
import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

import sample
from infra import scale
from infra.rng import uniform

KV_CACHES = ("none", "prefix", "dual")


def _count(stats: dict, committed: torch.Tensor, conf: torch.Tensor) -> None:
    # committed: tokens committed by each active row at one step; conf: their sampled tokens' probabilities.
    for k, v in (("row_steps", committed.numel()), ("tokens", int(committed.sum())),
                 ("conf_sum", float(conf.double().sum()))):
        stats[k] = stats.get(k, 0) + v
    stats["max"] = max(stats.get("max", 0), int(committed.max()) if committed.numel() else 0)


def step_summary(task: str, stats: dict | None, device) -> dict:
    """Log entries of one RL step's fast rollouts, over all ranks: tokens committed per decoding step and
    row (mean, max; the exact sampler commits gen_length / steps) and the mean probability of the committed
    tokens under the sampling distribution (Fast-dLLM thresholds it). {} without stats."""
    if stats is None:
        return {}
    sums = scale.all_sum(torch.tensor([stats.get(k, 0) for k in ("row_steps", "tokens", "conf_sum")],
                                      dtype=torch.float64, device=device)).tolist()
    top = scale.all_max(torch.tensor([float(stats.get("max", 0))], dtype=torch.float64, device=device)).item()
    return {f"{task}/committed_per_step": sums[1] / max(sums[0], 1), f"{task}/committed_per_step_max": top,
            f"{task}/committed_conf": sums[2] / max(sums[1], 1)}


@torch.no_grad()
def generate(model, prompt_ids, *, gen_length, block_length, steps, temperature=0.0, cfg_scale=0.0,
             remasking="low_confidence", mask_id, generator=None, attention_mask=None, kv_cache=None,
             threshold=None, return_order=False, progress=False, stats=None):
    """sample.generate with kv_cache (None | "none" | "prefix" | "dual") and threshold (None or 0 = off).
    stats: a dict that receives running sums of what each step committed (step_summary reads them)."""
    kv_cache = None if kv_cache in (None, "none") else kv_cache
    threshold = threshold or None
    common = dict(gen_length=gen_length, block_length=block_length, steps=steps, temperature=temperature,
                  cfg_scale=cfg_scale, remasking=remasking, mask_id=mask_id, generator=generator,
                  attention_mask=attention_mask, return_order=return_order, progress=progress)
    if kv_cache is None and threshold is None:
        return sample.generate(model, prompt_ids, **common)
    assert kv_cache in (None, "prefix", "dual") and (kv_cache is None or getattr(model, "accepts_cache_kwargs", False)), \
        f"kv_cache={kv_cache!r} needs model.Transformer's kv / start / return_kv forward arguments"
    assert threshold is None or remasking == "low_confidence", "threshold compares model confidences"
    num_blocks = gen_length // block_length
    spb = steps // max(num_blocks, 1)
    assert gen_length % block_length == 0 and spb >= 1, (gen_length, block_length, steps)
    x, order, attention_mask, prompt_index = sample.canvas(prompt_ids, gen_length, mask_id, attention_mask,
                                                           cfg_scale, return_order)
    (B, L), P = x.shape, prompt_ids.shape[1]
    bar = tqdm(total=spb * num_blocks, desc="denoising", disable=not progress, leave=False)
    for blk in range(num_blocks):
        start, end = P + blk * block_length, P + (blk + 1) * block_length
        kv = None
        for i in range(spb):
            masked = x == mask_id                                                  # (B, L)
            if not masked[:, start:end].any():  # the threshold finished this block early
                break
            xx = x if cfg_scale == 0 else torch.cat([x, x.masked_fill(prompt_index, mask_id)])  # (B or 2B, L)
            if kv is None:  # the block start: a full forward that stores every layer's keys and values
                logits, kv = sample._forward(model, xx, attention_mask, start, end, return_kv=kv_cache is not None) \
                    if kv_cache is not None else (sample._forward(model, xx, attention_mask, start, end), None)
            else:  # recompute the block and what follows it (prefix) or the block alone (dual)
                stop = L if kv_cache == "prefix" else end
                logits = model(xx[:, start:stop], attention_mask, kv=kv, start=start, logits_at=slice(0, end - start))
            if cfg_scale:
                cond, uncond = logits.chunk(2)
                logits = uncond + (cfg_scale + 1) * (cond - uncond)               # (B, l, V)
            logits[..., mask_id] = -math.inf
            draw = dict(active=masked[:, start:end].any(1).tolist())
            u = uniform((B, end - start, logits.shape[-1]), generator, x.device, **draw) if temperature > 0 else None
            x0 = sample.gumbel_argmax(logits, temperature, u)                      # (B, l)
            if remasking == "low_confidence":
                conf = F.softmax(logits, dim=-1).gather(-1, x0[..., None]).squeeze(-1)  # (B, l)
            else:
                conf = uniform((B, end - start), generator, x.device, torch.float32, **draw)  # (B, l)
            m = masked[:, start:end]                                               # (B, l)
            full = torch.full((B, L), -math.inf, dtype=conf.dtype, device=x.device)
            full[:, start:end] = torch.where(m, conf, -math.inf)
            # At least ceil(masked left / steps left): the fixed schedule when nothing extra was committed.
            left = m.sum(1)                                                        # (B,)
            select = sample.select_top_k(full, (left + spb - i - 1) // (spb - i))[:, start:end]
            if threshold is not None:
                select |= m & (conf > threshold)
            new = torch.where(select & m, x0, x[:, start:end])                     # (B, l)
            if stats is not None:  # per row that still had masked tokens: how many it committed, how sure
                _count(stats, (select & m)[m.any(1)].sum(1), conf[select & m])
            if order is not None:
                order[:, start:end][m & (new != mask_id)] = blk * spb + i
            x[:, start:end] = new
            bar.update()
    bar.close()
    return (x, order) if return_order else x
