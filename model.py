"""A LLaDA-architecture masked diffusion transformer (arXiv:2502.09992): a LLaMA-style Transformer with no
causal mask and one reserved mask token; MMaDA (arXiv:2505.15809) appends 8192 image-code rows to the vocabulary.
The numerics are the public LLaDA code's (tests/test_model.py checks logits it wrote); module names are its
checkpoint keys behind `model.transformer.` (infra/hf.py).

    logits = Transformer(ModelConfig()).init_weights()(input_ids)     # (B, L, V)

Shapes: B batch, L sequence length, D d_model, H heads, Hkv key/value heads, Dh head dim, V vocab rows.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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
    image_token_offset: int | None = None  # MMaDA: image code c is token id image_token_offset + c
    codebook_size: int | None = None
    extra: dict = field(default_factory=dict, repr=False)  # config.json fields save_pretrained writes back as read

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


class RMSNorm(nn.Module):
    """RMSNorm as LLaDA computes it: normalise in float32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def normalize(self, x):  # x / rms(x) in float32, before the weight
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):  # casting before the weight multiply makes bf16 outputs LLaDA's bit for bit
        return self.weight * self.normalize(x).to(x.dtype)


def apply_rope(x, cos, sin):
    """Rotate-half (NeoX) rotary embedding in float32: dim i pairs with dim i + Dh/2. x: (B, H, L, Dh)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Block(nn.Module):
    """One pre-norm LLaDA "llama" block: bidirectional attention, then a SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, dh = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, dh
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        # Separate q/k/v GEMMs: fusing them can change cuBLAS tiling, so the low bits of bf16 outputs.
        self.q_proj = nn.Linear(d, cfg.n_heads * dh, bias=False)
        self.k_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=False)
        self.v_proj = nn.Linear(d, cfg.n_kv_heads * dh, bias=False)
        self.attn_out = nn.Linear(cfg.n_heads * dh, d, bias=False)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)   # gate: SiLU goes here
        self.up_proj = nn.Linear(d, cfg.mlp_hidden_size, bias=False)   # up: no activation
        self.ff_out = nn.Linear(cfg.mlp_hidden_size, d, bias=False)    # down projection

    def forward(self, x, cos, sin, attn_mask=None, kv=None, start=0, return_kv=False):
        """x (B, L, D) -> (B, L, D) [, (k, v) each (B, Hkv, Lk, Dh)]. With kv cached for Lk positions, x holds
        positions [start, start + L) only, whose fresh keys overwrite those rows of the cache in place."""
        B, L, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)      # (B, H, L, Dh)
        k = self.k_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, Hkv, L, Dh)
        v = self.v_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)   # (B, Hkv, L, Dh)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:  # in place, keys in sequence order (the padding mask lines up); after RoPE
            kv[0][:, :, start:start + L], kv[1][:, :, start:start + L] = k, v
            k, v = kv                                                                     # (B, Hkv, Lk, Dh)
        new_kv = (k, v)  # before the GQA repeat: a cache of Hkv heads, not H
        if self.n_kv_heads != self.n_heads:  # grouped-query attention: each kv head serves H/Hkv heads
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)  # (B, H, L, Dh)
        x = x + self.attn_out(y.transpose(1, 2).reshape(B, L, -1))
        h = self.ff_norm(x)
        x = x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))
        return (x, new_kv) if return_kv else x


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
        """(cos, sin), each (n, Dh) float32 for n >= length positions (max_sequence_length at least), built on the
        CPU as the reference does (CPU and CUDA sin/cos can differ in the last bit); rows are position-wise."""
        n, dh = max(length, self.config.max_sequence_length), self.config.head_dim
        key = (n, str(device))
        if key not in self._rope_cache:
            self._rope_cache = {k: v for k, v in self._rope_cache.items() if k[0] >= n}
            inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
            angles = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq).repeat(1, 2)     # (n, Dh)
            self._rope_cache[key] = (angles.cos().to(device), angles.sin().to(device))
        return self._rope_cache[key]

    accepts_cache_kwargs = True  # tells sample.py that forward takes the options below

    def forward(self, input_ids, attention_mask=None, *, logits_at=None, vocab_slice=None, float32_head=False,
                padded=None, return_kv=False, kv=None, start=0):
        """input_ids (B, L), attention_mask (B, L) 1 = real token -> logits (B, L, V); the defaults are the exact
        forward. logits_at: the head at those positions only. vocab_slice, float32_head: see head (a bf16 logit
        rounds by up to 0.06 at 32, swamping close policies' log-ratio). padded: whether attention_mask holds a 0
        (None looks: a host sync). return_kv: also each layer's (k, v). kv, start: input_ids are positions
        [start, start + l), the other keys from kv: an APPROXIMATION once kv is stale (Fast-dLLM)."""
        B, l = input_ids.shape
        Lk = start + l if kv is None else kv[0][0].shape[2]
        assert (kv is None and start == 0) or (kv is not None and len(kv) == len(self.blocks) and start + l <= Lk), \
            "start > 0 needs the kv list a return_kv=True call returned for this batch"
        cos, sin = self.rope(Lk, input_ids.device)
        cos, sin = cos[start:start + l], sin[start:start + l]  # absolute positions, left padding included
        mask = None  # an all-ones mask is no mask: the unmasked attention, bit for bit
        if attention_mask is not None and (not bool(attention_mask.all()) if padded is None else padded):
            # Key padding (LLaDA's code since Oct 2025): no query sees a pad key; pad queries see real keys.
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
        """Final norm and LM head on x (..., D): logits (..., V), or (..., hi - lo) from those rows of the
        weight for vocab_slice (lo, hi). float32: both in float32 (ln_f's weight applied without a cast back)."""
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
        """N(0, std) matrices, unit norm weights, residual projections scaled by 1/sqrt(2 n_layers) (GPT-2)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                residual = name.startswith("blocks.") and name.endswith(("attn_out.weight", "ff_out.weight"))
                scale = std / math.sqrt(2 * self.config.n_layers) if residual else std
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * scale)
        return self


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
