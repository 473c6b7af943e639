"""The fast text sampler sample.fast_generate (kv_cache, threshold) and model.py's cached forward: the
defaults stay the reference (sample.generate itself), the cached forward equals the plain one on a fresh
cache, the fast paths decode every position and leave the prompt alone, they equal exact decoding on a model
for which the cache is not an approximation, and FastSampler's statistics are what the decoding order shows.

    python -m pytest tests/test_fast_sampling.py -q
"""
import math

import pytest
import torch
import torch.nn as nn
from conftest import REFERENCE
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel

from model import ModelConfig, Transformer
from infra import hf
from sample import fast_generate as generate
import sample


V, MASK, EOS = 64, 63, 1


def model_(n_layers=2, mixing_layers=None, seed=0, std=0.3) -> Transformer:
    """A tiny LLaDA with grouped-query attention. mixing_layers: if given, only these layers' attention
    reaches the residual stream (attn_out zeroed elsewhere), so the others act on each position alone."""
    cfg = ModelConfig(d_model=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, mlp_hidden_size=48, vocab_size=V,
                      max_sequence_length=64, mask_token_id=MASK, eos_token_id=EOS, pad_token_id=EOS)
    model = Transformer(cfg).init_weights(torch.Generator().manual_seed(seed), std=std)
    if mixing_layers is not None:
        with torch.no_grad():
            for i, block in enumerate(model.blocks):
                if i not in mixing_layers:
                    block.attn_out.weight.zero_()
    return model.eval()


class NoMask(nn.Module):
    """Never predicts the mask id, as a trained LLaDA: the exact sampler may commit a predicted mask (it stays
    masked and competes again) where the fast paths never do, so token-for-token comparisons need this.
    -1e4 rather than -inf keeps CFG's l_u + (w + 1)(l_c - l_u) finite. Passes the cache arguments through."""
    accepts_cache_kwargs = True

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, x, attention_mask=None, **kw):
        out = self.model(x, attention_mask, **kw)
        (out[0] if isinstance(out, tuple) else out)[..., MASK] = -1e4
        return out


class Recorder(nn.Module):
    """A model given as a function (x, attention_mask) -> logits, recording its inputs; no cache arguments."""

    def __init__(self, fn):
        super().__init__()
        self.fn, self.inputs = fn, []

    def forward(self, x, attention_mask=None):
        self.inputs.append(x.clone())
        return self.fn(x, attention_mask)


def padded_prompts(B=3, P=7, seed=0):
    """Left-padded prompts: row 0 has 3 pad positions, row 1 one, row 2 none."""
    p = torch.randint(2, V - 1, (B, P), generator=torch.Generator().manual_seed(seed))
    am = torch.ones_like(p)
    am[0, :3], am[1, :1] = 0, 0
    return p.masked_fill(am == 0, EOS), am


FAST = [("prefix", 0.0), ("dual", 0.0), ("none", 0.6), ("prefix", 0.6), ("dual", 0.6)]


# -----------------------------------------------------------------------------------------------------
# the defaults are the reference


@pytest.mark.parametrize("name", ["gen_32_32_32", "gen_32_8_16", "gen_24_8_24", "gen_cfg1.5_32_8_16"])
def test_defaults_reproduce_reference_generations(name):
    path = REFERENCE
    model, ref = hf.from_pretrained(path), load_file(str(path / "reference_generations.safetensors"))
    *cfg, G, K, S = name.split("_")[1:]
    cfg_scale = float(cfg[0].removeprefix("cfg")) if cfg else 0.0
    with sdpa_kernel(SDPBackend.MATH):  # the kernel the reference numbers match (see test_sample.py)
        out = generate(model, ref["prompt"], gen_length=int(G), block_length=int(K), steps=int(S),
                       cfg_scale=cfg_scale, mask_id=model.config.mask_token_id, kv_cache="none", threshold=0.0)
    assert torch.equal(out, ref[name]), f"{(out != ref[name]).sum()} tokens differ"


