"""A run's out_dir and what the run says of it: the paths refused before anything is written, the pid files that
make out_dir (and an sft_dir being trained) one process's alone, where a resume continues, the closing lines, and
what SIGTERM, SIGINT or SIGHUP (pre-emption, Ctrl-C, a closed terminal) keeps in each phase, naming the command
that continues (exit status 128 + signal):

    start-up      stops at once: nothing of the run is written (an SFT model being saved is saved first)
    SFT           the step finishes, then the run exits: SFT keeps no checkpoint (train.sft)
    evaluations   the batch finishes, then the run exits (before_rl; final checkpoints the last RL step first)
    an RL step    the step finishes, a checkpoint is written, the run exits; a second signal (after 5 s) drops
                  the step at once, naming what is lost and kept (rl_steps, Run.after_step)
    final save    finishes (the run is then complete), then the run exits
"""
from __future__ import annotations

import atexit
import json
import math
import os
import shlex
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import tasks
from infra import checkpoint, cli, data, plots, scale, tracker
from infra.scale import duration, print0
from tasks import IMAGE_TASKS


# What a run writes at the top of its out_dir (run.py, checkpoint.py, load.py's SFT cache), and the temporary
# names of those writes. Anything else in an out_dir that holds none of them is someone else's.
RUN_NAMES = {"config.json", "log.jsonl", "times.jsonl", "summary.json", "final", "checkpoints", "curves.png",
             "images.png", "run.pid", "sft", "sft.run.pid", "log.tmp", "times.tmp", *tracker.FILES}
RUN_TEMPORARY = (".write-test-", ".sft.tmp-", ".sft.old-")
# Files that make a folder a model (a Hugging Face checkpoint, or an SFT model this code wrote).
MODEL_FILES = ("sft_meta.json", "tokenizer.json", "model.safetensors.index.json", "generation.json")
# Fields a resumption may change (how it runs, not what it computes; lr and grad_clip when --change_on_resume names
# them). init_from and sft_dir are compared by the model's content (load.reference_identity), not by path.
RESUMABLE = ("resume", "extend", "change_on_resume", "retrain_sft", "rl_steps", "threads", "device", "sample_every",
             "checkpoint_every", "keep_last", "max_bad_steps", "device_batch_size", "out_dir", "init_from", "sft_dir",
             "tracker", "tracker_project", "tracker_run")
PID_FILE = "run.pid"
_HELD: set[Path] = set()
_ARGV: list[str] = []
_START_UP = {"holding": False, "pending": 0}

cli.EPILOGS["Config"] = (  # train.py --help, after the flags
    "Stopping and continuing: Ctrl-C, SIGTERM or SIGHUP (a closed terminal) lets the current SFT step, RL step "
    "or evaluation batch finish, writes a checkpoint during RL, and prints what was kept and the command that "
    "continues (the same command with --resume=true); the exit status is 128 + the signal. A second signal, 5 s "
    "or more after the first, stops at once; the first signal's line says what that loses. Out of memory, a full "
    "disk or a dead torchrun rank ends with one line naming what was kept and that command. "
    "`python -m infra.load OUT_DIR/checkpoints/step-N DEST` turns a checkpoint into a model folder for sample.py "
    "and evaluate.py.")


