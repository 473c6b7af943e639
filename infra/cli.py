"""One command-line style for every entry point: a dataclass is the list of options, a user error is one
line, and progress bars stay readable in a log file.

Every field of the dataclass becomes a flag of its own name, given as `--field=value` or `--field value`;
a boolean also works bare (`--dry_run`) or with a value (`--resume=true`, `--resume false`). Flags match
exactly, never by prefix: `--sft_step=1` is refused, not taken for --sft_steps. A flag given twice takes its
last value (`--seed=1 --seed=2` is seed 2; --help says so), so that a command can be extended by appending.
With presets, the value of a field comes from, in order of precedence: the flag, then `--preset NAME`, then
the dataclass default (--help shows the value under the preset given, or the default one). Only
int, float, str and bool fields exist, so no configuration language is needed. `--help` gives each flag the
comment written beside its field in the dataclass (and any comment lines under it).

`with user_errors():` around an entry point's body turns a ValueError or OSError (a bad flag, a missing or
damaged file) into one line `error: ...` on stderr and exit status 2, and Ctrl-C into exit status 130,
without a traceback. `progress_bar` is tqdm, drawn only when stderr is a terminal.
"""
from __future__ import annotations

import argparse
import difflib
import errno
import functools
import inspect
import io
import os
import re
import select
import sys
import tokenize
from contextlib import contextmanager
from dataclasses import MISSING, fields

from tqdm import tqdm

USER_ERROR = 2  # exit status of a user error, as argparse's own
# Text --help prints after the flags, per dataclass name (a module that explains a behaviour of that entry
# point registers it: infra/outdir.py, what a signal does to a training run).
EPILOGS: dict[str, str] = {}


# Flags whose value is a path (in any entry point: the names mean the same everywhere), or a list of paths
# (TASK=PATH,... or A,B). A shell expands `~` only at the start of a word, never after `--flag=`: expanded here,
# once, so that a run never writes into a folder named `~` while its messages point at the home folder.
PATH_FLAGS = {"out_dir", "init_from", "sft_dir", "ckpt", "data", "out", "run", "png"}
PATH_LIST_FLAGS = {"train_data", "eval_data", "compare"}


def expand_home(flag: str, value: str) -> str:
    """value with a leading ~ or ~user expanded (each item of a PATH_LIST_FLAGS list); an unknown user is refused."""
    def one(path: str) -> str:
        task, eq, where = path.rpartition("=") if flag in ("train_data", "eval_data") else ("", "", path)
        if not where.startswith("~"):
            return path
        full = os.path.expanduser(where)
        if full.startswith("~"):
            raise ValueError(f"--{flag}={value}: {where.split('/')[0]} names no user's home folder here; write "
                             "the path out in full")
        return task + eq + full
    if flag in PATH_LIST_FLAGS:
        return ",".join(one(item) for item in value.split(","))
    return one(value) if flag in PATH_FLAGS else value


def parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


@functools.cache  # parsing the module's source costs ~20 ms, and every parse() asks (a test suite, often)
def _comments(cls) -> tuple:
    """((field, its comment), ...) from the source of cls and its dataclass bases: the comment at the end of
    the field's line, continued by comment-only lines below it."""
    out: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if "__dataclass_fields__" in vars(k)]):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # defined where no source is kept (an interactive session)
            continue
        current = None
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.NAME and tok.start[1] == 4:  # a field, or a method (whose comment is its own)
                field = re.match(rf"\s*{tok.string}\s*:", tok.line) and tok.string in klass.__dataclass_fields__
                current = tok.string if field else None
            elif tok.type == tokenize.COMMENT and current:
                text, alone = tok.string.lstrip("#").strip(), tok.line.strip().startswith("#")
                if alone and tok.start[1] <= 4:  # a section heading ("    # model"), not a continuation
                    current = None
                else:
                    out[current] = f"{out[current]} {text}" if current in out and alone else text
    return tuple(out.items())


def field_comments(cls) -> dict[str, str]:
    """{field: its comment}, as written beside the field in the dataclass (see _comments)."""
    return dict(_comments(cls))


