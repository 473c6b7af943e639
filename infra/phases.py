"""What SIGTERM, SIGINT or SIGHUP (pre-emption, Ctrl-C, a closed terminal) does in each phase of a training run, so that no phase ends
silently and every stop names what was kept and the command that continues:

    start-up                 stops at once: data and model loading write nothing of the run, so the same
                             command starts it again; an SFT model being saved is finished first (start_up)
    SFT                      the SFT step finishes, then the run exits: SFT keeps no checkpoint, nothing is
                             written to sft_dir, and the same command trains it again (train.sft)
    evaluation before RL     the evaluation batch finishes, then the run exits: no RL step was taken, so
                             nothing of RL is kept; the command below starts it again (before_rl)
    an RL step               the step finishes, a checkpoint is written, the run exits (infra/run.Run.record);
                             a second signal (after 5 s) drops the step at once and names the command that
                             continues from the last checkpoint, or restarts from step 0 when there is none
    after the last RL step   a checkpoint of it is written before the final evaluation starts (with
                             checkpoint_every > 0), so the final evaluation and save can always be redone
    final evaluation         the evaluation batch finishes, the last step's checkpoint is written if it is
                             missing, the run exits; --resume=true redoes the evaluation and the save (final)
    final save               finishes (the run is then complete), then the run exits

Every exit on a signal has status 128 + signal. The evaluations check the flag between batches through a
Stop object (reduced over ranks, so that every rank stops at the same batch).
"""
from __future__ import annotations

import math
import shlex
import signal
import sys
import time
from contextlib import contextmanager

import torch

from infra import checkpoint, cli, scale
from infra.scale import print0

_ARGV: list[str] = []

# train.py --help, after the flags.
SIGNALS_HELP = (
    "Stopping and continuing: Ctrl-C, SIGTERM or SIGHUP (a closed terminal) lets the current SFT step, RL step "
    "or evaluation batch finish, writes a checkpoint during RL, and prints what was kept and the command that "
    "continues (the same command with --resume=true); the exit status is 128 + the signal. A second signal, 5 s "
    "or more after the first, stops at once; the first signal's line says what that loses. Out of memory, a full "
    "disk or a dead torchrun rank ends with one line naming what was kept and that command. "
    "`python -m infra.load OUT_DIR/checkpoints/step-N DEST` turns a checkpoint into a model folder for sample.py "
    "and evaluate.py.")
cli.EPILOGS["Config"] = SIGNALS_HELP


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


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def shown(v) -> str:
    """A held-out reward as printed: three decimals, or "not measured" (NaN: a scorer down)."""
    return f"{v:.3f}" if math.isfinite(v) else "not measured"


class Stop:
    """stop() raises Stopped when SIGTERM or SIGINT has arrived on any rank (a collective: every rank calls
    it at the same point, as infra/data.evaluate does at the top of every batch). Given the number of batches it
    also prints, every PROGRESS_EVERY seconds, how far the evaluation is and the time left."""

    PROGRESS_EVERY = 30.0

    def __init__(self, flag: dict, device, total: int = 0, label: str = ""):
        self.flag, self.device = flag, device
        self.counting(total, label)

    def counting(self, total: int, label: str) -> None:
        self.total, self.label, self.calls = total, label, 0
        self.t0 = self.shown_at = time.time()

    def __call__(self) -> None:
        s = int(scale.all_max(torch.tensor([self.flag["signal"]], device=self.device)).item())
        if s:
            raise Stopped(s)
        if self.total and self.calls and time.time() - self.shown_at >= self.PROGRESS_EVERY:
            spent = time.time() - self.t0
            left = spent / self.calls * max(0, self.total - self.calls)
            print0(f"{self.label}: batch {self.calls + 1} of about {self.total}, {duration(spent)} so far, "
                   f"about {duration(left)} left")
            self.shown_at = time.time()
        self.calls += 1

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
        checkpoint.away_from_gone_output()  # the line below must not fail on a closed terminal
        if _START_UP["holding"]:
            _START_UP["pending"] = _START_UP["pending"] or signum
            return
        raise _StartUpStopped(signum)
    previous = {sig: signal.signal(sig, handler) for sig in checkpoint.STOP_SIGNALS}
    try:
        yield
    except _StartUpStopped as e:
        name = signal.Signals(e.args[0]).name
        print0(f"stopped by {name} during start-up (loading data or the model, before any RL step): nothing was "
               f"written but config.json and a finished SFT model, and no checkpoint was touched; start it again "
               f"with: {start_command()}")
        raise SystemExit(128 + e.args[0]) from None
    except KeyboardInterrupt as e:  # a second signal during SFT (its step-finishing handler raises it)
        print0(f"aborted by a second {e if isinstance(e, checkpoint.Aborted) else 'SIGINT'} during start-up or "
               f"SFT: SFT keeps no checkpoint and nothing was written to the sft_dir; start it again with: "
               f"{start_command()}")
        raise SystemExit(128 + getattr(e, "signum", signal.SIGINT)) from None
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
    def abort() -> str:
        kept = _last_step_checkpoint(run)
        return (f"{kept} is kept and finishes the run" if kept else
                "no checkpoint of the last RL step exists (checkpoint_every=0), so all RL steps would be lost")
    with checkpoint.graceful_stop("finishing this evaluation batch, then stopping", abort) as flag:
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
        except (KeyboardInterrupt, checkpoint.Aborted) as e:  # a second signal: out at once, say what is kept
            kept = _last_step_checkpoint(run)
            print0(f"aborted by a second {'SIGINT' if isinstance(e, KeyboardInterrupt) else e} during the final "
                   "evaluation or save: " + (
                       f"{kept} holds the model after all {cfg.rl_steps} RL steps; finish the run with: "
                       f"{resume_command()}" if kept else "no checkpoint of the last RL step was written "
                       f"(checkpoint_every=0), so the RL steps are lost; restart the run with: {resume_command()}"))
            raise SystemExit(128 + getattr(e, "signum", signal.SIGINT)) from None
    if flag["signal"]:
        print0(f"stopped by {signal.Signals(flag['signal']).name} after the final save: the run is complete "
               f"({run.out / 'final'}, {run.out / 'summary.json'})")
        raise SystemExit(128 + flag["signal"])


def closing_summary(run, seconds: float) -> None:
    """The run's last lines: the time it took, where the model and pictures are, and the next commands."""
    out = run.out
    pictures = [str(out / n) for n in ("curves.png", "images.png") if (out / n).is_file()]
    rl = run.rl_end
    print0(f"done in {duration(seconds)} (RL {duration(rl)}{' over every resumed segment' if run.start else ''}): "
           f"model {out / 'final'}, summary {out / 'summary.json'}, log {out / 'log.jsonl'}"
           + (f", pictures {', '.join(pictures)}" if pictures
              else ", no pictures (the plots extra is not installed: pip install -e '.[plots]')"))
    print0(f"next: python -m tools.sample --ckpt={out / 'final'} --prompt=\"...\" (add --image for a picture); "
           f"python evaluate.py --run={out} re-scores it")
