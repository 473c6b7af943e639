"""Every moment of a run is covered: a signal in any phase (SFT, the evaluation before RL, an RL step, the
final evaluation, the final save) finishes the phase or stops at once, says what was kept and the command
that continues, and --resume then continues; the last RL step is checkpointed before the final evaluation.
Shared and mistyped paths (--sft_dir, --resume's out_dir) and finished runs are safe.

    OMP_NUM_THREADS=1 python -m pytest tests/test_phases.py -q
"""
import json
import os
import signal
import subprocess
import sys

import pytest

import tasks
import train
from infra import checkpoint, data, run as run_mod
from test_nothing_lost import TINY, tree_digest

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    """One SFT model shared by the runs below (SFT itself is not what is tested here)."""
    out = tmp_path_factory.mktemp("sft-run")
    train.main([*TINY, f"--out_dir={out}"])
    return out / "sft"


def no_sft(*args, **kwargs):
    raise AssertionError("SFT started before the paths were checked")


def signal_on_call(monkeypatch, module, name, n, sig, times=1):
    """Replace module.name by a wrapper that sends `sig` to this process `times` times on its n-th call (1-based),
    after checking that a handler is installed (without one SIGTERM ends the process silently)."""
    calls, original = {"n": 0}, getattr(module, name)

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.default_int_handler, None), \
                f"no {sig.name} handler in {name}: the signal would end the run silently"
            for _ in range(times):
                os.kill(os.getpid(), sig)
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)
    return calls


# -----------------------------------------------------------------------------------------------------
# signals, phase by phase


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_model_loading_stops_at_once(sft_dir, tmp_path, monkeypatch, capsys, sig):
    """Loading the starting model (here the SFT model as --init_from, first of its two loads): the run stops at
    once with one line naming the command, and that same command then runs."""
    from infra import load
    out = tmp_path / "run"
    args = [*TINY, f"--init_from={sft_dir}", f"--out_dir={out}", "--rl_steps=1"]
    calls = signal_on_call(monkeypatch, load, "load_sharded", 1, sig)
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert e.value.code == 128 + sig and calls["n"] == 1
    text = capsys.readouterr().out
    assert f"stopped by {sig.name} during start-up (loading data or the model, before any RL step)" in text, text
    assert f"start it again with: python train.py {' '.join(args)}" in text and "--resume" not in text, text
    monkeypatch.undo()
    assert "text" in train.main(args)


