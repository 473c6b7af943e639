"""Messages that point at the right cause and fix: each case a careless user met, one line, exit status 2
(or a working --help), naming the flag the user actually gave.

    OMP_NUM_THREADS=1 python -m pytest tests/test_messages.py -q
"""
import json
import re
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

import train
from infra import budget, cli
from tools import sample as sample_cli
from conftest import run_main
from test_errors import TINY, exit_code, one_line_error, toy  # noqa: F401 (toy: a fixture)

ROOT = Path(__file__).resolve().parents[1]


def error_of(capsys, fn) -> str:
    return one_line_error(capsys, exit_code(fn))


def test_init_from_a_runs_out_dir_asks_for_final(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(asdict(train.Config())))  # what train.py writes in an out_dir
    err = error_of(capsys, lambda: train.main([*TINY, f"--init_from={run}", f"--out_dir={tmp_path / 'o'}"]))
    assert f"{run} is a run's out_dir; did you mean {run / 'final'}?" in err, err


@pytest.mark.parametrize("config,kind", [({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}, "gpt2"),
                                         ({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096},
                                          "LlamaForCausalLM")])
def test_another_architecture_is_not_a_llada_checkpoint(tmp_path, capsys, config, kind):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    err = error_of(capsys, lambda: train.main([*TINY, f"--init_from={ckpt}", f"--out_dir={tmp_path / 'o'}"]))
    assert f"not a LLaDA/MMaDA checkpoint (model_type {kind!r})" in err and "lacks required" not in err, err


def test_sample_image_too_wide_names_image_width(toy, capsys):  # noqa: F811
    err = error_of(capsys, lambda: sample_cli.main(["--ckpt", str(toy / "final"), "--prompt", "a red block",
                                                    "--image", "--image_width=100"]))
    assert "--image_width=100 (10000 image tokens)" in err and "lower --image_width" in err, err
    assert "gen_length" not in err, err


@pytest.mark.parametrize("png,problem", [(".", "is a folder"), ("picture", "does not end in .png")])
def test_sample_png_must_be_a_png_file(toy, tmp_path, capsys, monkeypatch, png, problem):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sample_cli, "_load", lambda o: (_ for _ in ()).throw(AssertionError("sampled first")))
    err = error_of(capsys, lambda: sample_cli.main(["--ckpt", str(toy / "final"), "--prompt", "a red block",
                                                    "--image", f"--png={png}"]))
    assert f"--png {png} {problem}: pass the picture's file name" in err, err


def test_small_disk_is_said_in_sensible_units(tmp_path, monkeypatch):
    cfg = train.parse_args(["--preset=smoke", f"--out_dir={tmp_path}"])
    mc = budget.scratch_config(cfg, vocab_size=128)
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(ValueError) as e:
        budget.check_disk(cfg, tmp_path, mc)
    one = budget.checkpoint_bytes(cfg, mc)  # a toy checkpoint: a few MB
    assert "has 1000 bytes free" in str(e.value) and f"about {one / 2 ** 20:.1f} MB" in str(e.value), str(e.value)
    assert "0.0 GB" not in str(e.value)


@pytest.mark.parametrize("flag", ["--lr=inf", "--beta=nan", "--sft_lr=-inf"])
def test_non_finite_numbers_are_refused_at_validation(flag, capsys):
    err = error_of(capsys, lambda: train.main([flag]))
    name, value = flag[2:].split("=")
    assert err == f"error: {name} ({float(value)}) must be a finite number", err


def test_a_flag_given_twice_takes_the_last_as_help_says():
    assert train.parse_args(["--seed=1", "--seed", "2"]).seed == 2
    text = " ".join(cli.parser(train.Config, "", train.PRESETS).format_help().split())
    assert "a flag given twice takes its last value" in text


def test_infra_data_help_works(monkeypatch, capsys):
    code, out = run_main(["-m", "infra.data", "--help"], monkeypatch), capsys.readouterr()  # its __main__ block
    assert code == 0 and out.out.startswith("usage: python -m infra.data TASK PATH"), out


