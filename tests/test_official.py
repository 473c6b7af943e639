"""The official-run switches: the official AR-like operator as its call site applies it, the LoRA target sets,
attention over MMaDA padding, the system prompt (docs/differences.md).

Run: python -m pytest tests/test_official.py -q
Expected values come from hand derivations written out here, never from the functions under test.
Monte-Carlo checks use 5-sigma binomial tolerances: they fail on a real bias, not by chance.
"""
import math

import pytest
import torch

import importance as imp
from infra import diagnose


def sigma5(p: float, n: int) -> float:
    return 5 * math.sqrt(max(p * (1 - p), 1e-12) / n) + 1e-9


def official_mask_prob(P: int, N: int, r: float) -> list[float]:
    """P(window token n is masked) under martian422/MaskGRPO grpo/mask_grpo_trainer.py, step by step as its
    call site runs it: prompt_index is 1-D, so remask_ar's prompt length prompt_index[0].sum() is 1; the ramp
    linspace(1, 0, L - 1) covers positions 1..L-1; keep = clamp(ramp * (1 - r) * (L - 1) / sum(ramp), max 1);
    a position is masked when U > keep and it is not a prompt position."""
    L = P + N
    head = 1
    M = L - head                                            # ramp length
    ramp = [1.0 - k / (M - 1) for k in range(M)] if M > 1 else [1.0]
    total = sum(ramp)
    probs = []
    for n in range(N):
        k = P + n - head                                    # absolute position P + n, ramp index P + n - 1
        keep = min(1.0, ramp[k] * (1 - r) * M / total)
        probs.append(1.0 - keep)
    return probs


@pytest.mark.parametrize("P,N,r", [(150, 256, 0.6 + 0.4 / 12), (20, 64, 0.3), (7, 40, 0.85), (1, 24, 0.7)])
def test_official_masks_match_the_hand_derived_probabilities(P, N, r):
    B = 4000
    cm = torch.ones(B, N, dtype=torch.bool)
    m = imp.reverse_mask(cm, r, [imp.mask_seed(0, 0, i, 0) for i in range(B)], "arlike_official",
                         prompt_len=P).double()
    freq, want = m.mean(0), official_mask_prob(P, N, r)
    for n in range(N):
        assert abs(freq[n].item() - want[n]) < sigma5(want[n], B), (P, N, r, n, freq[n].item(), want[n])
    assert bool(m[:, -1].all())  # the ramp ends at keep 0: the last token is always masked


def test_quoted_figures_of_the_official_operator():
    # P = 150, N = 256, nominal 0.6333 (the first ratio of the gamma = 0.6, mu = 12 schedule).
    r = 0.6 + 0.4 / 12
    p = official_mask_prob(150, 256, r)
    assert sum(p) / 256 == pytest.approx(0.769, abs=5e-4)        # effective completion ratio
    # First window token: 1 - 2 (1 - r) (1 - 149/404) = 0.5371 exactly; the paper's operator gives 2r - 1.
    assert p[0] == pytest.approx(1 - 2 * (1 - r) * (1 - 149 / 404), abs=1e-12)
    assert p[0] == pytest.approx(0.537, abs=5e-4)
    assert imp.official_completion_ratio(150, 256, r) == pytest.approx(sum(p) / 256, abs=1e-6)
    # At P = N = 256 the gamma = 0.6 schedule lands on the paper formula's gamma = 0.8 schedule: the window
    # is the second half of the ramp, whose mean mask is (1 + r) / 2 up to the L - 2 vs L - 1 rounding.
    for j in range(11):
        r6, r8 = 0.6 + 0.4 * (j + 1) / 12, 0.8 + 0.2 * (j + 1) / 12
        assert sum(official_mask_prob(256, 256, r6)) / 256 == pytest.approx(r8, abs=2e-3)
    # Prompts of 100 to 200 tokens: the lowest official ratio of the gamma = 0.6 schedule is 0.74 to 0.79.
    assert 0.735 < sum(official_mask_prob(100, 256, r)) / 256 < sum(official_mask_prob(200, 256, r)) / 256 < 0.795


def test_ratio_table_rows_are_the_hand_derived_means():
    table = diagnose.official_ratio_table(prompt_lens=(20, 256), N=256, gammas=(0.6,), mu=12)
    rows = [line for line in table.splitlines() if line.startswith("| 0.6 ")]
    assert len(rows) == 12
    for j, line in enumerate(rows):
        r = min(0.6 + 0.4 * (j + 1) / 12, 0.999)
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == f"{r:.3f}"
        for P, cell in zip((20, 256), cells[2:]):
            # printed to 3 decimals: within half a unit of the last digit (0.9995 may round either way)
            assert abs(float(cell) - sum(official_mask_prob(P, 256, r)) / 256) <= 5e-4 + 1e-9


def test_build_masks_uses_each_rows_real_prompt_length():
    """Rows left-padded to one batch length get the masks of their own unpadded prompt, as the official runs
    (one unpadded prompt group per GPU) saw them; build_masks places them in the window."""
    B, P, N = 3, 9, 16
    real = [9, 4, 1]
    pm = torch.zeros(B, P, dtype=torch.bool)
    for b, n in enumerate(real):
        pm[b, P - n:] = True                                  # left padding
    cm = torch.ones(B, N, dtype=torch.bool)
    ins, outs = imp.build_masks(pm, cm, seed=3, step=1, seq_index=[0, 1, 2], num_iterations=4, gamma=0.6,
                                mode="arlike_official")
    for j, r in enumerate([0.7, 0.8, 0.9, 0.999]):
        for b in range(B):
            want = imp.reverse_mask(cm[b:b + 1], r, [imp.mask_seed(3, 1, b, j)], "arlike_official",
                                    prompt_len=real[b])
            assert torch.equal(ins[j, b, P:], want[0]) and torch.equal(outs[j, b, P:], want[0])
            assert not ins[j, b, :P].any()                    # the prompt is never masked
    # the same row with a longer prompt is masked more, on average, than with a shorter one
    many = torch.ones(2000, N, dtype=torch.bool)
    seeds = list(range(2000))
    short = imp.reverse_mask(many, 0.7, seeds, "arlike_official", prompt_len=1).double().mean()
    long = imp.reverse_mask(many, 0.7, seeds, "arlike_official", prompt_len=40).double().mean()
    assert long > short + 0.05


def test_official_mode_needs_the_prompt_length():
    with pytest.raises(ValueError, match="prompt_len"):
        imp.reverse_mask(torch.ones(2, 8, dtype=torch.bool), 0.7, [0, 1], "arlike_official")
