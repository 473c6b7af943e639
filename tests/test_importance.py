"""Tests for importance.py (seeds, masks, per-token log-probs, exact decoding log-likelihood).

Run: python -m pytest tests/test_importance.py -q
Monte-Carlo checks use 5-sigma binomial tolerances: they fail on a real bias, not by chance.
"""
import math

import pytest
import torch
import torch.nn as nn

import importance as imp


class ContextFree(nn.Module):
    """Logits depend only on the position, never on the input: exact log-probs are known."""

    def __init__(self, L: int, V: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(L, V, generator=g))  # (L, V)

    def forward(self, idx, attention_mask=None):
        return self.table.unsqueeze(0).expand(idx.shape[0], -1, -1)  # (B, L, V)


class Tiny(nn.Module):
    """Embedding + linear with a bidirectional mean-pool, so masking the input changes every logit."""

    def __init__(self, V: int, d: int = 16, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng():  # fixed init without leaking into the global RNG
            torch.manual_seed(seed)
            self.emb, self.head = nn.Embedding(V, d), nn.Linear(d, V)

    def forward(self, idx, attention_mask=None):
        h = self.emb(idx)  # (B, L, d)
        return self.head(h + h.mean(dim=1, keepdim=True))  # (B, L, V)


def sigma5(p: float, n: int) -> float:
    return 5 * math.sqrt(max(p * (1 - p), 1e-12) / n) + 1e-9


def arlike_prob(N: int, r: float) -> torch.Tensor:
    # independent closed form of Alg. 1 (arXiv:2510.02880): P(mask_n) = 1 - min(1, 2(1-r)(1 - n/(N-1)))
    n = torch.arange(N, dtype=torch.float64)
    return 1 - torch.clamp(2 * (1 - r) * (1 - n / (N - 1)), max=1.0)


# -----------------------------------------------------------------------------
# ratio schedule and seeds

@pytest.mark.parametrize("gamma, table", [
    (0.6, [.6333, .6667, .7000, .7333, .7667, .8000, .8333, .8667, .9000, .9333, .9667, .999]),
    (0.8, [.8167, .8333, .8500, .8667, .8833, .9000, .9167, .9333, .9500, .9667, .9833, .999]),
])
def test_mask_ratios_match_method_table(gamma, table):
    assert imp.mask_ratios(12, gamma) == pytest.approx(table, abs=5e-5)


def test_mask_ratios_mu1_and_errors():
    assert imp.mask_ratios(1, 0.6) == [0.999]
    assert imp.mask_ratios(2, 0.0) == pytest.approx([0.5, 0.999])
    with pytest.raises(AssertionError, match="gamma"):
        imp.mask_ratios(12, 1.0)
    with pytest.raises(AssertionError, match="gamma"):
        imp.mask_ratios(12, -0.1)
    with pytest.raises(AssertionError, match="mu"):
        imp.mask_ratios(0, 0.6)


def test_mask_seed_stable_and_distinct():
    s = imp.mask_seed(42, 3, 17, 5)
    assert s == imp.mask_seed(42, 3, 17, 5) and 0 <= s < 2**63
    others = {imp.mask_seed(42, 3, 17, 6), imp.mask_seed(42, 4, 17, 5),
              imp.mask_seed(42, 3, 18, 5), imp.mask_seed(43, 3, 17, 5)}
    assert s not in others and len(others) == 4
    with pytest.raises(AssertionError, match="seq_index"):
        imp.mask_seed(42, 3, -1, 0)


def test_seed_values_pinned():
    # Every mask, rollout and initial weight of a run hangs on these two hashes: a change to either
    # encoding changes every number of a run, so their values are pinned.
    import sample
    assert sample.derive_seed(0, "masks", "text") == 3114210071054700744
    assert sample.derive_seed(0, "rollout", "text", 3, 7) == 7451824479630074830
    assert sample.derive_seed(1, "sft-data") == 5498370931827955440
    assert sample.derive_seed(42, "eval-sampling", "image", 0.9, 2) == 1884213763776914083
    assert sample.derive_seed(0, "init") == 2020223635098297231
    assert imp.mask_seed(0, 0, 0, 0) == 3366760914556667051
    assert imp.mask_seed(42, 3, 17, 5) == 8001206201335323714
    assert imp.mask_seed(3114210071054700744, 5, 11, 2) == 3452893014633083592
    g = sample.generator("cpu", 0, "init")
    assert g.initial_seed() == 2020223635098297231 and g.device.type == "cpu"


# -----------------------------------------------------------------------------
# reversing operators

def test_arlike_frequencies_monte_carlo():
    B, N, r = 4000, 32, 0.8
    m = imp.reverse_mask(torch.ones(B, N, dtype=torch.bool), [r] * B, list(range(B)), "arlike").double()
    freq, p = m.mean(0), arlike_prob(N, r)
    assert bool(m[:, -1].all()), "last position must always be masked"
    assert abs(freq[0] - (2 * r - 1)) < sigma5(2 * r - 1, B)
    for n in range(N):  # whole linear profile, 5 sigma per position
        assert abs(freq[n] - p[n]) < sigma5(float(p[n]), B), (n, float(freq[n]), float(p[n]))
    assert abs(m.mean() - r) < sigma5(r, B * N)  # no clamping for r >= 0.5: mean fraction is r


def test_arlike_clamps_below_half():
    B, N, r = 2000, 200, 0.3
    expected = float(arlike_prob(N, r).mean())
    assert expected == pytest.approx(0.357, abs=3e-3)  # the clamp: r = 0.3 -> ~0.357, not 0.3
    m = imp.reverse_mask(torch.ones(B, N, dtype=torch.bool), [r] * B, list(range(B)), "arlike").double()
    assert abs(m.mean() - expected) < sigma5(expected, B * N)
    assert not m[:, 0].any()  # first 2(1-r)d >= 1 region is never masked


def test_arlike_single_token_window():
    B = 4000
    m = imp.reverse_mask(torch.ones(B, 1, dtype=torch.bool), [0.7] * B, list(range(B)), "arlike").double()
    assert abs(m.mean() - 0.7) < sigma5(0.7, B)


def test_random_mode_mean():
    B, N, r = 1000, 64, 0.63
    m = imp.reverse_mask(torch.ones(B, N, dtype=torch.bool), [r] * B, list(range(B)), "random").double()
    assert abs(m.mean() - r) < sigma5(r, B * N)


def test_reverse_mask_deterministic_and_respects_completion_mask():
    g = torch.Generator().manual_seed(0)
    cm = torch.rand(8, 40, generator=g) < 0.7  # (B, N) some invalid positions
    seeds = torch.tensor([imp.mask_seed(1, 2, i, 0) for i in range(8)])
    a = imp.reverse_mask(cm, [0.9] * 8, seeds, "arlike")
    assert torch.equal(a, imp.reverse_mask(cm, [0.9] * 8, seeds.tolist(), "arlike"))  # old == current
    assert not (a & ~cm).any()
    other = [imp.mask_seed(1, 2, i, 1) for i in range(8)]  # next inner iteration
    assert not torch.equal(a, imp.reverse_mask(cm, [0.9] * 8, other, "arlike"))
    with pytest.raises(AssertionError, match="mode"):
        imp.reverse_mask(cm, [0.9] * 8, seeds, "low_confidence")


# -----------------------------------------------------------------------------
# build_masks: all estimators

def left_padded_prompt_mask(lengths, P):
    return torch.stack([torch.arange(P) >= P - n for n in lengths])  # (B, P), left padding False


def make_batch(B=8, P=10, N=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, P + 1, (B,), generator=g).tolist()
    cm = torch.ones(B, N, dtype=torch.bool)
    cm[:, N - 4:] = torch.rand(B, 4, generator=g) < 0.5  # a few invalid tail positions
    return left_padded_prompt_mask(lengths, P), cm, lengths


@pytest.mark.parametrize("estimator", imp.MASK_ESTIMATORS)
@pytest.mark.parametrize("mu", [1, 4])
def test_build_masks_shapes_prompt_and_padding(estimator, mu):
    pm, cm, _ = make_batch()
    B, P = pm.shape
    N = cm.shape[1]
    ins, loss = imp.build_masks(pm, cm, seed=7, step=0, seq_index=range(B), mu=mu,
                                gamma=0.6, estimator=estimator, p_mask_prompt=0.5, suffix_len=2)
    assert ins.shape == loss.shape == (mu, B, P + N + 2) and ins.dtype == torch.bool
    assert not ins[:, :, P + N:].any() and not loss[:, :, P + N:].any()  # suffix untouched
    assert not (ins[:, :, :P] & ~pm).any(), "prompt padding must never be masked"
    assert not loss[:, :, :P].any() and not (loss[:, :, P:P + N] & ~cm).any()
    assert not (loss & ~ins).any(), "every scored position must be masked in the input"
    if estimator == "d1":
        assert ins[:, :, P:P + N].all() and torch.equal(loss[:, :, P:P + N], cm.expand(mu, -1, -1))
        assert ins[:, :, :P].any()
    else:
        assert not ins[:, :, :P].any(), "MaskGRPO/UniGRPO never mask the prompt"
        assert torch.equal(ins, loss)


def test_completion_mask_until_eos():
    EOS = 1
    w = torch.tensor([[5, 6, EOS, EOS, EOS],   # answer, then EOS padding
                      [5, 6, 7, 8, 9],         # no EOS: everything counts
                      [EOS, 5, EOS, 6, 7],     # EOS first: only that token
                      [5, 6, 7, 8, EOS]])      # EOS last
    expect = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(imp.completion_mask_until_eos(w, EOS), expect)


def test_d1_loss_mask_ends_at_first_eos():
    # d1's diffu-grpo/diffu_grpo_trainer.py: _generate_and_score_completions keeps completion tokens up to and
    # including the first EOS (completion_mask); forward_process masks every completion token.
    EOS, B, P, N = 1, 6, 5, 12
    g = torch.Generator().manual_seed(9)
    window = torch.randint(2, 50, (B, N), generator=g)
    first = [3, 0, 11, 7, N, 5]  # position of the first EOS per row; N = no EOS
    for b, k in enumerate(first):
        if k < N:
            window[b, k:] = EOS  # EOS padding after the answer
    window[5, 8] = 30  # a non-EOS token after the EOS padding started must still be left out
    cm = imp.completion_mask_until_eos(window, EOS)
    pm = torch.ones(B, P, dtype=torch.bool)
    ins, loss = imp.build_masks(pm, cm, seed=0, step=0, seq_index=range(B), mu=3, estimator="d1")
    for b, k in enumerate(first):
        scored = loss[:, b, P:].nonzero()[:, 1]  # window columns in the loss, over all iterations
        assert int(scored.max()) == min(k, N - 1), (b, k)
        assert loss[:, b, P:P + min(k, N - 1) + 1].all() and not loss[:, b, P + k + 1:].any()
    assert ins[:, :, P:].all(), "d1 masks the whole window, EOS padding included"


def test_d1_prompt_rate():
    B, P = 400, 50
    pm = left_padded_prompt_mask([30] * B, P)
    ins, _ = imp.build_masks(pm, torch.ones(B, 4, dtype=torch.bool), seed=1, step=0, seq_index=range(B),
                             mu=1, estimator="d1", p_mask_prompt=0.15)
    rate = ins[0, :, :P][pm].double().mean()
    assert abs(rate - 0.15) < sigma5(0.15, B * 30)


@pytest.mark.parametrize("estimator", imp.MASK_ESTIMATORS)
def test_world_size_independence(estimator):
    # One batch of 8 vs two "ranks" of 4, where rank 1 pads its prompts to a different width:
    # each row's mask depends only on its own global sequence index.
    pm, cm, lengths = make_batch(B=8, P=10)
    kw = dict(seed=3, step=5, mu=3, gamma=0.6, estimator=estimator, mode="arlike")
    full, _ = imp.build_masks(pm, cm, seq_index=torch.arange(100, 108), **kw)
    pm_b = left_padded_prompt_mask(lengths[4:], 13)  # wider padding on the second half
    half_a, _ = imp.build_masks(pm[:4], cm[:4], seq_index=[100, 101, 102, 103], **kw)
    half_b, _ = imp.build_masks(pm_b, cm[4:], seq_index=torch.arange(104, 108), **kw)
    assert torch.equal(full[:, :4], half_a)
    assert torch.equal(full[:, 4:, 10:], half_b[:, :, 13:])  # completion window
    for b in range(4):  # real prompt tokens (right-aligned under left padding)
        n = lengths[4 + b]
        assert torch.equal(full[:, 4 + b, 10 - n:10], half_b[:, b, 13 - n:13])


def test_masks_change_with_step_and_iteration():
    pm, cm, _ = make_batch()
    kw = dict(seq_index=range(8), mu=2, gamma=0.6)
    a, _ = imp.build_masks(pm, cm, seed=0, step=0, **kw)
    b, _ = imp.build_masks(pm, cm, seed=0, step=0, **kw)
    c, _ = imp.build_masks(pm, cm, seed=0, step=1, **kw)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a[0], a[1])


