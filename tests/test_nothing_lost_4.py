"""Nothing is lost when nobody can read the messages, or when a save fails: a run whose terminal closed (every
write fails with EIO) or whose pipe reader left (EPIPE) still finishes its step and writes its checkpoint on
SIGHUP; a save that fails, whatever the writer raises (safetensors' SafetensorError as well as an OSError),
ends in one line naming what was kept and the command that continues. Subprocesses, since signals, closed
terminals and file-size limits are what is tested.

    OMP_NUM_THREADS=1 python -m pytest tests/test_nothing_lost_4.py -q
"""
import os
import pty
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import checkpoint

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--preset=smoke", "--threads=1", "--sample_every=0", "--eval_prompts=1", "--rl_steps=2",
       "--checkpoint_every=0"]
# train.py as the command line runs it, with RL step 1 held until the file GO exists (so that the test can
# take the output away while a step is in progress).
WRAPPER = """
import os, sys, time
sys.argv[0] = "train.py"
import train
from infra import cli, scale
real, go = train.rl_step, os.environ["GO"]
def rl_step(model, ref, opt, ctx, step, prompts):
    if step == 1:
        print("step 1 begins", flush=True)
        for _ in range(1200):
            if os.path.exists(go):
                break
            time.sleep(0.05)
    return real(model, ref, opt, ctx, step, prompts)
train.rl_step = rl_step
with scale.process_exit(), cli.user_errors():
    train.main()
"""


def child_env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", **extra)


def read_fd_until(fd: int, marker: bytes, seconds: float = 240) -> bytes:
    seen, end = b"", time.time() + seconds
    while marker not in seen:
        assert time.time() < end, f"{marker!r} never printed:\n{seen.decode(errors='replace')}"
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # a pty whose child side closed
            chunk = b""
        assert chunk, f"output ended before {marker!r}:\n{seen.decode(errors='replace')}"
        seen += chunk
    return seen


@pytest.fixture(scope="module")
def sft_dir(smoke_sft_run):
    return smoke_sft_run / "sft"


@pytest.mark.parametrize("output", ["closed terminal", "closed pipe"])
def test_sighup_with_the_output_gone_still_writes_the_checkpoint(sft_dir, tmp_path, output):
    """The terminal goes away during RL step 1 (the pty's other side is closed: writes to it fail with EIO),
    or the pipe the run prints into loses its reader (EPIPE); then SIGHUP. The step finishes, its checkpoint
    is written, the exit status is 128 + SIGHUP and the out_dir is released, as with a terminal still there."""
    out, go = tmp_path / "run", tmp_path / "go"
    args = [*RUN, f"--sft_dir={sft_dir}", f"--out_dir={out}"]
    if output == "closed terminal":
        parent, child = pty.openpty()
        p = subprocess.Popen([sys.executable, "-c", WRAPPER, *args], cwd=ROOT, env=child_env(GO=str(go)),
                             stdin=child, stdout=child, stderr=child, start_new_session=True)
        os.close(child)
    else:
        parent, child = os.pipe()
        p = subprocess.Popen([sys.executable, "-c", WRAPPER, *args], cwd=ROOT, env=child_env(GO=str(go)),
                             stdout=child, stderr=child)
        os.close(child)
    try:
        read_fd_until(parent, b"step 1 begins")
        os.close(parent)  # nobody reads any more: EIO (a hung-up terminal) or EPIPE on every write
        p.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        go.touch()
        p.wait(timeout=240)
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGHUP, p.returncode
    assert checkpoint.latest(out).name == "step-00000002", list((out / "checkpoints").iterdir())
    assert not (out / "run.pid").exists()
