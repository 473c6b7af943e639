"""The LLaDA checkpoint format (config.json, sharded safetensors, tokenizer.json; a key is HF_PREFIX + our
state-dict key) and LoRA adapters (arXiv:2106.09685); a LoRA run's reference policy is AdaptersOff.

    model = add_lora(from_pretrained(path, device="cuda", dtype=torch.bfloat16), rank=128, alpha=64)
    save_adapters(model, "out/final")
    save_pretrained(merge_lora(model), "out/final")
"""
import json
import math
import os
import stat
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from model import ModelConfig, Transformer
from tasks import TokenIds

# The HF wrapper LLaDAModelLM holds `model`, which holds the ModuleDict `transformer`.
HF_PREFIX = "model.transformer."
INDEX_NAME = "model.safetensors.index.json"
# config.json values that would change the architecture: only the released LLaDA/MMaDA one is implemented.
_REQUIRED_VALUES = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu", "rope": True,
                    "alibi": False, "weight_tying": False, "include_bias": False, "attention_layer_norm": False,
                    "input_emb_norm": False, "scale_logits": False, "block_group_size": 1}
_ZERO_FIELDS = ("attention_dropout", "residual_dropout", "embedding_dropout")


def is_run_settings(saved) -> bool:
    """Whether a config.json's content is train.py's settings (a run's out_dir) rather than a model's."""
    return isinstance(saved, dict) and "rl_steps" in saved and "out_dir" in saved


def read_json(file, fix: str = "re-copy it from where it came from"):
    """The JSON object in `file`; a truncated or edited file is a ValueError naming it, its position and `fix`."""
    file = Path(file)
    try:
        value = json.loads(file.read_bytes())
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not UTF-8 text ({e.reason}); {fix}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); {fix}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} holds a JSON {type(value).__name__}, not an object; {fix}")
    return value


@contextmanager
def _safetensors_file(file: Path, device="cpu"):
    """safe_open(file), naming the file in the library's errors ('incomplete metadata', 'header too small')."""
    try:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{file} is not a complete safetensors file ({e}); re-download the checkpoint") from None


