"""Every bad input a new user tried gets one line naming the value, the file and the fix, exit status 2
and no traceback, in every entry point; damaged files are named; --resume skips a damaged checkpoint;
the prompt's fate is reported; logs stay readable.

    OMP_NUM_THREADS=1 python -m pytest tests/test_errors.py -q
"""
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluate
import train
from infra import checkpoint, cli, hf, load, outdir, plots
from tools import sample as sample_cli
from model import ModelConfig, Transformer
from conftest import run_main

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "data"
TINY = ["--preset=smoke", "--threads=1", "--sample_every=0", "--sft_steps=2", "--rl_steps=0", "--eval_prompts=1"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A finished toy run: out_dir with sft/ and final/ (text and image tokens, max_sequence_length 4096)."""
    out = tmp_path_factory.mktemp("toy")
    train.main([*TINY, f"--out_dir={out}"])
    return out


def one_line_error(capsys, code) -> str:
    """The stderr of a user error: exit status 2, a single line starting with "error: "."""
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def exit_code(fn) -> int:
    """Run fn inside cli.user_errors, as every entry point's __main__ does; its exit status."""
    with pytest.raises(SystemExit) as e:
        with cli.user_errors():
            fn()
    return e.value.code


# -----------------------------------------------------------------------------------------------------
# settings


@pytest.mark.parametrize("argv,match", [
    (["--block_length=0"], r"block_length \(0\) must be >= 1"),
    (["--gen_length=0"], r"gen_length \(0\) must be >= 1"),
    (["--steps=0"], r"steps \(0\) must be >= 1"),
    (["--n_layers=0"], r"n_layers \(0\) must be >= 1: a model needs at least one"),
    (["--d_model=30", "--n_heads=4"], r"d_model \(30\) must be n_heads \(4\) times an even head size"),
    (["--sft_step=1"], r"unknown argument\(s\) \['--sft_step=1'\].*did you mean --sft_steps"),
    (["--lr", "--seed=1"], r"argument --lr: expected one argument"),
])
def test_bad_settings(argv, match, capsys):
    err = one_line_error(capsys, exit_code(lambda: train.main(argv)))
    assert re.search(match, err), err


def test_sample_settings_follow_train_rules(toy, capsys):
    """sample.py refuses what train.py refuses, with the same message (one rule for both)."""
    for flag, message in (("--threshold=1.5", "threshold (1.5) must be in [0, 1)"),
                          ("--block_length=0", "block_length (0) must be >= 1"),
                          ("--gen_length=0", "gen_length (0) must be >= 1"),
                          ("--kv_cache=full", "kv_cache ('full') must be none, prefix or dual")):
        train_err = one_line_error(capsys, exit_code(lambda: train.main([flag])))
        sample_err = one_line_error(capsys, exit_code(
            lambda: sample_cli.main(["--ckpt", str(toy / "final"), "--prompt", "bob has 3 pens", flag])))
        assert sample_err == train_err and sample_err.startswith(f"error: {message}"), (flag, sample_err, train_err)


@pytest.mark.parametrize("argv,match", [
    (["--prompt", ""], r"--prompt is empty: pass the text to complete"),
    (["--prompt", "   "], r"--prompt is only whitespace"),
    (["--prompt_format=chatml"], r"prompt_format \('chatml'\) must be one of auto, toy, chat, raw"),
    (["--png=x.png"], r"--png x.png draws an image sample: add --image"),
    (["--image", "--png=/no/such/dir/x.png"], r"the directory /no/such/dir does not exist"),
    (["--remasking=topk"], r"remasking \('topk'\) must be one of low_confidence, random"),
    (["--remasking=random", "--threshold=0.9"], r"--threshold=0.9 compares the model's confidences: it needs "
                                                r"--remasking=low_confidence, not random"),
    (["--text_cfg_scale=-1"], r"text_cfg_scale \(-1.0\) must be a finite number >= 0"),
])
def test_sample_bad_options(toy, capsys, argv, match):
    argv = ["--ckpt", str(toy / "final")] + (["--prompt", "bob"] if "--prompt" not in argv else []) + argv
    err = one_line_error(capsys, exit_code(lambda: sample_cli.main(argv)))
    assert re.search(match, err), err


def test_sample_passes_remasking_and_text_guidance(toy, monkeypatch):
    """--remasking and --text_cfg_scale reach LLaDA's sampler options (sample.generate's remasking and
    cfg_scale) at non-default values; the defaults are LLaDA's (low confidence, no guidance)."""
    import sample
    seen, real = [], sample.generate
    monkeypatch.setattr(sample, "generate", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    base = ["--ckpt", str(toy / "final"), "--prompt", "bob has 3 pens", "--gen_length=4", "--block_length=4",
            "--steps=4", "--temperature=0.5"]
    sample_cli.main(base + ["--remasking=random", "--text_cfg_scale=1.5"])
    sample_cli.main(base)
    assert [(kw["remasking"], kw["cfg_scale"]) for kw in seen] == [("random", 1.5), ("low_confidence", 0.0)]


def test_sample_without_ckpt(capsys):
    err = one_line_error(capsys, exit_code(lambda: sample_cli.main(["--prompt", "hi"])))
    assert "--ckpt is missing: pass --ckpt DIR" in err


# -----------------------------------------------------------------------------------------------------
# the prompt


def test_unknown_characters_are_named(toy, capsys):
    out = sample_cli.main(["--ckpt", str(toy / "final"), "--prompt", "bob has 3 pens \N{GRINNING FACE} Z",
                           "--gen_length=4", "--block_length=4", "--steps=4"])
    err = capsys.readouterr().err
    # The toy tokenizer is lower-case word-level: the emoji and the capital Z have no token.
    assert "warning: 2 piece(s) of the prompt are not in the tokenizer's vocabulary and become [UNK]" in err, err
    assert "'\N{GRINNING FACE}'" in err and "'Z'" in err
    assert isinstance(out, str)


def test_prompt_longer_than_the_model_is_refused(toy, capsys):
    prompt = " ".join(["1"] * 5000)  # the toy tokenizer: one token per digit word
    err = one_line_error(capsys, exit_code(lambda: sample_cli.main(["--ckpt", str(toy / "final"), "--prompt", prompt])))
    assert "the prompt is 5001 tokens and --gen_length=12: 5013 > the model's max_sequence_length 4096" in err, err
    assert str(toy / "final" / "config.json") in err


def test_max_prompt_len_truncation_is_counted(toy, capsys):
    """Every GSM8K fixture prompt, in the chat template, is longer than 8 tokens: all are reported cut."""
    from infra.data import load_dataset

    rows = len((FIX / "gsm8k.jsonl").read_text().splitlines())
    tok = hf.load_tokenizer(toy / "final")
    cfg = train.Config(max_prompt_len=8, tasks="gsm8k")
    load.report_truncation(cfg, tok, {"gsm8k": {"train": load_dataset("gsm8k", FIX / "gsm8k.jsonl"), "test": []}})
    out = capsys.readouterr().out
    assert f"note: {rows} of {rows} gsm8k train prompts are longer than --max_prompt_len=8 tokens" in out, out
    cfg = train.Config(max_prompt_len=100000, tasks="gsm8k")
    load.report_truncation(cfg, tok, {"gsm8k": {"train": load_dataset("gsm8k", FIX / "gsm8k.jsonl"), "test": []}})
    assert capsys.readouterr().out == ""


def test_no_held_out_set_says_so(toy, tmp_path, capsys):
    train.main([*TINY, f"--sft_dir={toy / 'sft'}", f"--out_dir={tmp_path / 'run'}", "--eval_prompts=0"])
    out = capsys.readouterr().out
    assert "held-out mean reward" not in out and "no held-out set" in out, out
    # The SFT model came from the cache: said once, and not as if it had just been trained.
    assert out.count("loading the SFT model from") == 1 and "saved the SFT model" not in out


def test_fresh_sft_is_reported_as_saved(tmp_path, capsys):
    train.main([*TINY, f"--out_dir={tmp_path}", "--eval_prompts=0", "--sft_steps=1"])
    out = capsys.readouterr().out
    assert f"saved the SFT model to {tmp_path / 'sft'}" in out and "loading the SFT model" not in out, out


# -----------------------------------------------------------------------------------------------------
# damaged files name themselves


def damaged_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    shard = next(dst.glob("model-*.safetensors"))
    data = shard.read_bytes()
    if how == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        shard.write_bytes(b"")
    elif how == "random":
        shard.write_bytes(os.urandom(len(data)))
    elif how == "tokenizer":
        (dst / "tokenizer.json").write_text("not a tokenizer")
    elif how == "config":
        (dst / "config.json").write_text('{"d_model": 32,')
    elif how == "config_field":
        (dst / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), "n_layers": 0}))
    return shard


