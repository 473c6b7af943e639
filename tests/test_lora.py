"""hf.py: exact start at the base, targets and freezing, adapter switch-off, save/load, merge into a
Hugging Face checkpoint, bad-input errors, dropout.

    python -m pytest tests/test_lora.py -q
"""
import copy
import functools
import json

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

from infra.hf import (LORA_TARGETS, AdaptersOff, LoRALinear, add_lora, load_adapters, lora_state_dict,
                  lora_stats, merge_lora, save_adapters, trainable_parameters)
from model import ModelConfig, Transformer
from infra.hf import INDEX_NAME
from infra import hf
import math
from infra.hf import (TARGET_SETS, LoRALinear, add_lora, load_adapters,
                        lora_stats, merge_lora, save_adapters)


CFG = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=48, vocab_size=64,
           max_sequence_length=32, mask_token_id=63, eos_token_id=1, pad_token_id=1)
X = torch.randint(0, 63, (2, 12), generator=torch.Generator().manual_seed(1))  # (B, L) token ids


def tiny() -> Transformer:
    return Transformer(ModelConfig(**CFG)).init_weights(torch.Generator().manual_seed(0)).eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(X)


def trained() -> Transformer:
    """A copy of one adapted tiny model (rank 4, alpha 8) after a few AdamW steps on a toy loss, so every
    B is nonzero. Trained once per session: the first AdamW pulls in torch._dynamo, seconds on a busy CPU."""
    return copy.deepcopy(_trained())


@functools.cache
def _trained() -> Transformer:
    model = add_lora(tiny(), rank=4, alpha=8.0, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    target = torch.randint(0, 64, X.shape, generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(X).flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_starts_exactly_at_base():
    base = logits(tiny())
    assert torch.equal(logits(add_lora(tiny(), rank=4, alpha=8.0)), base)  # B = 0: the update is exactly 0


def test_targets_and_freezing():
    model = add_lora(tiny(), rank=4, alpha=8.0)
    adapted = sorted(n for n, m in model.named_modules() if isinstance(m, LoRALinear))
    assert adapted == sorted(f"blocks.{i}.{t}" for i in range(2) for t in LORA_TARGETS)
    assert type(model.ff_out) is nn.Linear  # the LM head shares the name `ff_out` but is not adapted
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}" for n in adapted for ab in "AB"}
    assert len(trainable_parameters(model)) == 2 * 7 * 2
    # Base keys keep their checkpoint names; the adapters add exactly two keys per adapted layer.
    assert set(tiny().state_dict()) == set(model.state_dict()) - set(lora_state_dict(model))
    # q/k/v/attn_out: r * (32 + 32) each; ff_proj/up_proj/ff_out: r * (32 + 48) each; per block, 2 blocks.
    stats = lora_stats(model)
    assert stats["modules"] == 14 and stats["lora_params"] == 2 * 4 * (4 * 64 + 3 * 80)
    official = add_lora(tiny(), rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "up_proj"))
    assert lora_stats(official)["modules"] == 8


def test_training_moves_and_disable_restores_base():
    base, model = logits(tiny()), trained()
    assert all(m.lora_B.abs().sum() > 0 for m in model.modules() if isinstance(m, LoRALinear))
    for k, v in tiny().state_dict().items():  # the frozen base weights did not move
        assert torch.equal(model.state_dict()[k], v), k
    adapted = logits(model)
    assert (adapted - base).abs().max() > 1e-3
    assert torch.equal(logits(AdaptersOff(model)), base)  # the reference policy is the base model, bit for bit
    assert torch.equal(logits(model), adapted)
    with pytest.raises(IndexError, match="out of range"):  # an error inside the reference pass
        AdaptersOff(model)(torch.full_like(X, 64))  # a token id past the 64 embedding rows
    assert torch.equal(logits(model), adapted)  # restored after the exception too


def test_save_load_round_trip(tmp_path):
    model = trained()
    save_adapters(model, tmp_path)
    assert json.loads((tmp_path / "adapters.json").read_text())["targets"] == sorted(LORA_TARGETS)
    fresh = add_lora(tiny(), rank=4, alpha=8.0, generator=torch.Generator().manual_seed(9))
    assert torch.equal(logits(load_adapters(fresh, tmp_path)), logits(model))
    # A plain base model gets the saved adapters added (rank, alpha, targets from adapters.json).
    assert torch.equal(logits(load_adapters(tiny(), tmp_path)), logits(model))
    with pytest.raises(ValueError, match="another rank"):
        load_adapters(add_lora(tiny(), rank=2, alpha=8.0), tmp_path)
    with pytest.raises(ValueError, match=r"0 missing .*24 unexpected"):
        load_adapters(add_lora(tiny(), rank=4, alpha=8.0, targets="q_proj"), tmp_path)
    with pytest.raises(ValueError, match="alpha"):
        load_adapters(add_lora(tiny(), rank=4, alpha=16.0), tmp_path)


