"""tests/first_gpu.py's decision and table helpers: the tolerances, the faults FIRST_GPU_FAULTS may plant,
decide (the failed figures, one line each), and the cells of the printed table."""
from __future__ import annotations

import math
import os
from pathlib import Path

from infra import budget

GB = 2 ** 30
# The decisions' tolerances. Update 0's ratio: the two passes run the same inputs and weights, but in train
# vs eval mode, with and without gradients and activation checkpointing, so a GPU may pick other kernels.
RATIO_TOL = 1e-3
PEAK_SLACK = 1.25  # measured peak / dry-run figure
FAULTS_ENV, FAULTS = "FIRST_GPU_FAULTS", ("ratio", "nan", "peak", "resume")


def planted_faults() -> set:
    raw = os.environ.get(FAULTS_ENV, "")
    faults = {f.strip() for f in raw.split(",") if f.strip()}
    if faults - set(FAULTS):
        raise SystemExit(f"error: {FAULTS_ENV}={raw!r} names {sorted(faults - set(FAULTS))}; the faults are {FAULTS}")
    return faults


def decide(first_ratio, losses, grad_norms, peaks: dict, resumed, stopped: str | None = None) -> list[str]:
    """The failed figures, one line each (empty: the check passes). peaks: phase -> (measured bytes, dry-run
    GiB); resumed: resume_check's (start, next step, tensors differing), None without a checkpoint; stopped:
    why train.main raised, if it did."""
    fails = [] if stopped is None else [stopped]
    if first_ratio is None:
        fails.append("update 0's first ratio: not seen (grpo.policy_loss never ran with gradients)")
    elif not all(math.isfinite(v) and abs(v - 1) <= RATIO_TOL for v in first_ratio):
        fails.append(f"update 0's first ratio (max, mean) = {first_ratio[0]:.6g}, {first_ratio[1]:.6g}: not 1 within "
                     f"{RATIO_TOL:g}; pi_old's and the update's passes scored the same inputs with the same weights")
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
    if not losses or bad:
        fails.append("loss: no update ran" if not losses else f"loss not finite in {len(bad)} of {len(losses)} update "
                     f"chunks (first: chunk {bad[0]}, {losses[bad[0]]})")
    bad = [i for i, v in enumerate(grad_norms) if not math.isfinite(v)]
    if not grad_norms or bad:
        fails.append("gradient norm: no update ran" if not grad_norms else f"gradient norm not finite in {len(bad)} "
                     f"of {len(grad_norms)} updates (first: update {bad[0]}, {grad_norms[bad[0]]})")
    for ph, (measured, dry) in peaks.items():
        if measured / GB > PEAK_SLACK * dry:
            fails.append(f"{ph}: peak memory {measured / GB:.2f} GiB is {measured / GB / dry - 1:.0%} above the dry "
                         f"run's {dry:.2f} GiB (allowed: {PEAK_SLACK - 1:.0%})")
    if resumed is None:
        return fails + ["resume: no checkpoint was written, so there is nothing to resume from"]
    start, expected, differ = resumed
    if start != expected:
        fails.append(f"resume: the checkpoint resumes at step {start}, the run's next step is {expected}")
    if differ:
        fails.append(f"resume: {differ} adapter or optimizer tensors differ from the run's after loading the checkpoint")
    return fails


def gpu_kind(device_name: str) -> str | None:
    """"H100" for "NVIDIA H100 80GB HBM3" and so on: the budget.GPU_PEAKS key a device name holds, or None."""
    return next((k for k in budget.GPU_PEAKS if k in device_name.upper()), None)


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fmt_gb(b: float) -> str:
    return f"{b / GB:.2f} GiB" if b >= GB / 10 else f"{b / 2 ** 20:.2f} MiB"


def format_table(rows) -> str:
    head = ("check", "measured", "dry run / expected")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    line = lambda r: " | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(head), "-+-".join("-" * w for w in widths), *map(line, rows)])
