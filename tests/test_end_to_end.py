"""train.py end to end, in-process: the smoke run (SFT and RL, the written checkpoint, the sampling CLI on
it, a deterministic re-run from the cached SFT model), the benchmark text tasks on a tiny checkpoint, and the
full toy preset (~10 min), which checks the reward gain. All slow; the fast tests of train.py are in
tests/test_train.py.

    python -m pytest tests/test_end_to_end.py -q -m slow
"""
import json
import math
import re
from pathlib import Path

import pytest
import torch

import train
from infra import hf, toy
from infra.hf import load_tokenizer
from tools import sample as sample_cli

FIXTURES = Path(__file__).parent / "fixtures" / "data"


@pytest.fixture(scope="module")
def tiny_ckpt(smoke_sft_run):
    """A smoke-trained toy checkpoint (MMaDA-like: text tokens, image codes and the t2i markers)."""
    return smoke_sft_run / "final"


@pytest.mark.slow  # two SFT+RL runs in-process: the slowest test of the suite
def test_smoke_run(tmp_path, capsys):
    """A few SFT and RL steps of the whole pipeline: finite losses, one log line per step, a final
    checkpoint in the Hugging Face layout that reloads to identical logits, a summary with both tasks."""
    out = tmp_path / "run"
    summary = train.main(["--preset", "smoke", f"--out_dir={out}", "--threads=1"])
    lines = [json.loads(s) for s in (out / "log.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [0, 1]
    # The console counts steps as log.jsonl (and so the plots' x axis) does.
    printed = [int(m) for m in re.findall(r"^step (\d+)/2 ", capsys.readouterr().out, re.M)]
    assert printed == [l["step"] for l in lines]
    for l in lines:
        for task in ("text", "image"):
            assert math.isfinite(l[f"{task}/loss"]) and 0.0 <= l[f"{task}/reward"] <= 1.0
    for task in ("text", "image"):
        assert set(summary[task]) == {"before", "after", "gain_se"}
    assert json.loads((out / "summary.json").read_text())["seconds"]["rl"] > 0
    assert (out / "curves.png").is_file() and (out / "images.png").is_file()  # the plots extra: in dev

    model = hf.from_pretrained(out / "final")
    tok = load_tokenizer(out / "final", model.config)
    assert tok.get_vocab_size() == toy.build_tokenizer().get_vocab_size()
    # The sampling CLI reads the written checkpoint, for a text and an image prompt.
    # With no generation flags it decodes as the run was trained (generation.json: 12 tokens, toy prompt).
    assert json.loads((out / "final" / "generation.json").read_text())["gen_length"] == 12
    text = sample_cli.main(["--ckpt", str(out / "final"), "--prompt", "bob has 3 pens . how many pens does he have ?"])
    assert isinstance(text, str) and len(tok.encode(text, add_special_tokens=False).ids) <= 12
    codes = sample_cli.main(["--ckpt", str(out / "final"), "--prompt", "two red blocks", "--image", "--image_steps", "4"])
    assert len(codes) == 16 and all(0 <= c < toy.CODEBOOK_SIZE for c in codes)
    # Re-run the same RL config from the cached SFT model (into another out_dir: the finished run is never
    # overwritten): the SFT stage is skipped, and the result is deterministic, so the final weights give
    # the same logits as the first run's.
    again = train.main(["--preset", "smoke", f"--out_dir={tmp_path / 'again'}", f"--sft_dir={out / 'sft'}",
                        "--threads=1"])
    assert again["seconds"]["sft"] == summary["seconds"]["sft"]
    model2 = hf.from_pretrained(tmp_path / "again" / "final")
    x = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), model2(x))


@pytest.mark.slow
def test_toy_preset_reward_rises(tmp_path):
    """The full toy preset raises held-out mean reward on both tasks by at least +0.10, the bar the toy is
    built to clear with its default seed: seed 0 gains text +0.111 and image +0.220 on two CPUs of one type
    (docs/results.md; over seeds 0-4 text ranged +0.088 to +0.234, image +0.136 to +0.220), and other CPUs
    follow other trajectories of the same kind. A broken estimator or loss sign gives a gain near zero or
    below."""
    summary = train.main(["--preset", "toy", f"--out_dir={tmp_path}", "--threads=1"])
    for task in ("text", "image"):
        gain = summary[task]["after"] - summary[task]["before"]
        assert gain >= 0.10, f"{task}: {summary[task]}"
    # The pictures (the plots extra is in the dev extra) and the periodic checkpoints.
    from PIL import Image
    assert Image.open(tmp_path / "curves.png").size[0] >= 600 and Image.open(tmp_path / "images.png").size[0] >= 600
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] and (tmp_path / "times.jsonl").is_file()


@pytest.mark.slow  # five end-to-end runs
@pytest.mark.parametrize("task", ["gsm8k", "math", "countdown", "sudoku", "mbpp"])
def test_benchmark_text_task_runs(tiny_ckpt, tmp_path, task):
    """The benchmark path end to end on a tiny checkpoint: data file -> chat prompt -> rollouts ->
    rewards.REWARDS -> update -> held-out eval -> final checkpoint (rewards are ~0 for a toy model)."""
    path = FIXTURES / (f"{task}.csv" if task == "sudoku" else f"{task}.jsonl")
    out = tmp_path / task
    summary = train.main(["--preset", "smoke", f"--out_dir={out}", "--threads=1", f"--init_from={tiny_ckpt}",
                          f"--tasks={task}", f"--train_data={task}={path}", f"--eval_data={task}={path}",
                          "--rl_steps=1", "--eval_prompts=2", "--gen_length=16", "--block_length=16", "--steps=8"])
    line = json.loads((out / "log.jsonl").read_text())
    assert 0.0 <= line[f"{task}/reward"] <= 1.0 and math.isfinite(line[f"{task}/loss"])
    assert set(summary[task]) == {"before", "after", "gain_se"} and f"{task}_greedy" in summary
    assert (out / "final" / "tokenizer.json").is_file()
