"""Wall and CPU seconds of each phase of an RL step, for times.jsonl, kept out of the step's own lines.

    @timed("rollout")          # on a function the step calls: its seconds add up under rollout_s, rollout_cpu_s
    def rollout(...): ...

train.main resets the counters before a step and adds take() to the step's record (infra/run.Run.record moves
every *_s key to times.jsonl, so that log.jsonl is the same on every repetition). CPU seconds (every thread of
this process) compare runs on a shared machine, where wall seconds depend on the neighbours.
"""
from __future__ import annotations

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


def reset() -> None:
    _SECONDS.clear()


def take() -> dict[str, float]:
    """The counters since the last reset, and a reset."""
    out = dict(_SECONDS)
    _SECONDS.clear()
    return out
