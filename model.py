"""A LLaDA-architecture masked diffusion transformer, with Hugging Face LLaDA checkpoint I/O.

LLaDA (arXiv:2502.09992) is a LLaMA-style Transformer with the causal mask removed and one reserved
mask token: every position sees the whole sequence and predicts the clean token behind each mask.
MMaDA (arXiv:2505.15809) is the same network with 8192 image-code rows appended to the vocabulary.

This file reproduces the public LLaDA modelling code's numerics (tests/test_model.py checks it against
logits that code wrote, tests/fixtures/tiny-llada):
RMSNorm and rotary embeddings computed in float32, separate q/k/v projections, SwiGLU with the SiLU on
`ff_proj`, untied output head. Module names mirror the checkpoint keys (`q_proj`, `attn_out`, `ff_proj`,
...), so a checkpoint key is our state-dict key behind the prefix `model.transformer.`, and a LoRA
target list written for LLaDA names the right layers.

    model = Transformer.from_pretrained("path/to/LLaDA-8B-Instruct", device="cuda", dtype=torch.bfloat16)
    logits = model(input_ids)                  # (B, L, V)
    model.save_pretrained("out/final")         # loads unchanged in the public LLaDA code

Shapes: B batch, L sequence length, D d_model, H heads, Hkv key/value heads, Dh head dim, V vocab rows.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Every checkpoint key is "model.transformer." + our state-dict key: the HF wrapper
# LLaDAModelLM holds `model`, which holds the ModuleDict `transformer`.
HF_PREFIX = "model.transformer."
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# config.json values the reference code accepts but that would change the architecture. We implement the
# released LLaDA/MMaDA architecture only, so anything else is refused up front.
_REQUIRED_VALUES = {
    "block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "rope": True,
    "alibi": False, "weight_tying": False, "include_bias": False, "attention_layer_norm": False,
    "input_emb_norm": False, "scale_logits": False, "block_group_size": 1,
}
_ZERO_FIELDS = ("attention_dropout", "residual_dropout", "embedding_dropout")


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

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a LLaDA/MMaDA config.json dict, refusing architectures we do not implement."""
        bad = {k: hf.get(k) for k, want in _REQUIRED_VALUES.items() if k in hf and hf[k] != want}
        bad.update({k: hf[k] for k in _ZERO_FIELDS if hf.get(k)})
        if hf.get("include_qkv_bias"):
            bad["include_qkv_bias"] = hf["include_qkv_bias"]
        if bad:
            want = {k: _REQUIRED_VALUES.get(k, 0.0 if k in _ZERO_FIELDS else False) for k in bad}
            raise ValueError(f"unsupported config values {bad}; this implementation covers the released "
                             f"LLaDA/MMaDA architecture, which needs {want}")
        # The reference fills missing fields with GPT-2-like defaults (dropout 0.1, tied weights), which
        # would silently build another network; require the architecture fields instead (§3).
        need = ["d_model", "n_layers", "n_heads", "mask_token_id"]
        missing = [k for k in need if k not in hf]
        if missing:
            raise ValueError(f"config.json lacks required fields {missing}")
        n_kv = hf.get("n_kv_heads")
        if n_kv is None:
            n_kv = 1 if hf.get("multi_query_attention") else hf["n_heads"]
        hidden = hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * hf["d_model"]
        rows = hf.get("embedding_size") or hf.get("vocab_size")
        offset = hf.get("image_token_offset")
        if offset is None and hf.get("codebook_size") and hf.get("llm_vocab_size"):
            # MMaDA: codes start at len(text tokenizer) = 126349, which the config does not store; the
            # released value is the only one we know of.
            offset = hf.get("text_tokenizer_size", 126349)
        # The HF `vocab_size` may be smaller than the row count (MMaDA); keep it in `extra` for saving.
        known = {f.name for f in fields(cls)} - {"vocab_size"} | {"embedding_size", "mlp_ratio",
                                                                  "multi_query_attention"}
        return cls(
            d_model=hf["d_model"], n_layers=hf["n_layers"], n_heads=hf["n_heads"], n_kv_heads=n_kv,
            mlp_hidden_size=hidden, vocab_size=rows,
            max_sequence_length=hf.get("max_sequence_length", 4096),
            rope_theta=float(hf.get("rope_theta", 10000.0)), rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            mask_token_id=hf["mask_token_id"], eos_token_id=hf.get("eos_token_id", hf["mask_token_id"] - 1),
            pad_token_id=hf.get("pad_token_id", hf.get("eos_token_id", 0)),
            bos_token_id=hf.get("bos_token_id"), image_token_offset=offset,
            codebook_size=hf.get("codebook_size"),
            extra={k: v for k, v in hf.items() if k not in known},
        )

    def to_hf(self, dtype: torch.dtype) -> dict:
        """The config.json the public LLaDA code reads (every field it needs)."""
        hf = {
            "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
            "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0, "attention_layer_norm": False,
            "attention_layer_norm_with_affine": True, "bias_for_layer_norm": False,
            "block_group_size": 1, "block_type": "llama", "embedding_dropout": 0.0,
            "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
            "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
            "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
            "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "precision": None,
            "residual_dropout": 0.0, "rope": True, "rope_full_precision": True, "scale_logits": False,
            "use_cache": False, "weight_tying": False,
        }
        hf.update(self.extra)  # fields read from a loaded checkpoint win over our defaults
        hf.update({
            "d_model": self.d_model, "n_layers": self.n_layers, "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads, "mlp_hidden_size": self.mlp_hidden_size,
            "vocab_size": self.extra.get("vocab_size", self.vocab_size),
            "embedding_size": self.vocab_size, "max_sequence_length": self.max_sequence_length,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "mask_token_id": self.mask_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "torch_dtype": str(dtype).removeprefix("torch."),
        })
        for k in ("bos_token_id", "image_token_offset", "codebook_size"):
            if getattr(self, k) is not None:
                hf[k] = getattr(self, k)
        return dict(sorted(hf.items()))


