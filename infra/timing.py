"""Wall and CPU seconds of each phase of an RL step, for times.jsonl, kept out of the step's own lines.

    with timing.phases((tasks, "score", "reward"), ...):   # train.main's loop: while open, every call of
        ...                                                 # tasks.score adds to reward_s and reward_cpu_s

train.main resets the counters before a step and adds take() to the step's record (infra/run.Run.record moves
every *_s key to times.jsonl, so that log.jsonl is the same on every repetition). CPU seconds (every thread of
this process) compare runs on a shared machine, where wall seconds depend on the neighbours.
"""
from __future__ import annotations

import contextlib
import functools
import time

_SECONDS: dict[str, float] = {}


def timed(phase: str):
    """Decorator: add the wall and CPU seconds of every call to the phase's counters."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            wall, cpu = time.time(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                _SECONDS[f"{phase}_s"] = _SECONDS.get(f"{phase}_s", 0.0) + time.time() - wall
                _SECONDS[f"{phase}_cpu_s"] = _SECONDS.get(f"{phase}_cpu_s", 0.0) + time.process_time() - cpu
        return inner
    return wrap


@contextlib.contextmanager
def phases(*targets):
    """While open, each (module, function name, phase) of targets is the function wrapped by timed(phase), so
    that its callers, which look it up in the module, are timed; the functions are restored on exit."""
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
    for (mod, name, phase), (_, _, fn) in zip(targets, saved):
        setattr(mod, name, timed(phase)(fn))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def reset() -> None:
    _SECONDS.clear()


def take() -> dict[str, float]:
    """The counters since the last reset, and a reset."""
    out = dict(_SECONDS)
    _SECONDS.clear()
    return out
