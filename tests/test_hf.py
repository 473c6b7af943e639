"""infra/hf.py at every architecture setting: save_pretrained then from_pretrained, checked against values and
shapes written out by hand (config.json fields, tensor shapes, shard layout), and config.json translation of
the fields a released LLaDA/MMaDA config may omit.

    python -m pytest tests/test_hf.py -q
"""
import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models

from model import ModelConfig, Transformer
from infra import hf

BASE = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=40, vocab_size=50,
            max_sequence_length=16, mask_token_id=49, eos_token_id=1, pad_token_id=1)
# Each architecture setting at a non-default value, with the k/v projection rows it implies (Hkv * Dh).
ARCHS = {
    "gqa2": (dict(n_kv_heads=2), 16),
    "mqa": (dict(n_kv_heads=1), 8),
    "gqa8x2": (dict(n_heads=8, n_kv_heads=2), 8),
    "rope_eps_len": (dict(rope_theta=1234.5, rms_norm_eps=1e-3, max_sequence_length=77), 32),
    "vocab_bos": (dict(vocab_size=71, mask_token_id=3, eos_token_id=70, pad_token_id=69, bos_token_id=0), 32),
    "mmada": (dict(vocab_size=90, mask_token_id=60, image_token_offset=62, codebook_size=24, n_kv_heads=2,
                   extra={"vocab_size": 61, "llm_vocab_size": 61, "codebook_size": 24}), 16),
}


def build(**kw) -> Transformer:
    return Transformer(ModelConfig(**{**BASE, **kw})).init_weights(torch.Generator().manual_seed(0), std=0.3).eval()


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_round_trip_at_every_architecture_setting(tmp_path, name):
    kw, kv_rows = ARCHS[name]
    model = build(**kw)
    hf.save_pretrained(model, tmp_path, max_shard_bytes=10_000)
    written = json.loads((tmp_path / "config.json").read_text())
    expect = {**BASE, **{k: v for k, v in kw.items() if k != "extra"}}
    embedding_rows = expect.pop("vocab_size")
    for k, v in expect.items():
        assert written[k] == v, k
    assert written["embedding_size"] == embedding_rows
    # MMaDA: the HF vocab_size is the text vocabulary (kept in extra), the embedding has every row.
    assert written["vocab_size"] == kw.get("extra", {}).get("vocab_size", embedding_rows)
    shapes = {}
    for f in set(json.loads((tmp_path / hf.INDEX_NAME).read_text())["weight_map"].values()):
        with safe_open(str(tmp_path / f), framework="pt") as st:
            shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
    d = expect["d_model"]
    assert shapes[hf.HF_PREFIX + "blocks.1.k_proj.weight"] == (kv_rows, d)
    assert shapes[hf.HF_PREFIX + "blocks.1.v_proj.weight"] == (kv_rows, d)
    assert shapes[hf.HF_PREFIX + "blocks.1.q_proj.weight"] == (d, d)
    assert shapes[hf.HF_PREFIX + "wte.weight"] == (embedding_rows, d)
    assert shapes[hf.HF_PREFIX + "ff_out.weight"] == (embedding_rows, d)
    assert shapes[hf.HF_PREFIX + "blocks.0.ff_proj.weight"] == (expect["mlp_hidden_size"], d)

    loaded = hf.from_pretrained(tmp_path)
    for k, v in expect.items():
        assert getattr(loaded.config, k) == v, k
    assert loaded.config.vocab_size == embedding_rows
    x = torch.randint(0, embedding_rows, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    hf.save_pretrained(loaded, tmp_path / "again")  # and once more: nothing drifts through a second save
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == written


def test_bf16_save_records_dtype_and_shards_one_tensor_each(tmp_path):
    """max_shard_bytes smaller than any tensor: one shard per tensor; total_size is the bytes of every
    tensor (2 per bf16 number); torch_dtype says bfloat16; the bf16 weights come back bit for bit."""
    model = build(n_kv_heads=2).to(torch.bfloat16)
    hf.save_pretrained(model, tmp_path, max_shard_bytes=1)
    index = json.loads((tmp_path / hf.INDEX_NAME).read_text())
    n = len(model.state_dict())
    assert len(set(index["weight_map"].values())) == n
    assert sorted(set(index["weight_map"].values()))[-1] == f"model-{n:05d}-of-{n:05d}.safetensors"
    assert index["metadata"]["total_size"] == 2 * sum(t.numel() for t in model.state_dict().values())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = hf.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_save_pretrained_writes_the_given_state_dict(tmp_path):
    """state_dict= (the FSDP2 gather): those tensors are written, not the module's own."""
    model, other = build(), build(n_kv_heads=4)
    with torch.no_grad():
        other.ln_f.weight.fill_(3.0)
    hf.save_pretrained(model, tmp_path, state_dict=other.state_dict())
    assert (hf.from_pretrained(tmp_path).ln_f.weight == 3.0).all()


def test_shards_take_the_mode_of_config_json(tmp_path):
    """safetensors creates 0600 files; the shards get config.json's mode, i.e. 0666 under the umask."""
    old = os.umask(0o027)
    try:
        hf.save_pretrained(build(), tmp_path, max_shard_bytes=10_000)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob("*.safetensors")}
    assert len(modes) > 1 and set(modes.values()) == {0o640}, modes