def _inside(a: Path, b: Path) -> bool:
    """a is b or lies under it (links resolved, so two spellings of one folder are the same)."""
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def check_paths(cfg) -> None:
    """Refuse, before anything is written, an out_dir this run would damage: a model folder, the --init_from model
    or a folder holding it, the --sft_dir, or a non-empty folder holding no run. Read-only, on every rank."""
    if not cfg.out_dir.strip():
        raise ValueError("--out_dir is empty: pass the folder this run writes into, e.g. --out_dir=out/run1")
    out, here, init = Path(cfg.out_dir), Path(cfg.out_dir).resolve(), Path(cfg.init_from).resolve()
    if cfg.init_from not in ("", "scratch") and (init == here or any(_inside(init, out / n) for n in RUN_NAMES)):
        raise ValueError(f"--init_from {cfg.init_from} {'is' if init == here else 'lies inside'} --out_dir {out}: the "
                         "run would write its config.json, logs and final/ over the model it starts from; pass a new "
                         f"folder as --out_dir (e.g. --out_dir={here.parent / (here.name + '-rl')})")
    if cfg.init_from == "scratch" and cfg.sft_dir:
        sft = Path(cfg.sft_dir).resolve()
        if _inside(out, sft):
            raise ValueError(f"--sft_dir {cfg.sft_dir} {'is' if sft == here else 'holds'} --out_dir {out}: the SFT "
                             "model and the run would share files; give the SFT model its own folder (e.g. "
                             f"--sft_dir={here.parent / 'sft'}) or drop --sft_dir (out_dir/sft)")
        for n in sorted(RUN_NAMES - {"sft"}):  # final/ is replaced, checkpoints/ rotated; sft/ is the SFT model's
            if _inside(sft, out / n):
                raise ValueError(f"--sft_dir {cfg.sft_dir} {'is' if sft == (out / n).resolve() else 'lies inside'} "
                                 f"{out / n}, which the run writes: the SFT model would be overwritten; give it its "
                                 f"own folder (e.g. --sft_dir={out / 'sft'}) or drop --sft_dir (out_dir/sft)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out_dir {out} is a file, not a folder (it is left as it is); pass a new folder")
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    model = [n for n in MODEL_FILES if n in names] + sorted(n for n in names if n.endswith(".safetensors"))
    try:  # a config.json that is not train.py's settings is a model's
        saved = json.loads((out / "config.json").read_bytes())
        if not (isinstance(saved, dict) and "rl_steps" in saved and "out_dir" in saved):
            model.insert(0, "config.json (a model's, not a run's)")
    except (OSError, ValueError):
        pass
    if model:
        raise ValueError(f"--out_dir {out} holds a model ({', '.join(model)}), not a run: a run would write its "
                         "settings and logs into it; pass a new folder as --out_dir (is it meant as --init_from?)")
    if names and not any(n in RUN_NAMES or n.startswith(RUN_TEMPORARY) for n in names):
        listed = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise ValueError(f"--out_dir {out} is not empty and holds no run of train.py ({listed}): a run writes only "
                         "into a new, empty or its own folder; pass a new folder as --out_dir")


def check_shared(out: Path, device) -> None:
    """A multi-node out_dir must be one file system: ranks that cannot see rank 0's checkpoints would take other
    branches and hang. Rank 0 leaves a file named by a fresh random number; each rank must see it."""
    if scale.world() == 1:
        return
    mine = int.from_bytes(os.urandom(7), "big") if scale.rank() == 0 else 0
    nonce = int(scale.all_max(torch.tensor([mine], dtype=torch.int64, device=device)).item())  # rank 0's number
    probe = out / f".shared-{nonce}"
    if scale.rank() == 0:
        probe.touch()
    scale.barrier()
    unseen = scale.all_max(torch.tensor([int(not probe.is_file())], device=device)).item()
    scale.barrier()
    if scale.rank() == 0:
        probe.unlink()
    if unseen:
        raise ValueError(f"--out_dir {out}: a rank on another node cannot see the files rank 0 writes there; a "
                         "multi-node run needs out_dir on a file system every node shares (a network file system)")


def claim(pid_file: Path, what: str, busy: str, fix: str, note: str = "") -> None:
    """Hold pid_file, created atomically with this process id (one left by a dead process, or by an earlier main()
    of this one, is taken over), or refuse in one line naming its live holder."""
    for _ in range(3):
        try:
            with open(pid_file, "x") as f:
                f.write(f"{os.getpid()}\n")
            return
        except FileExistsError:
            try:
                holder = int(pid_file.read_text().strip() or 0)
            except (OSError, ValueError):
                holder = 0
            if holder and holder != os.getpid() and pid_alive(holder):
                raise ValueError(f"{what} {busy} by the running process {holder} ({pid_file}); wait for it to "
                                 f"end{note}, {fix}, or delete that file if no run holds it") from None
            pid_file.unlink(missing_ok=True)
    raise ValueError(f"{what}: could not create {pid_file}; {fix}")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
    return True