def test_unigrpo_ratios_schedule():
    mu = 5
    rs = imp._unigrpo_ratios(0, 0, 3, mu)
    t1 = round(rs[0] * imp.UNIGRPO_T)
    assert rs[-1] == 1.0 and rs == sorted(rs) and 0 <= t1 < imp.UNIGRPO_T
    expect = [math.floor((n - 1) / (mu - 1) * (imp.UNIGRPO_T - t1) + t1) / imp.UNIGRPO_T for n in range(1, mu + 1)]
    assert rs == expect
    assert imp._unigrpo_ratios(0, 0, 3, 1) == rs[:1]  # mu = 1 keeps only t_1


def test_build_masks_errors():
    pm, cm, _ = make_batch()
    with pytest.raises(AssertionError, match="estimator"):
        imp.build_masks(pm, cm, seed=0, step=0, seq_index=range(8), mu=2, estimator="trace")
    with pytest.raises(AssertionError, match="seq_index"):
        imp.build_masks(pm, cm, seed=0, step=0, seq_index=range(7), mu=2)
    with pytest.raises(AssertionError, match="gamma"):
        imp.build_masks(pm, cm, seed=0, step=0, seq_index=range(8), mu=2, gamma=1.2)


@pytest.mark.parametrize("image, mode", [(False, "arlike"), (False, "arlike_official"), (True, "random")])
def test_maskgrpo_views_are_the_masks_build_masks_builds(image, mode):
    # The RL step's views (maskgrpo_views) and the masks tools/diagnose.py builds from explicit settings
    # (build_masks) are two callers of one estimator: for the same seed, ratios and rows they must agree.
    import tasks
    import train
    pm, _, _ = make_batch(B=5, P=10, N=24)
    B, P, N, S = 5, 10, 24, 2
    x = torch.randint(2, 90, (B, P + N + S), generator=torch.Generator().manual_seed(1))
    am = torch.cat([pm, torch.ones(B, N + S, dtype=torch.bool)], 1).long()
    batch = tasks.Batch("image" if image else "text", x, am, P, N, examples=[{}] * B)
    cfg = train.parse_args(["--preset=toy", "--mu=3", f"--text_reversing={mode}", "--gamma_text=0.4",
                            "--gamma_image=0.7", "--seed=5"])
    v = imp.maskgrpo_views(batch, torch.zeros_like(x), cfg, image=image, step=4, seq_index=[9, 3, 7, 0, 12],
                           eos_id=1, mask_id=99)
    ins, loss = imp.build_masks(pm, torch.ones(B, N, dtype=torch.bool), seed=imp.derive_seed(5, "masks", batch.task),
                                step=4, seq_index=[9, 3, 7, 0, 12], mu=3, gamma=0.7 if image else 0.4,
                                mode="random" if image else mode, suffix_len=S)
    assert torch.equal(v.loss_masks, loss) and v.updates == [[0], [1], [2]] and loss.any()
    assert all(torch.equal(v.inputs[j], x.masked_fill(ins[j], 99)) for j in range(3))
