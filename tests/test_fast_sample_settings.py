"""sample.generate's fast-step noise and reveal order at temperature > 0, replayed by a naive loop written here from
its documented behaviour: per block and step, each row whose block still has a mask draws its own uniforms
(float64, block positions x vocabulary, for the Gumbel-max token; then float32, block positions, for "random"
remasking), commits the top ceil(masked left / steps left) masked positions by confidence plus every one
above the threshold, and never commits the mask id. A row whose block is done draws nothing.

    python -m pytest tests/test_fast_sample_settings.py -q
"""
import math

import pytest
import torch

import sample
from model import ModelConfig, Transformer

V, MASK = 40, 39


def one_layer() -> Transformer:
    """One layer: a key depends on its own token only, so the block caches are exact (the replay may use full
    forwards); float64, so that no near-tie can flip between the cached and the full computation."""
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, mlp_hidden_size=32, vocab_size=V,
                      max_sequence_length=64, mask_token_id=MASK, eos_token_id=1, pad_token_id=1)
    return Transformer(cfg).init_weights(torch.Generator().manual_seed(0), std=0.5).double().eval()


def naive(model, prompt, G, K, S, temperature, remasking, threshold, gens):
    B, P = prompt.shape
    x = torch.cat([prompt, torch.full((B, G), MASK)], 1)
    order = torch.full_like(x, -1)
    spb = S // (G // K)
    for blk in range(G // K):
        start, end = P + blk * K, P + (blk + 1) * K
        for i in range(spb):
            if not (x[:, start:end] == MASK).any():
                break
            with torch.no_grad():
                logits = model(x)[:, start:end].clone()                               # (B, K, V)
            logits[..., MASK] = -math.inf
            for r in range(B):
                masked = (x[r, start:end] == MASK).nonzero().flatten().tolist()
                if not masked:
                    continue  # a finished row draws no noise
                u = torch.rand(K, V, generator=gens[r], dtype=torch.float64)
                tok = (logits[r].exp() / (-u.log()) ** temperature).argmax(-1)          # (K,)
                p = torch.softmax(logits[r], -1)
                conf = p[torch.arange(K), tok]
                if remasking == "random":
                    conf = torch.rand(K, generator=gens[r], dtype=torch.float32)
                n = -(-len(masked) // (spb - i))
                ranked = sorted(masked, key=lambda j: -float(conf[j]))
                chosen = set(ranked[:n]) | {j for j in masked if threshold and conf[j] > threshold}
                for j in chosen:
                    x[r, start + j] = tok[j]
                    order[r, start + j] = blk * spb + i
    return x, order


@pytest.mark.parametrize("kv_cache, threshold, remasking, temperature", [
    ("none", 0.3, "low_confidence", 1.0), ("dual", 0.0, "low_confidence", 0.7), ("prefix", 0.2, "low_confidence", 1.3),
    ("dual", 0.0, "random", 1.0)])
def test_noise_and_order_replay(kv_cache, threshold, remasking, temperature):
    model = one_layer()
    prompt = torch.randint(2, 38, (3, 4), generator=torch.Generator().manual_seed(1))
    G, K, S = 12, 4, 12
    gens = lambda: [torch.Generator().manual_seed(30 + r) for r in range(3)]
    got, order = sample.generate(model, prompt, gen_length=G, block_length=K, steps=S, temperature=temperature,
                                      remasking=remasking, mask_id=MASK, generator=gens(), kv_cache=kv_cache,
                                      threshold=threshold, return_order=True)
    want, want_order = naive(model, prompt, G, K, S, temperature, remasking, threshold, gens())
    assert torch.equal(got, want) and torch.equal(order, want_order)
    if threshold:
        assert order.max() < S - 1  # the threshold did finish blocks early, so "no draw when done" was exercised
