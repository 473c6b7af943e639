"""A LLaDA-architecture masked diffusion transformer.

LLaDA (arXiv:2502.09992) is a LLaMA-style Transformer with the causal mask removed and one reserved
mask token: every position sees the whole sequence and predicts the clean token behind each mask.
MMaDA (arXiv:2505.15809) is the same network with 8192 image-code rows appended to the vocabulary.

This file reproduces the public LLaDA modelling code's numerics (tests/test_model.py checks it against
logits that code wrote, tests/fixtures/tiny-llada):
RMSNorm and rotary embeddings computed in float32, separate q/k/v projections, SwiGLU with the SiLU on
`ff_proj`, untied output head. Module names mirror the checkpoint keys (`q_proj`, `attn_out`, `ff_proj`,
...), so a checkpoint key is our state-dict key behind the prefix `model.transformer.`, and a LoRA
target list written for LLaDA names the right layers.

    model = Transformer(ModelConfig(d_model=128, n_layers=4, vocab_size=128)).init_weights()
    logits = model(input_ids)                  # (B, L, V)

Checkpoints in the Hugging Face LLaDA layout are read and written by infra/hf.py (from_pretrained,
save_pretrained), which also builds the special-token ids (tasks.TokenIds) of a released checkpoint.

Shapes: B batch, L sequence length, D d_model, H heads, Hkv key/value heads, Dh head dim, V vocab rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# -----------------------------------------------------------------------------------------------------
# config


@dataclass
class ModelConfig:
    """Architecture and special-token ids. Field names follow LLaDA's config.json."""
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4            # < n_heads gives grouped-query attention
    mlp_hidden_size: int = 384     # LLaDA-8B: 12288 (not mlp_ratio * d_model)
    vocab_size: int = 128          # embedding / head rows (LLaDA's `embedding_size or vocab_size`)
    max_sequence_length: int = 4096  # only sizes the rotary table, as in the reference
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    mask_token_id: int = 127       # the absorbing state m of the diffusion process
    eos_token_id: int = 1
    pad_token_id: int = 1
    bos_token_id: int | None = None
    # MMaDA image tokens: image code c is token id image_token_offset + c.
    image_token_offset: int | None = None
    codebook_size: int | None = None
    # config.json fields we do not interpret, kept so save_pretrained writes them back unchanged.
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head dim {self.d_model // self.n_heads} must be even for rotary embeddings")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < self.vocab_size:
                raise ValueError(f"{name} ({v}) is outside the vocabulary [0, {self.vocab_size})")
        if self.pad_token_id == self.mask_token_id:
            raise ValueError(f"pad_token_id equals mask_token_id ({self.mask_token_id}): padding would be "
                             "read as 'to be generated'; use the EOS id for padding, as LLaDA does")
        if self.image_token_offset is not None:
            if not self.codebook_size or self.image_token_offset + self.codebook_size > self.vocab_size:
                raise ValueError(f"image codes [{self.image_token_offset}, {self.image_token_offset} + "
                                 f"{self.codebook_size}) do not fit in vocab_size {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

# -----------------------------------------------------------------------------------------------------
# layers


class RMSNorm(nn.Module):
    """RMSNorm as LLaDA computes it (LLaDA's modelling code): normalise in float32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalize(self, x):  # x / rms(x) in float32, before the weight
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        # Casting before the weight multiply (not after) is what makes bf16 outputs bit-identical.
        return self.weight * self.normalize(x).to(x.dtype)


def rope_table(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (length, Dh) in float32, built on the CPU as the reference does: CPU and
    CUDA sin/cos can differ in the last bit, so the table is always computed here and moved."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # (Dh/2,)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)              # (length, Dh/2)
    angles = torch.cat([angles, angles], dim=-1)                                          # (length, Dh)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate-half (NeoX) rotary embedding in float32: dim i pairs with dim i + Dh/2. x: (B, H, L, Dh)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Block(nn.Module):
    """One pre-norm LLaDA "llama" block: bidirectional attention, then a SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, dh = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, dh
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        # Separate q/k/v GEMMs rather than one fused projection: fusing can change cuBLAS tiling and
        # therefore the low bits of bf16 outputs.
        self.q_proj = nn.Linear(d, cfg.n_heads * dh, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=False)
        self.attn_out = nn.Linear(cfg.n_heads * dh, d, bias=False)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)   # gate: SiLU goes here
        self.up_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)   # up: no activation
        self.ff_out = nn.Linear(cfg.mlp_hidden_size, d, bias=False)    # down projection

    def forward(self, x, cos, sin, attn_mask=None, kv=None, start=0, return_kv=False):
        """x (B, L, D) -> (B, L, D) [, (k, v) each (B, Hkv, Lk, Dh)]. With kv = (k, v) cached for Lk positions,
        x holds positions [start, start + L) only, and its fresh keys overwrite those rows of the cache in place."""
        B, L, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)      # (B, H, L, Dh)
        k = self.k_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, Hkv, L, Dh)
        v = self.v_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, Hkv, L, Dh)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            # The fresh slice overwrites its rows of the cache in place (no copy of the whole cache per layer
            # and step), so keys stay in sequence order and a key-padding mask over the full sequence lines up
            # with them. Cached after RoPE: positions are absolute.
            kv[0][:, :, start:start + L], kv[1][:, :, start:start + L] = k, v
            k, v = kv                                                                     # (B, Hkv, Lk, Dh)
        new_kv = (k, v)  # before the GQA repeat: a cache of Hkv heads, not H
        if self.n_kv_heads != self.n_heads:  # grouped-query attention: each kv head serves H/Hkv heads
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # No causal mask: this is what makes the model a masked diffusion model rather than an AR LM.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)  # (B, H, L, Dh)
        x = x + self.attn_out(y.transpose(1, 2).reshape(B, L, -1))
        h = self.ff_norm(x)
        x = x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))
        return (x, new_kv) if return_kv else x


