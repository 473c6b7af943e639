"""Samplers at their non-default settings: what each fast-sampler cache mode recomputes (calls, positions,
which cached keys and values are refreshed), and the image samplers' noise replayed from the same per-row
generators by a naive loop written here (the documented draws: per step and row, one float64 uniform per
slot for the code by inverse CDF, then one per slot for emerge's reveal or MaskGIT's Gumbel choice noise).

    python -m pytest tests/test_sample_settings.py -q
"""
import math

import pytest
import torch
import torch.nn as nn

import sample
from model import ModelConfig, Transformer
from sample import generate_image


V2, MASK2 = 64, 63


def tiny(n_layers=2, dtype=torch.float32) -> Transformer:
    cfg = ModelConfig(d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, mlp_hidden_size=48, vocab_size=V2,
                      max_sequence_length=64, mask_token_id=MASK2, eos_token_id=1, pad_token_id=1)
    return Transformer(cfg).init_weights(torch.Generator().manual_seed(0), std=0.3).to(dtype).eval()


class Spy(nn.Module):
    """Passes every call to the model and records its input length, start, and the cache before and after."""
    accepts_cache_kwargs = True

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.calls = model, model.config, []

    def forward(self, x, attention_mask=None, **kw):
        kv = kw.get("kv")
        before = None if kv is None else [(k.clone(), v.clone()) for k, v in kv]
        out = self.model(x, attention_mask, **kw)
        if kw.get("return_kv"):
            kv = out[1]
        self.calls.append(dict(x=x.clone(), start=kw.get("start", 0), kv=kv, before=before,
                               after=None if kv is None else [(k.clone(), v.clone()) for k, v in kv]))
        return out