# -----------------------------------------------------------------------------------------------------
# model.py: the cached forward


def test_cached_forward_equals_plain_forward_on_a_fresh_cache():
    """With keys and values computed from the same tokens, running any slice against the cache gives the plain
    forward's logits there (left padding, batch 3, GQA); logits_at and return_kv leave the numbers alone."""
    model = model_(n_layers=3)
    x = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(1))
    _, am = padded_prompts(P=20)
    with torch.no_grad():
        full = model(x, am)                                                        # (3, 20, V)
        logits, kv = model(x, am, return_kv=True)
        assert torch.equal(logits, full)
        assert len(kv) == 3 and kv[0][0].shape == (3, 2, 20, 8)                     # (B, Hkv, L, Dh)
        assert torch.allclose(model(x, am, logits_at=slice(4, 9)), full[:, 4:9], atol=1e-5, rtol=0)
        for start, stop in ((7, 20), (7, 11), (0, 5), (19, 20)):                   # prefix-, dual-style, edges
            part = model(x[:, start:stop], am, kv=kv, start=start)
            torch.testing.assert_close(part, full[:, start:stop], atol=1e-5, rtol=0)
        part = model(x[:, 7:], am, kv=kv, start=7, logits_at=slice(0, 4))
        torch.testing.assert_close(part, full[:, 7:11], atol=1e-5, rtol=0)
        # The cache is what makes it work: a cache from other tokens gives other logits.
        _, other = model(torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(2)), am, return_kv=True)
        assert not torch.allclose(model(x[:, 7:11], am, kv=other, start=7), full[:, 7:11], atol=1e-3)


def test_cached_forward_refuses_a_slice_without_its_cache():
    model = model_()
    x = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        _, kv = model(x, return_kv=True)
        with pytest.raises(AssertionError, match="start > 0 needs the kv list"):
            model(x[:, 3:], start=3)
        with pytest.raises(AssertionError, match="start > 0 needs the kv list"):
            model(x[:, :4], kv=kv, start=8)


# -----------------------------------------------------------------------------------------------------
# sample.fast_generate: the fast paths


