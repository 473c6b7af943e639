"""Nothing a user made is destroyed: a shared SFT model trained with other settings, a finished run, and a
finished (or interrupted) evaluation all survive a rerun; Ctrl-C during SFT stops cleanly.

    OMP_NUM_THREADS=1 python -m pytest tests/test_nothing_lost.py -q
"""
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import evaluate
import tasks
import train
from infra import data, hf
from infra.run import RunFailed

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels

# A two-step SFT and no RL: enough to leave a complete run (sft/, final/, summary.json, log.jsonl).
TINY = ["--preset=smoke", "--threads=1", "--sample_every=0", "--sft_steps=2", "--rl_steps=0", "--eval_prompts=1"]


def tree_digest(root: Path) -> dict:
    """{relative path: sha1 of its bytes} of every file under root: equal digests mean nothing changed."""
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished toy run (out_dir) with its SFT model in out_dir/sft."""
    out = tmp_path_factory.mktemp("finished")
    train.main([*TINY, f"--out_dir={out}"])
    return out


@pytest.fixture
def shared_sft(finished, tmp_path):
    """A copy of the finished run's SFT model, as a --sft_dir several runs share."""
    import shutil

    d = tmp_path / "shared-sft"
    shutil.copytree(finished / "sft", d)
    return d


# -----------------------------------------------------------------------------------------------------
# a shared SFT model


def test_sft_model_of_other_settings_is_refused_not_overwritten(shared_sft, tmp_path):
    before = tree_digest(shared_sft)
    with pytest.raises(ValueError) as e:
        train.main([*TINY, f"--sft_dir={shared_sft}", f"--out_dir={tmp_path / 'run'}", "--seed=1", "--sft_steps=3"])
    msg = str(e.value)
    # The message names the directory, every differing setting with both values, and the two ways out.
    assert str(shared_sft) in msg and "seed 0 -> 1" in msg and "sft_steps 2 -> 3" in msg, msg
    assert "--retrain_sft=true" in msg and "--sft_dir" in msg, msg
    assert tree_digest(shared_sft) == before


def test_retrain_sft_replaces_the_model(shared_sft, tmp_path):
    train.main([*TINY, f"--sft_dir={shared_sft}", f"--out_dir={tmp_path / 'run'}", "--seed=1", "--retrain_sft=true"])
    assert json.loads((shared_sft / "sft_meta.json").read_text())["seed"] == 1


def test_sft_trains_only_the_runs_toy_tasks(tmp_path, monkeypatch):
    """A text-only run spends no SFT on images; the model it saves serves text runs and is refused, with
    the tasks named, by a run that also needs images. The toy's two-task model serves a text-only run."""
    seen = []
    loss = train.diffusion_loss

    def recording_loss(model, b, *args, **kwargs):
        seen.append(b.task)
        return loss(model, b, *args, **kwargs)
    monkeypatch.setattr(train, "diffusion_loss", recording_loss)
    text_sft = tmp_path / "text-sft"
    train.main([*TINY, "--tasks=text", f"--sft_dir={text_sft}", f"--out_dir={tmp_path / 'a'}"])
    assert seen == ["text", "text"]  # two SFT steps, one text batch each
    assert json.loads((text_sft / "sft_meta.json").read_text())["sft_tasks"] == ["text"]
    before = tree_digest(text_sft)
    with pytest.raises(ValueError) as e:
        train.main([*TINY, f"--sft_dir={text_sft}", f"--out_dir={tmp_path / 'b'}"])
    assert "toy tasks ['text'] -> ['text', 'image']" in str(e.value), str(e.value)
    assert tree_digest(text_sft) == before
    seen.clear()
    both_sft = tmp_path / "both-sft"
    train.main([*TINY, f"--sft_dir={both_sft}", f"--out_dir={tmp_path / 'c'}"])
    assert seen == ["text", "image", "text", "image"]
    seen.clear()
    train.main([*TINY, "--tasks=text", f"--sft_dir={both_sft}", f"--out_dir={tmp_path / 'd'}"])
    assert seen == []  # reused, not retrained


