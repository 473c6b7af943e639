"""Every flag acts or is refused: inputs that make a flag meaningless are refused at the boundary in one
line naming the flag and the fix (train.py's settings, tools.bench's own flags).

    OMP_NUM_THREADS=1 python -m pytest tests/test_flags_act.py -q -p no:xdist
"""
from pathlib import Path

import pytest
import torch

import train
from conftest import run_main

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "fixtures" / "tiny-llada"
DATA = ROOT / "tests" / "fixtures" / "data" / "gsm8k.jsonl"
GSM = [f"--init_from={MODEL}", "--tasks=gsm8k", f"--train_data=gsm8k={DATA}"]


@pytest.mark.parametrize("argv,match", [
    (["--tasks=text,text"], r"tasks \('text,text'\) names text twice.*\(--tasks=text\)$"),
    (["--tasks=text,image,text"], r"names text twice.*\(--tasks=text,image\)$"),
    ([*GSM, f"--train_data=gsm8k={DATA},gsm8k=other.jsonl"], r"train_data names task gsm8k twice"),
    (["--gen_length=12", "--block_length=12", "--steps=24"], r"steps \(24\) must be <= gen_length \(12\)"),
    (["--device=gpu"], r"device \('gpu'\) must be auto, cpu, cuda or cuda:N \(for a GPU: --device=cuda\)"),
    (["--device=mps"], r"device \('mps'\) must be .*Apple GPUs are not supported"),
    ([*GSM, "--d_model=64"], r"--d_model sets the toy model's shape, but --init_from=.* drop it"),
    ([*GSM, "--n_layers=1", "--n_heads=2"], r"--n_heads, --n_layers set the toy model.s shape.* drop them"),
    ([*GSM, f"--eval_data=gsm8k={DATA}", "--eval_prompts=0"], r"--eval_prompts=0 scores no --eval_data: drop one"),
])
def test_meaningless_flags_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        train.parse_args(argv)


def test_a_preset_may_still_set_what_a_flag_may_not():
    """The smoke preset sets the toy model's size and SFT steps: with --init_from those are not typed, so
    they are not refused (the model's config.json sets the shape)."""
    cfg = train.parse_args(["--preset=smoke", *GSM])
    assert cfg.d_model == 32 and cfg.init_from == str(MODEL)


def test_a_preset_for_another_model_shape_is_warned_about(tmp_path, capsys):
    """--preset=smoke names the toy size (d_model 32, mlp 64); the --init_from model is larger: one warning names
    the preset typed, the differing sizes on both sides, and that the model's config.json wins."""
    from infra import run
    run._check_out_dir(train.parse_args(["--preset=smoke", *GSM, "--max_prompt_len=64"]), tmp_path / "out")
    assert ("warning: --preset smoke is set for a model with d_model=32, mlp_hidden_size=64, but "
            f"{MODEL} has d_model=64, mlp_hidden_size=160; its config.json is used, and the preset's other "
            "settings may not suit it\n") in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--threads", "-1"], "threads (-1) must be >= 0"),
    (["--device", "gpu"], "device ('gpu') must be auto, cpu, cuda or cuda:N"),
    pytest.param(["--device", "cuda"], "asks for CUDA, but torch sees no GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_bench_refuses_device_and_threads_in_one_line(argv, message, monkeypatch, capsys):
    code, err = run_main(["-m", "tools.bench", *argv], monkeypatch), capsys.readouterr().err  # its __main__ block
    assert code == 2 and err == f"error: {err[7:]}" and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_sft_flags_with_init_from_are_warned_about(capsys):
    train.parse_args([*GSM, "--sft_steps=10", "--sft_dir=x"])
    out = capsys.readouterr().out
    assert "warning: with --tasks=" in out and "--sft_dir (it acts on the SFT stage" in out, out
    assert "--sft_steps (it acts on the SFT stage" in out and "do nothing: drop it" in out, out