def layer0_keys(model, x):
    """Layer 0's keys (B, Hkv, L, Dh), computed here: RoPE(RMSNorm(embedding) W_k) from the tokens alone."""
    blk, c = model.blocks[0], model.config
    h = model.wte.weight[x].double()
    h = blk.attn_norm.weight.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
    k = (h @ blk.k_proj.weight.double().T).view(*x.shape, c.n_kv_heads, c.head_dim).transpose(1, 2)
    dh, L = c.head_dim, x.shape[1]
    out = k.clone()
    for j in range(dh // 2):
        a = torch.arange(L, dtype=torch.float64) * c.rope_theta ** (-2 * j / dh)
        out[..., j] = k[..., j] * a.cos() - k[..., j + dh // 2] * a.sin()
        out[..., j + dh // 2] = k[..., j + dh // 2] * a.cos() + k[..., j] * a.sin()
    return out


@pytest.mark.parametrize("kv_cache", ["prefix", "dual"])
@pytest.mark.parametrize("threshold", [0.0, 0.08])
def test_cache_modes_recompute_what_they_say(kv_cache, threshold):
    """Each block starts with one full forward that returns the cache; every later step of the block feeds
    positions [start, L) ("prefix") or [start, end) ("dual") against that same cache, whose rows there and only
    there are overwritten, with the keys of the current tokens; rows outside keep their block-start values."""
    model = tiny()
    spy = Spy(model)
    P, G, K = 5, 12, 4
    p = torch.randint(2, 60, (2, P), generator=torch.Generator().manual_seed(3))
    out = sample.fast_generate(spy, p, gen_length=G, block_length=K, steps=G, mask_id=MASK2, kv_cache=kv_cache,
                               threshold=threshold)
    assert not (out == MASK2).any()
    L = P + G
    blocks_started, block = [], None
    for call in spy.calls:
        if call["before"] is None:  # a block start: the whole sequence, the cache returned
            assert call["x"].shape[1] == L and call["start"] == 0 and call["kv"] is not None
            block = len(blocks_started)
            blocks_started.append(call)
            start, end = P + block * K, P + (block + 1) * K
            assert (call["x"][:, start:] == MASK2).all() and (call["x"][:, :start] != MASK2).all()
            continue
        stop = L if kv_cache == "prefix" else end
        assert call["start"] == start and call["x"].shape[1] == stop - start
        assert call["kv"] is blocks_started[-1]["kv"]  # the block's own cache object
        for layer, ((k0, v0), (k1, v1)) in enumerate(zip(call["before"], call["after"])):
            for t0, t1 in ((k0, k1), (v0, v1)):
                assert torch.equal(t0[:, :, :start], t1[:, :, :start]), layer
                assert torch.equal(t0[:, :, stop:], t1[:, :, stop:]), layer
        block_tokens_changed = (call["x"][:, :end - start] != blocks_started[-1]["x"][:, start:end]).any()
        assert block_tokens_changed  # so a stale block row would show in layer 0
        want = layer0_keys(model, torch.cat([blocks_started[-1]["x"][:, :start], call["x"],
                                             blocks_started[-1]["x"][:, stop:]], 1))
        torch.testing.assert_close(call["after"][0][0][:, :, start:stop].double(), want[:, :, start:stop],
                                   rtol=0, atol=1e-5)
    assert len(blocks_started) == G // K
    assert len(spy.calls) == G if threshold == 0 else len(spy.calls) < G


# -----------------------------------------------------------------------------------------------------
# image samplers: the noise replayed


OFFSET2, C2, N_SLOTS = 40, 16, 6


def image_ids(B):
    head = torch.randint(0, OFFSET2, (B, 4), generator=torch.Generator().manual_seed(1))
    return torch.cat([head, torch.full((B, 1), 2), torch.full((B, N_SLOTS), MASK2), torch.full((B, 1), 3)], 1), 5


def inverse_cdf(p, u):
    """The first code whose cumulative probability exceeds u * total (a loop, not searchsorted)."""
    total, acc = float(p.sum()), 0.0
    for c in range(len(p)):
        acc += float(p[c])
        if acc > u * total:
            return c
    return len(p) - 1


def naive_image(model, ids, start, steps, sampler, gens, temperature=1.0):
    """MaskGRPO Alg. 4 (emerge) or MaskGIT from the per-row generators, one row and one slot at a time."""
    x = ids.clone()
    B, n = x.shape[0], N_SLOTS
    span = slice(start, start + n)
    for s in range(steps):
        with torch.no_grad():
            probs = torch.softmax(model(x)[:, span, OFFSET2:OFFSET2 + C2].double(), -1)    # (B, n, C2)
        for i, g in enumerate(gens):
            masked = [bool(t == MASK2) for t in x[i, span]]
            u = torch.rand(n, generator=g, dtype=torch.float64)
            code = [inverse_cdf(probs[i, j], float(u[j])) if masked[j] else int(x[i, start + j]) - OFFSET2
                    for j in range(n)]
            stay = [False] * n
            if s < steps - 1 and sampler == "emerge":
                k_t, k_s = math.cos(math.pi * s / steps / 2), math.cos(math.pi * (s + 1) / steps / 2)
                r = torch.rand(n, generator=g, dtype=torch.float64)
                stay = [masked[j] and float(r[j]) >= (k_t - k_s) / k_t for j in range(n)]
            elif s < steps - 1:
                tau = temperature * (1 - (s + 1) / steps)
                gumbel = -torch.log(-torch.log(torch.rand(n, generator=g, dtype=torch.float64))) if tau > 0 else None
                conf = [math.log(float(probs[i, j, code[j]])) + (tau * float(gumbel[j]) if tau > 0 else 0.0)
                        if masked[j] else math.inf for j in range(n)]
                keep = min(sum(masked) - 1, math.floor(n * math.cos(math.pi / 2 * (s + 1) / steps)))
                lowest = sorted(range(n), key=lambda j: conf[j])[:max(keep, 1)]
                stay = [j in lowest for j in range(n)]
            for j in range(n):
                x[i, start + j] = MASK2 if stay[j] else code[j] + OFFSET2
    return x


@pytest.mark.parametrize("sampler, steps, temperature", [("emerge", 4, 1.0), ("emerge", 1, 1.0),
                                                         ("maskgit", 4, 1.0), ("maskgit", 3, 2.5),
                                                         ("maskgit", 4, 0.0)])
def test_image_noise_replays_the_naive_sampler(sampler, steps, temperature):
    model = tiny(dtype=torch.float64)
    ids, start = image_ids(3)
    kw = dict(image_start=start, num_tokens=N_SLOTS, steps=steps, sampler=sampler, temperature=temperature,
              code_offset=OFFSET2, codebook_size=C2, mask_id=MASK2)
    got = generate_image(model, ids, generator=[torch.Generator().manual_seed(10 + i) for i in range(3)], **kw)
    want = naive_image(model, ids, start, steps, sampler, [torch.Generator().manual_seed(10 + i) for i in range(3)],
                       temperature)
    assert torch.equal(got, want)
    other = generate_image(model, ids, generator=[torch.Generator().manual_seed(20 + i) for i in range(3)], **kw)
    assert not torch.equal(other, got)  # the generators do decide the sample


def test_image_cfg_passes_the_unconditional_padding_mask():
    """uncond_attention_mask reaches the model as the second half of the CFG batch, attention_mask the first."""
    seen = []

    class Rec(nn.Module):
        def forward(self, x, attention_mask=None):
            seen.append(attention_mask.clone())
            return torch.zeros(x.shape[0], x.shape[1], V2)

    ids, start = image_ids(2)
    am, uam = torch.ones_like(ids), torch.ones_like(ids)
    am[:, 0] = 0
    uam[:, :3] = 0
    uncond = ids.clone()
    uncond[:, :4] = 1
    generate_image(Rec(), ids, image_start=start, num_tokens=N_SLOTS, steps=2, cfg_scale=1.5, uncond_input_ids=uncond,
                   attention_mask=am, uncond_attention_mask=uam, generator=torch.Generator().manual_seed(0),
                   code_offset=OFFSET2, codebook_size=C2, mask_id=MASK2)
    assert len(seen) == 2 and all(torch.equal(m, torch.cat([am, uam])) for m in seen)