# -----------------------------------------------------------------------------------------------------
# layers


class RMSNorm(nn.Module):
    """RMSNorm as LLaDA computes it (§4.2): normalise in float32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Casting before the weight multiply (not after) is what makes bf16 outputs bit-identical.
        return self.weight * y.to(x.dtype)


def rope_table(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (length, Dh) in float32, built on the CPU as the reference does (§4.3): CPU and
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

    accepts_cache_kwargs = True  # tells sample.generate that forward takes the fast-sampling options

    def forward(self, input_ids, attention_mask=None, *, logits_at=None, return_kv=False, kv=None, start=0):
        """input_ids (B, L) int64; attention_mask (B, L) with 1 = real token, 0 = padding (optional).
        Returns logits (B, L, V) in the parameter dtype.

        Keyword-only options for fast sampling (sample.generate); the defaults are the exact forward:
            logits_at: a slice; compute the head only at those positions (same maths, though BLAS may round
                a smaller matrix differently in the last bit).
            return_kv: also return every layer's keys and values: a list of (k, v), each (B, Hkv, L, Dh).
            kv, start: the cached path, an APPROXIMATION once the cache is stale. input_ids (B, l) are the
                positions [start, start + l) of a sequence whose other keys and values come from kv (a
                return_kv list for the same batch, Lk positions, whose rows [start, start + l) this call
                overwrites in place with the fresh keys and values); attention_mask then covers all Lk. With a
                cache of the current tokens this equals the exact forward up to rounding; with an older
                one it does not, since bidirectional attention lets every key depend on every token.
                Fast-dLLM (arXiv:2505.22618) finds the drift small across the steps of one block."""
        B, l = input_ids.shape
        if kv is None and start:
            raise ValueError(f"start ({start}) > 0 runs a slice of a sequence and needs the keys and values of "
                             "the rest of it: pass kv, the list a return_kv=True call returned")
        Lk = start + l if kv is None else kv[0][0].shape[2]
        if kv is not None and (len(kv) != len(self.blocks) or start + l > Lk or kv[0][0].shape[0] != B):
            raise ValueError(f"kv ({len(kv)} layers of {tuple(kv[0][0].shape)}) cannot serve positions "
                             f"[{start}, {start + l}) of a batch of {B} in this {len(self.blocks)}-layer model; "
                             "build it with return_kv=True on the same batch")
        if kv is not None and attention_mask is not None and attention_mask.shape != (B, Lk):
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must cover every key, {(B, Lk)}")
        cos, sin = self.rope(Lk, input_ids.device)
        cos, sin = cos[start:start + l], sin[start:start + l]  # absolute positions, left padding included
        mask = None
        if attention_mask is not None:
            # Key-padding mask on a bidirectional attention (the Oct-2025 HF LLaDA behaviour, §4.6):
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
        logits = self.ff_out(self.ln_f(x))                                       # (B, l, V)
        return (logits, new_kv) if return_kv else logits

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

    # -------------------------------------------------------------------------------------------------
    # checkpoint I/O (Hugging Face LLaDA layout)

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32) -> "Transformer":
        """Load a LLaDA/MMaDA checkpoint directory: config.json plus model.safetensors or sharded
        model-*.safetensors with model.safetensors.index.json. The model is built on the meta device
        and each tensor is read straight into `dtype` on `device`, so an 8B bf16 load never holds a
        float32 copy or a second set of weights. (Under torchrun infra/run.py's load_sharded reads the
        same tensors, through read_checkpoint, into each rank's shard instead.)"""
        config, tensors = read_checkpoint(path, device)
        with torch.device("meta"):
            model = cls(config)
        state = {key: t.to(dtype) for key, t in tensors}
        model.load_state_dict(state, strict=True, assign=True)
        return model.eval()

    def save_pretrained(self, path, max_shard_bytes: int = 4 << 30, state_dict: dict | None = None) -> None:
        """Write config.json, model-0000K-of-0000N.safetensors shards and model.safetensors.index.json,
        the layout the public LLaDA code (and our from_pretrained) loads. state_dict: the tensors to
        write instead of self.state_dict() (e.g. the full state gathered from FSDP2 shards)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state_dict = self.state_dict() if state_dict is None else state_dict
        tensors = {HF_PREFIX + k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
        shards: list[dict] = [{}]
        size = 0
        for key in sorted(tensors):
            nbytes = tensors[key].numel() * tensors[key].element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = tensors[key]
            size += nbytes
        n = len(shards)
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            for key, t in shard.items():
                weight_map[key] = fname
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        dtype = next(iter(tensors.values())).dtype
        (path / CONFIG_NAME).write_text(json.dumps(self.config.to_hf(dtype), indent=2) + "\n")


def read_checkpoint(path, device="cpu") -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """(config, tensors) of a LLaDA/MMaDA checkpoint directory. tensors yields (state-dict key, tensor in
    its stored dtype on `device`) one tensor at a time, so a caller can keep what it needs of each (the
    whole tensor, or one rank's shard) before the next is read. The key set is checked against the
    config's architecture up front, each shape as its tensor is read."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist; pass the folder that "
                                "holds config.json and the *.safetensors files")
    if not (path / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{path / CONFIG_NAME} not found: a LLaDA checkpoint needs its config.json")
    config = ModelConfig.from_hf(json.loads((path / CONFIG_NAME).read_text()))
    weight_map = _weight_map(path)

    with torch.device("meta"):
        expected = {HF_PREFIX + k: tuple(v.shape) for k, v in Transformer(config).state_dict().items()}
    missing = sorted(set(expected) - set(weight_map))
    unexpected = sorted(set(weight_map) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the LLaDA architecture of its config: "
                         f"{len(missing)} missing tensors {missing[:8]}, {len(unexpected)} unexpected "
                         f"tensors {unexpected[:8]}")

    def tensors():
        by_file: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            by_file.setdefault(fname, []).append(key)
        for fname, keys in sorted(by_file.items()):
            with safe_open(str(path / fname), framework="pt", device=str(device)) as f:
                present = set(f.keys())
                for key in keys:
                    if key not in present:
                        raise ValueError(f"{fname} does not contain {key}, which the index assigns to it")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != expected[key]:
                        raise ValueError(f"tensor {key} has shape {shape} in {fname}, but the config "
                                         f"implies {expected[key]}; the config.json and weights disagree")
                    yield key[len(HF_PREFIX):], f.get_tensor(key)

    return config, tensors()


def _weight_map(path: Path) -> dict[str, str]:
    """Tensor key -> shard file name, from the index when there is one, else from model.safetensors."""
    from safetensors import safe_open

    if (path / INDEX_NAME).is_file():
        weight_map = json.loads((path / INDEX_NAME).read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{path / INDEX_NAME} has no 'weight_map' dict")
        absent = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if absent:
            raise FileNotFoundError(f"{path / INDEX_NAME} names shard files that are missing: {absent}; "
                                    "re-download or re-copy the checkpoint")
        return weight_map
    if (path / SINGLE_NAME).is_file():
        with safe_open(str(path / SINGLE_NAME), framework="pt") as f:
            return {k: SINGLE_NAME for k in f.keys()}
    raise FileNotFoundError(f"no {INDEX_NAME} or {SINGLE_NAME} in {path}; a LLaDA checkpoint stores its "
                            "weights as safetensors")


# -----------------------------------------------------------------------------------------------------
# tokenizer and chat template


def load_tokenizer(path, model_config: ModelConfig | None = None):
    """tokenizer.json from a checkpoint directory (or the file itself), via the `tokenizers` library.
    With a model config, checks that every token id the tokenizer can emit has an embedding row."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found; the checkpoint directory must contain tokenizer.json")
    tok = Tokenizer.from_file(str(file))
    if model_config is not None and tok.get_vocab_size(with_added_tokens=True) > model_config.vocab_size:
        raise ValueError(f"tokenizer {file} has {tok.get_vocab_size(with_added_tokens=True)} tokens but the "
                         f"model has only {model_config.vocab_size} embedding rows; they come from different "
                         "checkpoints")
    return tok


def chat_prompt(messages: list[dict], bos: str = "<|startoftext|>") -> str:
    """LLaDA-Instruct chat template as a string. Encode the result with
    add_special_tokens=False; the special-token strings inside map to their ids.

    chat_prompt([{"role": "user", "content": "Q"}]) ==
    "<|startoftext|><|start_header_id|>user<|end_header_id|>\\n\\nQ<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\\n\\n"
    """
    turns = [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
             for m in messages]
    # The template has no add_generation_prompt switch: it always opens the assistant turn.
    return bos + "".join(turns) + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
