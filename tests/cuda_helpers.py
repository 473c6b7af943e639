"""Helpers of tests/test_cuda.py that do not depend on its device: random weights, padded prompts, a
synthetic rollout, one update chunk, a free port."""
import contextlib
import io
import socket

import torch

import grpo
import importance
import train
from model import Transformer



def head_dtype(model):
    """A list that receives the dtype of the LM head's output at every forward through the ff_out module: the
    compute dtype. Those are the text sampler's; the scoring head runs in float32 from the same weight, and the
    image sampler's from its code rows (model.Transformer.head), neither through the module."""
    seen = []
    model.ff_out.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    return seen


def random_weights(mc, device, dtype, seed=0):
    """A model of config mc with N(0, 0.02) weights drawn on `device` (an 8B embedding would take
    seconds to draw on the CPU) directly in `dtype` (drawing 8B weights in float32 first would hold 32 GB
    on the device, inflating the peak memory measured after it); norms at 1."""
    with torch.device("meta"):
        model = Transformer(mc).to(dtype)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()  # (the RoPE tables are a lazy cache, built at the first forward)


def padded_prompts(mc, B, prompt_len, device, seed=0):
    """B random prompts left-padded as tasks.make_batch pads them: row i has i * prompt_len // (2 B)
    pad tokens, masked out of attention (so the key-mask SDPA path runs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, mc.vocab_size - 1000 if mc.vocab_size > 2000 else mc.vocab_size - 2, (B, prompt_len),
                      generator=g)
    am = torch.ones(B, prompt_len, dtype=torch.long)
    for i in range(B):
        am[i, : i * prompt_len // (2 * B)] = 0
    x[am == 0] = mc.pad_token_id
    return x.to(device), am.to(device)


def synthetic_rollout(model, mc, B, prompt_len, gen_len, device, seed=0):
    """A text rollout of B left-padded sequences with one inner iteration's mask (ratio about 0.7) and
    its old and reference log-probs, shaped as train.rl_step builds it, for one update chunk."""
    g = torch.Generator().manual_seed(seed)
    prompt, am_p = padded_prompts(mc, B, prompt_len, device, seed)
    comp = torch.randint(0, mc.vocab_size - 2, (B, gen_len), generator=g).to(device)
    x = torch.cat([prompt, comp], 1)                                               # (B, L)
    am = torch.cat([am_p, torch.ones_like(comp)], 1)
    mask = torch.zeros(x.shape, dtype=torch.bool)
    mask[:, prompt_len:] = torch.rand(B, gen_len, generator=g) < 0.7
    mask = mask.to(device)
    inp = x.masked_fill(mask, mc.mask_token_id)
    with torch.no_grad():
        old = importance.token_logprobs(model, inp, x, mask, attention_mask=am)
    batch = train.Batch("gsm8k", x, am, prompt_len, gen_len)
    adv = torch.randn(B, generator=g).to(device)
    return train.Experience(batch, torch.zeros(B), adv, importance.Views([inp], mask[None], [[0]]), [old],
                            [old.clone()])


def one_update_chunk(model, r, cfg):
    """train.rl_step's update pass for inner iteration 0 of text rollout r, all rows in one chunk (backward
    only; the caller steps). Text is scored over the whole vocabulary."""
    b, mask = r.batch, r.views.loss_masks[0]
    logp = importance.token_logprobs(model, r.views.inputs[0], b.x, mask, attention_mask=b.attention_mask)
    loss, stats = grpo.policy_loss(logp, r.logp_old[0], r.adv, mask, clip_eps=cfg.clip_eps, beta=cfg.beta,
                                   logp_ref=None if r.logp_ref is None else r.logp_ref[0], norm=cfg.loss_norm)
    loss.backward()
    return {**stats, "loss": loss.item()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet(fn, *a, **kw):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*a, **kw)
