"""model.Transformer.head: the final norm and LM head over chosen positions and vocabulary rows, in float32 on
request; and the image sampler computing the head over the code columns only.

    python -m pytest tests/test_head.py -q
"""
import torch

import sample
from model import ModelConfig, Transformer
from test_sample import C, MASK, OFFSET, gen, image_layout, tiny_model


def test_float32_head_at_positions_and_rows_is_the_float64_head():
    """bf16 weights: float32_head gives the float64 computation of ln_f and the head from the same (bf16) hidden
    states to float32 rounding, at the positions logits_at and the rows [lo, hi) only; without
    float32_head the logits are bf16, as the reference computes them."""
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=48, vocab_size=64,
                      max_sequence_length=64, mask_token_id=63, eos_token_id=1, pad_token_id=1)
    model = Transformer(cfg).init_weights(torch.Generator().manual_seed(0), std=0.3).to(torch.bfloat16)
    x = torch.randint(0, 63, (3, 10), generator=gen(0))
    at = slice(3, 8)
    hidden = []
    model.ln_f.register_forward_hook(lambda m, args, out: hidden.append(args[0]))
    model(x)  # the hidden states entering ln_f, (B, L, D) bf16
    h = hidden[0][:, at].double()                                                    # (B, 5, D)
    n = model.ln_f.weight.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    want = n @ model.ff_out.weight.double()[20:36].T                                 # (B, 5, 16)
    got = model(x, logits_at=at, vocab_slice=(20, 36), float32_head=True)
    assert got.dtype == torch.float32 and got.shape == (3, 5, 16)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    plain = model(x, logits_at=at, vocab_slice=(20, 36))
    assert plain.dtype == torch.bfloat16
    # the bf16 head rounds what the float32 head keeps: at these magnitudes by more than float32 rounding
    assert (plain.double() - want).abs().max() > 100 * (got.double() - want).abs().max()


def test_image_sampler_computes_the_code_columns_only():
    """generate_image asks the model for the C code columns (vocab_slice) and never for full-vocabulary logits,
    with and without CFG; the codes it draws are the same as from the full logits sliced afterwards (float64)."""
    model = tiny_model(dtype=torch.float64)
    ids, start = image_layout(2, 6)
    shapes = []
    model.register_forward_hook(lambda m, a, out: shapes.append(out.shape[-1]))
    kw = dict(image_start=start, num_tokens=6, steps=3, code_offset=OFFSET, codebook_size=C, mask_id=MASK)
    for cfg_scale in (0.0, 2.0):
        extra = {} if cfg_scale == 0 else dict(cfg_scale=cfg_scale, uncond_input_ids=ids.clone())
        shapes.clear()
        out = sample.generate_image(model, ids, generator=[gen(i) for i in range(2)], **kw, **extra)
        assert shapes and set(shapes) == {C}

        class FullHead(torch.nn.Module):  # no logits_at: the sampler slices the full logits itself
            def __init__(self):
                super().__init__()
                self.m, self.config = model, model.config

            def forward(self, x, attention_mask=None):
                return self.m(x, attention_mask)

        ref = sample.generate_image(FullHead(), ids, generator=[gen(i) for i in range(2)], **kw, **extra)
        assert torch.equal(out, ref)