CORRUPT = [("truncated", "model-00001-of-00001.safetensors is not a complete safetensors file"),
           ("empty", "model-00001-of-00001.safetensors is not a complete safetensors file"),
           ("random", "model-00001-of-00001.safetensors is not a complete safetensors file"),
           ("tokenizer", "tokenizer.json is not a valid tokenizer.json"),
           ("config", "config.json is not valid JSON (Expecting property name enclosed in double quotes"),
           ("config_field", "config.json: config.json sizes {'n_layers': 0} must be positive integers")]


@pytest.mark.parametrize("how,message", CORRUPT, ids=[c[0] for c in CORRUPT])
@pytest.mark.parametrize("entry", ["train", "sample", "evaluate"])
def test_damaged_checkpoint_names_the_file(toy, tmp_path, capsys, how, message, entry):
    ckpt = tmp_path / "ckpt"
    damaged_copy(toy / "final", ckpt, how)
    if entry == "train":
        code = exit_code(lambda: train.main([*TINY, f"--init_from={ckpt}", f"--out_dir={tmp_path / 'run'}"]))
    elif entry == "sample":
        code = exit_code(lambda: sample_cli.main(["--ckpt", str(ckpt), "--prompt", "bob has 3 pens"]))
    else:
        code = evaluate.main(["--ckpt", str(ckpt), "--task", "text", "--limit=1", "--samples=0"])
    err = one_line_error(capsys, code)
    assert f"{ckpt}/{message}" in err, err


