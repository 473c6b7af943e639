"""Paths mean what a shell user means: `~` in a path flag's value (which no shell expands after `--flag=`) is the
home folder, expanded once where the flags are read; a `~user` that names nobody is refused; other text is left
as it is.

    OMP_NUM_THREADS=1 python -m pytest tests/test_paths.py -q
"""
import json

import pytest

import evaluate
import train


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.chdir(tmp_path)
    return h


def test_path_flags_expand_the_home_folder(home):
    cfg = train.parse_args(["--out_dir=~/run", "--sft_dir=~/sft", "--init_from=~/model", "--tasks=gsm8k",
                            "--train_data=gsm8k=~/train.jsonl", "--eval_data=gsm8k=~/test.jsonl", "--dry_run",
                            "--prompt_prefill=~ not a path"])
    assert (cfg.out_dir, cfg.sft_dir, cfg.init_from) == (f"{home}/run", f"{home}/sft", f"{home}/model")
    assert (cfg.train_data, cfg.eval_data) == (f"gsm8k={home}/train.jsonl", f"gsm8k={home}/test.jsonl")
    assert cfg.prompt_prefill == "~ not a path"
    o = evaluate.parse_options(["--ckpt=~/m", "--out=~/e.jsonl", "--data=~/d.jsonl", "--run=~/r", "--compare=~/a,~/b"])
    assert (o.ckpt, o.out, o.data, o.run, o.compare) == (f"{home}/m", f"{home}/e.jsonl", f"{home}/d.jsonl",
                                                          f"{home}/r", f"{home}/a,{home}/b")


def test_unknown_user_is_refused(home):
    with pytest.raises(ValueError, match=r"--out_dir=~nobody-here-at-all/run: ~nobody-here-at-all is no user's "
                                         "home; write it in full"):
        train.parse_args(["--out_dir=~nobody-here-at-all/run"])


def test_a_run_and_an_evaluation_write_into_the_home_folder(home, tmp_path, smoke_sft_run, capsys):
    summary = train.main(["--preset=smoke", "--threads=1", "--out_dir=~/run", f"--sft_dir={smoke_sft_run / 'sft'}",
                          "--rl_steps=0", "--eval_prompts=1"])
    assert json.loads((home / "run" / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert not (tmp_path / "~").exists()
    assert f"model {home}/run/final" in capsys.readouterr().out
    assert evaluate.main(["--preset=smoke", "--threads=1", "--ckpt=~/run/final", "--task=text", "--eval_prompts=2",
                          "--out=~/e.jsonl"]) == 0
    assert len((home / "e.jsonl").read_text().splitlines()) == 2 * (1 + 1)  # greedy and one sample per prompt
    assert evaluate.main(["--compare", "~/e.jsonl,~/e.jsonl"]) == 0
    assert not (tmp_path / "~").exists()