def flag_fields(cls, inherited: set | None = None) -> list:
    """The fields of cls that are flags: its own first (the ones its --help lists first), then those of its
    dataclass bases, all of them or only the names in `inherited` (an entry point that reuses train.Config
    for the settings it shares takes only those)."""
    own = set(getattr(cls, "__annotations__", {}))
    mine = [f for f in fields(cls) if f.name in own]
    base = [f for f in fields(cls) if f.name not in own and (inherited is None or f.name in inherited)]
    return mine + base if mine and base else mine or base


def preset_named(argv, presets: dict) -> str:
    """The --preset NAME given in argv, else the first preset (the one that applies when none is given)."""
    for i, a in enumerate(argv):
        if a.startswith("--preset="):
            return a.split("=", 1)[1]
        if a == "--preset" and i + 1 < len(argv):
            return argv[i + 1]
    return next(iter(presets))


def parser(cls, description: str, presets: dict | None = None, argv=(), defaults: dict | None = None,
           inherited: set | None = None, prog: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser with one flag per field of `cls` (and --preset when presets are given); every
    default is None so that `given` below sees which flags were typed. --help shows each field's value
    under the preset argv names (or the default preset) and `defaults`, and says where it comes from."""
    usage = "%(prog)s" + (" [--preset NAME]" if presets else "") + " [--FIELD=VALUE ...]  (every FIELD below; a " \
        "flag given twice takes its last value)"
    # allow_abbrev=False: a prefix of a flag would otherwise silently set the longer one.
    p = argparse.ArgumentParser(description=description, usage=usage, exit_on_error=False, allow_abbrev=False,
                                epilog=EPILOGS.get(cls.__name__), prog=prog)
    base, name = dict(defaults or {}), None
    if presets is not None:
        first, name = next(iter(presets)), preset_named(list(argv), presets)
        p.add_argument("--preset", default=first, help=f"one of {', '.join(presets)}; {first} when none is given")
        base.update(presets.get(name, {}))
    types = {"int": int, "float": float, "str": str, "bool": parse_bool}
    comments = field_comments(cls)
    own = set(getattr(cls, "__annotations__", {}))
    group = p
    for f in flag_fields(cls, inherited):
        if f.name not in own and own and group is p:  # an entry point's own flags first, then train.py's
            group = p.add_argument_group("settings shared with train.py")
        kind = f.type if isinstance(f.type, str) else f.type.__name__  # with or without postponed annotations
        if f.name in base:
            default = f"{base[f.name]!r}" + (f" under --preset {name}" if presets is not None and
                                             f.name in presets.get(name, {}) else "")
        else:
            default = "required" if f.default is MISSING else f"default {f.default!r}"
        text = (f"{comments[f.name]} ({default})" if f.name in comments else default).replace("%", "%%")
        if kind == "bool":  # bare --flag means true
            group.add_argument(f"--{f.name}", type=parse_bool, nargs="?", const=True, default=None, help=text)
        else:
            group.add_argument(f"--{f.name}", type=types[kind], default=None, help=text)
    return p


def parse_known(p: argparse.ArgumentParser, argv, module: str) -> argparse.Namespace:
    """p.parse_known_args for a module with its own argparse flags (python -m MODULE): a bad value or an
    unknown flag is a ValueError of one line."""
    try:
        args, unknown = p.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; see python -m {module} --help")
    return args


def parse(cls, argv=None, *, description: str = "", presets: dict | None = None, defaults: dict | None = None,
          inherited: set | None = None, refused: str = "", prog: str | None = None):
    """Build `cls` from the command line. defaults: values that replace the dataclass defaults (for
    instance a checkpoint's own generation settings), overridden in turn by the preset and the flags.
    inherited: the only fields of cls's bases that are flags (None: all); a flag naming another one is
    refused with `refused`, the reason this entry point does not take it. prog: the command as --help shows it
    (`python -m tools.sample`; default: the script's file name)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, unknown = parser(cls, description, presets, argv, defaults, inherited, prog).parse_known_args(argv)
    except argparse.ArgumentError as e:  # a value of the wrong type: one line naming flag and value
        raise ValueError(str(e)) from None
    other = [u for u in unknown if u.startswith("--") and u[2:].split("=")[0] in {f.name for f in fields(cls)}]
    if other:  # a field of the base class this entry point does not take (a training-only setting)
        raise ValueError(f"{', '.join(u.split('=')[0] for u in other)}: {refused or 'not a flag of this command'}; "
                         f"drop {'them' if len(other) > 1 else 'it'} (--help lists the flags)")
    if unknown:
        names = [f"--{f.name}" for f in flag_fields(cls, inherited)] + (["--preset"] if presets is not None else [])
        close = {u: difflib.get_close_matches(u.split("=")[0], names, n=1) for u in unknown if u.startswith("--")}
        hint = "; ".join(f"did you mean {m[0]} (not {u.split('=')[0]})?" for u, m in close.items() if m)
        raise ValueError(f"unknown argument(s) {unknown}; the flags are the fields of {cls.__name__} (--help)"
                         + (f"; {hint}" if hint else ""))
    given = {k: expand_home(k, v) if isinstance(v, str) else v for k, v in vars(args).items()
             if v is not None and k != "preset"}
    base = dict(defaults or {})
    if presets is not None:
        if args.preset not in presets:
            raise ValueError(f"unknown preset {args.preset!r}; choose one of {', '.join(presets)}")
        base.update(presets[args.preset])
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in {**base, **given}]
    if missing:
        raise ValueError("missing " + ", ".join(f"--{m}" for m in missing))
    obj = cls(**{**base, **given})
    # What was typed and which preset, for checks that refuse a flag the other inputs make meaningless
    # (not fields: asdict, config.json and replace() never see them).
    obj._given, obj._preset = frozenset(given), (args.preset if presets is not None else None)
    obj._preset_values = dict(presets[args.preset]) if presets is not None else {}
    return obj


def output_gone(fd: int) -> bool:
    """Whether nobody can read what is written to fd any more: a terminal that hung up (closed window, dropped
    ssh session: poll reports POLLHUP, and every write fails with EIO) or a pipe whose reader left (POLLERR)."""
    try:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


def silence(fd: int) -> None:
    """Point fd at /dev/null, so that later prints to it succeed (and go nowhere) instead of raising."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except OSError:
        pass


class _Unbroken:
    """sys.stdout or sys.stderr of an entry point: a write that fails because nobody reads any more (EIO: the
    terminal closed; EPIPE: the reader of a pipe left; EBADF: the descriptor was closed) points the descriptor
    at /dev/null and goes on, and a full non-blocking pipe (EAGAIN) drops the line: losing a message must not
    lose the run (the step finishes and its checkpoint is written; infra/checkpoint.graceful_stop)."""

    GONE = (errno.EIO, errno.EPIPE, errno.EBADF, errno.ENXIO)

    def __init__(self, stream):
        self._stream = stream

    def _failed(self, e: OSError) -> None:
        if isinstance(e, BlockingIOError):
            return
        if e.errno not in self.GONE:
            raise e
        silence(self._stream.fileno())
        try:
            self._stream.flush()  # what the buffer still holds goes to /dev/null
        except (OSError, ValueError):
            pass

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            self._failed(e)
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            self._failed(e)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextmanager
def output_may_vanish():
    """sys.stdout and sys.stderr that survive their reader going away (_Unbroken), where they are real files
    (a test's in-memory capture is left alone); restored afterwards."""
    saved = sys.stdout, sys.stderr
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            stream.fileno()
        except (AttributeError, ValueError, OSError):
            continue
        if not isinstance(stream, _Unbroken):
            setattr(sys, name, _Unbroken(stream))
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


@contextmanager
def user_errors():
    """An entry point's body: ValueError / OSError -> `error: message` on stderr, exit 2; Ctrl-C -> exit 130.
    Either way no traceback: the message names the value, the file and the fix, which is all a user needs.
    Programming errors (anything else) keep their traceback. Output whose reader is gone (a closed terminal)
    is dropped rather than raised (output_may_vanish)."""
    with output_may_vanish():
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
