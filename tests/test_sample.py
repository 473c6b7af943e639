"""sample.py: the reveal schedule and block order, seeded randomness, the vectorised top-k, padding,
validation, and statistical checks of the emerge / MaskGIT image samplers. The LLaDA reference generations
are in test_sample_reference.py, the cache modes and the image noise replayed in test_sample_settings.py.

    python -m pytest tests/test_sample.py -q
"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sample
from model import ModelConfig, Transformer
from sample import generate, generate_image, transfer_schedule
from sample import generate_image


# Stub vocabulary: ids 0..V-1, the last one is the mask. Image codes live at [OFFSET, OFFSET + C).
V, MASK, EOS = 48, 47, 46
OFFSET, C = 20, 16


class Recorder(nn.Module):
    """A model given as a function (x, attention_mask) -> logits (B, L, V); records both arguments."""

    def __init__(self, fn, config=None):
        super().__init__()
        self.fn, self.config, self.inputs, self.masks = fn, config, [], []

    def forward(self, x, attention_mask=None):
        self.inputs.append(x.clone())
        self.masks.append(None if attention_mask is None else attention_mask.clone())
        return self.fn(x, attention_mask)


def context_free(table):
    """A stub whose logits ignore the input: position i always gets table[i] (L_max, V)."""
    return Recorder(lambda x, attention_mask=None: table[: x.shape[1]].expand(x.shape[0], -1, -1).clone())


def text_stub(seed=0, scale=3.0):
    table = scale * torch.randn(64, V, generator=torch.Generator().manual_seed(seed))
    table[:, MASK] = -math.inf  # never predicts the mask, so "no masks remain" is a fair check
    return context_free(table)


def tiny_model(seed=0, dtype=torch.float32) -> Transformer:
    """dtype float64 where a test compares tokens sampled from differently shaped computations (a row
    alone vs in a batch, the head on a few positions vs all): BLAS picks its kernel by shape, and float32
    kernels round differently by ~1e-7, enough to flip a near-tie on some CPU. At float64's 1e-16 such a
    tie has no realistic chance, so token identity is then a property of the code, not of the machine."""
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=48, vocab_size=64,
                      max_sequence_length=64, mask_token_id=63, eos_token_id=1, pad_token_id=1)
    return Transformer(cfg).init_weights(torch.Generator().manual_seed(seed), std=0.3).to(dtype)


def prompts(B=3, P=5, seed=0, high=V - 2):
    return torch.randint(0, high, (B, P), generator=torch.Generator().manual_seed(seed))


def gen(seed):
    return torch.Generator().manual_seed(seed)


# -----------------------------------------------------------------------------------------------------
# text sampler


# Hand-derived from LLaDA's get_num_transfer_tokens (Eq. 8: equal counts per step, the remainder one
# apiece to the earliest steps): c tokens over s steps, for c and c + 1.
SCHEDULES = {
    (0, 4): ([0, 0, 0, 0], [1, 0, 0, 0]),
    (4, 4): ([1, 1, 1, 1], [2, 1, 1, 1]),
    (7, 3): ([3, 2, 2], [3, 3, 2]),
    (10, 1): ([10], [11]),
    (5, 8): ([1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]),
    (33, 8): ([5, 4, 4, 4, 4, 4, 4, 4], [5, 5, 4, 4, 4, 4, 4, 4]),
    (32, 12): ([3] * 8 + [2] * 4, [3] * 9 + [2] * 3),
}


@pytest.mark.parametrize("c, s", list(SCHEDULES))
def test_transfer_schedule(c, s):
    n = transfer_schedule(torch.tensor([c, c + 1]), s)
    assert n.dtype == torch.long and n.tolist() == list(SCHEDULES[c, s])


@pytest.mark.parametrize("temperature, remasking", [(0.0, "low_confidence"), (1.0, "low_confidence"),
                                                    (0.0, "random")])
def test_reveal_schedule_and_block_order(temperature, remasking, capsys):
    """Each step reveals exactly the scheduled count, only inside the current block; blocks go left to
    right; the prompt never changes and no mask remains."""
    model, p = text_stub(), prompts()
    G, K, S = 12, 4, 9  # 3 blocks x 3 steps: 4 tokens per block revealed 2, 1, 1 (4 = 3 x 1 + 1)
    out = generate(model, p, gen_length=G, block_length=K, steps=S, temperature=temperature,
                   remasking=remasking, mask_id=MASK, generator=gen(0), progress=True)
    assert "denoising" in capsys.readouterr().err  # the tqdm bar
    P, spb = p.shape[1], S // (G // K)
    states = model.inputs + [out]
    assert len(model.inputs) == S
    for t in range(S):
        before, after = states[t], states[t + 1]
        b, i = divmod(t, spb)
        assert ((before == MASK).sum(1) - (after == MASK).sum(1) == [2, 1, 1][i]).all()
        changed = (before != after).nonzero()[:, 1]
        assert ((changed >= P + b * K) & (changed < P + (b + 1) * K)).all(), "revealed outside the block"
        if i == 0:  # a block starts only when every earlier block is complete
            assert (before[:, : P + b * K] != MASK).all() and (before[:, P + b * K:] == MASK).all()
    assert torch.equal(out[:, :P], p) and not (out == MASK).any()


def test_deterministic_and_seeded():
    p, kw = prompts(B=2), dict(gen_length=16, block_length=8, steps=8, mask_id=MASK)
    greedy = [generate(text_stub(scale=0.3), p, **kw) for _ in range(2)]
    assert torch.equal(*greedy)
    sampled = [generate(text_stub(scale=0.3), p, temperature=1.0, generator=gen(s), **kw) for s in (1, 1, 2)]
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], sampled[2])
    assert not torch.equal(sampled[0], greedy[0])


@pytest.mark.parametrize("kw", [dict(), dict(kv_cache="prefix", threshold=0.5), dict(remasking="random")])
def test_per_row_generators_make_rows_batch_independent(kw):
    """A list of per-row generators: each row's sample depends on its own generator only, so a sequence
    is the same alone, in a batch, or in another order (train.py shards rollouts across processes)."""
    model, p = tiny_model(dtype=torch.float64), prompts(B=4, high=60)
    args = dict(gen_length=8, block_length=4, steps=8, mask_id=63, temperature=1.0, **kw)
    run = sample.fast_generate if "kv_cache" in kw else generate
    whole = run(model, p, generator=[gen(10 + i) for i in range(4)], **args)
    for i in range(4):
        alone = run(model, p[i:i + 1], generator=[gen(10 + i)], **args)
        assert torch.equal(alone[0], whole[i])
    flipped = run(model, p.flip(0), generator=[gen(10 + i) for i in reversed(range(4))], **args)
    assert torch.equal(flipped.flip(0), whole)
    assert not torch.equal(whole[0, 5:], run(model, p[:1], generator=[gen(99)], **args)[0, 5:])
    with pytest.raises(ValueError, match="3 per-row generators for a batch of 4"):
        run(model, p, generator=[gen(0)] * 3, **args)


def test_per_row_generators_threshold_rows_finishing_apart():
    """Threshold decoding ends a block when *every* row is done; a row that finished early must not keep
    drawing from its generator, or its next block would depend on its batch mates."""
    def fn(x, attention_mask=None):
        B, L = x.shape
        logits = 0.01 * torch.arange(V, dtype=torch.float32).expand(B, L, V).clone()  # flat: slow rows
        sure = x[:, 0] == 0                                                            # peaked: fast rows
        logits[sure, :, 5] = logits[sure, :, 6] = 20.0   # p ~ 0.5 each: all commit at once, 5 or 6 by the noise
        logits[..., MASK] = -math.inf
        return logits
    p = torch.tensor([[0, 3, 4], [1, 3, 4]])
    args = dict(gen_length=12, block_length=4, steps=12, mask_id=MASK, temperature=1.0, threshold=0.4)
    whole = sample.fast_generate(Recorder(fn), p, generator=[gen(1), gen(2)], **args)
    assert set(whole[0, 3:].tolist()) == {5, 6}  # the fast row's tokens do depend on its noise
    for i in range(2):
        alone = sample.fast_generate(Recorder(fn), p[i:i + 1], generator=[gen(1 + i)], **args)
        assert torch.equal(alone[0], whole[i]), i


def test_per_row_generators_image():
    model, ids, start = image_stub(4, 16)
    kw = dict(image_start=start, num_tokens=16, steps=4, code_offset=OFFSET, codebook_size=C, mask_id=MASK)
    for sampler in ("emerge", "maskgit"):
        whole = generate_image(model, ids, sampler=sampler, generator=[gen(i) for i in range(4)], **kw)
        for i in range(4):
            alone = generate_image(model, ids[i:i + 1], sampler=sampler, generator=[gen(i)], **kw)
            assert torch.equal(alone[0], whole[i])


def test_random_remasking_order_follows_generator():
    """"random" ranks masked positions by a uniform draw: same seed, same reveal order; another seed, another."""
    first = []
    for s in (3, 3, 4):
        model = text_stub()
        generate(model, prompts(), gen_length=8, block_length=8, steps=4, remasking="random", mask_id=MASK,
                 generator=gen(s))
        first.append(model.inputs[1] != MASK)  # positions revealed by the first step
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    with pytest.raises(ValueError, match="generator"):
        generate(text_stub(), prompts(), gen_length=8, block_length=8, steps=4, remasking="random", mask_id=MASK)


def llada_loop(model, prompt, gen_length, block_length, steps, temperature, cfg_scale, remasking, mask_id,
               gens=None, attention_mask=None):
    """LLaDA's public generate(): the global RNG (or gens, one generator per row, each drawing its row of
    the same shapes), the head and the noise over the whole sequence, and a per-row topk loop. Written for
    this test, independent of sample.py."""
    def rand(shape, dtype):
        if gens is None:
            return torch.rand(shape, dtype=dtype)
        return torch.stack([torch.rand(shape[1:], generator=g, dtype=dtype) for g in gens])

    B, P = prompt.shape
    kw = {} if attention_mask is None else {"attention_mask": torch.cat(
        [attention_mask, torch.ones(B, gen_length, dtype=attention_mask.dtype)], 1).repeat(1 + (cfg_scale > 0), 1)}
    x = torch.full((B, P + gen_length), mask_id)
    x[:, :P] = prompt
    prompt_index = x != mask_id
    num_blocks = gen_length // block_length
    spb = steps // num_blocks
    for b in range(num_blocks):
        end = P + (b + 1) * block_length
        c = (x[:, end - block_length:end] == mask_id).sum(1).tolist()
        for i in range(spb):
            mask_index = x == mask_id
            if cfg_scale > 0:
                un = x.clone()
                un[prompt_index] = mask_id
                lc, lu = model(torch.cat([x, un]), **kw).chunk(2)
                logits = lu + (cfg_scale + 1) * (lc - lu)
            else:
                logits = model(x, **kw)
            if temperature == 0:
                noisy = logits
            else:
                l64 = logits.to(torch.float64)
                noisy = l64.exp() / (-torch.log(rand(l64.shape, torch.float64))) ** temperature
            x0 = noisy.argmax(-1)
            if remasking == "low_confidence":
                x0_p = F.softmax(logits, -1).gather(-1, x0[..., None]).squeeze(-1)
            else:
                x0_p = rand(x.shape, torch.float32)
            x0_p[:, end:] = -math.inf
            x0 = torch.where(mask_index, x0, x)
            conf = torch.where(mask_index, x0_p, -math.inf)
            for j in range(B):
                _, idx = torch.topk(conf[j], k=c[j] // spb + (i < c[j] % spb))
                x[j, idx] = x0[j, idx]
    return x


@pytest.mark.parametrize("temperature, remasking, cfg_scale", [
    (0.0, "low_confidence", 0.0), (0.9, "low_confidence", 0.0), (0.6, "random", 0.0), (0.7, "random", 1.5)])
def test_matches_llada_loop(temperature, remasking, cfg_scale):
    """At temperature > 0 too: a generator seeded like LLaDA's global RNG gives LLaDA's exact samples, since we
    draw the same uniforms in the same order (one (B, L, V) float64 draw, then (B, L) for "random")."""
    model, p = tiny_model(dtype=torch.float64), prompts(B=3, P=6, high=60)  # the loop's head spans every row
    kw = dict(gen_length=16, block_length=8, steps=8, temperature=temperature, cfg_scale=cfg_scale,
              remasking=remasking, mask_id=63)
    with torch.no_grad():
        torch.manual_seed(5)
        want = llada_loop(model, p, **kw)
    assert torch.equal(generate(model, p, generator=gen(5), **kw), want)


def toy_shaped(seed=0, dtype=torch.float64):
    """train.py's toy dims (d 128, MLP 384, vocab 150), 2 layers: the head's GEMM has the toy's shape.
    float64 by default, for the reason tiny_model gives."""
    cfg = ModelConfig(d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=384, vocab_size=150,
                      max_sequence_length=64, mask_token_id=149, eos_token_id=1, pad_token_id=1)
    return Transformer(cfg).init_weights(gen(seed), std=0.1).to(dtype).eval()


@pytest.mark.parametrize("B, G, K, S, temperature, remasking, cfg_scale", [
    (8, 12, 12, 12, 1.0, "low_confidence", 0.0),  # the toy's rollouts: one block, per-row generators
    (1, 12, 12, 12, 1.0, "low_confidence", 0.0), (3, 16, 4, 8, 0.0, "low_confidence", 0.0),
    (5, 16, 8, 16, 0.8, "low_confidence", 1.5), (4, 12, 4, 6, 0.7, "random", 0.0)])
def test_exact_sampler_is_the_full_sequence_computation(B, G, K, S, temperature, remasking, cfg_scale):
    """The exact sampler computes the head only where a step chooses and draws the noise only there, yet
    gives the tokens of the computation over the whole sequence (LLaDA's, with per-row generators and left
    padding): the same uniforms reach the same positions. float64, so that only a logic error, not a BLAS
    kernel's rounding, can change a token."""
    model, p = toy_shaped(), prompts(B=B, P=9, high=140)
    am = torch.ones_like(p)
    am[0, :4] = 0
    p[am == 0] = 1
    kw = dict(gen_length=G, block_length=K, steps=S, temperature=temperature, cfg_scale=cfg_scale,
              remasking=remasking, mask_id=149)
    with torch.no_grad():
        want = llada_loop(model, p, **kw, gens=[gen(20 + i) for i in range(B)], attention_mask=am)
    got = generate(model, p, generator=[gen(20 + i) for i in range(B)], attention_mask=am, **kw)
    assert torch.equal(got, want)