def test_sft_model_saved_without_its_tasks_counts_as_both(shared_sft, tmp_path):
    """sft_meta.json written before the trained tasks were recorded: those models were trained on both."""
    meta = json.loads((shared_sft / "sft_meta.json").read_text())
    del meta["sft_tasks"]
    (shared_sft / "sft_meta.json").write_text(json.dumps(meta))
    train.main([*TINY, "--tasks=text", f"--sft_dir={shared_sft}", f"--out_dir={tmp_path / 'run'}"])
    assert "sft_tasks" not in json.loads((shared_sft / "sft_meta.json").read_text())  # reused as it was


def test_interrupted_retraining_keeps_the_old_model(shared_sft, tmp_path, monkeypatch):
    """The cache is written beside the old one and swapped in at the end: a crash while the new weights
    are being written leaves the old model, with its sft_meta.json, as it was."""
    before = tree_digest(shared_sft)

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf, "save_pretrained", crash)
    with pytest.raises(RunFailed, match=r"^the disk is full \(No space left on device\); no checkpoint"):
        train.main([*TINY, f"--sft_dir={shared_sft}", f"--out_dir={tmp_path / 'run'}", "--seed=1",
                    "--retrain_sft=true"])
    assert tree_digest(shared_sft) == before
    assert sorted(p.name for p in shared_sft.parent.iterdir()) == ["run", "shared-sft"]  # no temporary left


def test_ctrl_c_during_sft_stops_cleanly(tmp_path, monkeypatch, capsys):
    """SIGINT in the middle of SFT: the step finishes, the run exits with 128 + 2 and says that SFT will
    restart; nothing half-trained is left in --sft_dir."""
    calls = {"n": 0}
    loss = train.diffusion_loss

    def interrupted_loss(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # during the second SFT step (two tasks per step)
            os.kill(os.getpid(), signal.SIGINT)
        return loss(*args, **kwargs)
    monkeypatch.setattr(train, "diffusion_loss", interrupted_loss)
    sft_dir = tmp_path / "sft"
    with pytest.raises(SystemExit) as e:
        train.main([*TINY, f"--sft_dir={sft_dir}", f"--out_dir={tmp_path / 'run'}", "--sft_steps=50"])
    assert e.value.code == 128 + signal.SIGINT
    out = capsys.readouterr().out
    assert "SFT stopped by SIGINT after 2 of 50 steps" in out and "restarts SFT from step 0" in out, out
    assert calls["n"] == 4  # the interrupted step was finished, no later one was started
    assert not sft_dir.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# -----------------------------------------------------------------------------------------------------
# a finished run


def test_finished_run_is_refused_not_overwritten(finished):
    """A run without checkpoints (checkpoint_every=0, as in the smoke preset) is still a finished run; with
    --resume=true it is reported as finished (tests/test_phases.py)."""
    before = tree_digest(finished)
    with pytest.raises(ValueError, match=rf"out_dir {finished} holds a finished run \(final/, "
                                         r"summary.json\) and no checkpoint") as e:
        train.main([*TINY, f"--out_dir={finished}"])
    assert "choose another --out_dir" in str(e.value) and "delete" not in str(e.value)
    assert tree_digest(finished) == before


def test_a_running_run_holds_its_out_dir(tmp_path):
    """Two runs started at once in one out_dir both see it empty; the second must refuse, not overwrite."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "run"
        out.mkdir()
        (out / "run.pid").write_text(f"{holder.pid}\n")
        with pytest.raises(ValueError, match=rf"out_dir {out} is in use by the running process {holder.pid}") as e:
            train.main([*TINY, f"--out_dir={out}"])
        assert "choose another --out_dir" in str(e.value)
        assert sorted(p.name for p in out.iterdir()) == ["run.pid"]  # nothing of the second run was written
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_runs_pid_file_is_taken_over_and_released(tmp_path):
    """A killed run leaves run.pid behind; a later run takes the directory over and removes the file at
    the end, so the directory then reads as an ordinary finished run."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.pid").write_text(f"{gone.pid}\n")
    summary = train.main([*TINY, f"--out_dir={out}"])
    assert "text" in summary and (out / "summary.json").is_file()
    assert not (out / "run.pid").exists()