def test_merge_then_save_pretrained_matches_adapter_model(tmp_path):
    """Acceptance: merged and saved in the HF LLaDA layout, reloaded with from_pretrained, the model gives
    the adapter model's logits. Tolerance 1e-5 (max abs, float32): W + s*B@A is one rounded matrix, while
    the adapter path rounds W x and s*B(A x) separately, so the two differ by float32 rounding only
    (measured 8.9e-8 here, on logits of magnitude <= 0.35)."""
    model = trained()
    want = logits(model)
    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    hf.save_pretrained(model, tmp_path)
    reloaded = hf.from_pretrained(tmp_path)
    err = (logits(reloaded) - want).abs().max().item()
    assert err <= 1e-5, f"merged vs adapter max abs logit diff {err:.3g} > 1e-5"
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == {"model.transformer." + k for k in tiny().state_dict()}
    with safe_open(str(tmp_path / next(iter(index["weight_map"].values()))), framework="pt") as f:
        assert not any("lora" in k for k in f.keys())


def test_bf16_base_keeps_float32_adapters():
    """The CUDA configuration on the CPU: bf16 base and activations, float32 adapter parameters."""
    model = add_lora(tiny().to(torch.bfloat16), rank=4, alpha=8.0)
    out = model(X)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    grads = [p.grad for p in trainable_parameters(model)]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)  # B's gradient is nonzero even though B = 0
    assert merge_lora(model).blocks[0].q_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), r"rank \(0\) must be an integer >= 1"),
    (dict(rank=2.5), r"rank \(2.5\)"),
    (dict(alpha=0.0), r"alpha \(0.0\) must be > 0"),
    (dict(alpha=-1.0), r"alpha \(-1.0\)"),
    (dict(dropout=1.0), r"dropout \(1.0\) must be in \[0, 1\)"),
    (dict(dropout=-0.1), r"dropout \(-0.1\)"),
    (dict(targets=("q_proj", "o_proj")), r"\['o_proj'\] match no nn.Linear .*available names are \['attn_out'"),
    (dict(targets=()), "match no nn.Linear"),
])
def test_bad_inputs(kwargs, match):
    model = tiny()
    with pytest.raises(ValueError, match=match):
        add_lora(model, **{"rank": 4, "alpha": 8.0, **kwargs})
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # nothing half-applied


def test_double_add_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(add_lora(tiny(), rank=4, alpha=8.0), rank=4, alpha=8.0)
    with pytest.raises(ValueError, match="no LoRA adapters to save"):
        save_adapters(tiny(), tmp_path)
    with pytest.raises(FileNotFoundError, match="adapters.safetensors"):
        load_adapters(tiny(), tmp_path)


def test_dropout_only_in_train_mode_and_checkpoint_safe():
    model = trained()
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.lora_dropout = 0.5
    eval_logits = logits(model)
    assert torch.equal(logits(model), eval_logits)  # eval: no dropout, deterministic
    model.train()
    torch.manual_seed(0)
    assert not torch.equal(logits(model), eval_logits)

    def grads(checkpointing: bool) -> list[torch.Tensor]:
        model.set_activation_checkpointing(checkpointing)
        model.zero_grad()
        torch.manual_seed(0)
        model(X).square().mean().backward()
        return [p.grad.clone() for p in trainable_parameters(model)]

    # Activation checkpointing replays the global RNG in the recompute, so the dropout masks, and hence
    # the gradients, are the ones of the stored forward pass.
    for a, b in zip(grads(False), grads(True)):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


# -----------------------------------------------------------------------------
# infra/hf.py at non-default settings, against y = W x + (alpha / r) B A x written out here.
#
# tests/test_lora.py starts from B = 0 or compares a model with its own merge, where the scale alpha / r cannot
# show. Here A and B are set to known values and the layer, the merged weight and a whole adapted model are
# checked against the formula at r 128, alpha 64 (the official recipe) and other values; the adapters-off
# context is nested and must give back each adapter's own earlier state; dropout is checked by hand.
#
#     python -m pytest tests/test_lora.py -q


# a grouped-query model (n_kv_heads 2 < n_heads 4), unlike the one at the top of this file
CFG_GQA = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden_size=48, vocab_size=64,
           max_sequence_length=32, mask_token_id=63, eos_token_id=1, pad_token_id=1)
X_GQA = torch.randint(0, 63, (2, 9), generator=torch.Generator().manual_seed(1))


