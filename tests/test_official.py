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
from infra import toy
from tools import diagnose


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
    m = imp.reverse_mask(cm, [r] * B, [imp.mask_seed(0, 0, i, 0) for i in range(B)], "arlike_official",
                         prompt_len=[P] * B).double()
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
    ins, outs = imp.build_masks(pm, cm, seed=3, step=1, seq_index=[0, 1, 2], mu=4, gamma=0.6,
                                mode="arlike_official")
    for j, r in enumerate([0.7, 0.8, 0.9, 0.999]):
        for b in range(B):
            want = imp.reverse_mask(cm[b:b + 1], [r], [imp.mask_seed(3, 1, b, j)], "arlike_official",
                                    prompt_len=[real[b]])
            assert torch.equal(ins[j, b, P:], want[0]) and torch.equal(outs[j, b, P:], want[0])
            assert not ins[j, b, :P].any()                    # the prompt is never masked
    # the same row with a longer prompt is masked more, on average, than with a shorter one
    many = torch.ones(2000, N, dtype=torch.bool)
    seeds = list(range(2000))
    short = imp.reverse_mask(many, [0.7] * 2000, seeds, "arlike_official", prompt_len=[1] * 2000).double().mean()
    long = imp.reverse_mask(many, [0.7] * 2000, seeds, "arlike_official", prompt_len=[40] * 2000).double().mean()
    assert long > short + 0.05


def test_official_mode_needs_the_prompt_length():
    with pytest.raises(AssertionError, match="prompt_len"):
        imp.reverse_mask(torch.ones(2, 8, dtype=torch.bool), [0.7] * 2, [0, 1], "arlike_official")


# -----------------------------------------------------------------------------
# LoRA targets

def lora_param_count(targets):
    from infra.hf import add_lora, lora_stats
    from model import ModelConfig, Transformer
    mc = ModelConfig(vocab_size=126464, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288)
    with torch.device("meta"):
        model = Transformer(mc)
    return lora_stats(add_lora(model, rank=128, alpha=64.0, targets=targets))["lora_params"]


@pytest.mark.slow  # builds LLaDA-8B-shaped adapters
def test_lora_parameter_counts_at_llada8b_shape():
    from infra.hf import TARGET_SETS
    # By hand: an adapter on W (out, in) holds r (in + out). LLaDA-8B: d 4096, MLP 12288, 32 heads of 128 and
    # 32 key/value heads (q, k, v and attn_out are 4096 x 4096); 32 blocks; r 128.
    r, d, h, layers = 128, 4096, 12288, 32
    official = layers * r * (3 * (d + d) + (d + h))             # q, k, v, up_proj
    everything = layers * r * (4 * (d + d) + 3 * (d + h))      # + attn_out, ff_proj, ff_out
    assert official == 167_772_160 and everything == 335_544_320
    assert lora_param_count(TARGET_SETS["official"]) == official
    assert lora_param_count(TARGET_SETS["all"]) == everything


def test_dry_run_reports_the_configured_lora_set(capsys):
    import train
    assert train.main(["--preset=llada8b", "--dry_run"])["lora_params"] == 167_772_160      # preset: official
    assert train.main(["--preset=llada8b", "--dry_run", "--lora_targets=all"])["lora_params"] == 335_544_320
    assert "LoRA r=128 on the 'all' targets: 335,544,320 adapter parameters" in capsys.readouterr().out
    with pytest.raises(ValueError, match="lora_targets"):
        train.parse_args(["--preset=llada8b", "--dry_run", "--lora_targets=qv"])


# -----------------------------------------------------------------------------
# attention over padding, system prompt

def toy_image_batch(mode):
    import tasks
    from infra import toy
    import train
    tok = toy.build_tokenizer()
    ids = tasks.token_ids(tok)
    cfg = train.Config(attend_padding=mode)
    import random
    rng = random.Random(0)
    exs = [tasks.make_example("image", rng, cfg, "train") for _ in range(4)]
    return tasks.make_batch("image", exs, tok, ids, cfg, torch.device("cpu"), with_targets=True), tok