# -----------------------------------------------------------------------------------------------------
# a finished evaluation


def _no_evaluation(*args, **kwargs):
    raise AssertionError("evaluated before --out was checked")


@pytest.mark.parametrize("bad,reason", [("dir", "is a directory"), ("file/under/a/file.jsonl", "not a directory"),
                                        ("done.jsonl", "already exists")])
def test_evaluate_checks_out_before_evaluating(finished, tmp_path, monkeypatch, capsys, bad, reason):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "done.jsonl").write_text('{"reward": 1.0}\n')
    monkeypatch.setattr(data, "evaluate", _no_evaluation)
    out = tmp_path / bad
    assert evaluate.main(["--ckpt", str(finished / "final"), "--task", "text", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out {out} ") and reason in err.lower() and "\n" not in err, err
    assert (tmp_path / "done.jsonl").read_text() == '{"reward": 1.0}\n'


def test_interrupted_evaluation_keeps_what_it_scored(finished, tmp_path, monkeypatch, capsys):
    """Records are written as each batch of 64 is scored: Ctrl-C in the third batch keeps the first two."""
    score = tasks.score
    calls = {"n": 0}

    def interrupted_score(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return score(*args, **kwargs)
    monkeypatch.setattr(tasks, "score", interrupted_score)
    out = tmp_path / "eval.jsonl"
    code = evaluate.main(["--ckpt", str(finished / "final"), "--task", "text", "--limit=200", "--samples=0",
                          "--out", str(out)])
    assert code == 130
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_index"] for r in lines] == list(range(128))
    assert f"128 scored completions in {out}" in capsys.readouterr().err


# -----------------------------------------------------------------------------------------------------
# a run writes only into its own out_dir: every refusal comes before anything is written, and no advice
# destroys anything


@pytest.fixture
def model_copy(finished, tmp_path):
    """A copy of the finished run's final/ model, as a user's model folder."""
    import shutil

    d = tmp_path / "model"
    shutil.copytree(finished / "final", d)
    return d


def refused(capsys, argv) -> str:
    """Run train.py as the command line does; the one-line error (exit 2)."""
    from infra import cli

    with pytest.raises(SystemExit) as e, cli.user_errors():
        train.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_training_in_place_is_refused_and_the_model_kept(model_copy, capsys):
    """--init_from=X --out_dir=X ("train in place") wrote the run's config.json over the model's."""
    before = tree_digest(model_copy)
    err = refused(capsys, [*TINY, "--tasks=text", f"--init_from={model_copy}", f"--out_dir={model_copy}"])
    assert f"--init_from {model_copy} is --out_dir {model_copy}" in err and "a new folder as --out_dir" in err, err
    assert tree_digest(model_copy) == before


@pytest.mark.parametrize("where", ["model", "sft"])
def test_out_dir_naming_a_model_is_refused(finished, model_copy, tmp_path, capsys, where):
    """Flags swapped: --out_dir names a model folder (or another run's SFT model): refused, nothing written."""
    out = model_copy if where == "model" else finished / "sft"
    before = tree_digest(out)
    err = refused(capsys, [*TINY, "--tasks=text", f"--init_from={finished / 'final'}", f"--out_dir={out}"])
    assert f"--out_dir {out} holds a model" in err, err
    assert ("sft_meta.json" if where == "sft" else "config.json (a model's, not a run's)") in err, err
    assert tree_digest(out) == before


def test_init_from_inside_out_dir_is_refused(finished, capsys):
    """A run's final/ as --init_from and the run itself as --out_dir: the final save would replace the model."""
    before = tree_digest(finished)
    err = refused(capsys, [*TINY, "--tasks=text", f"--init_from={finished / 'final'}", f"--out_dir={finished}",
                           "--resume=true", "--extend=true", "--rl_steps=1"])
    assert "lies inside --out_dir" in err, err
    assert tree_digest(finished) == before


def test_a_folder_of_other_things_is_refused(tmp_path, capsys):
    assert "--out_dir is empty" in refused(capsys, [*TINY, "--out_dir="])
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    err = refused(capsys, [*TINY, f"--out_dir={tmp_path}"])
    assert "holds no run of train.py (data, notes.txt)" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


def test_sft_dir_equal_to_out_dir_is_refused_even_with_retrain(finished, capsys):
    """The refusal used to advise --retrain_sft=true, which then moved the out_dir aside and deleted it."""
    before = tree_digest(finished)
    for extra in ([], ["--retrain_sft=true"]):
        err = refused(capsys, [*TINY, f"--out_dir={finished}", f"--sft_dir={finished}", *extra])
        assert f"--sft_dir {finished} is --out_dir {finished}" in err and "--retrain_sft" not in err, err
    assert tree_digest(finished) == before


def test_sft_dir_holding_a_run_or_a_model_is_never_replaced(finished, model_copy, tmp_path, capsys):
    """--sft_dir naming a folder that is not an SFT model (another run, a model): --retrain_sft=true does
    not replace it, and no advice says it would."""
    for folder in (finished, model_copy):
        before = tree_digest(folder)
        err = refused(capsys, [*TINY, f"--out_dir={tmp_path / 'run'}", f"--sft_dir={folder}", "--retrain_sft=true"])
        assert f"sft_dir {folder} holds files" in err and "left as it is" in err and "--retrain_sft" not in err, err
        assert tree_digest(folder) == before


def test_an_empty_log_from_a_crash_in_the_first_step_does_not_block(tmp_path, monkeypatch, capsys):
    """A crash in the first RL step leaves config.json and an empty log.jsonl: the same command starts the
    run again (nothing of it is lost); the SFT model beside it is reused, never deleted."""
    out = tmp_path / "run"

    def crash(*args, **kwargs):
        raise RuntimeError("crash in the first step")
    real = train.rl_step
    monkeypatch.setattr(train, "rl_step", crash)
    with pytest.raises(RuntimeError):
        train.main([*TINY, f"--out_dir={out}", "--rl_steps=1"])
    assert (out / "log.jsonl").read_text() == "" and (out / "sft" / "sft_meta.json").is_file()
    sft = tree_digest(out / "sft")
    monkeypatch.setattr(train, "rl_step", real)
    summary = train.main([*TINY, f"--out_dir={out}", "--rl_steps=1"])
    assert "text" in summary and "took no RL step" in capsys.readouterr().out
    assert tree_digest(out / "sft") == sft


def test_an_unfinished_run_without_checkpoint_names_one_command(tmp_path, monkeypatch, capsys):
    """A crash after logged steps but before any checkpoint: the same command is refused with the one
    command that restarts it (--resume=true), which then runs to the end."""
    out = tmp_path / "run"
    real, calls = train.rl_step, {"n": 0}

    def crash_second(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("crash in the second step")
        return real(*args, **kwargs)
    monkeypatch.setattr(train, "rl_step", crash_second)
    args = [*TINY, f"--out_dir={out}", "--rl_steps=2"]
    with pytest.raises(RuntimeError):
        train.main(args)
    monkeypatch.setattr(train, "rl_step", real)
    with pytest.raises(ValueError, match="1 RL step\\(s\\) in log.jsonl.*--resume=true restarts it from step 0"):
        train.main(args)
    summary = train.main(args + ["--resume=true"])
    assert "text" in summary
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [0, 1]