def tiny_gqa() -> Transformer:
    return Transformer(ModelConfig(**CFG_GQA)).init_weights(torch.Generator().manual_seed(0), std=0.2).eval()


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
    model = add_lora(tiny_gqa().train(), rank=3, alpha=6.0, dropout=0.25, targets=("v_proj", "ff_out"),
                     generator=torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(11)
    for blk in model.blocks:
        for name, fan_in in (("v_proj", 32), ("ff_out", 48)):  # the targets' order, not the model's
            m = getattr(blk, name)
            want = (torch.rand(3, fan_in, generator=g) * 2 - 1) / math.sqrt(fan_in)
            torch.testing.assert_close(m.lora_A.detach(), want, rtol=1e-6, atol=0, msg=name)
            assert (m.lora_B == 0).all() and (m.rank, m.alpha, m.lora_dropout, m.scaling) == (3, 6.0, 0.25, 2.0)
            assert m.training
    assert not add_lora(tiny_gqa(), rank=2, alpha=1.0).blocks[0].q_proj.training  # eval base: eval adapter
    other = add_lora(tiny_gqa(), rank=3, alpha=6.0, targets=("v_proj",), generator=torch.Generator().manual_seed(12))
    assert not torch.equal(other.blocks[0].v_proj.lora_A, model.blocks[0].v_proj.lora_A)


def test_whole_model_equals_hand_merged_weights():
    """An adapted model at r 128, alpha 64 ("official" targets) equals a plain model whose target weights are
    W + (64 / 128) B A, computed here from the adapter tensors (not by merge_lora)."""
    model = fill_adapters(add_lora(tiny_gqa(), rank=128, alpha=64.0, targets=TARGET_SETS["official"]), scale=0.05)
    reference = tiny_gqa()
    with torch.no_grad():
        for i, blk in enumerate(model.blocks):
            for name in TARGET_SETS["official"]:
                m = getattr(blk, name)
                getattr(reference.blocks[i], name).weight += 0.5 * m.lora_B @ m.lora_A
        got, want = model(X_GQA), reference(X_GQA)
    assert (want - tiny_gqa()(X_GQA)).abs().max() > 0.05  # the update is large enough to see a wrong scale
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert lora_stats(model)["modules"] == 2 * len(TARGET_SETS["official"])
    assert set(TARGET_SETS) == {"all", "official"}


def test_nested_adapters_off_restore_each_adapter_state():
    """AdaptersOff nests: the inner pass's exit leaves everything off, the outer exit gives back each
    adapter's own earlier state, including adapters that were already off before (not "all on")."""
    model = fill_adapters(add_lora(tiny_gqa(), rank=2, alpha=4.0, targets=("q_proj", "up_proj")))
    base = tiny_gqa()
    with torch.no_grad():
        base_logits = base(X_GQA)
    model.blocks[1].up_proj.disabled = True  # one adapter switched off by hand
    with torch.no_grad():
        partial = model(X_GQA)
    states = lambda: [m.disabled for m in model.modules() if isinstance(m, LoRALinear)]
    before = states()
    assert before == [False, False, False, True]
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(states()))  # inside the inner pass
    inner = AdaptersOff(model)
    inner.register_forward_hook(lambda m, args, out: seen.append(states()))  # after the inner exit, inside the outer
    with torch.no_grad():
        assert torch.equal(AdaptersOff(inner)(X_GQA), base_logits)
    assert len(seen) == 2 and all(seen[0]) and all(seen[1]), seen  # the inner exit must not switch adapters back on
    assert states() == before
    with torch.no_grad():
        assert torch.equal(model(X_GQA), partial)
    # Partial state differs from both "all on" and "all off": the test above can tell them apart.
    model.blocks[1].up_proj.disabled = False
    with torch.no_grad():
        assert not torch.equal(model(X_GQA), partial) and not torch.equal(partial, base_logits)


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
    model = fill_adapters(add_lora(tiny_gqa(), rank=5, alpha=3.0, dropout=0.1, targets=("k_proj", "ff_out")))
    save_adapters(model, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "adapters.json").read_text()) == {
        "rank": 5, "alpha": 3.0, "dropout": 0.1, "targets": ["ff_out", "k_proj"]}
    fresh = load_adapters(tiny_gqa(), tmp_path / "a")
    mods = {n: m for n, m in fresh.named_modules() if isinstance(m, LoRALinear)}
    assert sorted(mods) == sorted(f"blocks.{i}.{t}" for i in range(2) for t in ("k_proj", "ff_out"))
    assert {(m.rank, m.alpha, m.lora_dropout) for m in mods.values()} == {(5, 3.0, 0.1)}
    with torch.no_grad():
        assert torch.equal(fresh.eval()(X_GQA), model.eval()(X_GQA))
