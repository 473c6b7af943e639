"""An extension (--resume --extend to more RL steps) that stops before it finishes is an unfinished run: the same
command continues it to its end. config.json already holds the extension's --rl_steps while summary.json is still
the earlier finish's; reading the pair as "finished" left the run unfinishable.

    python -m pytest tests/test_extend_resume.py -q
"""
import json

import pytest

import train
from infra.run import Run

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels

RUN = ["--preset=smoke", "--threads=1", "--sample_every=0", "--checkpoint_every=1", "--eval_prompts=2",
       "--prompts_per_step=1", "--group_size=4"]


def steps(out):
    return [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]


def test_a_stopped_extension_continues_to_its_end(smoke_sft_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = [*RUN, f"--sft_dir={smoke_sft_run / 'sft'}", f"--out_dir={out}"]
    train.main([*args, "--rl_steps=1"])
    first = json.loads((out / "summary.json").read_text())
    save = Run._save_checkpoint

    def dies_at_3(self, step):  # the machine goes away after step 1 of the extension is logged (3 steps taken)
        if step == 3:
            raise RuntimeError("the machine went away")
        return save(self, step)
    extend = [*args, "--rl_steps=3", "--resume=true", "--extend=true"]
    with monkeypatch.context() as mp, pytest.raises(RuntimeError, match="went away"):
        mp.setattr(Run, "_save_checkpoint", dies_at_3)
        train.main(extend)
    assert steps(out) == [0, 1, 2] and json.loads((out / "summary.json").read_text()) == first
    capsys.readouterr()
    with pytest.raises(ValueError, match="stopped at step 2: pass --extend=true"):
        train.main([*args, "--rl_steps=3", "--resume=true"])  # without --extend: refused, by name
    with pytest.raises(ValueError, match="--rl_steps=1: its checkpoint step-00000002 has taken 2 RL steps"):
        train.main([*args, "--rl_steps=1", "--resume=true", "--extend=true"])
    summary = train.main(extend)  # the same command: continues from step 2 and finishes, never "nothing to do"
    assert "nothing to do" not in capsys.readouterr().out
    assert steps(out) == [0, 1, 2] and (out / "checkpoints" / "step-00000003").is_dir()
    assert summary == json.loads((out / "summary.json").read_text()) and summary != first