def test_head_on_a_few_positions_is_the_full_head():
    """The sampler's head on a few positions gives the full head's logits there, in float32 (the toy's
    dtype). Within float32 rounding only: sample.MIN_HEAD_ROWS widens the head so that on the CPU it was
    tuned on the bits agree too, but another CPU's BLAS may pick other kernels, so bits are not promised."""
    model = toy_shaped(dtype=torch.float32)
    for B in (1, 2, 3):
        x = torch.randint(0, 149, (B, 20), generator=gen(B))
        full = model(x)
        for lo, end in ((19, 20), (10, 11), (0, 2), (5, 8), (0, 20)):
            torch.testing.assert_close(sample._forward(model, x, None, lo, end), full[:, lo:end], rtol=1e-5,
                                       atol=1e-5, msg=f"{(B, lo, end)}")


@pytest.mark.parametrize("chunk", [sample.CHUNK, 7, 10])
def test_uniform_columns_replay_the_full_draw(monkeypatch, chunk):
    """cols returns the columns of one full draw made naively from the row's own generator, and leaves the
    generator where that draw leaves it, whatever chunks the stream is walked in (7: one column of 5 per
    draw; 10: two)."""
    monkeypatch.setattr(sample, "CHUNK", chunk)
    for dtype in (torch.float64, torch.float32):
        naive = torch.stack([torch.rand((9, 5), generator=gen(7 + i), dtype=dtype) for i in range(3)])
        shared_g, shared_naive = gen(7), torch.rand((3, 9, 5), generator=gen(7), dtype=dtype)
        for lo, hi in ((2, 6), (0, 9), (8, 9), (0, 1)):
            gens = [gen(7 + i) for i in range(3)]
            part = sample.uniform((3, 9, 5), gens, "cpu", dtype, cols=slice(lo, hi))
            assert part.shape == (3, hi - lo, 5) and torch.equal(part, naive[:, lo:hi])
            for i, g in enumerate(gens):  # each stream ends where the naive full draw leaves it
                ref = gen(7 + i)
                torch.rand((9, 5), generator=ref, dtype=dtype)
                assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=ref))
            shared_g = gen(7)
            part = sample.uniform((3, 9, 5), shared_g, "cpu", dtype, cols=slice(lo, hi))
            assert torch.equal(part, shared_naive[:, lo:hi])
    idle = sample.uniform((3, 4), [gen(1), gen(2), gen(3)], "cpu", active=[True, False, True])
    assert (idle[1] == 0.5).all() and torch.equal(idle[2], torch.rand(4, generator=gen(3), dtype=torch.float64))