def read_config(path, flag: str = "the path") -> ModelConfig:
    """The ModelConfig of checkpoint directory `path` (its config.json), every error naming the file."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: {flag} must be a LLaDA/MMaDA checkpoint directory (config.json)")
    hf = read_json(file, "re-copy the checkpoint's config.json")
    if is_run_settings(hf):
        raise ValueError(f"{file} holds a training run's settings, not a model's: {path} is a run's out_dir; "
                         f"did you mean {Path(path) / 'final'}?")
    try:
        return config_from_hf(hf)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    except TypeError as e:  # a field of the wrong type (a string for n_layers, say)
        raise ValueError(f"{file}: a field has the wrong type ({e}); re-copy the checkpoint's config.json") from None


def config_from_hf(hf: dict) -> ModelConfig:
    """Build from a LLaDA/MMaDA config.json dict, refusing architectures we do not implement."""
    bad = {k: hf.get(k) for k, want in _REQUIRED_VALUES.items() if k in hf and hf[k] != want}
    bad.update({k: hf[k] for k in (*_ZERO_FIELDS, "include_qkv_bias") if hf.get(k)})
    if bad:
        want = {k: _REQUIRED_VALUES.get(k, 0.0 if k in _ZERO_FIELDS else False) for k in bad}
        raise ValueError(f"unsupported config values {bad}; this implementation covers the released "
                         f"LLaDA/MMaDA architecture, which needs {want}")
    # The reference's defaults for missing fields (dropout 0.1, tied weights) would silently build another network.
    need = ["d_model", "n_layers", "n_heads", "mask_token_id"]
    missing = [k for k in need if k not in hf]
    if missing and not any(k in hf for k in need[:3]):  # another architecture's names (n_layer, hidden_size...)
        kind = hf.get("model_type") or ", ".join(hf.get("architectures") or []) or "no model_type"
        raise ValueError(f"not a LLaDA/MMaDA checkpoint (model_type {kind!r}); pass a LLaDA/MMaDA checkpoint folder")
    if missing:
        raise ValueError(f"config.json lacks required fields {missing}")
    if small := {k: hf[k] for k in ("d_model", "n_layers", "n_heads") if not (isinstance(hf[k], int) and hf[k] >= 1)}:
        raise ValueError(f"config.json sizes {small} must be positive integers")
    n_kv = hf.get("n_kv_heads")
    n_kv = n_kv if n_kv is not None else 1 if hf.get("multi_query_attention") else hf["n_heads"]
    eos = hf.get("eos_token_id", hf["mask_token_id"] - 1)
    offset = hf.get("image_token_offset")
    if offset is None and hf.get("codebook_size") and hf.get("llm_vocab_size"):
        # MMaDA: codes start at len(text tokenizer), which its config does not store; 126349 is the released value.
        offset = hf.get("text_tokenizer_size", 126349)
    # The HF `vocab_size` may be smaller than the row count (MMaDA); it stays in `extra` for saving.
    known = {f.name for f in fields(ModelConfig)} | {"embedding_size", "mlp_ratio", "multi_query_attention"}
    return ModelConfig(
        d_model=hf["d_model"], n_layers=hf["n_layers"], n_heads=hf["n_heads"], n_kv_heads=n_kv,
        mlp_hidden_size=hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * hf["d_model"],
        vocab_size=hf.get("embedding_size") or hf.get("vocab_size"),
        max_sequence_length=hf.get("max_sequence_length", 4096),
        rope_theta=float(hf.get("rope_theta", 10000.0)), rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        mask_token_id=hf["mask_token_id"], eos_token_id=eos,
        pad_token_id=hf.get("pad_token_id", eos),  # LLaDA pads with the EOS id, given or defaulted
        bos_token_id=hf.get("bos_token_id"), image_token_offset=offset, codebook_size=hf.get("codebook_size"),
        extra={k: v for k, v in hf.items() if k not in known or k == "vocab_size"})


def config_to_hf(config: ModelConfig, dtype: torch.dtype) -> dict:
    """The config.json the public LLaDA code reads (every field it needs)."""
    hf = {
        **_REQUIRED_VALUES, **dict.fromkeys(_ZERO_FIELDS, 0.0), "include_qkv_bias": False, "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"], "attention_layer_norm_with_affine": True, "bias_for_layer_norm": False,
        "flash_attention": False, "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell",
        "init_std": 0.02, "layer_norm_with_affine": True, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "precision": None, "rope_full_precision": True, "use_cache": False,
    }
    hf.update(config.extra)  # fields read from a loaded checkpoint win over our defaults
    hf.update({k: v for k, v in asdict(config).items() if k not in ("vocab_size", "extra") and v is not None})
    hf.update(vocab_size=config.extra.get("vocab_size", config.vocab_size), embedding_size=config.vocab_size,
              torch_dtype=str(dtype).removeprefix("torch."))
    return dict(sorted(hf.items()))


def from_pretrained(path, device="cpu", dtype=torch.float32) -> Transformer:
    """Load a LLaDA/MMaDA checkpoint directory, each tensor read straight into `dtype` on `device` (no copy)."""
    config, tensors = read_checkpoint(path, device)
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict({key: t.to(dtype) for key, t in tensors}, strict=True, assign=True)
    return model.eval()


def save_pretrained(model: Transformer, path, max_shard_bytes: int = 4 << 30, state_dict: dict | None = None) -> None:
    """Write config.json, model-0000K-of-0000N.safetensors and their index; state_dict: FSDP2's gathered state."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state_dict = model.state_dict() if state_dict is None else state_dict
    tensors = {HF_PREFIX + k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    shards, size = [{}], 0
    for key in sorted(tensors):
        if shards[-1] and size + tensors[key].nbytes > max_shard_bytes:
            shards, size = shards + [{}], 0
        shards[-1][key] = tensors[key]
        size += tensors[key].nbytes
    dtype = next(iter(tensors.values())).dtype
    (path / "config.json").write_text(json.dumps(config_to_hf(model.config, dtype), indent=2) + "\n")
    mode, weight_map = stat.S_IMODE((path / "config.json").stat().st_mode), {}  # the umask's; safetensors' is 0600
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        os.chmod(path / fname, mode)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}  # sorted
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def read_checkpoint(path, device="cpu") -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """(config, tensors yielding (state-dict key, tensor on `device`) one at a time); keys checked up front."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist; pass one with config.json and *.safetensors")
    config = read_config(path)
    if (index := path / INDEX_NAME).is_file():  # tensor key -> shard file name, else every key in model.safetensors
        weight_map = read_json(index, "re-download or re-copy the checkpoint").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map' dict")
        if absent := sorted({f for f in weight_map.values() if not (path / f).is_file()}):
            raise FileNotFoundError(f"{index} names missing shard files {absent}; re-download the checkpoint")
    elif (path / "model.safetensors").is_file():
        with _safetensors_file(path / "model.safetensors") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise FileNotFoundError(f"no {INDEX_NAME} or model.safetensors in {path}; pass a LLaDA checkpoint folder")
    with torch.device("meta"):
        expected = {HF_PREFIX + k: tuple(v.shape) for k, v in Transformer(config).state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(weight_map)), sorted(set(weight_map) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit its config.json: {len(missing)} missing tensors "
                         f"{missing[:8]}, {len(unexpected)} unexpected tensors {unexpected[:8]}")

    def tensors():
        for fname in sorted(set(weight_map.values())):
            with _safetensors_file(path / fname, device) as f:
                present = set(f.keys())
                for key in (k for k, v in weight_map.items() if v == fname):
                    if key not in present:
                        raise ValueError(f"{path / fname} does not contain {key}, which the index assigns to it")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != expected[key]:
                        raise ValueError(f"tensor {key} has shape {shape} in {path / fname}, but the config "
                                         f"implies {expected[key]}; the config.json and weights disagree")
                    yield key[len(HF_PREFIX):], f.get_tensor(key)

    return config, tensors()


def load_tokenizer(path, model_config: ModelConfig | None = None):
    """tokenizer.json of a checkpoint directory (or the file), checked to fit model_config's embedding rows."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found; the checkpoint directory must contain tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception ("expected ident at line 1 ...")
        raise ValueError(f"{file} is not a valid tokenizer.json ({e}); re-copy the checkpoint's") from None
    if model_config is not None and (n := tok.get_vocab_size(with_added_tokens=True)) > model_config.vocab_size:
        raise ValueError(f"tokenizer {file} has {n} tokens but the model has only {model_config.vocab_size} "
                         "embedding rows; they come from different checkpoints")
    return tok