# -----------------------------------------------------------------------------------------------------
# config.json fields a released checkpoint may omit


LLADA_8B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464,
            "embedding_size": 126464, "mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081,
            "rope_theta": 500000.0, "block_type": "llama", "max_sequence_length": 4096}


@pytest.mark.parametrize("edit, field, want", [
    ({}, "n_kv_heads", 32),                                         # absent: every head has its own k/v
    ({"n_kv_heads": 8}, "n_kv_heads", 8),
    ({"multi_query_attention": True}, "n_kv_heads", 1),
    ({"mlp_hidden_size": None, "mlp_ratio": 3}, "mlp_hidden_size", 3 * 4096),
    ({"mlp_hidden_size": None}, "mlp_hidden_size", 4 * 4096),      # the reference's mlp_ratio default 4
    ({"embedding_size": None}, "vocab_size", 126464),              # rows from vocab_size
    ({"embedding_size": 126500}, "vocab_size", 126500),
    ({"rope_theta": None}, "rope_theta", 10000.0),                 # the reference's default
    ({"eos_token_id": None, "pad_token_id": None}, "eos_token_id", 126335),  # mask - 1
    ({"pad_token_id": None}, "pad_token_id", 126081),              # pad defaults to EOS
    ({"eos_token_id": None, "pad_token_id": None}, "pad_token_id", 126335),  # ... also to a defaulted EOS
    ({"max_sequence_length": None}, "max_sequence_length", 4096),
    ({"rms_norm_eps": 1e-6}, "rms_norm_eps", 1e-6),
    ({"bos_token_id": 126080}, "bos_token_id", 126080),
])
def test_config_from_hf_fields(edit, field, want):
    hf_cfg = {k: v for k, v in {**LLADA_8B, **edit}.items() if v is not None}
    assert getattr(hf.config_from_hf(hf_cfg), field) == want


def test_mmada_image_offset():
    """MMaDA's config stores llm_vocab_size and codebook_size but not where codes start: len(text tokenizer)
    = 126349 in the release, or text_tokenizer_size when given; an explicit image_token_offset wins."""
    mmada = {**LLADA_8B, "vocab_size": 134656, "embedding_size": None, "llm_vocab_size": 126464,
             "codebook_size": 8192}
    mmada = {k: v for k, v in mmada.items() if v is not None}
    c = hf.config_from_hf(mmada)
    assert (c.image_token_offset, c.codebook_size, c.vocab_size) == (126349, 8192, 134656)
    assert hf.config_from_hf({**mmada, "text_tokenizer_size": 126400}).image_token_offset == 126400
    assert hf.config_from_hf({**mmada, "image_token_offset": 126000}).image_token_offset == 126000
    assert hf.config_from_hf(LLADA_8B).image_token_offset is None
    written = hf.config_to_hf(c, torch.bfloat16)
    assert (written["vocab_size"], written["embedding_size"], written["image_token_offset"]) == (134656, 134656, 126349)
    assert written["llm_vocab_size"] == 126464  # fields we do not interpret go back unchanged


