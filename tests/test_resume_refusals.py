"""Resume continues the same run or refuses: a changed learning rate or gradient clip is refused unless
--change_on_resume names it, and then log.jsonl records the step where it changed; a stop step below the
checkpoint's is refused, and the run stays resumable and extendable.

    OMP_NUM_THREADS=1 python -m pytest tests/test_resume_refusals.py -q
"""
import json
import shutil

import pytest

import train
from infra import checkpoint

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels

TINY = ["--preset=smoke", "--threads=1", "--sample_every=0", "--eval_prompts=1", "--checkpoint_every=1"]


@pytest.fixture(scope="module")
def cut_once(smoke_sft_run, tmp_path_factory):
    """A run of rl_steps=4 stopped after its step-2 checkpoint (as a kill would leave it: no final/)."""
    out = tmp_path_factory.mktemp("cut") / "run"
    train.main([*TINY, f"--sft_dir={smoke_sft_run / 'sft'}", f"--out_dir={out}", "--rl_steps=2"])
    for name in ("summary.json", "curves.png", "images.png"):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "final")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "rl_steps": 4}))
    state = json.loads((checkpoint.latest(out) / "state.json").read_text())
    state["config"]["rl_steps"] = 4
    (checkpoint.latest(out) / "state.json").write_text(json.dumps(state))
    return out


@pytest.fixture
def cut(cut_once, smoke_sft_run, tmp_path):
    """A copy of cut_once for the test to resume (out_dir may change on resume), and its arguments."""
    out = tmp_path / "run"
    shutil.copytree(cut_once, out)
    return out, [*TINY, f"--sft_dir={smoke_sft_run / 'sft'}", f"--out_dir={out}", "--rl_steps=4"]


@pytest.mark.parametrize("flag,value,saved", [("lr", "0.05", 1e-4), ("grad_clip", "0.5", 1.0)])
def test_result_changing_setting_is_refused_on_resume(cut, flag, value, saved):
    out, args = cut
    before = (out / "log.jsonl").read_text()
    with pytest.raises(ValueError) as e:
        train.main([*args, "--resume=true", f"--{flag}={value}"])
    msg = str(e.value)
    assert f"these settings differ from the saved run: {flag} {saved!r} -> {float(value)!r}" in msg, msg
    assert f"--change_on_resume={flag}" in msg, msg
    assert (out / "log.jsonl").read_text() == before and checkpoint.latest(out).name == "step-00000002"


def test_change_on_resume_changes_it_and_the_log_records_the_step(cut):
    out, args = cut
    train.main([*args, "--resume=true", "--lr=0.05", "--change_on_resume=lr"])
    steps = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert [s.get("changed") for s in steps] == [None, None, {"lr": [1e-4, 0.05]}, None]
    assert json.loads((out / "config.json").read_text())["lr"] == 0.05


@pytest.mark.parametrize("argv,message", [
    (["--change_on_resume=lr"], "--change_on_resume changes settings of a run being continued: pass --resume=true"),
    (["--resume=true", "--change_on_resume=lr,seed"], "change_on_resume ('lr,seed') names seed: only lr or "
                                                       "grad_clip may change"),
])
def test_change_on_resume_is_checked(argv, message, tmp_path):
    with pytest.raises(ValueError) as e:
        train.main([*TINY, f"--out_dir={tmp_path / 'x'}", *argv])
    assert message in str(e.value), str(e.value)


def test_stop_step_below_the_checkpoint_is_refused(cut):
    """--rl_steps=1 on a run checkpointed at step 2: refused (nothing written), and the run then finishes
    with its own rl_steps and extends as any finished run."""
    out, args = cut
    with pytest.raises(ValueError) as e:
        train.main([*args, "--resume=true", "--rl_steps=1"])
    msg = str(e.value)
    assert "at --rl_steps=1: its checkpoint step-00000002 has taken 2 RL steps already" in msg, msg
    assert "pass --rl_steps=4 (the run's own) or more" in msg, msg
    assert not (out / "final").exists() and not (out / "summary.json").exists()
    train.main([*args, "--resume=true"])
    train.main([*args[:-1], "--rl_steps=5", "--resume=true", "--extend=true"])
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [0, 1, 2, 3, 4]


def test_change_on_resume_naming_an_unchanged_setting_is_warned_about(cut, capsys):
    out, args = cut
    train.main([*args, "--resume=true", "--change_on_resume=grad_clip"])
    text = capsys.readouterr().out
    assert "warning: --change_on_resume names grad_clip, which the run already has; nothing changes" in text, text
    assert all("changed" not in json.loads(x) for x in (out / "log.jsonl").read_text().splitlines())