def test_scorer_on_a_busy_port_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "tools.stub_scorer", f"--port={port}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == (
        f"error: cannot serve on 127.0.0.1:{port} (Address already in use); stop what holds it, or pass another "
        "--port"), p.stderr


def test_dry_run_prints_once_under_torchrun(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    assert train.main(["--preset=llada8b", "--dry_run"]) == {}
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert train.main(["--preset=llada8b", "--dry_run"])["params"] > 0
    assert capsys.readouterr().out.count("model: ") == 1


@pytest.mark.parametrize("flag,problem", [("--init_from=/no/such/model", "/no/such/model/config.json not found: --init_from must be"),
                                          ("--train_data=gsm8k=/no/such.jsonl", "--train_data gsm8k=/no/such.jsonl: "
                                                                                "no such file")])
def test_dry_run_checks_the_model_folder_and_data_files(capsys, flag, problem):
    err = error_of(capsys, lambda: train.main(["--preset=llada8b", "--dry_run", flag]))
    assert err.startswith(f"error: {problem}"), err


def test_every_readme_torchrun_command_names_its_out_dir():
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "install_and_8b.md").read_text()
    code = "\n".join(re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S))  # commands, not prose
    commands = re.findall(r"^torchrun .*?(?<!\\)$", code.replace("\\\n", " "), flags=re.M)
    assert commands and all("--out_dir=" in c for c in commands), [c for c in commands if "--out_dir=" not in c]


# -----------------------------------------------------------------------------------------------------
# each entry point takes its own flags


def test_evaluate_refuses_training_flags(capsys):
    import evaluate

    assert evaluate.main(["--ckpt", "out/toy/final", "--task", "text", "--lr=5", "--rl_steps=9999"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --lr, --rl_steps: a train.py setting that evaluate.py does not use (it scores a "
                   "checkpoint, it does not train); drop them (--help lists the flags)"), err


def test_evaluate_help_shows_its_own_flags_first_and_the_tasks():
    import evaluate

    text = " ".join(cli.parser(evaluate.Options, "", train.PRESETS, inherited=evaluate.SHARED).format_help().split())
    assert text.index("--ckpt") < text.index("settings shared with train.py") < text.index("--gen_length")
    assert "text | image (toy: no --data) | gsm8k | math | mbpp | countdown | sudoku | geneval" in text
    assert "--lr " not in text and "--rl_steps" not in text and "--sft_steps" not in text


def test_evaluate_run_takes_threads_and_device_only(tmp_path, monkeypatch, capsys):
    import evaluate

    seen = []
    monkeypatch.setattr(evaluate, "check_run", lambda run_dir, **kw: seen.append((run_dir, kw)) or True)
    assert evaluate.main(["--run", str(tmp_path), "--threads=1", "--device=cpu"]) == 0
    assert seen == [(str(tmp_path), {"threads": 1, "device": "cpu"})]
    assert evaluate.main(["--run", str(tmp_path), "--seed=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: --run re-scores with the run's own config.json, which --seed would change; drop it "
                   "(it takes --threads and --device)"), err


def test_diagnosis_refuses_whole_run_flags(capsys):
    from tools import diagnose

    with pytest.raises(ValueError, match=r"^--sft_steps, --out_dir: a train.py setting of a whole run, which the "
                                         r"diagnosis of one RL step does not use; drop them"):
        diagnose.main(["--ckpt=x", "--sft_steps=3", "--out_dir=y"])


def test_help_shows_the_chosen_presets_values():
    text = " ".join(cli.parser(train.Config, "", train.PRESETS, ["--preset", "llada8b"]).format_help().split())
    assert "(667 under --preset llada8b)" in text and "toy when none is given" in text
    text = " ".join(cli.parser(train.Config, "", train.PRESETS, []).format_help().split())
    assert "mu optimizer steps (default 80)" in text  # the toy preset sets no rl_steps: the default applies
    assert "its generation.json): they replace the defaults shown below" in sample_cli.DESCRIPTION


def test_help_says_what_each_signal_does_and_how_to_continue(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("Ctrl-C, SIGTERM or SIGHUP", "--resume=true", "A second signal", "128 + the signal",
                  "python -m infra.load OUT_DIR/checkpoints/step-N DEST"):
        assert words in text, words