# -----------------------------------------------------------------------------------------------------
# model


class Transformer(nn.Module):
    """The LLaDA network: token embedding, n_layers blocks, final RMSNorm, untied output head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = RMSNorm(config.d_model, config.rms_norm_eps)
        self.ff_out = nn.Linear(config.d_model, config.vocab_size, bias=False)  # untied LM head
        self.activation_checkpointing = False
        self._rope_cache: dict = {}

    def rope(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        # The reference pre-computes max_sequence_length rows and slices; rows are position-wise, so
        # slicing a longer table gives the same values as building a short one.
        n = max(length, self.config.max_sequence_length)
        key = (n, str(device))
        if key not in self._rope_cache:
            self._rope_cache = {k: v for k, v in self._rope_cache.items() if k[0] >= n}
            cos, sin = rope_table(self.config.head_dim, n, self.config.rope_theta)
            self._rope_cache[key] = (cos.to(device), sin.to(device))
        cos, sin = self._rope_cache[key]
        return cos[:length], sin[:length]

    accepts_cache_kwargs = True  # tells the samplers (sample.py, infra/fast_sample.py) forward takes the options below

    def forward(self, input_ids, attention_mask=None, *, logits_at=None, vocab_slice=None, float32_head=False,
                padded=None, return_kv=False, kv=None, start=0):
        """input_ids (B, L) int64; attention_mask (B, L) with 1 = real token, 0 = padding (optional).
        Returns logits (B, L, V) in the parameter dtype.

        Keyword-only options for the samplers (logits_at; the KV cache: infra/fast_sample.py); the defaults are the
        exact forward:
            logits_at: a slice; compute the head only at those positions (same maths, though BLAS may round
                a smaller matrix differently in the last bit).
            vocab_slice: (lo, hi); only the logits of vocabulary rows [lo, hi) (image codes), computed from
                those rows of the head's weight (a (.., V) result is never made and then sliced).
            padded: whether attention_mask holds a 0; None looks (a host sync each forward), so a caller that
                runs many forwards on one mask (the samplers, importance.token_logprobs) looks once and says.
            float32_head: the final norm and the head in float32, logits float32 whatever the parameter
                dtype. A bf16 logit is rounded by up to 0.06 at magnitude 32; a log-ratio of two policies
                that differ by a small update would be mostly that rounding (importance.token_logprobs).
            return_kv: also return every layer's keys and values: a list of (k, v), each (B, Hkv, L, Dh).
            kv, start: the cached path, an APPROXIMATION once the cache is stale. input_ids (B, l) are the
                positions [start, start + l) of a sequence whose other keys and values come from kv (a
                return_kv list for the same batch, Lk positions, whose rows [start, start + l) this call
                overwrites in place with the fresh keys and values); attention_mask then covers all Lk. With a
                cache of the current tokens this equals the exact forward up to rounding; with an older
                one it does not, since bidirectional attention lets every key depend on every token.
                Fast-dLLM (arXiv:2505.22618) finds the drift small across the steps of one block."""
        B, l = input_ids.shape
        Lk = start + l if kv is None else kv[0][0].shape[2]
        assert (kv is None and start == 0) or (kv is not None and len(kv) == len(self.blocks) and start + l <= Lk), \
            "start > 0 needs the kv list a return_kv=True call returned for this batch"
        cos, sin = self.rope(Lk, input_ids.device)
        cos, sin = cos[start:start + l], sin[start:start + l]  # absolute positions, left padding included
        mask = None
        # An all-ones mask is no mask (tasks.attends_padding): the unmasked attention, bit for bit.
        if attention_mask is not None and (not bool(attention_mask.all()) if padded is None else padded):
            # Key-padding mask on a bidirectional attention (the public LLaDA modelling code since Oct 2025):
            # no query attends to a pad key. Pad queries still attend to real keys, so no row is empty.
            # On the cached path it covers the cached keys too, so left padding stays hidden.
            mask = attention_mask.bool()[:, None, None, :]                       # (B, 1, 1, Lk)
        x = self.wte(input_ids)                                                  # (B, l, D)
        new_kv = []
        for i, block in enumerate(self.blocks):
            if kv is not None or return_kv:
                x, layer_kv = block(x, cos, sin, mask, None if kv is None else kv[i], start, return_kv=True)
                new_kv.append(layer_kv)
            elif self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask)
        if logits_at is not None:
            x = x[:, logits_at]                                                  # (B, l', D)
        logits = self.head(x, vocab_slice, float32_head)                         # (B, l', V or hi - lo)
        return (logits, new_kv) if return_kv else logits

    def head(self, x, vocab_slice=None, float32: bool = False):
        """Final norm and LM head on hidden states x (..., D): logits (..., V), or (..., hi - lo) for
        vocab_slice (lo, hi), from only those rows of the weight. float32: both computed in float32 (RMSNorm
        as ln_f does, its weight applied in float32 rather than after a cast back to the parameter dtype)."""
        if vocab_slice is None and not float32:
            return self.ff_out(self.ln_f(x))                                      # the reference's numerics
        weight = self.ff_out.weight if vocab_slice is None else self.ff_out.weight[vocab_slice[0]:vocab_slice[1]]
        if not float32:
            return F.linear(self.ln_f(x), weight)
        return F.linear(self.ln_f.weight.float() * self.ln_f.normalize(x.float()), weight.float())

    def set_activation_checkpointing(self, on: bool = True) -> "Transformer":
        """Recompute each block in the backward pass instead of storing its activations (needed at 8B)."""
        self.activation_checkpointing = on
        return self

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02):
        """Random init for training from scratch: N(0, std) matrices, unit norm weights, and output
        projections scaled by 1/sqrt(2 n_layers) (GPT-2's residual scaling)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                # Projections that write into the residual stream (attn_out, a block's ff_out).
                residual = name.startswith("blocks.") and name.endswith(("attn_out.weight", "ff_out.weight"))
                scale = std / math.sqrt(2 * self.config.n_layers) if residual else std
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * scale)
        return self

def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
