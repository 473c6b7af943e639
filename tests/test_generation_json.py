"""A checkpoint's generation.json (written by infra/load.save_model) carries every setting the held-out
evaluation decodes and scores with, so that evaluate.py and sample.py decode a checkpoint as it was trained:
a checkpoint trained with CFG (--cfg_scale) is decoded with it.

The settings the evaluation reads are recorded by running train.py's own held-out evaluation
(data.evaluate_all) with a Config that records every field read; of those, the evaluator's own choices
(the seed, how many prompts and samples, the batch size, which only changes speed) are left to evaluate.py's
flags, and every other one must come back from the checkpoint, at a non-default value.

    python -m pytest tests/test_generation_json.py -q
"""
import dataclasses
import json

import pytest
import torch

import evaluate
import sample
import tasks
import train
from infra import budget, data, load, toy
from tools import sample as sample_cli
from model import Transformer

from test_sft_key import Reading

EVALUATOR_CHOICES = {"seed", "eval_prompts", "eval_samples", "device_batch_size", "tasks"}
NON_DEFAULT = {"gen_length": 24, "block_length": 8, "steps": 6, "temperature": 0.7, "image_steps": 5,
               "image_sampler": "maskgit", "cfg_scale": 2.5, "image_width": 3, "image_text_len": 40,
               "text_max_steps": 2, "text_reward": "solution", "attend_padding": "on"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny random checkpoint saved as train.py saves its final/ for a run at NON_DEFAULT settings."""
    path = tmp_path_factory.mktemp("ckpt")
    tok = toy.build_tokenizer()
    cfg = dataclasses.replace(train.parse_args(["--preset=smoke"]), **NON_DEFAULT)
    train.cli.validate(cfg)
    model = Transformer(budget.scratch_config(cfg, **tasks.model_config_overrides(tok)))
    model.init_weights(torch.Generator().manual_seed(0))
    load.save_model(model, cfg, path, tok, torch.float32)
    return path, tok, cfg


def test_the_fields_evaluation_reads_are_known():
    """Run the held-out evaluation of both toy tasks with a recording Config: what it reads is exactly the
    evaluator's choices and NON_DEFAULT's keys (a new field read by the evaluation must be added here)."""
    tok = toy.build_tokenizer()
    ids = tasks.token_ids(tok)
    cfg = train.parse_args(["--preset=smoke", "--tasks=text,image", "--eval_prompts=2", "--eval_samples=1"])
    model = Transformer(budget.scratch_config(cfg, **tasks.model_config_overrides(tok)))
    model.init_weights(torch.Generator().manual_seed(0))
    reading = Reading(cfg)
    data.evaluate_all(model.eval(), tasks.Ctx(reading, tok, ids, torch.device("cpu"), {}))
    assert reading.read == EVALUATOR_CHOICES | set(NON_DEFAULT)
    assert all(getattr(cfg, k) != v for k, v in NON_DEFAULT.items())


@pytest.mark.parametrize("task", ["text", "image"])
def test_evaluate_py_takes_every_setting_from_the_checkpoint(trained, task):
    path, _, cfg = trained
    o = evaluate.parse_options(["--ckpt", str(path), "--task", task])
    assert {k: getattr(o, k) for k in NON_DEFAULT} == NON_DEFAULT
    assert json.loads((path / "generation.json").read_text())["cfg_scale"] == 2.5


def test_sample_py_decodes_an_image_with_the_checkpoint_cfg_scale(trained, monkeypatch):
    path, _, _ = trained
    calls = []

    def image(model, ids, **kw):
        calls.append(kw)
        out = ids.clone()
        out[:, kw["image_start"]:kw["image_start"] + kw["num_tokens"]] = kw["code_offset"] + 1
        return out
    monkeypatch.setattr(sample, "generate_image", image)
    sample_cli.main(["--ckpt", str(path), "--image", "--prompt", "two red blocks"])
    (kw,) = calls
    assert (kw["cfg_scale"], kw["steps"], kw["sampler"], kw["num_tokens"]) == (2.5, 5, "maskgit", 9)
