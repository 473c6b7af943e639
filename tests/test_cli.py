"""infra/cli.py, the one flag style of train.py, sample.py and evaluate.py: dataclass fields as flags, in
either `--field=value` or `--field value` form, booleans also bare; presets under flags; errors in one line.

    python -m pytest tests/test_cli.py -q
"""
from __future__ import annotations

from dataclasses import dataclass

import sys

import pytest

import train
from infra import cli


@dataclass
class Opts:
    name: str = "a"
    n: int = 1
    x: float = 0.5
    flag: bool = False


PRESETS = {"base": {}, "big": {"n": 10, "flag": True}}


@pytest.mark.parametrize("argv,expect", [
    ([], Opts()),
    (["--flag"], Opts(flag=True)),                         # bare boolean
    (["--flag=false"], Opts(flag=False)),
    (["--flag", "true", "--n", "3"], Opts(flag=True, n=3)),  # space-separated values
    (["--n=3", "--x=1"], Opts(n=3, x=1.0)),                 # an int typed for a float field is fine
    (["--preset=big"], Opts(n=10, flag=True)),
    (["--preset", "big", "--n=2", "--flag=no"], Opts(n=2, flag=False)),  # flags beat the preset
])
def test_parse(argv, expect):
    assert cli.parse(Opts, argv, presets=PRESETS) == expect


def test_defaults_sit_under_preset_and_flags():
    assert cli.parse(Opts, [], defaults={"n": 7}) == Opts(n=7)
    assert cli.parse(Opts, ["--n=8"], defaults={"n": 7}) == Opts(n=8)


@pytest.mark.parametrize("argv,match", [
    (["--nope=1"], r"unknown argument\(s\) \['--nope=1'\]"),
    (["--n=two"], r"--n.*'two'"),
    (["--flag=maybe"], r"expected true or false, got 'maybe'"),
    (["--preset=huge"], r"unknown preset 'huge'"),
])
def test_errors_are_value_errors(argv, match):
    with pytest.raises(ValueError, match=match):
        cli.parse(Opts, argv, presets=PRESETS)


def test_train_boolean_flags_work_bare():
    """--dry_run and --resume work bare, as people type them."""
    assert train.parse_args(["--preset=llada8b", "--dry_run"]).dry_run is True
    assert train.parse_args(["--resume"]).resume is True
    assert train.parse_args(["--resume=true"]).resume is True
    assert train.parse_args(["--resume", "false"]).resume is False


def test_every_flag_has_a_meaning_in_help():
    """--help shows, for every flag of every entry point, the comment written beside its field."""
    from dataclasses import fields

    import evaluate
    from tools import diagnose
    from tools import sample as sample_cli

    for cls in (train.Config, evaluate.Options, sample_cli.Options, diagnose.Options):
        comments = cli.field_comments(cls)
        assert [f.name for f in fields(cls) if not comments.get(f.name)] == [], cls
    text = cli.parser(train.Config, "", train.PRESETS).format_help()
    flat = " ".join(text.split())  # argparse wraps the help text
    assert "denoising steps per text rollout: a multiple of the blocks, <= gen_length" in flat
    assert "maskgrpo's text masks: arlike (paper Alg. 1) | random | arlike_official" in flat


def test_config_help_is_one_line_per_flag():
    """Every train.Config field's help is the one comment on its own line: no comment-only continuation
    lines (a flag says what it means; its history lives in docs/differences.md)."""
    import inspect

    lines = inspect.getsource(train.Config).splitlines()
    continuations = [line for line in lines if line.strip().startswith("#") and len(line) - len(line.lstrip()) > 4]
    assert continuations == []


@dataclass
class Sectioned:
    # io
    out: str = "o"            # where it goes
                              # (and stays)
    # model
    width: int = 4            # how wide


def test_section_headings_are_not_part_of_the_field_above():
    """A comment line at the field column heads the next section; only lines indented under the comment
    continue it (train.Config's "# model" once ended the help of --threads)."""
    assert cli.field_comments(Sectioned) == {"out": "where it goes (and stays)", "width": "how wide"}
    comments = cli.field_comments(train.Config)
    assert comments["threads"] == "torch CPU threads (0: one on CPU, fastest for the toy on busy cores; torch's default with a GPU)"
    assert comments["activation_checkpointing"] == "recompute each block in backward (needed at 8B)"


@dataclass
class Needs:
    path: str
    n: int = 1


def test_required_fields_and_module_flags():
    """A field without a default must be given (named in the error); parse_known (the infra modules' own
    argparse flags) turns a bad value or an unknown flag into one-line ValueErrors naming the module."""
    assert cli.parse(Needs, ["--path=x"]) == Needs(path="x")
    with pytest.raises(ValueError, match=r"^missing --path$"):
        cli.parse(Needs, ["--n=2"])
    import argparse
    p = argparse.ArgumentParser(exit_on_error=False, allow_abbrev=False)  # as the infra modules make theirs
    p.add_argument("--reps", type=int, default=1)
    assert cli.parse_known(p, ["--reps=3"], "tools.bench").reps == 3
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['--rep=2'\]; see python -m tools.bench --help"):
        cli.parse_known(p, ["--rep=2"], "tools.bench")
    with pytest.raises(ValueError, match=r"--reps.*'x'"):
        cli.parse_known(p, ["--reps=x"], "tools.bench")


@pytest.mark.parametrize("exc,status,line", [(ValueError("bad --n (3)"), 2, "error: bad --n (3)"),
                                             (FileNotFoundError("no such file"), 2, "error: no such file"),
                                             (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)")])
def test_user_errors_exit_with_one_line(capsys, exc, status, line):
    with pytest.raises(SystemExit) as e, cli.user_errors():
        raise exc
    assert e.value.code == status and capsys.readouterr().err == line + "\n"


class Stopped(RuntimeError):
    pass


@pytest.mark.parametrize("exc,status,line", [(ValueError("bad --n (3)"), 2, "error: bad --n (3)\n"),
                                             (Stopped("3 bad steps"), 1, "error: 3 bad steps\n"),
                                             (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)\n")])
def test_the_line_goes_out_in_one_write(monkeypatch, exc, status, line):
    """Two torchrun ranks refusing (or failing: train.py passes TrainingStopped and RunFailed as failures) at once
    share one stderr, which writes through: a line sent in two writes (text, then newline, as print and
    SystemExit("...") do) interleaves with the other rank's into one garbled line."""
    writes = []
    monkeypatch.setattr(sys, "stderr", type("Recorder", (), {"write": lambda self, t: writes.append(t)})())
    with pytest.raises(SystemExit) as e, cli.user_errors(failures=(Stopped,)):
        raise exc
    assert writes == [line] and e.value.code == status


def test_an_error_not_named_a_failure_keeps_its_traceback():
    with pytest.raises(Stopped), cli.user_errors():
        raise Stopped("a bug")


def test_programming_errors_keep_their_traceback():
    with pytest.raises(KeyError), cli.user_errors():
        raise KeyError("bug")