@pytest.mark.parametrize("kv_cache, threshold", FAST)
@pytest.mark.parametrize("temperature, cfg_scale", [(0.0, 0.0), (1.0, 0.0), (0.0, 1.5)])
def test_fast_paths_decode_every_position_and_keep_the_prompt(kv_cache, threshold, temperature, cfg_scale):
    """Left padding, batch 3: no mask left (even where the model likes the mask id), prompt and padding
    untouched, seeded runs repeat."""
    model = model_()
    with torch.no_grad():
        model.ff_out.weight[MASK] *= 3  # make the mask id a frequent argmax: it must still never be committed
    p, am = padded_prompts()
    kw = dict(gen_length=16, block_length=4, steps=16, mask_id=MASK, attention_mask=am, kv_cache=kv_cache,
              threshold=threshold, temperature=temperature, cfg_scale=cfg_scale)
    out = generate(model, p, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(out[:, :7], p) and not (out == MASK).any()
    again = generate(model, p, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(out, again)


@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
@pytest.mark.parametrize("n_layers, mixing", [(1, None), (3, {2})])
def test_cache_equals_exact_decoding_where_it_is_exact(n_layers, mixing, cfg_scale):
    """When only the last layer mixes positions, keys and values are functions of (token, position) alone, so a
    cache from the block start is never stale: prefix and dual caches (with a threshold that never fires)
    must give the exact sampler's tokens, under left padding, batch 3 and CFG. Every row also matches the
    same row sampled alone. Layers 0 and 1 carry keys that no output reads, so a cache read from the
    wrong layer would show."""
    # float64: the cached passes multiply other shapes than the exact one, and float32 kernels of other
    # shapes round differently enough to flip a near-tie on some CPU; at float64 only staleness can.
    model = NoMask(model_(n_layers, mixing).double())
    p, am = padded_prompts()
    kw = dict(gen_length=16, block_length=4, steps=16, mask_id=MASK, cfg_scale=cfg_scale)
    exact = sample.generate(model, p, attention_mask=am, **kw)
    for kv_cache, threshold in (("prefix", 0.0), ("dual", 0.0), ("prefix", 1.0), ("none", 1.0)):
        out = generate(model, p, attention_mask=am, kv_cache=kv_cache, threshold=threshold, **kw)
        assert torch.equal(out, exact), (kv_cache, threshold, (out != exact).sum().item())
    for j in range(3):
        alone = generate(model, p[j:j + 1], attention_mask=am[j:j + 1], kv_cache="dual", **kw)
        assert torch.equal(alone[0], exact[j])
    # With a threshold that fires, the cached paths take the uncached threshold path's decisions.
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    threshold = 0.2 if n_layers == 1 else 0.25  # fires on these models: fewer passes than steps (asserted)
    parallel = generate(model, p, attention_mask=am, threshold=threshold, **kw)
    hook.remove()
    assert len(calls) < 16, "the threshold never fired: pick a lower one"
    for kv_cache in ("prefix", "dual"):
        out = generate(model, p, attention_mask=am, kv_cache=kv_cache, threshold=threshold, **kw)
        assert torch.equal(out, parallel)


def test_cache_is_an_approximation_on_a_general_model():
    """On a model where every layer mixes positions the caches do change some tokens (else the test above
    would prove nothing about staleness), yet every position is decoded."""
    model = NoMask(model_(n_layers=3))
    p, am = padded_prompts()
    kw = dict(gen_length=16, block_length=4, steps=16, mask_id=MASK, attention_mask=am)
    exact = sample.generate(model, p, **kw)
    for kv_cache in ("prefix", "dual"):
        out = generate(model, p, kv_cache=kv_cache, **kw)
        assert not torch.equal(out, exact) and not (out == MASK).any()


def table_stub(seed=0, scale=3.0):
    """A context-free stub: position i always gets the logits table[i] (no cache arguments, so the fast
    paths use its full logits)."""
    table = scale * torch.randn(64, V, generator=torch.Generator().manual_seed(seed))
    table[:, MASK] = -math.inf
    return Recorder(lambda x, attention_mask=None: table[: x.shape[1]].expand(x.shape[0], -1, -1).clone()), table


@pytest.mark.parametrize("threshold, steps", [(0.5, 16), (0.5, 8), (0.2, 16), (0.97, 16)])
def test_threshold_commits_every_confident_position_and_at_least_the_schedule(threshold, steps):
    """Each step commits exactly the top max(ceil(masked left / steps left), #confidence > threshold) masked
    positions of the current block, so at least one per step and every one above the threshold; a block ends
    as soon as it has no mask, and never takes more than its share of `steps`."""
    model, table = table_stub()
    P, G, K = 5, 16, 4
    p = torch.randint(2, V - 1, (2, P), generator=torch.Generator().manual_seed(3))
    out = generate(model, p, gen_length=G, block_length=K, steps=steps, mask_id=MASK, threshold=threshold)
    conf = torch.softmax(table[: P + G], -1).max(-1).values                        # (L,)
    states = model.inputs + [out]
    spb, block, step_in_block = steps // (G // K), 0, 0
    for before, after in zip(states, states[1:]):
        while not (before[:, P + block * K:P + (block + 1) * K] == MASK).any():
            block, step_in_block = block + 1, 0
        lo, hi = P + block * K, P + (block + 1) * K
        assert torch.equal(before[:, :lo], after[:, :lo]) and torch.equal(before[:, hi:], after[:, hi:])
        for row in range(2):
            masked = (before[row, lo:hi] == MASK).nonzero().squeeze(1) + lo
            left = len(masked)
            n = max(-(-left // (spb - step_in_block)), int((conf[masked] > threshold).sum()))
            want = masked[conf[masked].argsort(descending=True)[:n]]
            got = ((before[row] == MASK) & (after[row] != MASK)).nonzero().squeeze(1)
            assert sorted(got.tolist()) == sorted(want.tolist())
            assert len(got) >= 1 or left == 0
        step_in_block += 1
        assert step_in_block <= spb
    assert not (out == MASK).any()
    if threshold < 0.9:
        assert len(model.inputs) < steps  # the threshold saved forward passes


def test_threshold_one_or_more_is_the_fixed_schedule():
    """Confidences never exceed 1, so threshold >= 1 is the exact sampler's schedule (one per step when steps
    = gen_length), with as many forward passes."""
    kw = dict(gen_length=16, block_length=4, mask_id=MASK)
    p = torch.randint(2, V - 1, (3, 5), generator=torch.Generator().manual_seed(3))
    for steps in (16, 8):
        exact, _ = table_stub()
        want = sample.generate(exact, p, steps=steps, **kw)
        for threshold in (1.0, 2.0):
            fast, _ = table_stub()
            assert torch.equal(generate(fast, p, steps=steps, threshold=threshold, **kw), want)
            assert len(fast.inputs) == len(exact.inputs) == steps


def counted(order, P, G, K, spb, conf):
    """What the fast step committed, read off one call's decoding order: (row steps, tokens, most tokens in one
    row step, their confidences' sum). A row takes part in its block's steps up to its last commit, and commits
    at least one token at each (ceil(masked left / steps left) >= 1)."""
    row_steps = tokens = top = 0
    conf_sum = 0.0
    for row in order.tolist():
        for blk in range(G // K):
            o = row[P + blk * K:P + (blk + 1) * K]
            n = [o.count(s) for s in range(blk * spb, max(o) + 1)]
            row_steps, tokens, top = row_steps + len(n), tokens + sum(n), max(top, *n)
        conf_sum += float(conf[P:P + G].double().sum())
    return row_steps, tokens, top, conf_sum


def test_fast_sampler_sums_its_calls_until_take_log():
    """FastSampler adds up every call's statistics (two calls of other lengths here) and take_log reports and
    resets them. Expected values: counted from the returned orders, with the confidences of a context-free
    stub at temperature 0 (position i commits argmax table[i], of probability max softmax(table[i]))."""
    model, table = table_stub()
    conf = torch.softmax(table, -1).max(-1).values                                 # (64,)
    sampler = sample.FastSampler("none", 0.5)
    calls = [(5, 16, 4, 16, 2), (3, 8, 8, 4, 3)]                                   # P, G, K, steps, B
    want = [0, 0, 0, 0.0]
    for P, G, K, S, B in calls:
        p = torch.randint(2, V - 1, (B, P), generator=torch.Generator().manual_seed(P))
        out, order = sampler(model, p, gen_length=G, block_length=K, steps=S, mask_id=MASK, return_order=True)
        assert not (out == MASK).any()
        c = counted(order, P, G, K, S // (G // K), conf)
        want = [want[0] + c[0], want[1] + c[1], max(want[2], c[2]), want[3] + c[3]]
    row_steps, tokens, top, conf_sum = want
    assert tokens == 2 * 16 + 3 * 8 and row_steps < tokens and top >= 2  # the threshold committed several at once
    log = sampler.take_log("cpu")
    assert log == pytest.approx({"text/committed_per_step": tokens / row_steps, "text/committed_per_step_max": top,
                                 "text/committed_conf": conf_sum / tokens}, rel=1e-6)
    assert sampler.take_log("cpu") == {"text/committed_per_step": 0.0, "text/committed_per_step_max": 0.0,
                                       "text/committed_conf": 0.0}
    P, G, K, S, B = calls[1]
    p = torch.randint(2, V - 1, (B, P), generator=torch.Generator().manual_seed(P))
    order = sampler(model, p, gen_length=G, block_length=K, steps=S, mask_id=MASK, return_order=True)[1]
    row_steps, tokens, top, conf_sum = counted(order, P, G, K, S // (G // K), conf)
    assert sampler.take_log("cpu") == pytest.approx({"text/committed_per_step": tokens / row_steps,
                                                     "text/committed_per_step_max": top,
                                                     "text/committed_conf": conf_sum / tokens}, rel=1e-6)


@pytest.mark.parametrize("kw", [dict(kv_cache="full"), dict(threshold=0.9, remasking="random")])
def test_fast_settings_outside_their_domain_are_refused(kw):
    with pytest.raises(AssertionError):
        generate(model_(), padded_prompts()[0], gen_length=8, block_length=4, steps=8, mask_id=MASK,
                 generator=torch.Generator().manual_seed(0), **kw)


def test_cache_needs_a_model_with_cache_arguments():
    model, _ = table_stub()
    with pytest.raises(AssertionError, match="kv_cache='prefix' needs model.Transformer's kv"):
        generate(model, padded_prompts()[0], gen_length=8, block_length=4, steps=8, mask_id=MASK,
                 kv_cache="prefix")


# -----------------------------------------------------------------------------
# sample.fast_generate's fast-step noise and reveal order at temperature > 0, replayed by a naive loop written here from
# its documented behaviour: per block and step, each row whose block still has a mask draws its own uniforms
# (float64, block positions x vocabulary, for the Gumbel-max token; then float32, block positions, for "random"
# remasking), commits the top ceil(masked left / steps left) masked positions by confidence plus every one
# above the threshold, and never commits the mask id. A row whose block is done draws nothing.
#
#     python -m pytest tests/test_fast_sampling.py -q


V_REPLAY, MASK_REPLAY = 40, 39


def one_layer() -> Transformer:
    """One layer: a key depends on its own token only, so the block caches are exact (the replay may use full
    forwards); float64, so that no near-tie can flip between the cached and the full computation."""
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, mlp_hidden_size=32, vocab_size=V_REPLAY,
                      max_sequence_length=64, mask_token_id=MASK_REPLAY, eos_token_id=1, pad_token_id=1)
    return Transformer(cfg).init_weights(torch.Generator().manual_seed(0), std=0.5).double().eval()


def naive(model, prompt, G, K, S, temperature, remasking, threshold, gens):
    B, P = prompt.shape
    x = torch.cat([prompt, torch.full((B, G), MASK_REPLAY)], 1)
    order = torch.full_like(x, -1)
    spb = S // (G // K)
    for blk in range(G // K):
        start, end = P + blk * K, P + (blk + 1) * K
        for i in range(spb):
            if not (x[:, start:end] == MASK_REPLAY).any():
                break
            with torch.no_grad():
                logits = model(x)[:, start:end].clone()                               # (B, K, V_REPLAY)
            logits[..., MASK_REPLAY] = -math.inf
            for r in range(B):
                masked = (x[r, start:end] == MASK_REPLAY).nonzero().flatten().tolist()
                if not masked:
                    continue  # a finished row draws no noise
                u = torch.rand(K, V_REPLAY, generator=gens[r], dtype=torch.float64)
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
    got, order = generate(model, prompt, gen_length=G, block_length=K, steps=S, temperature=temperature,
                          remasking=remasking, mask_id=MASK_REPLAY, generator=gens(), kv_cache=kv_cache,
                          threshold=threshold, return_order=True)
    want, want_order = naive(model, prompt, G, K, S, temperature, remasking, threshold, gens())
    assert torch.equal(got, want) and torch.equal(order, want_order)
    if threshold:
        assert order.max() < S - 1  # the threshold did finish blocks early, so "no draw when done" was exercised