def test_signal_while_loading_data_stops_at_once(tmp_path, monkeypatch, capsys):
    from infra import run  # train.main's start-up (infra/run.start) loads the data
    calls = signal_on_call(monkeypatch, run.data, "load_data", 1, signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        train.main([*TINY, f"--out_dir={tmp_path / 'run'}"])
    assert e.value.code == 128 + signal.SIGTERM and calls["n"] == 1
    assert "stopped by SIGTERM during start-up" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_signal_during_the_sft_save_waits_for_it(tmp_path, monkeypatch, capsys):
    """A signal while the SFT model is written lets the save and its rename finish (a model moved aside half
    way would be lost), then stops; the next run reuses the saved model."""
    from infra import hf
    out = tmp_path / "run"
    args = [*TINY, f"--out_dir={out}", "--sft_steps=3"]
    signal_on_call(monkeypatch, hf, "save_pretrained", 1, signal.SIGINT)
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert e.value.code == 130
    text = capsys.readouterr().out
    assert "saved the SFT model to" in text and "stopped by SIGINT during start-up" in text, text
    assert (out / "sft" / "sft_meta.json").is_file()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".sft")]  # no temporary or old copy left
    monkeypatch.undo()
    train.main(args)
    assert "loading the SFT model from" in capsys.readouterr().out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_final_evaluation_keeps_the_last_step(sft_dir, tmp_path, monkeypatch, capsys, sig):
    """3 RL steps, a checkpoint every 2: the last step is checkpointed before the final evaluation; a signal
    in it stops after the batch, names the checkpoint and the command; --resume=true finishes the run."""
    out = tmp_path / "run"
    args = [*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=3", "--checkpoint_every=2"]
    # before RL: text, text greedy, image (3 evaluations); the 4th is the first of the final evaluation
    signal_on_call(monkeypatch, data, "evaluate", 4, sig)
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert e.value.code == 128 + sig
    text = capsys.readouterr().out
    last = out / "checkpoints" / "step-00000003"
    assert f"stopped by {sig.name} during the final held-out evaluation: {last} holds the model after all 3 " \
           "RL steps" in text, text
    assert f"python train.py {' '.join(args)} --resume=true" in text, text
    assert checkpoint.latest(out) == last
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    monkeypatch.undo()
    summary = train.main([*args, "--resume=true"])
    text = capsys.readouterr().out
    assert f"resumed from {last} at step 3" in text and "image" in summary
    assert (out / "final" / "config.json").is_file() and len((out / "log.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("module,name,n,sig,where", [
    (train, "rl_step", 1, signal.SIGHUP, "RL step 0: step 0 is lost"),
    (data, "evaluate", 4, signal.SIGTERM, "the final evaluation or save: {last} holds the model after all 1 RL"),
    (data, "evaluate", 1, signal.SIGTERM, "the held-out evaluation before RL: no RL step was taken"),
])
def test_a_second_signal_is_named_as_sent(sft_dir, tmp_path, monkeypatch, capsys, module, name, n, sig, where):
    """A second SIGTERM or SIGHUP (a scheduler's or a closed terminal's, not Ctrl-C) drops the work at once: its
    line names that signal and the exit status is 128 + it, in an RL step and in the final evaluation."""
    out = tmp_path / "run"
    args = [*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=1", "--checkpoint_every=1"]
    monkeypatch.setattr(checkpoint, "REPEAT_WINDOW", -1.0)  # the second signal is a new one, not a repeat
    calls = signal_on_call(monkeypatch, module, name, n, sig, times=2)
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert e.value.code == 128 + sig and calls["n"] == n
    text = capsys.readouterr().out
    last = out / "checkpoints" / "step-00000001"
    assert f"caught {sig.name}: " in text and "SIGINT" not in text and "Ctrl-C again" not in text, text
    assert f"a second signal (another {sig.name} or Ctrl-C, after" in text, text
    assert f"aborted by a second {sig.name} during {where.format(last=last)}" in text, text
    if "before RL" in where:  # the caught line says what the evaluation's stop does and loses, not an RL step's
        assert "finishing this evaluation batch, then stopping" in text and "RL step 0" not in text, text
        assert "stops at once: no RL step was taken, so nothing more is lost" in text, text


def test_a_second_signal_while_the_stop_writes_the_checkpoint(sft_dir, tmp_path, monkeypatch, capsys):
    """checkpoint_every=0: the first SIGTERM in the final evaluation writes the last step's checkpoint; a second one
    during that save drops it at once, in one line naming SIGTERM (no traceback), exit status 128 + SIGTERM."""
    out = tmp_path / "run"
    monkeypatch.setattr(checkpoint, "REPEAT_WINDOW", -1.0)  # the second signal is a new one, not a repeat
    signal_on_call(monkeypatch, data, "evaluate", 4, signal.SIGTERM)
    calls = signal_on_call(monkeypatch, checkpoint, "save", 1, signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        train.main([*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=1"])
    assert e.value.code == 128 + signal.SIGTERM and calls["n"] == 1
    text = capsys.readouterr().out
    assert "aborted by a second SIGTERM during the final evaluation or save: no checkpoint of the last RL step " \
           "was written (checkpoint_every=0), so the RL steps are lost; restart the run with: " in text, text
    assert checkpoint.latest(out) is None


def test_without_cadence_the_stop_writes_the_checkpoint(sft_dir, tmp_path, monkeypatch, capsys):
    """checkpoint_every=0: nothing is written before the final evaluation; a signal in it writes the last
    step's checkpoint then."""
    out = tmp_path / "run"
    args = [*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=1"]
    signal_on_call(monkeypatch, data, "evaluate", 5, signal.SIGINT)  # the final evaluation's second
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert e.value.code == 130
    assert checkpoint.latest(out).name == "step-00000001"
    assert "holds the model after all 1 RL steps" in capsys.readouterr().out


def test_signal_during_evaluation_before_rl(sft_dir, tmp_path, monkeypatch, capsys):
    """Stopped after the first evaluation batch before RL: no step taken, nothing but config.json left, and
    the command printed starts the run again."""
    out = tmp_path / "run"
    args = [*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=2"]
    calls = signal_on_call(monkeypatch, data, "evaluate", 1, signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert e.value.code == 128 + signal.SIGTERM and calls["n"] == 1
    text = capsys.readouterr().out
    assert "stopped by SIGTERM during the held-out evaluation before RL: no RL step was taken" in text, text
    assert f"the SFT model in {sft_dir} is kept" in text and "--resume=true" in text
    # (run.pid is this test process's until it exits, then removed by the exit hook)
    assert sorted(p.name for p in out.iterdir() if p.name != "run.pid") == ["config.json"]
    monkeypatch.undo()
    train.main([*args, "--resume=true"])
    assert len((out / "log.jsonl").read_text().splitlines()) == 2


def test_signal_during_the_final_save_finishes_it(sft_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    signal_on_call(monkeypatch, run_mod.load, "save_model", 1, signal.SIGINT)
    with pytest.raises(SystemExit) as e:
        train.main([*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=1"])
    assert e.value.code == 130
    text = capsys.readouterr().out
    assert "caught SIGINT: finishing the final save first (the run is then complete)" in text, text
    assert "stopped by SIGINT after the final save: the run is complete" in text, text
    assert (out / "summary.json").is_file() and (out / "final" / "config.json").is_file()


def test_sft_signal_line_promises_no_checkpoint(tmp_path, monkeypatch, capsys):
    """SFT keeps no checkpoint, so the caught-signal line must not promise one."""
    signal_on_call(monkeypatch, train, "diffusion_loss", 1, signal.SIGINT)
    with pytest.raises(SystemExit):
        train.main([*TINY, f"--out_dir={tmp_path / 'run'}", "--sft_steps=20"])
    text = capsys.readouterr().out
    assert "caught SIGINT: finishing this SFT step, then stopping (SFT keeps no checkpoint)" in text, text
    assert "writing a checkpoint" not in text
    assert "a second signal (Ctrl-C again, after 5 s) stops at once: nothing more is lost, SFT restarts from step 0" in text, text
    assert "SFT stopped by SIGINT after 1 of 20 steps" in text and "start it again with: python train.py" in text


# -----------------------------------------------------------------------------------------------------
# --resume: a run to continue, a finished run, real conflicts


def test_resume_of_a_missing_out_dir_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "sft", no_sft)
    out = tmp_path / "typo"
    with pytest.raises(ValueError, match=rf"--resume: out_dir {out} holds no run \(no config.json, no checkpoints/\)"):
        train.main([*TINY, f"--out_dir={out}", "--resume=true"])
    assert not out.exists()


@pytest.fixture(scope="module")
def finished_with_checkpoint(sft_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("done") / "run"
    train.main([*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=1", "--checkpoint_every=1"])
    return out


def test_resume_of_a_finished_run_rewrites_nothing(sft_dir, finished_with_checkpoint, monkeypatch, capsys):
    out = finished_with_checkpoint
    before = tree_digest(out)
    monkeypatch.setattr(data, "evaluate", no_sft)
    summary = train.main([*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=1", "--checkpoint_every=1",
                          "--resume=true"])
    assert summary == json.loads((out / "summary.json").read_text())
    assert f"out_dir {out} holds a finished run (1 RL steps" in capsys.readouterr().out
    assert tree_digest(out) == before


def test_extending_a_finished_run_needs_extend(sft_dir, finished_with_checkpoint, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_with_checkpoint, out)
    args = [*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--checkpoint_every=1", "--resume=true"]
    before = tree_digest(out)
    with pytest.raises(ValueError, match=r"holds a finished run of 1 RL steps; --rl_steps=2 would train it further "
                                         r"and replace its final/ and summary.json: pass --extend=true"):
        train.main([*args, "--rl_steps=2"])
    with pytest.raises(ValueError, match=r"--rl_steps=0 asks for fewer"):
        train.main([*args, "--rl_steps=0"])
    assert tree_digest(out) == before
    train.main([*args, "--rl_steps=2", "--extend=true"])
    assert [json.loads(l)["step"] for l in (out / "log.jsonl").read_text().splitlines()] == [0, 1]


def test_resume_names_the_real_conflicts(sft_dir, finished_with_checkpoint, tmp_path, monkeypatch):
    """A stopped run resumed with another seed and group size: both are named (not the SFT cache, whose
    advice --retrain_sft would retrain the reference)."""
    monkeypatch.setattr(train, "sft", no_sft)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_bytes((finished_with_checkpoint / "config.json").read_bytes())
    with pytest.raises(ValueError) as e:
        train.main([*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=1", "--checkpoint_every=1",
                    "--resume=true", "--seed=1", "--group_size=3"])
    msg = str(e.value)
    assert f"cannot resume {out / 'config.json'}: these settings differ from the saved run: " in msg, msg
    assert "seed 0 -> 1" in msg and "group_size 4 -> 3" in msg and "retrain_sft" not in msg, msg


def test_resume_of_a_checkpoint_names_the_real_conflicts(sft_dir, finished_with_checkpoint, tmp_path, monkeypatch):
    """The same with a checkpoint: the seed (which the SFT cache also depends on) is named with the rest."""
    import shutil

    monkeypatch.setattr(train, "sft", no_sft)
    out = tmp_path / "run"
    shutil.copytree(finished_with_checkpoint, out)
    (out / "summary.json").unlink()  # stopped during its final evaluation
    with pytest.raises(ValueError, match=r"these settings differ from the saved run: group_size 4 -> 3, seed 0 -> 1$"):
        train.main([*TINY, f"--sft_dir={sft_dir}", f"--out_dir={out}", "--rl_steps=1", "--checkpoint_every=1",
                    "--resume=true", "--seed=1", "--group_size=3"])


# -----------------------------------------------------------------------------------------------------
# --sft_dir: checked before SFT, held while it trains


def test_sft_dir_that_is_a_file_is_refused_not_moved(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "sft", no_sft)
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    with pytest.raises(ValueError, match=rf"sft_dir {f}: it is a file, not a folder \(it is left as it is\)"):
        train.main([*TINY, f"--sft_dir={f}", f"--out_dir={tmp_path / 'run'}"])
    assert f.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_sft_dir_under_a_file_is_refused_before_sft(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "sft", no_sft)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=rf"sft_dir {tmp_path}/file/sft: {tmp_path}/file is a file, not a folder"):
        train.main([*TINY, f"--sft_dir={tmp_path / 'file' / 'sft'}", f"--out_dir={tmp_path / 'run'}"])


def test_sft_dir_being_trained_by_another_run_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "sft", no_sft)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        shared = tmp_path / "shared-sft"
        (tmp_path / "shared-sft.run.pid").write_text(f"{holder.pid}\n")
        with pytest.raises(ValueError, match=rf"sft_dir {shared} is being trained by the running process "
                                             rf"{holder.pid}") as e:
            train.main([*TINY, f"--sft_dir={shared}", f"--out_dir={tmp_path / 'run'}"])
        assert "pass another --sft_dir" in str(e.value)
        assert not shared.exists()
    finally:
        holder.kill()
        holder.wait()


def test_sft_dir_claim_is_held_during_sft_and_released(tmp_path, monkeypatch):
    seen = []
    sft = train.sft

    def watching_sft(*args, **kwargs):
        seen.append((tmp_path / "s.run.pid").read_text().strip())
        return sft(*args, **kwargs)
    monkeypatch.setattr(train, "sft", watching_sft)
    train.main([*TINY, f"--sft_dir={tmp_path / 's'}", f"--out_dir={tmp_path / 'run'}"])
    assert seen == [str(os.getpid())]
    assert not (tmp_path / "s.run.pid").exists() and (tmp_path / "s" / "sft_meta.json").is_file()
