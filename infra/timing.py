"""Wall and CPU seconds of each phase of an RL step, for times.jsonl (never log.jsonl, which is then the same on
every repetition). rl_step marks each phase where it calls it:

    with timed("reward"):            # adds the block's seconds to reward_s and reward_cpu_s
        r = tasks.score(...)

and train.py's loop takes the counters after each step (take). CPU seconds (every thread of this process) compare
runs on a shared machine, where wall seconds depend on the neighbours.
"""
from __future__ import annotations

import contextlib
import time

_SECONDS: dict[str, float] = {}


@contextlib.contextmanager
def timed(phase: str):
    """Add the wall and CPU seconds of the block to the phase's counters (also when it raises)."""
    wall, cpu = time.time(), time.process_time()
    try:
        yield
    finally:
        _SECONDS[f"{phase}_s"] = _SECONDS.get(f"{phase}_s", 0.0) + time.time() - wall
        _SECONDS[f"{phase}_cpu_s"] = _SECONDS.get(f"{phase}_cpu_s", 0.0) + time.process_time() - cpu


def take() -> dict[str, float]:
    """The counters since the last take, which starts them again from zero."""
    out = dict(_SECONDS)
    _SECONDS.clear()
    return out
