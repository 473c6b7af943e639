"""Nothing is lost when nobody can read the messages, or when a save fails: a run whose terminal closed (every
write fails with EIO) or whose pipe reader left (EPIPE) still finishes its step and writes its checkpoint on
SIGHUP; a save that fails, whatever the writer raises (safetensors' SafetensorError as well as an OSError),
ends in one line naming what was kept and the command that continues. Subprocesses, since signals, closed
terminals and file-size limits are what is tested.

    OMP_NUM_THREADS=1 python -m pytest tests/test_nothing_lost_4.py -q
"""
import fcntl
import os
import pty
import resource
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from infra import checkpoint, cli
from conftest import run_main

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels

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


def controlling_terminal():
    """In the child, after its setsid: make the pty on stdin its controlling terminal, as a terminal window's
    shell has it, so that closing the pty's other side makes the kernel send it SIGHUP."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_a_handler_line_nobody_can_read_is_dropped_and_the_output_silenced(monkeypatch):
    """The fast sibling of the run below: a pipe whose reader left (as a closed terminal, every write fails).
    The handler's line raises nothing, and the descriptor is found gone and pointed at /dev/null, so the
    next print succeeds; a pipe still read is left as it is."""
    r, w = os.pipe()
    os.close(r)
    out = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "stdout", out)
    with pytest.raises(BrokenPipeError):  # what the handler meets: a write to it fails
        os.write(w, b"x")
    checkpoint._say_in_handler("caught SIGHUP: finishing this step, then writing a checkpoint")
    live_r, live_w = os.pipe()
    checkpoint.away_from_gone_output((w, live_w))
    assert os.write(w, b"now nowhere\n") == 12
    assert os.write(live_w, b"read\n") == 5 and os.read(live_r, 5) == b"read\n"
    out.close()
    os.close(live_r)
    os.close(live_w)


@pytest.mark.slow  # two real runs (about 8 s); the handler's part is tested fast just above
@pytest.mark.parametrize("output", ["terminal window closed", "closed pipe"])
def test_sighup_with_the_output_gone_still_writes_the_checkpoint(sft_dir, tmp_path, output):
    """The terminal goes away during RL step 1: its window closes (the pty's other side is closed, the kernel
    hangs the terminal up and sends SIGHUP; every write to it then fails with EIO); or the pipe the run prints
    into loses its reader (EPIPE), then SIGHUP. The step finishes, its checkpoint is written, the exit status is
    128 + SIGHUP and the out_dir is released, as with a terminal still there."""
    out, go = tmp_path / "run", tmp_path / "go"
    args = [*RUN, f"--sft_dir={sft_dir}", f"--out_dir={out}"]
    if output != "closed pipe":
        parent, child = pty.openpty()
        p = subprocess.Popen([sys.executable, "-c", WRAPPER, *args], cwd=ROOT, env=child_env(GO=str(go)),
                             stdin=child, stdout=child, stderr=child, start_new_session=True,
                             preexec_fn=controlling_terminal)
        os.close(child)
    else:
        parent, child = os.pipe()
        p = subprocess.Popen([sys.executable, "-c", WRAPPER, *args], cwd=ROOT, env=child_env(GO=str(go)),
                             stdout=child, stderr=child)
        os.close(child)
    try:
        read_fd_until(parent, b"step 1 begins")
        os.close(parent)  # nobody reads any more: EIO (a hung-up terminal) or EPIPE on every write
        if output == "closed pipe":  # a closed terminal's SIGHUP comes from the kernel
            p.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        go.touch()
        p.wait(timeout=240)
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGHUP, p.returncode
    assert checkpoint.latest(out).name == "step-00000002", list((out / "checkpoints").iterdir())
    assert not (out / "run.pid").exists()


# -----------------------------------------------------------------------------------------------------
# a save that fails, whatever the writer raises

TINY = ["--preset=smoke", "--threads=1", "--sample_every=0", "--eval_prompts=1"]


@pytest.mark.parametrize("how", ["in process", pytest.param("command", marks=pytest.mark.slow)])
def test_sft_save_over_a_file_size_limit_is_one_line(tmp_path, how, monkeypatch, capsys):
    """RLIMIT_FSIZE below the SFT model's size: safetensors raises SafetensorError ("File too large"), not an
    OSError. One line says the SFT model was lost, the sft_dir is as it was, and the command to run again;
    no traceback, no temporary folder left. train.py's __main__ block in this process (conftest.run_main) under
    a lowered soft limit, and as a command (slow: seconds to start)."""
    out = tmp_path / "run"
    limit = 32 << 10  # the smoke model's weights are larger; config.json and the logs are smaller
    args = ["train.py", *TINY, "--sft_steps=2", "--rl_steps=0", f"--out_dir={out}"]
    if how == "command":
        def small_files():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        p = subprocess.run([sys.executable, *args], cwd=ROOT, env=child_env(), preexec_fn=small_files,
                           capture_output=True, text=True, timeout=300)
        code, said = p.returncode, (p.stdout, p.stderr)
    else:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # Python ignores SIGXFSZ: such a write fails
        try:
            code = run_main(args, monkeypatch)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        said = capsys.readouterr()
    err = said[1].strip()
    assert code == 1 and "Traceback" not in said[1] and len(err.splitlines()) == 1, said
    assert err.startswith("error: saving the SFT model to") and "File too large" in err, err
    assert "the trained SFT model is lost" in err and "no checkpoint of this run exists" in err, err
    assert "continue with: python train.py" in err and f"--out_dir={out}" in err, err
    assert not (out / "sft").exists() and not [q for q in out.iterdir() if q.name.startswith(".sft")]


def test_final_save_failing_with_a_safetensors_error_keeps_the_checkpoint(smoke_sft_run, tmp_path, monkeypatch):
    """A fake writer raises SafetensorError while final/ is written: RunFailed in one line naming the last
    step's checkpoint as kept and --resume=true; no partial final/; that command then finishes the run."""
    import train
    from infra import hf
    from infra.run import RunFailed
    from safetensors import SafetensorError

    out = tmp_path / "run"
    args = [*TINY, f"--sft_dir={smoke_sft_run / 'sft'}", f"--out_dir={out}", "--rl_steps=1", "--checkpoint_every=1"]
    real = hf.save_file

    def full_disk(tensors, filename, *a, **k):
        if Path(filename).parent == out / "final":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *a, **k)
    monkeypatch.setattr(hf, "save_file", full_disk)
    with pytest.raises(RunFailed) as e:
        train.main(args)
    msg = str(e.value)
    assert "\n" not in msg and f"writing the model to {out / 'final'} failed" in msg, msg
    assert "No space left on device" in msg and "step-00000001, is kept" in msg, msg
    assert "continue with: python train.py" in msg and "--resume=true" in msg, msg
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    monkeypatch.setattr(hf, "save_file", real)
    train.main([*args, "--resume=true"])
    assert (out / "summary.json").is_file() and (out / "final" / "config.json").is_file()


def test_checkpoint_writer_raising_anything_is_one_line(smoke_sft_run, tmp_path, monkeypatch):
    """A checkpoint writer that raises an error no one foresaw (not an OSError): one line naming the
    previous checkpoint as kept and the command that continues, and no half-written checkpoint."""
    import train
    from infra import checkpoint as ckpt
    from infra.run import RunFailed

    out = tmp_path / "run"
    real = ckpt.save

    def broken(out_dir, step, *a, **k):
        if step == 2:
            ckpt._step_dir(out_dir, step, tmp=True).mkdir(parents=True)
            raise RuntimeError("the storage driver gave up")
        return real(out_dir, step, *a, **k)
    monkeypatch.setattr(ckpt, "save", broken)
    with pytest.raises(RunFailed) as e:
        train.main([*TINY, f"--sft_dir={smoke_sft_run / 'sft'}", f"--out_dir={out}", "--rl_steps=2",
                    "--checkpoint_every=1"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("writing checkpoint step 2: RuntimeError: the storage driver gave up"), msg
    assert "step-00000001, is kept" in msg and "--resume=true" in msg, msg
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000001"]
