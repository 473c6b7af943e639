"""Every flag acts on the chosen tasks or is refused or warned about, no check passes on nothing, and each entry
point run the wrong way says in one line how to run it. Expected texts and numbers are written by hand.

    OMP_NUM_THREADS=1 python -m pytest tests/test_flags_act_4.py -q
"""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluate
import train
from infra import budget, cli, plots
from tools import diagnose, report
from tools import sample as sample_cli

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")


# -----------------------------------------------------------------------------------------------------
# entry points run the wrong way, and --help

@pytest.mark.parametrize("script,module", [("sample.py", "tools.sample"), ("tools/sample.py", "tools.sample"),
                                           ("tools/report.py", "tools.report"), ("tools/diagnose.py", "tools.diagnose")])
def test_a_file_run_the_wrong_way_says_how_to_run_it(script, module, tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / script), "--ckpt", "out/toy/final", "--prompt", "two red"],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout == "", p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"python -m {module} --ckpt out/toy/final --prompt 'two red'"), p.stderr


def test_tools_sample_help_names_itself(capsys):
    with pytest.raises(SystemExit):
        sample_cli.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m tools.sample ")


def test_help_gives_device_batch_size_its_own_comment():
    text = cli.parser(train.Config, "x").format_help()
    entry = " ".join(text.split("--device_batch_size DEVICE_BATCH_SIZE", 1)[1].split("--", 1)[0].split())
    assert entry.startswith("sequences per forward pass in rollouts and log-prob passes (0 = all) (default 0)"), entry
    assert "adv_std" not in entry, entry  # the comment of the method below the field


# -----------------------------------------------------------------------------------------------------
# a mistyped generation.json, and --image on a model that never learned to draw

