"""Fast-dLLM (arXiv:2505.22618): two approximations of sample.generate for faster text rollouts, off by default.

  kv_cache  "prefix" or "dual" caches every layer's keys and values at each block start; later steps of the
            block recompute the block and what follows it ("prefix") or the block alone ("dual") against it
            (model.Transformer's kv / start / return_kv forward arguments).
  threshold tau > 0 also commits every masked position of the block more confident than tau, at least
            ceil(masked left / steps left), so a block may end early.

Either one switches from LLaDA's exact step to the fast step, the same sample.denoise_step around a cache and
a threshold: the block alone is scored, the mask id is never committed, and a row whose block is done draws no
noise. They approximate the behaviour policy only:
MaskGRPO rescores every rollout under its own masks. RL rollouts use FastSampler under --kv_cache /
--threshold; held-out evaluation keeps the exact sampler.
"""
import math

import torch
from tqdm import tqdm

import sample
from infra import scale
from sample import _forward, canvas, denoise_step

KV_CACHES = ("none", "prefix", "dual")  # Fast-dLLM block KV cache: off, or what a cached step recomputes


@torch.no_grad()
def generate(model, prompt_ids, *, gen_length, block_length, steps, temperature=0.0, cfg_scale=0.0,
             remasking="low_confidence", mask_id, generator=None, attention_mask=None, kv_cache="none",
             threshold=0.0, return_order=False, progress=False, stats=None):
    """sample.generate's arguments and outputs, with kv_cache in KV_CACHES and threshold tau >= 0 (module
    docstring); with neither, sample.generate itself. stats: a dict that collects what each fast step
    committed, kept on the device until fast_summary sums it."""
    if kv_cache == "none" and threshold <= 0:
        return sample.generate(model, prompt_ids, gen_length=gen_length, block_length=block_length, steps=steps,
                               temperature=temperature, cfg_scale=cfg_scale, remasking=remasking, mask_id=mask_id,
                               generator=generator, attention_mask=attention_mask, return_order=return_order,
                               progress=progress)
    num_blocks = gen_length // block_length
    spb = steps // max(num_blocks, 1)
    assert gen_length % block_length == 0 and spb >= 1 and remasking in sample.REMASKING, \
        f"gen_length {gen_length} must be a multiple of block_length {block_length}, with steps {steps} >= blocks"
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
            left = (x[:, start:end] == mask_id).sum(1).tolist()                   # the step's one host read
            if not any(left):  # the threshold finished this block early
                break
            xx = x if cfg_scale == 0 else torch.cat([x, x.masked_fill(prompt_index, mask_id)])  # (B or 2B, L)
            if kv is None:  # a full forward (at a block start, it stores every layer's keys and values)
                logits, kv = _forward(model, xx, attention_mask, start, end, return_kv=True, **fwd) \
                    if kv_cache != "none" else (_forward(model, xx, attention_mask, start, end, **fwd), None)
            else:  # recompute the block and what follows it (prefix) or the block alone (dual)
                stop = L if kv_cache == "prefix" else end
                logits = model(xx[:, start:stop], attention_mask, kv=kv, start=start, logits_at=slice(0, end - start),
                               **fwd)
            if cfg_scale:  # l_u + (w + 1)(l_c - l_u), as sample.generate
                cond, uncond = logits.chunk(2)
                logits = uncond + (cfg_scale + 1) * (cond - uncond)               # (B, K, V)
            logits[..., mask_id] = -math.inf
            # At least ceil(masked left / steps left): the fixed schedule when nothing extra was committed.
            k = [(n + spb - i - 1) // (spb - i) for n in left]
            # A row whose block is done draws no noise (with per-row generators).
            active = [n > 0 for n in left]
            revealed, conf = denoise_step(x, order, blk * spb + i, logits, start, end, torch.tensor(k, device=x.device),
                                          sorted(set(k)), temperature=temperature, remasking=remasking,
                                          mask_id=mask_id, generator=generator, active=active, threshold=threshold)
            if stats is not None:  # kept on the device; fast_summary reads them (a read per step would stall)
                stats.setdefault("steps", []).append((revealed, conf, active))
            bar.update()
    bar.close()
    return (x, order) if return_order else x


def _count(stats: dict, committed: torch.Tensor, conf: torch.Tensor) -> None:
    # committed: tokens committed by each active row at one step; conf: their sampled tokens' probabilities.
    for k, v in (("row_steps", committed.numel()), ("tokens", int(committed.sum())),
                 ("conf_sum", float(conf.double().sum()))):
        stats[k] = stats.get(k, 0) + v
    stats["max"] = max(stats.get("max", 0), int(committed.max()) if committed.numel() else 0)


def fast_summary(task: str, stats: dict | None, device) -> dict:
    """Log entries of one RL step's fast rollouts, over all ranks: tokens committed per decoding step and
    row (mean, max; the exact sampler commits gen_length / steps) and the mean probability of the committed
    tokens under the sampling distribution (Fast-dLLM thresholds it). {} without stats."""
    if stats is None:
        return {}
    for revealed, conf, active in stats.pop("steps", []):  # each fast step's (B, K) tensors, read here
        _count(stats, revealed[torch.tensor(active, device=revealed.device)].sum(1), conf[revealed])
    sums = scale.all_sum(torch.tensor([stats.get(k, 0) for k in ("row_steps", "tokens", "conf_sum")],
                                      dtype=torch.float64, device=device)).tolist()
    top = scale.all_max(torch.tensor([float(stats.get("max", 0))], dtype=torch.float64, device=device)).item()
    return {f"{task}/committed_per_step": sums[1] / max(sums[0], 1), f"{task}/committed_per_step_max": top,
            f"{task}/committed_conf": sums[2] / max(sums[1], 1)}


class FastSampler:
    """The text sampler of RL rollouts under --kv_cache / --threshold: sample.generate's keywords, run by
    generate with this kv_cache and threshold, summing what every call committed until take_log."""

    def __init__(self, kv_cache: str, threshold: float):
        self.kv_cache, self.threshold, self.stats = kv_cache, threshold, {}

    def __call__(self, model, prompt_ids, **kw):
        return generate(model, prompt_ids, kv_cache=self.kv_cache, threshold=self.threshold, stats=self.stats, **kw)

    def take_log(self, device) -> dict:
        """fast_summary of the statistics since the last call, over all ranks (task name "text"); then reset."""
        log, self.stats = fast_summary("text", self.stats, device), {}
        return log