def test_damaged_generation_and_index_files(toy, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(toy / "final", ckpt)
    (ckpt / "generation.json").write_text("[1, 2")
    err = one_line_error(capsys, exit_code(lambda: sample_cli.main(["--ckpt", str(ckpt), "--prompt", "bob"])))
    assert f"{ckpt / 'generation.json'} is not valid JSON" in err
    (ckpt / "generation.json").unlink()
    (ckpt / "model.safetensors.index.json").write_text("")
    err = one_line_error(capsys, exit_code(lambda: sample_cli.main(["--ckpt", str(ckpt), "--prompt", "bob"])))
    assert f"{ckpt / 'model.safetensors.index.json'} is not valid JSON" in err


# -----------------------------------------------------------------------------------------------------
# --resume over a damaged checkpoint


def three_checkpoints(out: Path) -> list[Path]:
    """Checkpoints of steps 1, 2 and 3 of a tiny model, written by checkpoint.save as a run writes them."""
    model = Transformer(ModelConfig(d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, mlp_hidden_size=8,
                                    vocab_size=16, mask_token_id=15))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    return [checkpoint.save(out, s, model, opt, {"step": s}, keep_last=0) for s in (1, 2, 3)]


@pytest.mark.parametrize("damage,problem", [
    ("delete_shard", "its shard {d}/__0_0.distcp is missing"),
    ("truncate_shard", r"its shard {d}/__0_0.distcp is truncated \(100 of at least \d+ bytes\)"),
    ("state_json", r"{d}/state.json is unreadable"),
    ("metadata", r"{d}/.metadata is unreadable"),
])
def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, capsys, damage, problem):
    first, second, third = three_checkpoints(tmp_path)
    if damage == "delete_shard":
        (third / "__0_0.distcp").unlink()
    elif damage == "truncate_shard":
        with open(third / "__0_0.distcp", "r+b") as f:
            f.truncate(100)
    elif damage == "state_json":
        (third / "state.json").write_text('{"step": 3')
    else:
        (third / ".metadata").write_bytes(b"\0" * 10)
    assert checkpoint.latest(tmp_path) == third  # it looks complete: only its contents are wrong
    assert outdir.resume_point(tmp_path, quiet=False) == second
    out = capsys.readouterr().out
    assert re.search(rf"warning: {third} is damaged: " + problem.format(d=third), out), out
    assert "resuming from the newest intact checkpoint, step-00000002" in out
    with pytest.raises(ValueError, match="is damaged"):
        checkpoint.load(third, None, None)


def test_resume_with_every_checkpoint_damaged(tmp_path):
    for d in three_checkpoints(tmp_path):
        (d / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match=r"--resume: no intact checkpoint in .*checkpoints: .*step-00000003 is "
                                         r"damaged: its shard .* is missing; .*step-00000002 is damaged"):
        outdir.resume_point(tmp_path)


@pytest.mark.slow
def test_resume_over_a_deleted_shard_end_to_end(toy, tmp_path, capsys):
    args = [*TINY, f"--sft_dir={toy / 'sft'}", f"--out_dir={tmp_path}", "--rl_steps=2", "--checkpoint_every=1"]
    train.main(args)
    (tmp_path / "checkpoints" / "step-00000002" / "__0_0.distcp").unlink()
    # As if the run had been killed in its final evaluation: no summary.json, no final/, so it is unfinished.
    (tmp_path / "summary.json").unlink()
    shutil.rmtree(tmp_path / "final")
    capsys.readouterr()
    train.main(args + ["--resume=true"])
    out = capsys.readouterr().out
    assert "step-00000002 is damaged: its shard" in out and "resumed from" in out and "step-00000001 at step 1" in out


