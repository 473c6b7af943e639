"""The command a stopped run prints to continue it (infra/outdir.resume_command) and to start it again
(start_command), for every way a flag can be written: `--flag=v`, `--flag v`, and booleans bare
(`--resume`, `--extend`) or with a value (`--resume true`, `--resume=false`, `--resume 0`). Expected strings
are written by hand; and parsing the printed command gives the run's own settings with resume = true.

    python -m pytest tests/test_continue_command.py -q
"""
import dataclasses
import shlex

import pytest

import train
from infra import outdir, scale

CASES = [  # (argv as typed, the continue command by hand)
    (["--preset=smoke", "--out_dir", "out/a", "--resume"],
     "python train.py --preset=smoke --out_dir out/a --resume=true"),
    (["--resume", "true", "--seed=1"], "python train.py --seed=1 --resume=true"),
    (["--resume", "0", "--lr", "1e-3"], "python train.py --lr 1e-3 --resume=true"),
    (["--resume=false", "--rl_steps", "3"], "python train.py --rl_steps 3 --resume=true"),
    (["--resume=True", "--dry_run_gpus=2"], "python train.py --dry_run_gpus=2 --resume=true"),
    (["--resume", "--extend", "--rl_steps=20"], "python train.py --extend --rl_steps=20 --resume=true"),
    (["--extend", "true", "--resume", "yes", "--rl_steps", "20"],
     "python train.py --extend true --rl_steps 20 --resume=true"),
    (["--retrain_sft", "--resume", "--resume", "off"], "python train.py --retrain_sft --resume=true"),
    (["--out_dir=runs/my run", "--system_prompt", "be brief; think"],
     "python train.py '--out_dir=runs/my run' --system_prompt 'be brief; think' --resume=true"),
    ([], "python train.py --resume=true"),
]


@pytest.mark.parametrize("argv, want", CASES)
def test_continue_command_by_hand(argv, want):
    outdir.remember_command(argv)
    assert outdir.resume_command() == want
    assert outdir.start_command() == " ".join(["python", "train.py", *map(shlex.quote, argv)])


@pytest.mark.parametrize("argv, want", CASES)
def test_continue_command_parses_to_the_same_run_with_resume(argv, want):
    """What the printed command would run: the same settings, resume = true (extend kept as given)."""
    outdir.remember_command(argv)
    printed = shlex.split(outdir.resume_command())
    assert printed[:2] == ["python", "train.py"]
    assert train.parse_args(printed[2:]) == dataclasses.replace(train.parse_args(argv), resume=True)


def test_under_torchrun_the_launcher_is_named(monkeypatch):
    monkeypatch.setattr(scale, "world", lambda: 2)
    outdir.remember_command(["--resume", "false", "--seed", "3"])
    assert outdir.resume_command() == "torchrun [the same launcher flags] train.py --seed 3 --resume=true"
    assert outdir.start_command() == "torchrun [the same launcher flags] train.py --resume false --seed 3"
