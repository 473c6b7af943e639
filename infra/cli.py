"""One command-line style for every entry point: a dataclass is the list of options, a user error is one
line, and progress bars stay readable in a log file.

Every field of the dataclass becomes a flag of its own name, given as `--field=value` or `--field value`;
a boolean also works bare (`--dry_run`) or with a value (`--resume=true`, `--resume false`). Flags match
exactly, never by prefix: `--sft_step=1` is refused, not taken for --sft_steps. With presets, the value of a
field comes from, in order of precedence: the flag, then `--preset NAME`, then the dataclass default. Only
int, float, str and bool fields exist, so no configuration language is needed. `--help` gives each flag the
comment written beside its field in the dataclass (and any comment lines under it).

`with user_errors():` around an entry point's body turns a ValueError or OSError (a bad flag, a missing or
damaged file) into one line `error: ...` on stderr and exit status 2, and Ctrl-C into exit status 130,
without a traceback. `progress_bar` is tqdm, drawn only when stderr is a terminal.
"""
from __future__ import annotations

import argparse
import difflib
import inspect
import io
import re
import sys
import tokenize
from contextlib import contextmanager
from dataclasses import MISSING, fields

from tqdm import tqdm

USER_ERROR = 2  # exit status of a user error, as argparse's own


def parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def field_comments(cls) -> dict[str, str]:
    """{field: its comment} from the source of cls and its dataclass bases: the comment at the end of the
    field's line, continued by comment-only lines below it."""
    out: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if "__dataclass_fields__" in vars(k)]):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # defined where no source is kept (an interactive session)
            continue
        current = None
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.NAME and tok.start[1] == 4 and re.match(rf"\s*{tok.string}\s*:", tok.line):
                current = tok.string if tok.string in klass.__dataclass_fields__ else None
            elif tok.type == tokenize.COMMENT and current:
                text, alone = tok.string.lstrip("#").strip(), tok.line.strip().startswith("#")
                if alone and tok.start[1] <= 4:  # a section heading ("    # model"), not a continuation
                    current = None
                else:
                    out[current] = f"{out[current]} {text}" if current in out and alone else text
    return out


def parser(cls, description: str, presets: dict | None = None, flags: tuple | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser with one flag per field of `cls` (only those named in `flags`, when given, and
    --preset when presets are given); every default is None so that `given` below sees which were typed."""
    usage = "%(prog)s" + (" [--preset NAME]" if presets else "") + " [--FIELD=VALUE ...]  (every FIELD below)"
    # allow_abbrev=False: a prefix of a flag would otherwise silently set the longer one.
    p = argparse.ArgumentParser(description=description, usage=usage, exit_on_error=False, allow_abbrev=False)
    if presets is not None:
        p.add_argument("--preset", default=next(iter(presets)), help=f"one of {', '.join(presets)}")
    types = {"int": int, "float": float, "str": str, "bool": parse_bool}
    comments = field_comments(cls)
    for f in fields(cls):
        if flags is not None and f.name not in flags:
            continue
        kind = f.type if isinstance(f.type, str) else f.type.__name__  # with or without postponed annotations
        default = "required" if f.default is MISSING else f"default {f.default!r}"
        text = (f"{comments[f.name]} ({default})" if f.name in comments else default).replace("%", "%%")
        if kind == "bool":  # bare --flag means true
            p.add_argument(f"--{f.name}", type=parse_bool, nargs="?", const=True, default=None, help=text)
        else:
            p.add_argument(f"--{f.name}", type=types[kind], default=None, help=text)
    return p


def parse_known(p: argparse.ArgumentParser, argv, name: str) -> argparse.Namespace:
    """p.parse_known_args for a module with its own argparse flags (python -m infra.NAME): a bad value or an
    unknown flag is a ValueError of one line."""
    try:
        args, unknown = p.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; see python -m infra.{name} --help")
    return args


def parse(cls, argv=None, *, description: str = "", presets: dict | None = None, defaults: dict | None = None,
          flags: tuple | None = None):
    """Build `cls` from the command line. defaults: values that replace the dataclass defaults (for
    instance a checkpoint's own generation settings), overridden in turn by the preset and the flags.
    flags: the fields that are flags (default: all); a preset may still set the others."""
    try:
        args, unknown = parser(cls, description, presets, flags).parse_known_args(argv)
    except argparse.ArgumentError as e:  # a value of the wrong type: one line naming flag and value
        raise ValueError(str(e)) from None
    if unknown:
        names = [f"--{f.name}" for f in fields(cls) if flags is None or f.name in flags] + \
            (["--preset"] if presets is not None else [])
        close = {u: difflib.get_close_matches(u.split("=")[0], names, n=1) for u in unknown if u.startswith("--")}
        hint = "; ".join(f"did you mean {m[0]} (not {u.split('=')[0]})?" for u, m in close.items() if m)
        raise ValueError(f"unknown argument(s) {unknown}; the flags are {'some' if flags else 'the'} fields of "
                         f"{cls.__name__} (--help)"
                         + (f"; {hint}" if hint else ""))
    given = {k: v for k, v in vars(args).items() if v is not None and k != "preset"}
    base = dict(defaults or {})
    if presets is not None:
        if args.preset not in presets:
            raise ValueError(f"unknown preset {args.preset!r}; choose one of {', '.join(presets)}")
        base.update(presets[args.preset])
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in {**base, **given}]
    if missing:
        raise ValueError("missing " + ", ".join(f"--{m}" for m in missing))
    return cls(**{**base, **given})


@contextmanager
def user_errors():
    """An entry point's body: ValueError / OSError -> `error: message` on stderr, exit 2; Ctrl-C -> exit 130.
    Either way no traceback: the message names the value, the file and the fix, which is all a user needs.
    Programming errors (anything else) keep their traceback."""
    try:
        yield
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(USER_ERROR)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr)
        sys.exit(130)


def bars_shown(file=None) -> bool:
    """Progress bars only on a terminal: redirected, tqdm's carriage-return updates pile up into one line."""
    file = file or sys.stderr
    return hasattr(file, "isatty") and file.isatty()


def progress_bar(iterable=None, **kwargs):
    """tqdm, drawn on stderr when it is a terminal and silent otherwise (a log file gets the summary lines
    the callers print instead). The one place every bar of the project is made."""
    kwargs.setdefault("disable", not bars_shown(kwargs.get("file")))
    return tqdm(iterable, **kwargs)