def test_attend_padding_on_equals_no_attention_mask():
    import tasks
    from model import ModelConfig, Transformer
    off, tok = toy_image_batch("off")
    on, _ = toy_image_batch("on")
    assert torch.equal(on.x, off.x) and not off.attention_mask.all()  # the toy captions are left-padded
    assert on.attention_mask.all() and on.uncond_mask.all()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**tasks.model_config_overrides(tok), d_model=32, n_layers=2, n_heads=4,
                                    mlp_hidden_size=64)).eval()
    with torch.no_grad():
        free = model(on.x)
        assert torch.equal(model(on.x, on.attention_mask), free)           # all ones = no mask, bit for bit
        assert not torch.allclose(model(off.x, off.attention_mask), free)  # masking the pad keys changes logits


def test_attend_padding_auto_is_on_for_geneval_only():
    import tasks
    import train
    cfg = train.Config()
    assert cfg.attend_padding == "auto"
    assert tasks.attends_padding(cfg, "geneval")
    assert not any(tasks.attends_padding(cfg, t) for t in ("image", "text", "gsm8k"))
    assert all(tasks.attends_padding(train.Config(attend_padding="on"), t) for t in ("image", "gsm8k"))
    assert train.Config(**train.PRESETS["mmada8b"]).attend_padding == "auto"


class Recorder:
    """A tokenizer stand-in that records the text make_batch encodes."""

    def __init__(self):
        self.seen = []

    def encode(self, text, add_special_tokens=False):
        self.seen.append(text)
        return type("Enc", (), {"ids": [5] * 3})()


@pytest.mark.parametrize("system", ["", "You are a math expert."])
def test_system_prompt_opens_a_system_turn(system):
    import tasks
    import train
    ids = tasks.token_ids(toy.build_tokenizer())
    rec = Recorder()
    cfg = train.Config(system_prompt=system, gen_length=4, block_length=4, steps=4)
    tasks.make_batch("gsm8k", [{"prompt": "Q?"}], rec, ids, cfg, torch.device("cpu"), with_targets=False)
    turn = lambda role, text: f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>"
    want = ("<|startoftext|>" + (turn("system", system) if system else "") + turn("user", "Q?")
            + "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert rec.seen == [want]


# -----------------------------------------------------------------------------
# measurements behind docs/differences.md (tools/official.py)

def test_strided_indices_under_gradient_accumulation():
    from tools.official import strided_indices
    # By hand, mu 12 and accumulation 2: micro-batch m scores index m mod 12 (the counter is m + 1 when
    # compute_loss runs), slot m mod 2, so slot 0 gets the even indices twice and slot 1 the odd ones.
    assert strided_indices(12, 2, 12) == [[0, 2, 4, 6, 8, 10] * 2, [1, 3, 5, 7, 9, 11] * 2]
    assert strided_indices(12, 1, 12) == [list(range(12))]              # without accumulation: in order
    assert strided_indices(6, 2, 6) == [[0, 2, 4] * 2, [1, 3, 5] * 2]   # t2i_grpo_train.sh


def test_float64_gumbel_samples_the_tempered_softmax():
    from tools.official import entropy_top1, gumbel_stats
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)
    tau = 0.9
    p = [math.exp(v / tau) for v in logits.tolist()]
    p = [v / sum(p) for v in p]                                          # softmax(l / tau), by hand
    h_want = -sum(v * math.log(v) for v in p)
    h, top = gumbel_stats(logits, tau, torch.float64, 20000, torch.Generator().manual_seed(0))
    assert abs(top - p[0]) < sigma5(p[0], 20000)
    assert h == pytest.approx(h_want, abs=0.02)
    assert entropy_top1(torch.tensor(p)) == pytest.approx((h_want, p[0]))


def test_official_ratios_cli_prints_the_table(capsys):
    assert diagnose.main(["--official_ratios"]) == {}
    out = capsys.readouterr().out
    assert "| gamma | nominal ratio t_j | P = 20 | P = 100 | P = 150 | P = 256 |" in out
    r = 0.6 + 0.4 / 12
    cells = " | ".join(f"{sum(official_mask_prob(P, 256, r)) / 256:.3f}" for P in (20, 100, 150, 256))
    assert f"| 0.6 | 0.633 | {cells} |" in out and "0.769" in cells
