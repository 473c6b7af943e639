"""One command-line style for train.py, sample.py and evaluate.py: a dataclass is the list of options.

Every field of the dataclass becomes a flag of its own name, given as `--field=value` or `--field value`;
a boolean also works bare (`--dry_run`) or with a value (`--resume=true`, `--resume false`). With presets,
the value of a field comes from, in order of precedence: the flag, then `--preset NAME`, then the dataclass
default. Only int, float, str and bool fields exist, so no configuration language is needed. `--help`
gives each flag the comment written beside its field in the dataclass (and any comment lines under it).
"""
from __future__ import annotations

import argparse
import inspect
import io
import re
import tokenize
from dataclasses import MISSING, fields


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
                text = tok.string.lstrip("#").strip()
                out[current] = f"{out[current]} {text}" if current in out and tok.line.strip().startswith("#") else text
    return out


def parser(cls, description: str, presets: dict | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser with one flag per field of `cls` (and --preset when presets are given); every
    default is None so that `given` below sees which flags were typed."""
    usage = "%(prog)s" + (" [--preset NAME]" if presets else "") + " [--FIELD=VALUE ...]  (every FIELD below)"
    p = argparse.ArgumentParser(description=description, usage=usage, exit_on_error=False)
    if presets is not None:
        p.add_argument("--preset", default=next(iter(presets)), help=f"one of {', '.join(presets)}")
    types = {"int": int, "float": float, "str": str, "bool": parse_bool}
    comments = field_comments(cls)
    for f in fields(cls):
        kind = f.type if isinstance(f.type, str) else f.type.__name__  # with or without postponed annotations
        default = "required" if f.default is MISSING else f"default {f.default!r}"
        text = (f"{comments[f.name]} ({default})" if f.name in comments else default).replace("%", "%%")
        if kind == "bool":  # bare --flag means true
            p.add_argument(f"--{f.name}", type=parse_bool, nargs="?", const=True, default=None, help=text)
        else:
            p.add_argument(f"--{f.name}", type=types[kind], default=None, help=text)
    return p


def parse(cls, argv=None, *, description: str = "", presets: dict | None = None, defaults: dict | None = None):
    """Build `cls` from the command line. defaults: values that replace the dataclass defaults (for
    instance a checkpoint's own generation settings), overridden in turn by the preset and the flags."""
    try:
        args, unknown = parser(cls, description, presets).parse_known_args(argv)
    except argparse.ArgumentError as e:  # a value of the wrong type: one line naming flag and value
        raise ValueError(str(e)) from None
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; the flags are the fields of {cls.__name__} (--help)")
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
