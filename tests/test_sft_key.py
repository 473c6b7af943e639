"""Every setting the toy SFT stage reads keys its cache (infra/load.check_sft_cache: a cached model trained
with another value is refused, never reused), and no RL-only setting does (a cached model is reused).

The fields SFT reads are derived twice, independently of the key's own list: by reading train.sft,
infra/load.load_or_train_sft (the scratch model's shape and init seed) and tasks.make_batch / make_example
(the toy data and its encoding), written out below as SFT_READS; and by running one SFT step with a Config
that records every field read. The two must agree, and each field must change the key.

    python -m pytest tests/test_sft_key.py -q
"""
import dataclasses
import json

import pytest
import torch

import tasks
import train
from infra import budget, load, toy
from model import Transformer

# field -> a valid other value (the base is the smoke preset on both toy tasks)
SFT_READS = {
    "seed": 1,                    # the init, the SFT data and mask generators
    "d_model": 48, "n_layers": 3, "n_heads": 2, "mlp_hidden_size": 96,   # the scratch model's shape
    "sft_steps": 31, "sft_batch_size": 32, "sft_lr": 1e-3, "sft_warmup": 10,  # the optimiser and schedule
    "text_noise": 0.3, "image_noise": 0.3, "cond_dropout": 0.2, "image_loss_weight": 2.0,
    "tasks": "text",              # which toy tasks SFT trains (tasks.sft_tasks)
    "text_max_steps": 2,          # make_text_example
    "image_width": 3,             # make_image_example and the t2i layout
    "gen_length": 24,             # encode_text pads the answer with EOS to gen_length
    "image_text_len": 40,         # the t2i caption part's length (tasks._image_batch)
    "attend_padding": "on",       # attention over the left padding (tasks.attends_padding)
}
RL_ONLY = {
    "temperature": 0.5, "block_length": 6, "steps": 6, "kv_cache": "dual", "threshold": 0.9, "image_sampler": "maskgit",
    "image_steps": 6, "cfg_scale": 2.0, "reward_shaping": "official", "text_reward": "solution", "group_size": 6,
    "adv_std": "off", "estimator": "d1", "text_reversing": "random", "gamma_text": 0.5, "gamma_image": 0.7,
    "p_mask_prompt": 0.2, "clip_eps": 0.1, "beta": 0.0, "loss_norm": "sequence", "grad_clip": 0.5,
    "device_batch_size": 2, "rl_steps": 7, "prompts_per_step": 3, "lr": 1e-3, "weight_decay": 0.1,
    "eval_prompts": 5, "eval_samples": 2, "sample_every": 3, "checkpoint_every": 2, "keep_last": 1,
    "max_bad_steps": 1, "threads": 1, "retrain_sft": False,
    "mu": 3,
}
BASE = ["--preset=smoke", "--tasks=text,image"]


def config(tmp_path, **changes):
    cfg = train.parse_args([*BASE, f"--out_dir={tmp_path / 'run'}", f"--sft_dir={tmp_path / 'sft'}"])
    cfg = dataclasses.replace(cfg, **changes)
    train.cli.validate(cfg)
    return cfg


def saved_model(tmp_path, cfg):
    """An sft_dir holding the metadata SFT writes beside its model (what check_sft_cache compares)."""
    (tmp_path / "sft").mkdir(exist_ok=True)
    (tmp_path / "sft" / "sft_meta.json").write_text(json.dumps(load.sft_key(cfg)))


class Reading:
    """A Config that records the fields read from it."""

    def __init__(self, cfg):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._cfg, name)


def test_one_sft_step_reads_exactly_these_fields(tmp_path):
    cfg = Reading(dataclasses.replace(config(tmp_path), sft_steps=1, sft_batch_size=2))
    tok = toy.build_tokenizer()
    ids = tasks.token_ids(tok)
    model = Transformer(budget.scratch_config(cfg, **tasks.model_config_overrides(tok)))  # as load_or_train_sft
    model.init_weights(torch.Generator().manual_seed(0))
    train.sft(model, tok, ids, cfg, torch.device("cpu"))
    assert cfg.read == set(SFT_READS)


@pytest.mark.parametrize("field", sorted(SFT_READS))
def test_every_sft_setting_changes_the_key(tmp_path, field):
    base = config(tmp_path)
    if field == "tasks":  # a model of more tasks serves a run of fewer: only the other way is a change
        base = dataclasses.replace(base, tasks="text")
        changed = dataclasses.replace(base, tasks="text,image")
    else:
        changed = dataclasses.replace(base, **{field: SFT_READS[field]})
    assert getattr(changed, field) != getattr(base, field)
    saved_model(tmp_path, base)
    assert load.check_sft_cache(base) is True
    with pytest.raises(ValueError, match="holds an SFT model trained with other settings"):
        load.check_sft_cache(changed)


@pytest.mark.parametrize("field", sorted(RL_ONLY))
def test_rl_only_settings_reuse_the_cached_model(tmp_path, field):
    base = config(tmp_path)
    changed = dataclasses.replace(base, **{field: RL_ONLY[field]})
    assert getattr(changed, field) != getattr(base, field) or field == "retrain_sft"
    saved_model(tmp_path, base)
    assert load.check_sft_cache(changed) is True
