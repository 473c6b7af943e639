"""Every output file has one writer: a second evaluate.py given the same --out is refused while the first
writes it (two processes), and the file holds the first one's complete, valid records; a refusal's advice
never replaces another run's files (--sft_dir pointing at another run's SFT model).

    OMP_NUM_THREADS=1 python -m pytest tests/test_one_writer.py -q
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import evaluate
import train

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels

ROOT = Path(__file__).resolve().parents[1]
# evaluate.py as the command line runs it, its first batch held until the file GO exists.
HELD = """
import os, sys, time
sys.argv[0] = "evaluate.py"
import evaluate
from infra import data
real, go = data.evaluate, os.environ["GO"]
def held(*a, **k):
    print("scoring begins", flush=True)
    for _ in range(2400):
        if os.path.exists(go):
            break
        time.sleep(0.05)
    return real(*a, **k)
data.evaluate = held
sys.exit(evaluate.main())
"""


@pytest.mark.slow  # two real evaluate.py processes (about 8 s); the lock is tested fast in one process below
def test_two_evaluations_with_one_out_file(smoke_sft_run, tmp_path):
    """The first evaluate.py holds --out while it scores; a second one started meanwhile with the same --out
    exits 2 naming the other writer; the first then completes the file: 4 greedy + 4 x 2 sampled records,
    every line valid JSON."""
    out, go = tmp_path / "eval.jsonl", tmp_path / "go"
    args = ["--preset=smoke", "--threads=1", "--eval_prompts=4", "--eval_samples=2",
            f"--ckpt={smoke_sft_run / 'final'}", "--task=text", f"--out={out}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", GO=str(go))
    first = subprocess.Popen([sys.executable, "-c", HELD, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        seen = ""
        for line in first.stdout:
            seen += line
            if "scoring begins" in line:
                break
        assert "scoring begins" in seen, seen
        second = subprocess.run([sys.executable, "evaluate.py", *args], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=300)
        go.touch()
        rest, _ = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 2, second.stdout + second.stderr
    assert second.stderr.strip() == (f"error: --out {out} is being written by another evaluate.py (it holds the "
                                      "file's lock); wait for it to end, or choose another --out"), second.stderr
    assert first.returncode == 0, seen + rest
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["mode"], r["prompt_index"], r["sample"]) for r in records) == sorted(
        [("greedy", i, 0) for i in range(4)] + [("sampled", i, s) for i in range(4) for s in range(2)])
    # and once the first is done, its complete file is never written over
    third = subprocess.run([sys.executable, "evaluate.py", *args], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert third.returncode == 2 and "already exists" in third.stderr, third.stderr
    assert len(out.read_text().splitlines()) == 12


def test_out_file_open_in_this_process_is_refused_to_a_second_opener(tmp_path):
    out = tmp_path / "e.jsonl"
    f = evaluate.open_out(str(out))
    try:
        with pytest.raises(ValueError, match="being written by another evaluate.py"):
            evaluate.open_out(str(out))
    finally:
        f.close()
    g = evaluate.open_out(str(out))  # empty and free again: taken
    g.close()


def tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("retrain", [False, True])
def test_another_runs_sft_model_is_never_replaced(smoke_sft_run, tmp_path, retrain):
    """--sft_dir=<another run>/sft with other SFT settings: refused, and the advice is a folder of this run's
    own, never --retrain_sft; given --retrain_sft=true anyway, still refused; that run's files are unchanged."""
    other = tmp_path / "other"
    shutil.copytree(smoke_sft_run, other)
    before = tree_digest(other)
    argv = ["--preset=smoke", "--threads=1", "--rl_steps=0", "--eval_prompts=1", f"--sft_dir={other / 'sft'}",
            "--sft_steps=31", f"--out_dir={tmp_path / 'mine'}"] + (["--retrain_sft=true"] if retrain else [])
    with pytest.raises(ValueError) as e:
        train.main(argv)
    msg = str(e.value)
    assert f"is the SFT model of the run in {other}" in msg and "sft_steps 30 -> 31" in msg, msg
    assert "pass --retrain_sft=true" not in msg and f"--sft_dir={tmp_path / 'mine' / 'sft'}" in msg, msg
    assert tree_digest(other) == before


def test_an_export_never_mixes_with_another_into_the_same_folder(smoke_sft_run, tmp_path, monkeypatch):
    """Two `python -m infra.load` exports to one new folder at once: the one that finishes second is refused and
    the folder holds the first one's complete model (here the first is a stand-in that fills the folder while
    the second writes)."""
    from infra import load

    out = tmp_path / "run"
    train.main(["--preset=smoke", "--threads=1", "--sample_every=0", "--eval_prompts=1", "--rl_steps=1",
                "--checkpoint_every=1", f"--sft_dir={smoke_sft_run / 'sft'}", f"--out_dir={out}"])
    dest = tmp_path / "model"
    real = load.save_model

    def meanwhile(model, cfg, path, tok, dtype):
        real(model, cfg, path, tok, dtype)
        shutil.copytree(smoke_sft_run / "final", dest)  # the other export finishes first
    monkeypatch.setattr(load, "save_model", meanwhile)
    before = tree_digest(dest) if dest.exists() else None
    with pytest.raises(ValueError, match=rf"{dest} was filled by another process while this export ran"):
        load.main([str(out / "checkpoints" / "step-00000001"), str(dest)])
    assert before is None and tree_digest(dest) == tree_digest(smoke_sft_run / "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "run"]  # no temporary folder left