def token_ids(tok: Tokenizer, config: ModelConfig) -> TokenIds:
    """The special ids of a LLaDA/MMaDA checkpoint: its config's, and MMaDA's image markers by name (or None)."""
    return TokenIds(bos=config.bos_token_id, eos=config.eos_token_id, pad=config.pad_token_id,
                    mask=config.mask_token_id, vocab_size=config.vocab_size, t2i=tok.token_to_id("<|t2i|>"),
                    soi=tok.token_to_id("<|soi|>"), eoi=tok.token_to_id("<|eoi|>"), ipad=tok.token_to_id("[iPAD]"),
                    image_token_offset=config.image_token_offset, codebook_size=config.codebook_size)


# LoRA on the seven nn.Linear of a LLaDA block (the head, also named ff_out, is outside model.blocks), or on the
# four of the official run's Llama names that peft finds in one (docs/differences.md, "LoRA targets").
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out")
TARGET_SETS = {"all": LORA_TARGETS, "official": ("q_proj", "k_proj", "v_proj", "up_proj")}
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapters.safetensors", "adapters.json"


class LoRALinear(nn.Linear):
    """nn.Linear (base weight adopted) and lora_A (r, in), lora_B (out, r) in float32: bf16 drops AdamW's tiny steps."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 generator: torch.Generator | None = None):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")  # no copy
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.lora_dropout = rank, alpha, dropout
        self.scaling = alpha / rank  # LoRA §4.1: dividing by r keeps the update size stable across ranks
        self.disabled = False        # True: exactly the base layer (the reference policy)
        self.train(base.training)
        # A ~ U(+-1/sqrt(in)), peft's kaiming-uniform(a=sqrt(5)) that the official run used, drawn on the CPU (a
        # CPU and a CUDA run get the same A); B = 0, so the adapted model starts at the base (LoRA §4.1).
        a = torch.rand(rank, base.in_features, generator=generator, dtype=torch.float32) * 2 - 1  # (r, in)
        self.lora_A = nn.Parameter((a * (1.0 / math.sqrt(base.in_features))).to(base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=torch.float32, device=base.weight.device))

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)                                  # (..., out)
        if self.disabled:
            return y
        # Dropout from the global RNG on purpose: activation checkpointing replays only the default generators,
        # so a private one would draw another mask in the recompute. The adapters follow x's dtype.
        h = F.dropout(x, self.lora_dropout, self.training)
        h = F.linear(h, self.lora_A.to(x.dtype)) * self.scaling                  # (..., r)
        return y + F.linear(h, self.lora_B.to(x.dtype))                          # (..., out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}, dropout={self.lora_dropout}"


def _adapted(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0, targets=LORA_TARGETS,
             generator: torch.Generator | None = None) -> nn.Module:
    """Wrap each block's nn.Linear named in `targets` in LoRALinear and freeze the rest, before any FSDP wrap."""
    if bad := [f"{name} ({v!r}) must be {rule}" for name, v, ok, rule in (
        ("rank", rank, isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1, "an integer >= 1"),
        ("alpha", alpha, alpha > 0, "> 0 (the update scale is alpha / rank)"),
        ("dropout", dropout, 0.0 <= dropout < 1.0, "in [0, 1) (0.0 switches it off)")) if not ok]:
        raise ValueError(f"LoRA {'; '.join(bad)}; the official recipe uses rank=128, alpha=64, dropout=0.05")
    # A lone string is one name, not a list of characters; duplicates would wrap a layer twice.
    targets = tuple(dict.fromkeys((targets,) if isinstance(targets, str) else targets))
    if _adapted(model):
        raise ValueError("model already has LoRA adapters; merge_lora(model) first to stack a new set")
    available = sorted({n for b in model.blocks for n, m in b.named_children() if isinstance(m, nn.Linear)})
    if (unknown := [t for t in targets if t not in available]) or not targets:
        raise ValueError(f"LoRA targets {unknown or targets} match no nn.Linear in model.blocks; "
                         f"available names are {available}")
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    model.requires_grad_(False)
    for block in model.blocks:  # a fixed order: a seed always gives the same A to the same layer
        for name in targets:
            setattr(block, name, LoRALinear(getattr(block, name), rank, alpha, dropout, generator))
    return model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters to hand to the optimizer (after add_lora: only lora_A and lora_B)."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_stats(model: nn.Module) -> dict:
    """Counts for a startup log line: adapted modules, adapter parameters, all parameters."""
    mods = [m for _, m in _adapted(model)]
    return {"modules": len(mods), "lora_params": sum(m.lora_A.numel() + m.lora_B.numel() for m in mods),
            "total_params": sum(p.numel() for p in model.parameters())}