def claim_out_dir(out: Path) -> None:
    """Two runs started at once in one out_dir would pass the checks and overwrite each other: run.pid is one's."""
    claim(out / PID_FILE, f"out_dir {out}", "is in use", "choose another --out_dir")
    if out not in _HELD:  # one exit hook per directory, however often main() runs in this process
        _HELD.add(out)
        atexit.register(release, out / PID_FILE)


def release(pid_file: Path) -> None:  # if this process holds it
    try:
        if int(pid_file.read_text().strip()) == os.getpid():
            pid_file.unlink()
    except (OSError, ValueError):
        pass


def resume_point(out: Path, quiet: bool = True) -> Path:
    """The newest intact checkpoint of out (newer damaged ones named, with the fix, unless quiet), else ValueError."""
    last, skipped = checkpoint.latest_intact(out)
    if last is None:
        raise ValueError(f"--resume: no intact checkpoint in {out / checkpoint.DIRNAME}: " + "; ".join(skipped)
                         + "; remove the damaged directories, or choose another --out_dir")
    for line in () if quiet else skipped:
        print0(f"warning: {line}; resuming from the newest intact checkpoint, {last.name} (remove the "
               "damaged one to silence this)")
    return last


def step_of(path: Path | None) -> int:  # the RL step a checkpoint holds, 0 for none
    return int(path.name[len(checkpoint.PREFIX):]) if path else 0


def step_lines(log: Path) -> list[tuple[int, str]]:
    """(step, line) of each complete line of a jsonl log ([] if none; a line cut short by a crash is skipped)."""
    lines = []
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else ():
        try:
            lines.append((int(json.loads(line)["step"]), line))
        except (ValueError, KeyError, TypeError):
            continue
    return lines


def root_causes(e: BaseException) -> list[BaseException]:
    """e, its cause and context chain, and the per-rank failures a (DCP) CheckpointException carries."""
    seen, todo = [], [e]
    while todo:
        x = todo.pop()
        if x is None or any(x is y for y in seen):
            continue
        seen.append(x)
        todo += [x.__cause__, x.__context__]
        for failure in getattr(x, "failures", {}).values() if isinstance(getattr(x, "failures", None), dict) else ():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return seen


def remember_command(argv) -> None:
    """Keep this run's arguments (train.main's argv, or the command line) for the commands a stop prints."""
    _ARGV[:] = list(sys.argv[1:] if argv is None else argv)


def start_command(args=None) -> str:
    """The command of this run as it was typed, or with args as its arguments."""
    launcher = "torchrun [the same launcher flags]" if scale.world() > 1 else "python"
    return " ".join([launcher, "train.py", *map(shlex.quote, _ARGV if args is None else args)])


def resume_command() -> str:
    """The command that continues this run: its own arguments with --resume=true instead of any --resume."""
    args, drop = [], False
    for a in _ARGV:
        if drop and not a.startswith("--"):  # "--resume false": the value goes too
            drop = False
            continue
        drop = a == "--resume"
        if not (drop or a.startswith("--resume=")):
            args.append(a)
    return start_command([*args, "--resume=true"])


def continue_command(out: Path) -> str:
    """After a failure: --resume=true with a checkpoint or logged steps (then redone from step 0), else as typed."""
    return resume_command() if checkpoint.latest(out) or step_lines(out / "log.jsonl") else start_command()


def kept_line(out: Path) -> str:
    last = checkpoint.latest(out)
    return f"the last checkpoint, {last}, is kept" if last else "no checkpoint of this run exists"


