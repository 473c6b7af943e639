"""Checkpoint I/O in the Hugging Face LLaDA layout: config.json translation, sharded safetensors, tokenizer.

A checkpoint key is "model.transformer." + our state-dict key (model.py names its modules after the
checkpoint keys), so a folder written by save_pretrained loads unchanged in the public LLaDA code, and a
released LLaDA-8B / MMaDA-8B folder loads here. tests/test_model.py checks the logits against a checkpoint
the public code wrote (tests/fixtures/tiny-llada).

    model = from_pretrained("path/to/LLaDA-8B-Instruct", device="cuda", dtype=torch.bfloat16)
    save_pretrained(model, "out/final")
"""
from __future__ import annotations

import json
import os
import stat
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from model import ModelConfig, Transformer
from tasks import TokenIds

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
# reading files a user may have damaged: every error names the file


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
    """safe_open(file), with the library's errors (an empty, truncated or random file says only
    'incomplete metadata' or 'header too small') naming the file."""
    try:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{file} is not a complete safetensors file ({e}); it was cut short or damaged: "
                         "re-download or re-copy the checkpoint") from None


def read_config(path) -> ModelConfig:
    """The ModelConfig of checkpoint directory `path` (its config.json), every error naming the file."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a LLaDA/MMaDA checkpoint directory holds config.json")
    try:
        hf = read_json(file, "re-copy the checkpoint's config.json")
        if "rl_steps" in hf and "out_dir" in hf:  # train.py's settings: a run's out_dir, whose model is final/
            raise ValueError(f"{file} holds a training run's settings, not a model's: {path} is a run's out_dir; "
                             f"did you mean {Path(path) / 'final'}?")
        return config_from_hf(hf)
    except ValueError as e:
        raise ValueError(str(e) if str(file) in str(e) else f"{file}: {e}") from None
    except TypeError as e:  # a field of the wrong type (a string for n_layers, say)
        raise ValueError(f"{file}: a field has the wrong type ({e}); re-copy the checkpoint's config.json") from None


# -----------------------------------------------------------------------------------------------------
# config.json


def config_from_hf(hf: dict) -> ModelConfig:
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
    # would silently build another network; require the architecture fields instead.
    need = ["d_model", "n_layers", "n_heads", "mask_token_id"]
    missing = [k for k in need if k not in hf]
    if missing and not any(k in hf for k in need[:3]):  # another architecture's names (n_layer, hidden_size...)
        kind = hf.get("model_type") or ", ".join(hf.get("architectures") or []) or "no model_type"
        raise ValueError(f"not a LLaDA/MMaDA checkpoint (model_type {kind!r}): this implementation loads the "
                         "LLaDA and MMaDA architectures only; pass a LLaDA/MMaDA checkpoint directory")
    if missing:
        raise ValueError(f"config.json lacks required fields {missing}")
    small = {k: hf[k] for k in ("d_model", "n_layers", "n_heads") if not (isinstance(hf[k], int) and hf[k] >= 1)}
    if small:
        raise ValueError(f"config.json sizes {small} must be positive integers")
    n_kv = hf.get("n_kv_heads")
    if n_kv is None:
        n_kv = 1 if hf.get("multi_query_attention") else hf["n_heads"]
    hidden = hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * hf["d_model"]
    eos = hf.get("eos_token_id", hf["mask_token_id"] - 1)
    rows = hf.get("embedding_size") or hf.get("vocab_size")
    offset = hf.get("image_token_offset")
    if offset is None and hf.get("codebook_size") and hf.get("llm_vocab_size"):
        # MMaDA: codes start at len(text tokenizer) = 126349, which the config does not store; the
        # released value is the only one we know of.
        offset = hf.get("text_tokenizer_size", 126349)
    # The HF `vocab_size` may be smaller than the row count (MMaDA); keep it in `extra` for saving.
    known = {f.name for f in fields(ModelConfig)} - {"vocab_size"} | {"embedding_size", "mlp_ratio",
                                                              "multi_query_attention"}
    return ModelConfig(
        d_model=hf["d_model"], n_layers=hf["n_layers"], n_heads=hf["n_heads"], n_kv_heads=n_kv,
        mlp_hidden_size=hidden, vocab_size=rows,
        max_sequence_length=hf.get("max_sequence_length", 4096),
        rope_theta=float(hf.get("rope_theta", 10000.0)), rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        mask_token_id=hf["mask_token_id"], eos_token_id=eos,
        pad_token_id=hf.get("pad_token_id", eos),  # LLaDA pads with the EOS id, given or defaulted
        bos_token_id=hf.get("bos_token_id"), image_token_offset=offset,
        codebook_size=hf.get("codebook_size"),
        extra={k: v for k, v in hf.items() if k not in known},
    )


def config_to_hf(config: ModelConfig, dtype: torch.dtype) -> dict:
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
    hf.update(config.extra)  # fields read from a loaded checkpoint win over our defaults
    hf.update({
        "d_model": config.d_model, "n_layers": config.n_layers, "n_heads": config.n_heads,
        "n_kv_heads": config.n_kv_heads, "mlp_hidden_size": config.mlp_hidden_size,
        "vocab_size": config.extra.get("vocab_size", config.vocab_size),
        "embedding_size": config.vocab_size, "max_sequence_length": config.max_sequence_length,
        "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "mask_token_id": config.mask_token_id, "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id, "torch_dtype": str(dtype).removeprefix("torch."),
    })
    for k in ("bos_token_id", "image_token_offset", "codebook_size"):
        if getattr(config, k) is not None:
            hf[k] = getattr(config, k)
    return dict(sorted(hf.items()))


# -----------------------------------------------------------------------------------------------------
# weights


def from_pretrained(path, device="cpu", dtype=torch.float32) -> Transformer:
    """Load a LLaDA/MMaDA checkpoint directory: config.json plus model.safetensors or sharded
    model-*.safetensors with model.safetensors.index.json. The model is built on the meta device
    and each tensor is read straight into `dtype` on `device`, so an 8B bf16 load never holds a
    float32 copy or a second set of weights. (Under torchrun infra/load.py's load_sharded reads the
    same tensors, through read_checkpoint, into each rank's shard instead.)"""
    config, tensors = read_checkpoint(path, device)
    with torch.device("meta"):
        model = Transformer(config)
    state = {key: t.to(dtype) for key, t in tensors}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()

def save_pretrained(model: Transformer, path, max_shard_bytes: int = 4 << 30, state_dict: dict | None = None) -> None:
    """Write config.json, model-0000K-of-0000N.safetensors shards and model.safetensors.index.json,
    the layout the public LLaDA code (and our from_pretrained) loads. state_dict: the tensors to
    write instead of model.state_dict() (e.g. the full state gathered from FSDP2 shards)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state_dict = model.state_dict() if state_dict is None else state_dict
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
    (path / CONFIG_NAME).write_text(json.dumps(config_to_hf(model.config, dtype), indent=2) + "\n")
    for i in range(n):
        same_mode(path / f"model-{i + 1:05d}-of-{n:05d}.safetensors", path / CONFIG_NAME)


def same_mode(file: Path, like: Path) -> None:
    """Give `file` the permissions of `like`, a file written beside it with open() (so under the umask):
    safetensors creates its files 0600, which would leave the weights of a shared checkpoint unreadable
    to the group while its config.json and tokenizer.json are readable."""
    os.chmod(file, stat.S_IMODE(os.stat(like).st_mode))


def read_checkpoint(path, device="cpu") -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """(config, tensors) of a LLaDA/MMaDA checkpoint directory. tensors yields (state-dict key, tensor in
    its stored dtype on `device`) one tensor at a time, so a caller can keep what it needs of each (the
    whole tensor, or one rank's shard) before the next is read. The key set is checked against the
    config's architecture up front, each shape as its tensor is read."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist; pass the folder that "
                                "holds config.json and the *.safetensors files")
    config = read_config(path)
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
            with _safetensors_file(path / fname, device) as f:
                present = set(f.keys())
                for key in keys:
                    if key not in present:
                        raise ValueError(f"{path / fname} does not contain {key}, which the index assigns to it")
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != expected[key]:
                        raise ValueError(f"tensor {key} has shape {shape} in {path / fname}, but the config "
                                         f"implies {expected[key]}; the config.json and weights disagree")
                    yield key[len(HF_PREFIX):], f.get_tensor(key)

    return config, tensors()


def _weight_map(path: Path) -> dict[str, str]:
    """Tensor key -> shard file name, from the index when there is one, else from model.safetensors."""
    if (path / INDEX_NAME).is_file():
        weight_map = read_json(path / INDEX_NAME, "re-download or re-copy the checkpoint").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{path / INDEX_NAME} has no 'weight_map' dict")
        absent = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if absent:
            raise FileNotFoundError(f"{path / INDEX_NAME} names shard files that are missing: {absent}; "
                                    "re-download or re-copy the checkpoint")
        return weight_map
    if (path / SINGLE_NAME).is_file():
        with _safetensors_file(path / SINGLE_NAME) as f:
            return {k: SINGLE_NAME for k in f.keys()}
    raise FileNotFoundError(f"no {INDEX_NAME} or {SINGLE_NAME} in {path}; a LLaDA checkpoint stores its "
                            "weights as safetensors")


def load_tokenizer(path, model_config: ModelConfig | None = None):
    """tokenizer.json from a checkpoint directory (or the file itself), via the `tokenizers` library.
    With a model config, checks that every token id the tokenizer can emit has an embedding row."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found; the checkpoint directory must contain tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises a bare Exception ("expected ident at line 1 ...")
        raise ValueError(f"{file} is not a valid tokenizer.json ({e}); re-copy it from the checkpoint's "
                         "source") from None
    if model_config is not None and tok.get_vocab_size(with_added_tokens=True) > model_config.vocab_size:
        raise ValueError(f"tokenizer {file} has {tok.get_vocab_size(with_added_tokens=True)} tokens but the "
                         f"model has only {model_config.vocab_size} embedding rows; they come from different "
                         "checkpoints")
    return tok


def token_ids(tok: Tokenizer, config: ModelConfig) -> TokenIds:
    """The special ids of a released LLaDA/MMaDA checkpoint: from its config.json, and MMaDA's image markers
    from its tokenizer by name (None for a text-only LLaDA, which has none)."""
    return TokenIds(bos=config.bos_token_id, eos=config.eos_token_id, pad=config.pad_token_id,
                    mask=config.mask_token_id, vocab_size=config.vocab_size, t2i=tok.token_to_id("<|t2i|>"),
                    soi=tok.token_to_id("<|soi|>"), eoi=tok.token_to_id("<|eoi|>"), ipad=tok.token_to_id("[iPAD]"),
                    image_token_offset=config.image_token_offset, codebook_size=config.codebook_size)
