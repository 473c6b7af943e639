"""Every signal a terminal, a scheduler or a launcher sends ends with a line naming what was kept and the
command that continues: a second Ctrl-C during a long RL step says first what it will lose, then leaves an
out_dir that the printed command continues; SIGHUP (a closed terminal) stops like SIGTERM. Subprocesses,
since signals are what is tested; the long step is a wrapper that makes step 1 sleep.

    OMP_NUM_THREADS=1 python -m pytest tests/test_signals.py -q -p no:xdist
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import checkpoint

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--preset=smoke", "--threads=1", "--sample_every=0", "--eval_prompts=1", "--rl_steps=4"]
# train.py as the command line runs it, with RL step `SLOW_STEP` made long (a large model's step).
WRAPPER = """
import os, sys, time
sys.argv[0] = "train.py"
import train
from infra import cli, scale
real, slow = train.rl_step, int(os.environ.get("SLOW_STEP", "-1"))
def rl_step(model, ref, opt, ctx, step, prompts):
    if step == slow:
        print("slow step begins", flush=True)
        for _ in range(600):
            time.sleep(0.1)
    return real(model, ref, opt, ctx, step, prompts)
train.rl_step = rl_step
with scale.process_exit(), cli.user_errors():
    train.main()
"""


def spawn(args, slow_step=-1):
    env = dict(os.environ, OMP_NUM_THREADS="1", SLOW_STEP=str(slow_step))
    return subprocess.Popen([sys.executable, "-c", WRAPPER, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def read_until(p, marker: str) -> str:
    seen = []
    for line in p.stdout:
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"{marker!r} never printed:\n{''.join(seen)}")


def printed_command(text: str, after: str) -> list[str]:
    """The arguments of the `python train.py ...` command a line printed after `after`."""
    line = next(line for line in text.splitlines() if after in line)
    return shlex.split(line.split("python train.py ", 1)[1])


@pytest.fixture(scope="module")
def sft_dir(smoke_sft_run):
    return smoke_sft_run / "sft"


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_every", [1, 0])
def test_second_ctrl_c_says_what_it_loses_and_the_command_continues(sft_dir, tmp_path, checkpoint_every):
    """Ctrl-C during a long step 1, then again 6 s later: the first line says a second press loses the
    step and where the run would go on from; the second aborts at once (exit 130) naming what is lost and
    one command; that command then runs the run to its end (from step-1, or from step 0 without one)."""
    out = tmp_path / "run"
    args = [*RUN, f"--sft_dir={sft_dir}", f"--out_dir={out}", f"--checkpoint_every={checkpoint_every}"]
    p = spawn(args, slow_step=1)
    try:
        text = read_until(p, "slow step begins")
        p.send_signal(signal.SIGINT)
        text += read_until(p, "caught SIGINT")
        time.sleep(checkpoint.REPEAT_WINDOW + 1)
        p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    text += rest
    assert p.returncode == 130, text
    first = next(line for line in text.splitlines() if line.startswith("caught SIGINT"))
    assert "finishing this step" in first and "a second signal" in first, first
    if checkpoint_every:
        assert "step 1 would be lost and the run would continue from" in first and "step-00000001" in first, first
    else:
        assert "no checkpoint exists yet, so steps 0 to 1 would be lost" in first, first
    assert "aborted by a second SIGINT during RL step 1" in text, text
    assert "Traceback" not in text and "interrupted (Ctrl-C)" not in text, text
    command = printed_command(text, "aborted by a second SIGINT")
    assert "--resume=true" in command
    p = spawn(command)
    done, _ = p.communicate(timeout=600)
    assert p.returncode == 0, done
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert (out / "summary.json").is_file() and not (out / "run.pid").exists()


@pytest.mark.slow
def test_sighup_stops_like_sigterm(sft_dir, tmp_path):
    """SIGHUP (the terminal closed, an ssh session dropped) during a step: the step finishes, a checkpoint
    is written, a line names the command, exit 128 + 1, no pid file left; the command continues."""
    out = tmp_path / "run"
    args = [*RUN, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--checkpoint_every=0"]
    p = spawn(args, slow_step=1)
    try:
        text = read_until(p, "slow step begins")
        p.send_signal(signal.SIGHUP)
        rest, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    text += rest
    assert p.returncode == 128 + signal.SIGHUP, text
    assert "caught SIGHUP: finishing this step" in text and "stopped by SIGHUP after step 1" in text, text
    assert checkpoint.latest(out).name == "step-00000002" and not (out / "run.pid").exists()
    command = printed_command(text, "stopped by SIGHUP")
    p = spawn(command)
    done, _ = p.communicate(timeout=600)
    assert p.returncode == 0 and "resumed from" in done, done
