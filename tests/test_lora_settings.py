"""infra/lora.py at non-default settings, against y = W x + (alpha / r) B A x written out here.

tests/test_lora.py starts from B = 0 or compares a model with its own merge, where the scale alpha / r cannot
show. Here A and B are set to known values and the layer, the merged weight and a whole adapted model are
checked against the formula at r 128, alpha 64 (the official recipe) and other values; the adapters-off
context is nested and must give back each adapter's own earlier state; dropout is checked by hand.

    python -m pytest tests/test_lora_settings.py -q
"""
import json
import math

import pytest
import torch
import torch.nn as nn

from infra.lora import (OFFICIAL_TARGETS, TARGET_SETS, LoRALinear, adapters_disabled, add_lora, load_adapters,
                        lora_stats, merge_lora, save_adapters)
from model import ModelConfig, Transformer

CFG = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=48, vocab_size=64,
           max_sequence_length=32, mask_token_id=63, eos_token_id=1, pad_token_id=1)
X = torch.randint(0, 63, (2, 9), generator=torch.Generator().manual_seed(1))


def tiny() -> Transformer:
    return Transformer(ModelConfig(**CFG)).init_weights(torch.Generator().manual_seed(0), std=0.2).eval()


def fill_adapters(model, seed=5, scale=0.3):
    """Give every A and B known random values (B nonzero), so that the update is visible."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * scale)
                m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * scale)
    return model


@pytest.mark.parametrize("rank, alpha", [(128, 64.0), (4, 8.0), (3, 1.0), (1, 0.5)])
def test_layer_is_base_plus_alpha_over_r_times_BA(rank, alpha):
    base = nn.Linear(6, 5, bias=True)
    W, b = base.weight.detach().clone(), base.bias.detach().clone()
    layer = fill_adapters(nn.Sequential(LoRALinear(base, rank, alpha)))[0]
    A, B = layer.lora_A.detach(), layer.lora_B.detach()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    want = x @ W.T + b + (alpha / rank) * (x @ A.T) @ B.T
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
        # Merged: W + (alpha / r) B A, the same formula folded into the weight.
        model = nn.Module()
        model.blocks = nn.ModuleList([nn.Module()])
        model.blocks[0].q_proj = layer
        merge_lora(model)
        plain = model.blocks[0].q_proj
    assert type(plain) is nn.Linear and plain.bias is base.bias
    torch.testing.assert_close(plain.weight.detach(), W + (alpha / rank) * B @ A, rtol=1e-5, atol=1e-6)


def test_a_draw_follows_the_generator_in_block_then_target_order():
    """lora_A ~ U(-1/sqrt(in), 1/sqrt(in)) drawn as (rand * 2 - 1) * bound from `generator` in block order, then
    target order; B = 0; rank/alpha/dropout recorded; the layer keeps the base's train/eval mode."""
    model = add_lora(tiny().train(), rank=3, alpha=6.0, dropout=0.25, targets=("v_proj", "ff_out"),
                     generator=torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(11)
    for blk in model.blocks:
        for name, fan_in in (("v_proj", 32), ("ff_out", 48)):  # the targets' order, not the model's
            m = getattr(blk, name)
            want = (torch.rand(3, fan_in, generator=g) * 2 - 1) / math.sqrt(fan_in)
            torch.testing.assert_close(m.lora_A.detach(), want, rtol=1e-6, atol=0, msg=name)
            assert (m.lora_B == 0).all() and (m.rank, m.alpha, m.lora_dropout, m.scaling) == (3, 6.0, 0.25, 2.0)
            assert m.training
    assert not add_lora(tiny(), rank=2, alpha=1.0).blocks[0].q_proj.training  # eval base: eval adapter
    other = add_lora(tiny(), rank=3, alpha=6.0, targets=("v_proj",), generator=torch.Generator().manual_seed(12))
    assert not torch.equal(other.blocks[0].v_proj.lora_A, model.blocks[0].v_proj.lora_A)


def test_whole_model_equals_hand_merged_weights():
    """An adapted model at r 128, alpha 64 ("official" targets) equals a plain model whose target weights are
    W + (64 / 128) B A, computed here from the adapter tensors (not by merge_lora)."""
    model = fill_adapters(add_lora(tiny(), rank=128, alpha=64.0, targets=TARGET_SETS["official"]), scale=0.05)
    reference = tiny()
    with torch.no_grad():
        for i, blk in enumerate(model.blocks):
            for name in OFFICIAL_TARGETS:
                m = getattr(blk, name)
                getattr(reference.blocks[i], name).weight += 0.5 * m.lora_B @ m.lora_A
        got, want = model(X), reference(X)
    assert (want - tiny()(X)).abs().max() > 0.05  # the update is large enough to see a wrong scale
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert lora_stats(model)["modules"] == 2 * len(OFFICIAL_TARGETS)
    assert set(TARGET_SETS) == {"all", "official"}


def test_nested_contexts_restore_each_adapter_state():
    """adapters_disabled nests: an inner context leaves everything off, the outer exit gives back each
    adapter's own earlier state, including adapters that were already off before (not "all on")."""
    model = fill_adapters(add_lora(tiny(), rank=2, alpha=4.0, targets=("q_proj", "up_proj")))
    base = tiny()
    with torch.no_grad():
        base_logits = base(X)
    model.blocks[1].up_proj.disabled = True  # one adapter switched off by hand
    with torch.no_grad():
        partial = model(X)
    states = lambda: [m.disabled for m in model.modules() if isinstance(m, LoRALinear)]
    before = states()
    assert before == [False, False, False, True]
    with adapters_disabled(model):
        with adapters_disabled(model):
            assert all(states())
        assert all(states())  # the inner exit must not switch adapters back on inside the outer block
        with torch.no_grad():
            assert torch.equal(model(X), base_logits)
    assert states() == before
    with torch.no_grad():
        assert torch.equal(model(X), partial)
    # Partial state differs from both "all on" and "all off": the test above can tell them apart.
    model.blocks[1].up_proj.disabled = False
    with torch.no_grad():
        assert not torch.equal(model(X), partial) and not torch.equal(partial, base_logits)


def test_dropout_acts_on_the_adapter_input_only():
    """One input feature: dropout either zeroes it (the adapter adds nothing) or scales it by 1 / (1 - p), so
    the adapter's contribution is 0 or 1 / (1 - p) times the no-dropout one; the base path never changes.
    Eval mode and dropout 0 give the exact formula."""
    p = 0.75
    base = nn.Linear(1, 4, bias=False)
    layer = fill_adapters(nn.Sequential(LoRALinear(base, 2, 2.0, dropout=p)))[0]
    x = torch.full((200, 1), 0.7)
    with torch.no_grad():
        plain = base(x)
        update = layer.eval()(x) - plain                                          # (200, 4), all rows equal
        assert update.abs().min() > 1e-3
        torch.manual_seed(0)
        delta = layer.train()(x) - plain
    kept = (delta - update / (1 - p)).abs().amax(1) < 1e-5
    dropped = delta.abs().amax(1) < 1e-7
    assert (kept | dropped).all() and 20 < kept.sum() < 80  # about (1 - p) * 200 = 50 rows kept
    no_drop = fill_adapters(nn.Sequential(LoRALinear(nn.Linear(1, 4, bias=False), 2, 2.0)))[0].train()
    with torch.no_grad():
        torch.testing.assert_close(no_drop(x), no_drop.eval()(x))


def test_save_load_keeps_every_setting(tmp_path):
    """adapters.json records rank, alpha, dropout and targets at non-default values; a plain model given
    the saved adapters gets the same settings and the same function."""
    model = fill_adapters(add_lora(tiny(), rank=5, alpha=3.0, dropout=0.1, targets=("k_proj", "ff_out")))
    save_adapters(model, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "adapters.json").read_text()) == {
        "rank": 5, "alpha": 3.0, "dropout": 0.1, "targets": ["ff_out", "k_proj"]}
    fresh = load_adapters(tiny(), tmp_path / "a")
    mods = {n: m for n, m in fresh.named_modules() if isinstance(m, LoRALinear)}
    assert sorted(mods) == sorted(f"blocks.{i}.{t}" for i in range(2) for t in ("k_proj", "ff_out"))
    assert {(m.rank, m.alpha, m.lora_dropout) for m in mods.values()} == {(5, 3.0, 0.1)}
    with torch.no_grad():
        assert torch.equal(fresh.eval()(X), model.eval()(X))
