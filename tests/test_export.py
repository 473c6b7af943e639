"""`python -m infra.load OUT/checkpoints/step-N DEST` turns an intermediate checkpoint into a model folder
that sample.py and evaluate.py take: the checkpoint of the last step equals the run's final/ (saved by
the live run), an earlier one does not, with full fine-tuning and with LoRA.

    OMP_NUM_THREADS=1 python -m pytest tests/test_export.py -q -p no:xdist
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluate
import train
from infra import hf, load
from conftest import run_main

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--preset=smoke", "--threads=1", "--sample_every=0", "--eval_prompts=1", "--tasks=image", "--rl_steps=2",
       "--checkpoint_every=1", "--keep_last=0"]


def weights(path):
    return {k: v.detach() for k, v in hf.from_pretrained(path).named_parameters()}


@pytest.mark.parametrize("lora", [False, True])
def test_the_last_checkpoint_exported_is_the_final_model(smoke_sft_run, tmp_path, lora):
    out = tmp_path / "run"
    start = ([f"--init_from={smoke_sft_run / 'final'}", "--lora_rank=4", "--lr=0.01"] if lora else
             [f"--sft_dir={smoke_sft_run / 'sft'}"])
    train.main([*RUN, *start, f"--out_dir={out}"])
    last, first = tmp_path / "last", tmp_path / "first"
    load.main([str(out / "checkpoints" / "step-00000002"), str(last)])
    load.main([str(out / "checkpoints" / "step-00000001"), str(first)])
    final, got, early = weights(out / "final"), weights(last), weights(first)
    assert final.keys() == got.keys() and all(torch.equal(final[k], got[k]) for k in final)
    assert any(not torch.equal(final[k], early[k]) for k in final)  # step 1's policy, not step 2's
    assert evaluate.main(["--ckpt", str(first), "--task", "image", "--limit=2", "--samples=1"]) == 0


def test_export_refuses_in_one_line(smoke_sft_run, tmp_path, monkeypatch, capsys):
    run = smoke_sft_run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    cases = [([str(run / "final"), str(tmp_path / "x")], "is not a complete checkpoint"),
             ([str(tmp_path / "nothing")], "pass a checkpoint and a new folder")]
    for argv, message in cases:
        code = run_main(["-m", "infra.load", *argv], monkeypatch)
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("entry", ["evaluate.py", "tools.sample", "train.py"])
@pytest.mark.parametrize("how", ["in process", pytest.param("command", marks=pytest.mark.slow)])
def test_a_training_checkpoint_given_as_a_model_names_the_export(tmp_path, entry, how, monkeypatch, capsys):
    """checkpoints/step-N where a model folder is needed: one line with the command that converts it. The
    entry point's __main__ block in this process (conftest.run_main), and as a command (slow: a second each)."""
    step = tmp_path / "run" / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    flag = "--init_from" if entry == "train.py" else "--ckpt"
    extra = {"evaluate.py": ["--task=text"], "tools.sample": ["--prompt=a"], "train.py": ["--tasks=text",
             f"--out_dir={tmp_path / 'new'}"]}[entry]
    args = [*(["-m", entry] if entry.startswith("tools.") else [entry]), f"{flag}={step}", *extra]
    if how == "command":
        p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
        code, err = p.returncode, p.stderr
    else:
        code, err = run_main(args, monkeypatch), capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"python -m infra.load {step} {tmp_path / 'run-step-00000004'}" in err, err


def test_export_after_a_code_change_reads_the_sft_model_by_content(smoke_sft_run, tmp_path, monkeypatch):
    """The SFT model's settings key includes a hash of the toy code, so an edit of tasks.py makes a new run
    retrain SFT; exporting an old run's checkpoint must still work (the model's content is what is checked)."""
    import shutil

    sft = tmp_path / "sft"
    shutil.copytree(smoke_sft_run / "sft", sft)
    out = tmp_path / "run"
    train.main([*RUN, "--rl_steps=1", f"--sft_dir={sft}", f"--out_dir={out}"])
    key = load.sft_key  # the code changed since: its hash is another
    monkeypatch.setattr(load, "sft_key", lambda cfg: {**key(cfg), "toy_sha1": "the toy code after an edit"})
    with pytest.raises(ValueError, match="holds an SFT model trained with other settings"):
        load.check_sft_cache(train.parse_args([*RUN, f"--sft_dir={sft}"]))  # a new run would retrain
    dest = tmp_path / "exported"
    load.main([str(out / "checkpoints" / "step-00000001"), str(dest)])
    final, got = weights(out / "final"), weights(dest)
    assert all(torch.equal(final[k], got[k]) for k in final)
