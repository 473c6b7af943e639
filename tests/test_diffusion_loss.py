"""train.diffusion_loss, the SFT loss, against its closed form (the 1/t-weighted masked cross-entropy of MDLM /
LLaDA) on a model whose log-probs are known; the prompt is never masked.

    python -m pytest tests/test_diffusion_loss.py -q
"""
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tasks
import train
from infra import toy
from test_rl_step import CPU


# -----------------------------------------------------------------------------------------------------
# the SFT loss


class FixedLogits(nn.Module):
    """Logits that depend on the position only (table[k] at position k), and a record of the input: the
    per-token cross-entropies are then known whatever is masked."""

    def __init__(self, table):
        super().__init__()
        self.table, self.seen = table, []

    def forward(self, x, attention_mask=None):
        self.seen.append(x.clone())
        return self.table[: x.shape[1]].expand(x.shape[0], -1, -1)


def sft_batch(task, B, seed=0):
    tok = toy.build_tokenizer()
    ids = tasks.token_ids(tok)
    cfg = train.parse_args(["--preset=smoke"])
    rng = random.Random(seed)
    exs = [train.make_example(task, rng, cfg, "train") for _ in range(B)]
    return tasks.make_batch(task, exs, tok, ids, cfg, CPU, with_targets=True), ids


@pytest.mark.parametrize("task", ["text", "image"])
def test_diffusion_loss_is_the_weighted_elbo(task):
    """train.diffusion_loss on a model whose log-probs are known: for t ~ U(eps, 1) per sequence and
    each window token masked with probability t, the loss is
        (1 / (B N)) sum_b (1 / t_b) sum_{k masked in b} -log p(o_k)            (MDLM, LLaDA SFT loss)
    with p over the whole vocabulary for text and over the image codes for images. Two checks:
      - exact: replaying the documented draws (t first, then the uniforms) reproduces the masks the
        model was shown, and the loss equals the formula on them;
      - in expectation, derived by hand: E[1[masked] / t] = 1 for every token, so the mean loss over many
        sequences is the mean cross-entropy of the window (about 1.0 of it with eps = 1e-3); without the
        1/t weight it would be E[t] = 0.5 of it."""
    B = 4000
    b, ids = sft_batch(task, B)
    L, V = b.x.shape[1], ids.vocab_size
    table = 2.0 * torch.randn(L, V, generator=torch.Generator().manual_seed(1))
    model = FixedLogits(table)
    lo, hi = (0, V) if task == "text" else (ids.image_token_offset, ids.image_token_offset + ids.codebook_size)
    logp = F.log_softmax(table[:, lo:hi].double(), -1)                              # (L, V')
    pos = torch.arange(L).expand(B, L)                                               # (B, L)
    ce = -logp[pos, (b.x - lo).clamp(0, hi - lo - 1)]                               # (B, L) per-token CE
    eps = 1e-3
    g = torch.Generator().manual_seed(5)
    replay = torch.Generator().manual_seed(5)
    loss = train.diffusion_loss(model, b, ids, g, eps=eps).item()

    t = torch.rand(B, 1, generator=replay) * (1 - eps) + eps
    u = torch.rand(B, L, generator=replay)
    window = torch.zeros(B, L, dtype=torch.bool)
    window[:, b.window_slice] = True
    masked = (u < t) & window
    assert torch.equal(model.seen[0] == ids.mask, masked), "the replayed draws are not the loss's masks"
    exact = float((ce * masked / t.double()).sum()) / (B * b.window)
    assert loss == pytest.approx(exact, rel=1e-5)

    mean_ce = float(ce[:, b.window_slice].mean())
    # Per sequence the weighted sum has variance about log(1/eps) / N times mean_ce^2: 5 sigma over B rows.
    tol = 5 * mean_ce * math.sqrt(math.log(1 / eps) / b.window / B) * 2
    assert abs(loss - mean_ce) < tol, (loss, mean_ce, tol)
    assert abs(0.5 * mean_ce - mean_ce) > 3 * tol  # the check separates the weighted loss from the unweighted


def test_diffusion_loss_never_masks_the_prompt():
    b, ids = sft_batch("text", 64)
    model = FixedLogits(torch.zeros(b.x.shape[1], ids.vocab_size))
    train.diffusion_loss(model, b, ids, torch.Generator().manual_seed(0))
    seen = model.seen[0]
    assert torch.equal(seen[:, : b.prompt_len], b.x[:, : b.prompt_len])
    assert (seen[:, b.window_slice] == ids.mask).any()