class AdaptersOff(nn.Module):
    """A LoRA run's reference policy: the policy with its adapters off (no second copy of the base model)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, *args, **kwargs):  # each adapter's own state (one may be off by hand) comes back after
        before = {m: m.disabled for _, m in _adapted(self.policy)}
        for m in before:
            m.disabled = True
        try:
            return self.policy(*args, **kwargs)
        finally:
            for m, state in before.items():
                m.disabled = state

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.policy, name)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, keyed like the model's state dict (`blocks.0.q_proj.lora_A`)."""
    return {k: v for k, v in model.state_dict().items() if k.endswith((".lora_A", ".lora_B"))}


def save_adapters(model: nn.Module, path) -> None:
    """Write `path/adapters.safetensors` (the lora tensors) and `path/adapters.json` (rank, alpha, ...)."""
    if not (mods := _adapted(model)):
        raise ValueError("model has no LoRA adapters to save; call add_lora(model, ...) first")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in lora_state_dict(model).items()},
              str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    m = mods[0][1]
    config = {"rank": m.rank, "alpha": m.alpha, "dropout": m.lora_dropout,
              "targets": sorted({n.rsplit(".", 1)[-1] for n, _ in mods})}
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    os.chmod(path / ADAPTER_WEIGHTS, stat.S_IMODE((path / ADAPTER_CONFIG).stat().st_mode))  # as save_pretrained


def load_adapters(model: nn.Module, path) -> nn.Module:
    """Load save_adapters' output into the model's adapters (added with the saved settings when it has none)."""
    path = Path(path)
    for f in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path / f} not found; pass the directory written by save_adapters")
    config = read_json(path / ADAPTER_CONFIG, "pass the directory written by save_adapters")
    if not _adapted(model):
        add_lora(model, config["rank"], config["alpha"], config["dropout"], config["targets"])
    saved, ours = load_file(str(path / ADAPTER_WEIGHTS)), lora_state_dict(model)
    missing, unexpected = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    if missing or unexpected:
        raise ValueError(f"adapters in {path} do not fit this model ({len(missing)} missing {missing[:6]}, "
                         f"{len(unexpected)} unexpected {unexpected[:6]}); pass adapters of its targets and n_layers")
    if bad := [f"{k}: saved {tuple(saved[k].shape)} vs model {tuple(v.shape)}" for k, v in ours.items()
               if saved[k].shape != v.shape]:
        raise ValueError(f"adapter shapes in {path} differ (another rank?): {bad[:4]}")
    if (alphas := {m.alpha for _, m in _adapted(model)}) != {config["alpha"]}:
        raise ValueError(f"saved alpha {config['alpha']} is not the model's {sorted(alphas)}; rebuild adapters with it")
    model.load_state_dict(saved, strict=False)  # copies: each parameter keeps its dtype (float32) and device
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold each adapter into a plain nn.Linear: W <- W + (alpha / r) B A in float32, rounded once to W's dtype."""
    for name, m in _adapted(model):
        parent, _, child = name.rpartition(".")
        delta = m.scaling * (m.lora_B.float() @ m.lora_A.float())                 # (out, in)
        m.weight.copy_((m.weight.float() + delta).to(m.weight.dtype))
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")  # adopts, no copy
        plain.weight, plain.bias = m.weight, m.bias
        plain.train(m.training)
        setattr(model.get_submodule(parent), child, plain)
    return model