@pytest.mark.parametrize("temperature, remasking", [(1.0, "low_confidence"), (0.8, "random")])
def test_rows_alone_equal_rows_in_batches_of_any_size(monkeypatch, temperature, remasking):
    """Six left-padded rows sampled alone and in batches of 2, 3 and 6 give the same tokens: a row's noise
    depends on its generator and its own state only, never on the column range [lo, end) the sampler
    computes over its batch. This is the path every device takes (sample.uniform has no device branch).
    The spy checks that batching did move lo for some row, so that the comparison has something to catch."""
    model, p = tiny_model(dtype=torch.float64), prompts(B=6, P=7, high=60)
    am = torch.ones_like(p)
    am[1, :3] = am[4, :5] = 0
    p[am == 0] = 1
    kw = dict(gen_length=12, block_length=4, steps=12, temperature=temperature, remasking=remasking, mask_id=63)
    los, forward = [], sample._forward
    def spy(model_, x, mask, lo, end, **kw_):
        los.append(lo)
        return forward(model_, x, mask, lo, end, **kw_)
    monkeypatch.setattr(sample, "_forward", spy)
    out = {}
    for size in (1, 2, 3, 6):
        los.clear()
        out[size] = torch.cat([generate(model, p[a:a + size], generator=[gen(30 + i) for i in range(a, a + size)],
                                        attention_mask=am[a:a + size], **kw) for a in range(0, 6, size)])
        out[size, "lo"] = torch.tensor(los).view(6 // size, -1)                  # (batches, steps)
    # at some step the batch of 6 drew from an earlier column than one of its rows alone would have
    assert (out[6, "lo"] < out[1, "lo"]).any()
    for size in (2, 3, 6):
        assert torch.equal(out[size], out[1]), size


def replay(order, final, mask_id):
    """The states the sampler saw: x^(s) = final with every position of order >= s masked, s = 0, 1, ..."""
    return [final.masked_fill(order >= s, mask_id) for s in range(int(order.max()) + 1)]


@pytest.mark.parametrize("temperature, remasking, G, K, S", [
    (0.0, "low_confidence", 16, 8, 8), (1.0, "low_confidence", 12, 4, 12), (0.8, "random", 12, 6, 6)])
def test_text_order_replays_the_sampler(monkeypatch, temperature, remasking, G, K, S):
    """return_order: the states rebuilt from the order are the sampler's own inputs, step by step, and the
    replayed model gives the probabilities the sampler chose from (its argmax at temperature 0)."""
    model, p = tiny_model(dtype=torch.float64), prompts(B=3, P=5, high=60)
    seen, forward = [], sample._forward
    def spy(model_, x, mask, lo=0, end=None, **kw):
        out = forward(model_, x, mask, lo, end, **kw)
        seen.append((x.clone(), lo, out[0] if kw.get("return_kv") else out))
        return out
    monkeypatch.setattr(sample, "_forward", spy)
    kw = dict(gen_length=G, block_length=K, steps=S, temperature=temperature, remasking=remasking, mask_id=63)
    plain = generate(model, p, generator=[gen(i) for i in range(3)], **kw)
    seen.clear()
    out, order = generate(model, p, generator=[gen(i) for i in range(3)], return_order=True, **kw)
    assert torch.equal(out, plain)
    assert (order[:, :5] == -1).all() and torch.equal(order[:, 5:] >= 0, out[:, 5:] != 63)
    assert order.max() == S - 1 and len(seen) == S
    for s, (x_s, (x_seen, lo, logits)) in enumerate(zip(replay(order, out, 63), seen)):
        assert torch.equal(x_s, x_seen)
        full = model(x_s)                                                            # (B, L, V)
        # The head on the chosen positions only is the full-sequence head, to float64 rounding.
        torch.testing.assert_close(full[:, lo:lo + logits.shape[1]], logits, rtol=1e-10, atol=1e-10)
        rows, pos = (order == s).nonzero(as_tuple=True)
        assert (pos >= lo).all()
        if temperature == 0:
            assert torch.equal(full[rows, pos].argmax(-1), out[rows, pos])


@pytest.mark.parametrize("sampler", ["emerge", "maskgit"])
def test_image_order_replays_the_sampler(monkeypatch, sampler):
    model = tiny_model(dtype=torch.float64)
    ids, start = image_layout(3, 9)
    ids = ids.clone()
    ids[ids == MASK] = 63
    n, seen, probs_fn = 9, [], sample._image_probs
    def spy(model_, x, *a):
        out = probs_fn(model_, x, *a)
        seen.append((x.clone(), out))
        return out
    monkeypatch.setattr(sample, "_image_probs", spy)
    kw = dict(image_start=start, num_tokens=n, steps=4, sampler=sampler, code_offset=OFFSET, codebook_size=C,
              mask_id=63)
    plain = generate_image(model, ids, generator=[gen(i) for i in range(3)], **kw)
    seen.clear()
    out, order = generate_image(model, ids, generator=[gen(i) for i in range(3)], return_order=True, **kw)
    assert torch.equal(out, plain) and len(seen) == 4
    span = slice(start, start + n)
    assert (order[:, span] >= 0).all() and (order[:, :start] == -1).all() and (order[:, start + n:] == -1).all()
    for s, (x_s, (x_seen, probs)) in enumerate(zip(replay(order, out, 63), seen)):
        assert torch.equal(x_s, x_seen)
        # The sampler's head spans the slots only: the full head's probabilities to float64 rounding.
        torch.testing.assert_close(F.softmax(model(x_s)[:, span, OFFSET:OFFSET + C].double(), -1), probs,
                                   rtol=1e-10, atol=1e-12)
        assert ((order == s) <= (x_s == 63)).all()  # step s reveals slots that x^(s) has masked


# helpers of the image tests (also tests/test_sample_image.py)


def image_layout(B, n, text=4):
    """(B, L) MMaDA-like sequence: `text` prompt tokens, <|soi|>, n mask slots, <|eoi|>; slot span start."""
    SOI, EOI = 44, 45
    head = torch.randint(0, OFFSET, (B, text), generator=gen(1))
    ids = torch.cat([head, torch.full((B, 1), SOI), torch.full((B, n), MASK), torch.full((B, 1), EOI)], 1)
    return ids, text + 1


def code_distributions():
    """Two known distributions over the C codes: even slots use p_even, odd slots its reverse."""
    p_even = torch.arange(1, C + 1, dtype=torch.float64) ** 1.5
    p_even /= p_even.sum()
    return p_even, p_even.flip(0)


def image_stub(B, n):
    """Context-free model: slot i's logits over the code columns are log p_{parity(i)}; every other
    column gets a large logit, so sampling outside the codebook columns would show up at once."""
    p_even, p_odd = code_distributions()
    ids, start = image_layout(B, n)
    table = torch.full((ids.shape[1], V), 10.0)
    for i in range(n):
        table[start + i, OFFSET:OFFSET + C] = (p_even if i % 2 == 0 else p_odd).log().float()
    return context_free(table), ids, start
