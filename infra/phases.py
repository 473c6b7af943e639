"""What SIGTERM or SIGINT (pre-emption, Ctrl-C) does in each phase of a training run, so that no phase ends
silently and every stop names what was kept and the command that continues:

    start-up                 stops at once: data and model loading write nothing of the run, so the same
                             command starts it again; an SFT model being saved is finished first (start_up)
    SFT                      the SFT step finishes, then the run exits: SFT keeps no checkpoint, nothing is
                             written to sft_dir, and the same command trains it again (train.sft)
    evaluation before RL     the evaluation batch finishes, then the run exits: no RL step was taken, so
                             nothing of RL is kept; the command below starts it again (before_rl)
    an RL step               the step finishes, a checkpoint is written, the run exits (infra/run.Run.record)
    after the last RL step   a checkpoint of it is written before the final evaluation starts (with
                             checkpoint_every > 0), so the final evaluation and save can always be redone
    final evaluation         the evaluation batch finishes, the last step's checkpoint is written if it is
                             missing, the run exits; --resume=true redoes the evaluation and the save (final)
    final save               finishes (the run is then complete), then the run exits

Every exit on a signal has status 128 + signal. The evaluations check the flag between batches through a
Stop object (reduced over ranks, so that every rank stops at the same batch).
"""
from __future__ import annotations

import shlex
import signal
import sys
from contextlib import contextmanager

import torch

from infra import checkpoint, scale
from infra.scale import print0

_ARGV: list[str] = []


def remember_command(argv) -> None:
    """Keep the arguments of this run (train.main's argv, or the command line) for resume_command."""
    _ARGV[:] = list(sys.argv[1:] if argv is None else argv)


def _command(args) -> str:
    launcher = "torchrun [the same launcher flags]" if scale.world() > 1 else "python"
    return " ".join([launcher, "train.py", *map(shlex.quote, args)])


def start_command() -> str:
    """The command of this run as it was typed (python train.py and its arguments)."""
    return _command(_ARGV)


def resume_command() -> str:
    """The command that continues this run: its own arguments with --resume=true."""
    args, skip = [], False
    for i, a in enumerate(_ARGV):
        if skip:
            skip = False
            continue
        if a == "--resume" and i + 1 < len(_ARGV) and not _ARGV[i + 1].startswith("--"):
            skip = True  # "--resume false": the value goes too
            continue
        if a == "--resume" or a.startswith("--resume="):
            continue
        args.append(a)
    return _command([*args, "--resume=true"])


class Stopped(Exception):
    """Raised between evaluation batches once a signal has been caught (on every rank at the same batch)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stop:
    """stop() raises Stopped when SIGTERM or SIGINT has arrived on any rank (a collective: every rank calls
    it at the same point, as infra/heldout.evaluate does at the top of every batch)."""

    def __init__(self, flag: dict, device):
        self.flag, self.device = flag, device

    def __call__(self) -> None:
        s = int(scale.all_max(torch.tensor([self.flag["signal"]], device=self.device)).item())
        if s:
            raise Stopped(s)

    def saving(self) -> None:
        """A last check (the image snapshot came after the evaluation); from here on a signal lets the
        final save finish (it is the end of the run)."""
        self()
        self.flag["doing"] = "finishing the final save first (the run is then complete)"


_START_UP = {"holding": False, "pending": 0}


class _StartUpStopped(BaseException):
    """Raised by the start-up handler; a BaseException so that no `except Exception` on the way swallows it."""


@contextmanager
def start_up():
    """From the parsed flags to the first RL phase: a signal stops the run at once (a step-finishing handler
    of its own, like SFT's, takes over inside). Nothing of the run is written before RL but config.json, which
    a new start overwrites, and the SFT model, saved atomically inside holding()."""
    def handler(signum, frame):
        if _START_UP["holding"]:
            _START_UP["pending"] = _START_UP["pending"] or signum
            return
        raise _StartUpStopped(signum)
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    except _StartUpStopped as e:
        name = signal.Signals(e.args[0]).name
        print0(f"stopped by {name} during start-up (loading data or the model, before any RL step): nothing was "
               f"written but config.json and a finished SFT model, and no checkpoint was touched; start it again "
               f"with: {start_command()}")
        raise SystemExit(128 + e.args[0]) from None
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


@contextmanager
def holding():
    """Inside start_up: a signal waits until the block is done (the SFT model's save and rename), then stops."""
    _START_UP["holding"] = True
    try:
        yield
    finally:
        _START_UP["holding"], pending = False, _START_UP["pending"]
        _START_UP["pending"] = 0
    if pending:
        raise _StartUpStopped(pending)


@contextmanager
def before_rl(run):
    """The held-out evaluation before RL: a signal stops it after the current batch; the empty logs the
    run opened are removed, so the out_dir reads as a run that took no step and the command starts it again."""
    try:
        yield
    except Stopped as s:
        if scale.rank() == 0:
            for name in ("log.jsonl", "times.jsonl"):
                p = run.out / name
                if p.is_file() and p.stat().st_size == 0:
                    p.unlink()
        sft_dir = run.cfg.sft_dir or run.out / "sft"
        kept = f"the SFT model in {sft_dir} is kept; " if run.cfg.init_from == "scratch" else ""
        print0(f"stopped by {s} during the held-out evaluation before RL: no RL step was taken, so no checkpoint "
               f"was written ({kept}the evaluation starts again); continue with: {resume_command()}")
        raise SystemExit(128 + s.signum) from None


def _checkpoint_step(path) -> int:
    return int(path.name[len(checkpoint.PREFIX):])


def _last_step_checkpoint(run):
    """The checkpoint of the run's last RL step, or None."""
    last = checkpoint.latest(run.out)
    return last if last is not None and _checkpoint_step(last) == run.cfg.rl_steps else None


@contextmanager
def final(run):
    """The final evaluation and save, as `with final(run) as stop:`. First the last RL step is checkpointed
    (checkpoint_every > 0, unless its cadence did it); a signal during the evaluation stops it after the
    current batch, writes that checkpoint if it is missing and names the command that finishes the run; a
    signal during the save lets it finish."""
    cfg = run.cfg
    with checkpoint.graceful_stop("finishing this evaluation batch, then stopping") as flag:
        stop = Stop(flag, run.device)
        try:
            if cfg.checkpoint_every and run.start < cfg.rl_steps and _last_step_checkpoint(run) is None:
                print0(f"checkpoint {run._save_checkpoint(cfg.rl_steps)} (the last RL step, before the final "
                       "evaluation)")
            yield stop
        except Stopped as s:
            kept = _last_step_checkpoint(run)
            if kept is None:
                kept = run._save_checkpoint(cfg.rl_steps)
            print0(f"stopped by {s} during the final held-out evaluation: {kept} holds the model after all "
                   f"{cfg.rl_steps} RL steps; finish the run (the final evaluation and save) with: "
                   f"{resume_command()}")
            raise SystemExit(128 + s.signum) from None
        except KeyboardInterrupt:  # a second Ctrl-C: out at once, but say what is kept
            kept = _last_step_checkpoint(run)
            print0("interrupted during the final evaluation or save: " + (
                f"{kept} holds the model after all {cfg.rl_steps} RL steps; finish the run with: {resume_command()}"
                if kept else "no checkpoint of the last RL step was written (checkpoint_every=0)"))
            raise
    if flag["signal"]:
        print0(f"stopped by {signal.Signals(flag['signal']).name} after the final save: the run is complete "
               f"({run.out / 'final'}, {run.out / 'summary.json'})")
        raise SystemExit(128 + flag["signal"])