# -----------------------------------------------------------------------------------------------------
# pictures, progress bars, permissions


def test_image_png_and_plain_text_off_a_terminal(toy, tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    figures = []  # the figure image_grid saves, for its axes' transform
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, _save=Figure.savefig, **k: figures.append(self)
                        or _save(self, *a, **k))
    png = tmp_path / "sample.png"
    codes = sample_cli.main(["--ckpt", str(toy / "final"), "--prompt", "two red blocks", "--image",
                             "--image_steps=4", "--png", str(png)])
    out = capsys.readouterr().out
    assert "\x1b" not in out  # captured stdout is not a terminal: no ANSI escape codes
    letters = ".rgbypcw"
    assert out.split("\n")[:4] == [" ".join(letters[c] for c in codes[r:r + 4]) for r in range(0, 16, 4)]
    from PIL import Image

    picture = Image.open(png).convert("RGB")
    # one row of one image (infra/plots.image_grid): the centre of its first cell, from the axes' data
    # coordinates (the cell indices; display y runs up, the picture's rows down), has colour PALETTE[code].
    x, y = figures[0].axes[0].transData.transform((0, 0))
    assert picture.getpixel((int(x), picture.height - 1 - int(y))) == plots.PALETTE[codes[0]]


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_only_on_a_terminal():
    log = io.StringIO()
    for _ in cli.progress_bar(range(3), file=log, desc="x"):
        pass
    assert log.getvalue() == ""  # a log file gets no carriage-return updates
    term = FakeTerminal()
    for _ in cli.progress_bar(range(3), file=term, desc="x"):
        pass
    assert "\r" in term.getvalue() and "3/3" in term.getvalue()


def test_weights_get_the_permissions_of_the_files_beside_them(tmp_path):
    model = Transformer(ModelConfig(d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, mlp_hidden_size=8,
                                    vocab_size=16, mask_token_id=15))
    old = os.umask(0o022)
    try:
        hf.save_pretrained(model, tmp_path)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {n: 0o644 for n in modes} and len(modes) == 3, modes


# -----------------------------------------------------------------------------------------------------
# every entry point, as a command: exit status 2 and one line on stderr


def command(args, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, **kw)


ENTRY_POINTS = [
    (["train.py", "--block_length=0"], "error: block_length (0) must be >= 1"),
    (["train.py", "--sft_step=1"], "error: unknown argument(s) ['--sft_step=1']"),
    (["-m", "tools.sample", "--ckpt", "/no/such/dir", "--prompt", "hi"], "error: /no/such/dir/config.json not found"),
    (["evaluate.py", "--ckpt", "/no/such/dir", "--task", "text"], "error: checkpoint directory not found"),
    (["-m", "tools.diagnose"], "error: usage: python -m tools.diagnose --ckpt DIR"),
    (["-m", "tools.bench", "--reps=0"], "error: --reps must be >= 1, got 0"),
    (["-m", "tools.bench", "--rep=2"], "error: unknown argument(s) ['--rep=2']"),
    (["-m", "infra.data", "gsm8k", "/no/such.jsonl"], "error: dataset file not found: /no/such.jsonl"),
    (["-m", "infra.data"], "error: usage: python -m infra.data TASK PATH"),
    (["-m", "infra.plots", "/no/such/run"], "error: /no/such/run/log.jsonl not found"),
    (["-m", "infra.plots", "--compare", "a=x"], "error: --compare takes LABEL=DIR[,DIR...] groups and needs --png"),
]


@pytest.mark.parametrize("args,message", ENTRY_POINTS)
def test_every_entry_point_exits_2_with_one_line(args, message, monkeypatch, capsys):
    """Each __main__ block, run in this process (conftest.run_main)."""
    code = run_main(args, monkeypatch)
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err)
    assert err.startswith(message) and "\n" not in err, err


@pytest.mark.slow  # a process that imports torch takes seconds to start on a shared CPU
@pytest.mark.parametrize("args,message", ENTRY_POINTS)
def test_every_command_exits_2_with_one_line(args, message):
    """The same as commands; the fast test_every_entry_point_exits_2_with_one_line runs their __main__ blocks."""
    p = command(args)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.strip().startswith(message) and "\n" not in p.stderr.strip(), p.stderr