@pytest.mark.parametrize("edit, match", [
    ({"d_model": None}, r"lacks required fields \['d_model'\]"),
    ({"n_layers": 0}, r"sizes \{'n_layers': 0\} must be positive integers"),
    ({"n_heads": "32"}, "must be positive integers"),
    ({"input_emb_norm": True}, "unsupported config values.*input_emb_norm"),
    ({"attention_dropout": 0.1}, "unsupported config values.*attention_dropout"),
])
def test_config_from_hf_refuses(edit, match):
    hf_cfg = {k: v for k, v in {**LLADA_8B, **edit}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf(hf_cfg)


@pytest.fixture
def ckpt(tmp_path):
    hf.save_pretrained(build(n_kv_heads=2), tmp_path / "ck", max_shard_bytes=10_000)
    return tmp_path / "ck"


@pytest.mark.parametrize("content, match", [
    (b"\xff\xfe{", "is not UTF-8 text"),
    (b'{"d_model": 32,', r"is not valid JSON \(.* at line 1 column"),
    (b"[1, 2]", "holds a JSON list, not an object"),
    (None, "a field has the wrong type"),
])
def test_damaged_config_names_the_file(ckpt, content, match):
    file = ckpt / "config.json"
    if content is None:  # a type the config cannot take: a list for an id
        cfg = json.loads(file.read_text())
        cfg["mask_token_id"] = [49]
        content = json.dumps(cfg).encode()
    file.write_bytes(content)
    with pytest.raises(ValueError, match=match) as e:
        hf.from_pretrained(ckpt)
    assert str(file) in str(e.value)


def test_truncated_shard_names_the_file(ckpt):
    shard = sorted(ckpt.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(ValueError, match=f"{shard}.* is not a complete safetensors file"):
        hf.from_pretrained(ckpt)


def test_index_without_weight_map(ckpt):
    (ckpt / hf.INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match="has no 'weight_map' dict"):
        hf.from_pretrained(ckpt)


def test_read_checkpoint_streams_stored_dtype(ckpt):
    config, tensors = hf.read_checkpoint(ckpt)
    assert config.n_kv_heads == 2
    got = dict(tensors)
    assert set(got) == set(build(n_kv_heads=2).state_dict()) and all(t.dtype == torch.float32 for t in got.values())


def test_token_ids_of_a_released_checkpoint(tmp_path):
    """The special ids come from config.json, MMaDA's image markers from the tokenizer by name (None when absent)."""
    vocab = {w: i for i, w in enumerate(["a", "b", "<|t2i|>", "<|soi|>", "<|eoi|>", "[iPAD]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    cfg = ModelConfig(**{**BASE, "vocab_size": 90, "mask_token_id": 60, "bos_token_id": 7, "image_token_offset": 62,
                         "codebook_size": 24})
    ids = hf.token_ids(tok, cfg)
    assert (ids.bos, ids.eos, ids.pad, ids.mask, ids.vocab_size) == (7, 1, 1, 60, 90)
    assert (ids.t2i, ids.soi, ids.eoi, ids.ipad, ids.image_token_offset, ids.codebook_size) == (2, 3, 4, 5, 62, 24)
    text_only = hf.token_ids(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")), ModelConfig(**BASE))
    assert (text_only.t2i, text_only.soi, text_only.image_token_offset) == (None, None, None)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        hf.load_tokenizer(tmp_path)