@pytest.fixture
def ckpt(smoke_sft_run, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(smoke_sft_run / "final", d)
    return d


@pytest.mark.parametrize("value,said", [("twelve", '"twelve", not a whole number'), (None, "null, not a whole number"),
                                        (12.5, "12.5, not a whole number"), (True, "true, not a whole number")])
def test_mistyped_generation_json_is_one_line(ckpt, value, said, capsys):
    saved = json.loads((ckpt / "generation.json").read_text())
    (ckpt / "generation.json").write_text(json.dumps({**saved, "gen_length": value}))
    expected = f"{ckpt / 'generation.json'}: gen_length is {said}; e.g. \"gen_length\": 12, or delete it"
    with pytest.raises(ValueError) as e:
        sample_cli.main(["--ckpt", str(ckpt), "--prompt", "bob has 3 pens"])
    assert str(e.value).startswith(expected), str(e.value)
    assert evaluate.main(["--ckpt", str(ckpt), "--task", "text"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {expected}") and len(err.splitlines()) == 1, err


def test_image_from_a_text_only_model_is_refused(ckpt, monkeypatch):
    saved = json.loads((ckpt / "generation.json").read_text())
    (ckpt / "generation.json").write_text(json.dumps({**saved, "tasks": "text"}))
    monkeypatch.setattr(sample_cli, "_load", lambda o: (_ for _ in ()).throw(AssertionError("weights read")))
    with pytest.raises(ValueError, match=rf"--image: {ckpt} was trained for text only \(its generation.json\), "
                                         "never to draw"):
        sample_cli.main(["--ckpt", str(ckpt), "--prompt", "two red blocks", "--image"])


# -----------------------------------------------------------------------------------------------------
# checks that must not pass on nothing

def test_rank_correlation_of_ties_is_undefined_not_one(capsys):
    # Spearman by hand: ranks of [1, 2, 2, 3] are [1, 2.5, 2.5, 4]; with [1, 2, 3, 4]: 4.5 / sqrt(4.5 * 5)
    assert diagnose.spearman(torch.tensor([1., 2, 2, 3]), torch.tensor([1., 2, 3, 4])) == pytest.approx(
        4.5 / math.sqrt(22.5))
    m = diagnose.metrics(torch.zeros(3, 6), torch.zeros(6), torch.ones(18), 0.2)  # log-ratios all zero
    assert all(math.isnan(m[k]) for k in ("pearson", "spearman", "sign", "spread")), m
    diagnose.print_table("text", {"MaskGRPO": m})
    out = capsys.readouterr().out
    assert "| MaskGRPO | undefined | undefined | undefined | undefined | 1.000 |" in out and "1.000 | 1.000" not in out
    assert "warning: text: a correlation is undefined" in out, out
    # sign agreement leaves out the sequences whose exact log-ratio is 0: in each draw 1 of the 2 others agrees
    m = diagnose.metrics(torch.tensor([[0.5, -1.0, 2.0], [0.4, -0.5, 1.0]]), torch.tensor([0.0, 1.0, 3.0]),
                         torch.ones(3), 0.2)
    assert m["sign"] == 0.5


def test_report_on_a_file_without_markers_writes_nothing(tmp_path):
    f = tmp_path / "notes.md"
    f.write_text("# notes\nno tables here\n")
    with pytest.raises(ValueError, match=rf"{f} holds no table markers .* so no table would be written"):
        report.main(["--results", str(f), "--figures", str(tmp_path)])
    assert f.read_text() == "# notes\nno tables here\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]


def test_evaluate_run_without_held_out_numbers_is_refused(smoke_sft_run, tmp_path, capsys):
    out = tmp_path / "run"
    train.main(["--preset=smoke", "--threads=1", f"--sft_dir={smoke_sft_run / 'sft'}", f"--out_dir={out}",
                "--rl_steps=0", "--eval_prompts=0"])
    capsys.readouterr()
    assert evaluate.main(["--run", str(out)]) == 2
    captured = capsys.readouterr()
    assert "numbers match" not in captured.out, captured.out
    assert captured.err.startswith(f"error: {out / 'summary.json'} holds no held-out reward"), captured.err


@pytest.mark.parametrize("argv,message", [
    (["--task", "image", "--samples", "0"], "--samples 0 scores greedy completions only, and image tasks (image) "
                                            "have none"),
    (["--task", "text", "--eval_prompts", "0"], "no text prompts to score (--eval_prompts=0)"),
])
def test_evaluate_table_of_nothing_is_refused(smoke_sft_run, tmp_path, argv, message, capsys):
    out = tmp_path / "e.jsonl"
    assert evaluate.main(["--preset=smoke", "--threads=1", "--ckpt", str(smoke_sft_run / "final"), *argv,
                          "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "| n |" not in captured.out, captured.err


# -----------------------------------------------------------------------------------------------------
# flags that act on nothing

def test_plots_png_is_where_the_curves_go(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text("".join(json.dumps({"step": s, "text/reward": s / 4, "text/kl": 0.01 * s})
                                           + "\n" for s in range(4)))
    png = tmp_path / "mine.png"
    assert plots.main([str(run), "--png", str(png)]) == png
    assert png.is_file() and not (run / "curves.png").exists()
    with pytest.raises(ValueError, match="--task choose what --compare draws"):
        plots.main([str(run), "--task", "image"])


@pytest.mark.parametrize("argv,idle", [
    (["--system_prompt=be brief"], "--system_prompt (it acts on benchmark prompts"),
    (["--reward_shaping=official"], "--reward_shaping (it acts on benchmark prompts"),
    (["--image_scorer_timeout=5"], "--image_scorer_timeout (it acts on the image scorer"),
    (["--tasks=image", "--text_reward=solution"], "--text_reward (it acts on the toy text task)"),
])
def test_flags_the_chosen_tasks_never_read_are_warned_about(argv, idle, capsys):
    train.parse_args(argv)
    out = capsys.readouterr().out
    assert "warning: with --tasks=" in out and idle in out and "does nothing" in out, out


def test_no_warning_for_flags_that_act(capsys):
    train.parse_args(["--tasks=text", "--text_reward=solution"])
    assert "warning" not in capsys.readouterr().out


def test_toy_dry_run_never_advises_a_shutdown_timeout_below_30_s(capsys):
    train.main(["--preset=toy", "--dry_run"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("SIGTERM:"))
    assert "the default TORCH_ELASTIC_SHUTDOWN_TIMEOUT of 30 s leaves room for it" in line, line
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in line, line


def test_disk_estimate_counts_only_the_checkpoints_the_run_writes(tmp_path, monkeypatch):
    """rl_steps=2 with checkpoint_every=10 writes one checkpoint (of its last step, before the final
    evaluation): room for 1.5 of them is enough, though keep_last=2 would allow three; a resumed run's own
    two checkpoints are on the disk already, so with keep_last=2 it needs room for one more."""
    cfg = train.parse_args(["--preset=smoke", "--rl_steps=2", "--checkpoint_every=10", "--keep_last=2"])
    mc = budget.scratch_config(cfg, vocab_size=128)
    one = budget.checkpoint_bytes(cfg, mc)
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda p: type("U", (), {"free": int(1.5 * one)})())
    budget.check_disk(cfg, tmp_path, mc)
    longer = train.parse_args(["--preset=smoke", "--rl_steps=80", "--checkpoint_every=10", "--keep_last=2"])
    with pytest.raises(ValueError, match="rotation keeps 3 at once"):
        budget.check_disk(longer, tmp_path, mc)
    budget.check_disk(longer, tmp_path, mc, present=2)


# -----------------------------------------------------------------------------------------------------
# the README's command: one CPU thread unless --threads says otherwise

def test_default_threads_on_cpu_is_one():
    from infra.cli import setup

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        setup(train.parse_args(["--device=cpu"]))
        assert torch.get_num_threads() == 1
        setup(train.parse_args(["--device=cpu", "--threads=2"]))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
