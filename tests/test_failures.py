"""A failure of the machine ends with one line naming the cause, what was kept and the command that goes
on, and that command works: a full disk while a checkpoint is written (a fake writer), out of memory at a
large --group_size (a forced allocation failure), a scorer down for every step (nothing unmeasured is
reported as a number).

    OMP_NUM_THREADS=1 python -m pytest tests/test_failures.py -q -p no:xdist
"""
import dataclasses
import errno
import json
import shlex

import pytest
import torch

import model as model_module
import tasks
import train
from infra import checkpoint, sandbox
from infra.run import RunFailed, TrainingStopped

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels

RUN = ["--preset=smoke", "--threads=1", "--sample_every=0", "--eval_prompts=1"]


@pytest.fixture(scope="module")
def sft_dir(smoke_sft_run):
    return smoke_sft_run / "sft"


def command_in(message: str) -> list[str]:
    """The arguments of the `python train.py ...` command that ends a one-line message."""
    return shlex.split(message.split("python train.py ", 1)[1])


def test_full_disk_during_a_checkpoint_is_one_line_and_resumable(sft_dir, tmp_path, monkeypatch):
    """The writer fails with ENOSPC in checkpoint 2 (DCP wraps it in a CheckpointException, a
    BaseException, which printed two nested tracebacks): one line naming the cause and the kept step-1,
    no half-written directory, and the printed command finishes the run."""
    import torch.distributed.checkpoint.filesystem as fs

    real, writes = fs._write_item, {"n": 0}
    out = tmp_path / "run"
    target = checkpoint._step_dir(out, 2, tmp=True)

    def full_disk(transform_list, stream, data, write_item, storage_key, *args, **kwargs):
        if target.exists():
            raise OSError(errno.ENOSPC, "No space left on device", str(target / "__0_0.distcp"))
        return real(transform_list, stream, data, write_item, storage_key, *args, **kwargs)
    monkeypatch.setattr(fs, "_write_item", full_disk)
    args = [*RUN, "--tasks=text", f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=3", "--checkpoint_every=1"]
    with pytest.raises(RunFailed) as e:
        train.main(args)
    msg = str(e.value)
    assert "\n" not in msg and "writing checkpoint step 2: the disk is full (No space left on device" in msg, msg
    assert f"{checkpoint._step_dir(out, 1)}, is kept" in msg and "--resume=true" in msg, msg
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000001"]
    monkeypatch.setattr(fs, "_write_item", real)
    summary = train.main(command_in(msg))
    assert "text" in summary and checkpoint.latest(out).name == "step-00000003"


def test_out_of_memory_names_device_batch_size_and_the_command_works(sft_dir, tmp_path, monkeypatch):
    """A device that holds at most 8 sequences per forward pass (a forced allocation failure above that):
    --group_size=8 with 2 prompts puts 16 in one pass, which now ends in one line naming the sizes and
    --device_batch_size; the printed command (with --device_batch_size=8) runs to the end."""
    real = model_module.Transformer.forward

    def small_device(self, x, *args, **kwargs):
        if x.shape[0] > 8:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 GiB ({x.shape[0]} rows)")
        return real(self, x, *args, **kwargs)
    monkeypatch.setattr(model_module.Transformer, "forward", small_device)
    out = tmp_path / "run"
    with pytest.raises(RunFailed) as e:
        train.main([*RUN, "--tasks=text", f"--sft_dir={sft_dir}", f"--out_dir={out}", "--group_size=8"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("out of memory (CUDA out of memory. Tried to allocate"), msg
    assert "group_size=8, prompts_per_step=2, device_batch_size=all" in msg and "--device_batch_size=8" in msg, msg
    command = command_in(msg)
    assert command[-1] == "--device_batch_size=8"
    summary = train.main(command)
    assert "text" in summary and (out / "final").is_dir()


def test_every_step_skipped_for_a_scorer_down_names_it(sft_dir, tmp_path, monkeypatch, capsys):
    """Image rewards from a scorer that is down (nothing listens on port 9) for every step: no final/, no
    reward after RL, the held-out reward before RL printed as "not measured", one line naming the scorer
    (it wrote final/ and ended with an error about missing log keys)."""
    monkeypatch.setattr(tasks, "TASKS", {**tasks.TASKS, "image": dataclasses.replace(tasks.TASKS["image"], reward=None)})
    monkeypatch.setattr(train.cli, "validate", lambda cfg: None)  # a toy image task with a scorer url
    monkeypatch.setattr(sandbox.time, "sleep", lambda s: None)   # no back-off waits between the retries
    out = tmp_path / "run"
    url = "http://127.0.0.1:9"
    with pytest.raises(TrainingStopped) as e:
        train.main([*RUN, "--tasks=image", f"--sft_dir={sft_dir}", f"--out_dir={out}", f"--image_scorer_url={url}"])
    msg = str(e.value)
    assert "every one of the 2 RL steps was skipped" in msg and f"is the image scorer at {url} up?" in msg, msg
    assert "\n" not in msg and not (out / "final").exists() and not (out / "summary.json").exists()
    printed = capsys.readouterr().out
    assert "held-out mean reward before RL: image not measured" in printed, printed
    assert all("bad_reward" in json.loads(x) for x in (out / "log.jsonl").read_text().splitlines())


# Rank 1 dies by SIGKILL as it records step 3; then train.py runs as its own __main__ (its one-line errors).
KILL_RANK_1_AT_STEP_3 = """
import os, runpy, signal, sys
sys.path.insert(0, {root!r})
from infra import run, scale
record = run.Run.record
def dying(self, step, *args, **kwargs):
    if scale.rank() == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return record(self, step, *args, **kwargs)
run.Run.record = dying
runpy.run_path(os.path.join({root!r}, "train.py"), run_name="__main__")
"""


@pytest.mark.slow  # two torchrun launches
def test_a_dead_torchrun_worker_names_resume(sft_dir, tmp_path):
    """Rank 1 SIGKILLed after step 3 (a launcher that wraps Run.record, then runs train.py as torchrun would):
    rank 0 ends with one line saying another process stopped, the checkpoint kept and the --resume=true command;
    that command finishes the run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    args = [*RUN, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=8", "--checkpoint_every=2"]
    killer = tmp_path / "train.py"  # named train.py, so that the command it prints is train.py's
    killer.write_text(KILL_RANK_1_AT_STEP_3.format(root=str(root)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([*torchrun, str(killer), *args], cwd=root, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode != 0
    line = next((x for x in p.stderr.splitlines() if x.startswith("error: another process")), None)
    assert line is not None, p.stderr[-3000:]
    assert "Connection" in line and f"{out / 'checkpoints' / 'step-00000002'}, is kept" in line, line
    assert line.endswith("--resume=true") and "--resume=true continues: torchrun" in line, line
    p = subprocess.run([*torchrun, "train.py", *args, "--resume=true"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0 and (out / "summary.json").is_file(), p.stdout[-2000:] + p.stderr[-2000:]


def test_progress_time_left_and_closing_summary(sft_dir, tmp_path, monkeypatch, capsys):
    """Each RL step line says the time left; the held-out evaluations say how far they are (every
    PROGRESS_EVERY seconds: 0 here); the last lines name the time, the model, the pictures and the next
    commands."""
    from infra import outdir

    monkeypatch.setattr(outdir.Stop, "PROGRESS_EVERY", 0.0)
    out = tmp_path / "run"
    train.main([*RUN, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=3"])
    lines = capsys.readouterr().out.splitlines()
    steps = [x for x in lines if x.startswith("step ")]
    assert all(" left" in x.rsplit("|", 1)[1] for x in steps[:2]) and "left" not in steps[2], steps
    # text sampled, text greedy and image: one batch each at eval_prompts=1
    assert "held-out evaluation before RL: batch 2 of about 3," in "\n".join(lines)
    assert "held-out evaluation after RL: batch 3 of about 3," in "\n".join(lines)
    done = next(x for x in lines if x.startswith("done in "))
    assert f"model {out / 'final'}" in done and f"{out / 'curves.png'}" in done and f"{out / 'images.png'}" in done
    assert lines[-1].startswith(f"next: python -m tools.sample --ckpt={out / 'final'}") and f"--run={out}" in lines[-1]


def test_a_final_evaluation_not_measured_is_null_and_exits_nonzero(sft_dir, tmp_path, monkeypatch, capsys):
    """The held-out reward after RL could not be measured (NaN: a scorer down at the end): summary.json has
    null, not NaN; the line says "not measured"; the run fails with the command that scores it again."""
    real, calls = train.evaluate_all, {"n": 0}

    def down_at_the_end(*args, **kwargs):
        calls["n"] += 1
        res = real(*args, **kwargs)
        return {k: float("nan") if calls["n"] == 2 and k == "image" else v for k, v in res.items()}
    monkeypatch.setattr(train, "evaluate_all", down_at_the_end)
    out = tmp_path / "run"
    with pytest.raises(RunFailed, match=rf"not measured: the held-out reward of image .* --run={out}$"):
        train.main([*RUN, f"--sft_dir={sft_dir}", f"--out_dir={out}"])
    summary = json.loads((out / "summary.json").read_text())  # strict JSON: NaN would not parse in most readers
    assert summary["image"]["after"] is None and summary["image"]["before"] is not None
    assert "image not measured" in capsys.readouterr().out


def test_full_disk_during_the_final_save_is_one_line_and_the_command_finishes(sft_dir, tmp_path, monkeypatch):
    """final/ cannot be written (ENOSPC): one line naming the kept checkpoint of the last step and the
    --resume=true command, which redoes the final evaluation and save."""
    from infra import hf

    real = hf.save_pretrained

    def full(model, path, *args, **kwargs):
        if path.name == "final":
            raise OSError(errno.ENOSPC, "No space left on device", str(path / "model.safetensors"))
        return real(model, path, *args, **kwargs)
    monkeypatch.setattr(hf, "save_pretrained", full)
    out = tmp_path / "run"
    args = [*RUN, "--tasks=text", f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=2", "--checkpoint_every=1"]
    with pytest.raises(RunFailed) as e:
        train.main(args)
    msg = str(e.value)
    assert msg.startswith("the disk is full (No space left on device") and "step-00000002, is kept" in msg, msg
    monkeypatch.setattr(hf, "save_pretrained", real)
    summary = train.main(command_in(msg))
    assert "text" in summary and (out / "final" / "config.json").is_file()