class Stopped(Exception):
    """Raised between evaluation batches once a signal has been caught (on every rank at the same batch)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stop:
    """stop() raises Stopped once a signal has arrived on any rank (a collective, called by every rank at the top of
    each evaluation batch); given the batch count it prints progress every PROGRESS_EVERY seconds."""

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
        """A last check; from here on a signal lets the final save finish (it is the end of the run)."""
        self()
        self.flag["doing"] = "finishing the final save first (the run is then complete)"


class _StartUpStopped(BaseException):
    """Raised by the start-up handler; a BaseException so that no `except Exception` on the way swallows it."""


@contextmanager
def start_up():
    """From the parsed flags to the first RL phase a signal stops the run at once (SFT's step-finishing handler
    takes over inside): nothing is written before RL but config.json and the SFT model, saved inside holding()."""
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
        print0(f"stopped by {signal.Signals(e.args[0]).name} during start-up (loading data or the model, before "
               "any RL step): nothing was written but config.json and a finished SFT model, and no checkpoint "
               f"was touched; start it again with: {start_command()}")
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
    """The held-out evaluation before RL: a signal stops it after the current batch; the empty logs the run opened
    are removed, so the out_dir reads as a run that took no step."""
    try:
        yield
    except Stopped as s:
        for p in (run.out / "log.jsonl", run.out / "times.jsonl") if scale.rank() == 0 else ():
            if p.is_file() and p.stat().st_size == 0:
                p.unlink()
        sft_dir = run.cfg.sft_dir or run.out / "sft"
        kept = f"the SFT model in {sft_dir} is kept; " if run.cfg.init_from == "scratch" else ""
        print0(f"stopped by {s} during the held-out evaluation before RL: no RL step was taken, so no checkpoint "
               f"was written ({kept}the evaluation starts again); continue with: {resume_command()}")
        raise SystemExit(128 + s.signum) from None


@contextmanager
def rl_steps(run):
    """The RL steps: a signal sets the flag run.signal (Run.after_step then checkpoints and exits); a second one
    drops the step in progress at once, naming what is lost and the command that continues."""
    def lost() -> tuple[Path | None, str, bool]:  # the newest checkpoint, the steps lost, whether several
        last = checkpoint.latest(run.out)
        many = run.done > step_of(last)
        return last, f"steps {step_of(last)} to {run.done}" if many else f"step {run.done}", many

    def abort() -> str:
        last, steps, _ = lost()
        return (f"{steps} would be lost and the run would continue from {last}" if last else
                f"no checkpoint exists yet, so {steps} would be lost and the run would restart from step 0")
    try:
        with checkpoint.graceful_stop(abort=abort) as run.signal:
            yield
    except KeyboardInterrupt as e:
        last, steps, many = lost()
        name = f"a second {e}" if isinstance(e, checkpoint.Aborted) else "Ctrl-C"
        print0(f"aborted by {name} during RL step {run.done}: {steps} {'are' if many else 'is'} lost; " +
               (f"{last} is kept; continue with: " if last else "no checkpoint was written, so the run "
                "restarts from step 0 with: ") + resume_command())
        raise SystemExit(128 + getattr(e, "signum", signal.SIGINT)) from None


@contextmanager
def final(run):
    """The final evaluation and save, as `with final(run) as stop:`: the last RL step is checkpointed first
    (checkpoint_every > 0); a signal stops the evaluation after a batch (that checkpoint written if missing) and
    names the command that finishes the run; a signal during the save lets it finish."""
    cfg = run.cfg

    def last_step():  # the checkpoint of the run's last RL step, or None
        last = checkpoint.latest(run.out)
        return last if step_of(last) == cfg.rl_steps else None

    def abort() -> str:
        kept = last_step()
        return (f"{kept} is kept and finishes the run" if kept else
                "no checkpoint of the last RL step exists (checkpoint_every=0), so all RL steps would be lost")
    with checkpoint.graceful_stop("finishing this evaluation batch, then stopping", abort) as flag:
        try:
            if cfg.checkpoint_every and run.start < cfg.rl_steps and last_step() is None:
                print0(f"checkpoint {run._save_checkpoint(cfg.rl_steps)} (the last RL step, before the final "
                       "evaluation)")
            yield Stop(flag, run.device)
        except Stopped as s:
            kept = last_step() or run._save_checkpoint(cfg.rl_steps)
            print0(f"stopped by {s} during the final held-out evaluation: {kept} holds the model after all "
                   f"{cfg.rl_steps} RL steps; finish the run (the final evaluation and save) with: "
                   f"{resume_command()}")
            raise SystemExit(128 + s.signum) from None
        except KeyboardInterrupt as e:  # a second signal (checkpoint.Aborted): out at once, say what is kept
            kept = last_step()
            print0("aborted by a second SIGINT during the final evaluation or save: " + (
                f"{kept} holds the model after all {cfg.rl_steps} RL steps; finish the run with: "
                f"{resume_command()}" if kept else "no checkpoint of the last RL step was written "
                f"(checkpoint_every=0), so the RL steps are lost; restart the run with: {resume_command()}"))
            raise SystemExit(128 + getattr(e, "signum", signal.SIGINT)) from None
    if flag["signal"]:
        print0(f"stopped by {signal.Signals(flag['signal']).name} after the final save: the run is complete "
               f"({run.out / 'final'}, {run.out / 'summary.json'})")
        raise SystemExit(128 + flag["signal"])


def shown(v) -> str:
    """A held-out reward as printed: three decimals, or "not measured" (NaN: a scorer down)."""
    return f"{v:.3f}" if math.isfinite(v) else "not measured"


def print_held_out(when: str, rewards: dict, summary: dict | None = None) -> None:
    """The held-out mean reward per task before or after RL in one line; after RL with the gain over before and its
    standard error paired by prompt, where both were measured."""
    if not rewards:
        if when == "before RL":
            print0("no held-out set, so no mean reward before and after RL: pass --eval_data=TASK=PATH "
                   "(and --eval_prompts > 0)")
        return

    def gain(k, v) -> str:
        s = (summary or {}).get(k, {})
        if None in (s.get("gain_se"), s.get("before"), s.get("after")):
            return ""
        return f" ({v - s['before']:+.3f} ± {s['gain_se']:.3f})"
    print0(f"held-out mean reward {when}:{' ' * (when == 'after RL')} " +
           ", ".join(f"{k} {shown(v)}{gain(k, v)}" for k, v in rewards.items()))


def show(b, rewards, tok, ids, n: int = 1) -> None:
    """Print n decoded rollouts with their rewards (a toy image in ANSI colours on a terminal, letters in a log)."""
    outs = tasks.decode_window(b, tok, ids)
    for i in range(n):
        prompt = b.examples[i]["prompt"]
        if b.task in IMAGE_TASKS:
            print0(f"  [{b.task}] {prompt!r}  reward {rewards[i]:.2f}")
        else:
            print0(f"  [{b.task}] {prompt[-200:]!r} -> {outs[i]!r}  reward {rewards[i]:.2f}")
        if b.task == "image":  # toy palette codes; real VQ codes need the image decoder
            print0(plots.text_image(outs[i], int(math.isqrt(len(outs[i])))))


def write_pictures(cfg, out: Path, grid_before, grid_after, summary: dict) -> None:
    """curves.png (reward, KL, clip fraction per step) and images.png (toy images before and after RL, prompt under
    each), when the plots extra is installed (plots.py says how to get it otherwise)."""
    log = out / "log.jsonl"
    if log.is_file() and any("/reward" in line for line in log.read_text().splitlines()):  # a step that was taken
        plots.plot_curves(log, out / "curves.png")
    if grid_before is not None and grid_after is not None:  # a score not measured (null) is left off the panel
        summary = {k: v for k, v in summary.items() if not isinstance(v, dict) or None not in v.values()}
        grid = [("before RL", grid_before), ("after RL", grid_after)]
        plots.toy_image_panel(grid, data.eval_examples("image", cfg, {})[:data.GRID_PROMPTS], cfg.image_width,
                              out / "images.png", summary)


def closing_summary(run, seconds: float) -> None:
    """The run's last lines: the time it took, where the model and pictures are, and the next commands."""
    out = run.out
    pictures = [str(out / n) for n in ("curves.png", "images.png") if (out / n).is_file()]
    print0(f"done in {duration(seconds)} (RL {duration(run.rl_end)}{' over every resumed segment' if run.start else ''}"
           f"): model {out / 'final'}, summary {out / 'summary.json'}, log {out / 'log.jsonl'}"
           + (f", pictures {', '.join(pictures)}" if pictures
              else ", no pictures (the plots extra is not installed: pip install -e '.[plots]')"))
    print0(f"next: python -m tools.sample --ckpt={out / 'final'} --prompt=\"...\" (add --image for a picture); "
           f"python evaluate.py --run={out} re-scores it")
