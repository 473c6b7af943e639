"""A run's out_dir: the paths refused before anything is written, the pid files that make it one process's, where
a resume continues, the closing lines, and what a stop signal keeps in each phase (start_up to final; cli.EPILOGS)."""
import atexit
import json
import math
import os
import shlex
import signal
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

import tasks
from infra import checkpoint, data, hf, plots, scale, tracker
from infra.cli import need
from infra.scale import duration, print0


# What a run writes at the top of its out_dir, and the temporary names of those writes (anything else is not ours).
RUN_NAMES = {"config.json", "log.jsonl", "times.jsonl", "summary.json", "final", "checkpoints", "curves.png",
             "images.png", "run.pid", "sft", "sft.run.pid", "log.tmp", "times.tmp", *tracker.FILES}
RUN_TEMPORARY = (".write-test-", ".sft.tmp-", ".sft.old-")
# Files that make a folder a model (a Hugging Face checkpoint, or an SFT model this code wrote).
MODEL_FILES = ("sft_meta.json", "tokenizer.json", "model.safetensors.index.json", "generation.json")
# Fields a resume may change: how it runs, not what it computes (init_from, sft_dir: compared by content).
RESUMABLE = ("resume", "extend", "change_on_resume", "retrain_sft", "rl_steps", "threads", "device", "sample_every",
             "checkpoint_every", "keep_last", "max_bad_steps", "device_batch_size", "out_dir", "init_from", "sft_dir",
             "tracker", "tracker_project", "tracker_run")
PID_FILE = "run.pid"
_HELD: set[Path] = set()
_ARGV: list[str] = []
_START_UP = {"holding": False}  # and "pending": the signal holding() defers


def _inside(a: Path, b: Path) -> bool:  # a is b or lies under it (links resolved)
    return a.resolve().is_relative_to(b.resolve())


def check_paths(cfg) -> None:
    """Refuse an out_dir this run would damage (a model, --init_from's, --sft_dir's, others' files); read-only."""
    need(cfg.out_dir.strip(), "--out_dir is empty: pass the folder this run writes into, e.g. --out_dir=out/run1")
    out, here, init = Path(cfg.out_dir), Path(cfg.out_dir).resolve(), Path(cfg.init_from).resolve()
    clash = cfg.init_from not in ("", "scratch") and (init == here or any(_inside(init, out / n) for n in RUN_NAMES))
    need(not clash, f"--init_from {cfg.init_from} {'is' if init == here else 'lies inside'} --out_dir {out}, whose "
         f"files would replace it; pass a new folder as --out_dir (e.g. --out_dir={here.parent / (here.name + '-rl')})")
    if cfg.init_from == "scratch" and cfg.sft_dir:
        sft = Path(cfg.sft_dir).resolve()
        need(not _inside(out, sft), f"--sft_dir {cfg.sft_dir} {'is' if sft == here else 'holds'} --out_dir {out}: "
             f"they would share files; pass --sft_dir={here.parent / 'sft'}, or drop it (out_dir/sft)")
        for n in sorted(RUN_NAMES - {"sft"}):  # final/ is replaced, checkpoints/ rotated; sft/ is the SFT model's
            where = "is" if sft == (out / n).resolve() else "lies inside"
            need(not _inside(sft, out / n), f"--sft_dir {cfg.sft_dir} {where} {out / n}, which the run writes over; "
                 f"pass --sft_dir={out / 'sft'}, or drop it")
    need(not out.exists() or out.is_dir(), f"--out_dir {out} is a file, not a folder; pass a new folder")
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    model = [n for n in MODEL_FILES if n in names] + sorted(n for n in names if n.endswith(".safetensors"))
    with suppress(OSError, ValueError):  # a config.json that is not train.py's settings is a model's
        if not hf.is_run_settings(json.loads((out / "config.json").read_bytes())):
            model.insert(0, "config.json (a model's, not a run's)")
    need(not model, f"--out_dir {out} holds a model ({', '.join(model)}), not a run; pass a new folder as --out_dir "
         "(is it meant as --init_from?)")
    listed = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
    need(not names or any(n in RUN_NAMES or n.startswith(RUN_TEMPORARY) for n in names), f"--out_dir {out} holds "
         f"no run of train.py ({listed}); pass a new or empty folder as --out_dir")


def check_shared(out: Path, device) -> None:
    """Every rank must see the file rank 0 leaves in out_dir (ranks that cannot would take other branches, and hang)."""
    if scale.world() == 1:
        return
    mine = int.from_bytes(os.urandom(7), "big") if scale.rank() == 0 else 0
    if scale.rank() == 0:  # before the collective that tells the other ranks its name
        (out / f".shared-{mine}").touch()
    probe = out / f".shared-{scale.all_max(torch.tensor([mine], dtype=torch.int64, device=device)).item()}"
    unseen = scale.all_max(torch.tensor([int(not probe.is_file())], device=device)).item()  # once every rank looked
    if scale.rank() == 0:
        probe.unlink()
    need(not unseen, f"--out_dir {out}: a rank on another node cannot see rank 0's files; pass a folder all share")


def claim(pid_file: Path, what: str, busy: str, fix: str, note: str = "") -> None:
    """Hold pid_file, created atomically (a dead process's is taken over), or refuse naming its live holder."""
    for _ in range(3):
        try:
            with open(pid_file, "x") as f:
                f.write(f"{os.getpid()}\n")
            return
        except FileExistsError:
            holder = 0
            with suppress(OSError, ValueError):
                holder = int(pid_file.read_text().strip() or 0)
            try:  # signal 0 only asks whether the process exists
                alive = holder and holder != os.getpid() and os.kill(holder, 0) is None
            except OSError as e:
                alive = isinstance(e, PermissionError)  # another user's live process
            if alive:
                raise ValueError(f"{what} {busy} by the running process {holder} ({pid_file}); wait for it to "
                                 f"end{note}, {fix}, or delete that file if no run holds it") from None
            pid_file.unlink(missing_ok=True)
    raise ValueError(f"{what}: could not create {pid_file}; {fix}")


def claim_out_dir(out: Path) -> None:
    """Two runs started at once in one out_dir would overwrite each other: run.pid is one's."""
    claim(out / PID_FILE, f"out_dir {out}", "is in use", "choose another --out_dir")
    if out not in _HELD:  # one exit hook per directory, however often main() runs in this process
        _HELD.add(out)
        atexit.register(release, out / PID_FILE)


def release(pid_file: Path) -> None:  # if this process holds it
    with suppress(OSError, ValueError):
        if int(pid_file.read_text().strip()) == os.getpid():
            pid_file.unlink()


def resume_point(out: Path, quiet: bool = True) -> Path:
    """The newest intact checkpoint of out (newer damaged ones named, with the fix, unless quiet), else ValueError."""
    skipped = []
    for last in reversed(checkpoint.complete(out)):
        if (problem := checkpoint.damage(last)) is None:
            break
        skipped.append(f"{last} is damaged: {problem}")
    else:
        raise ValueError(f"--resume: no intact checkpoint in {out / checkpoint.DIRNAME}: " + "; ".join(skipped)
                         + "; remove the damaged directories, or choose another --out_dir")
    for line in () if quiet else skipped:
        print0(f"warning: {line}; resuming from the newest intact checkpoint, {last.name}; remove the damaged one")
    return last


def step_of(path: Path | None) -> int:  # the RL step a checkpoint holds, 0 for none
    return int(path.name[len(checkpoint.PREFIX):]) if path else 0


def step_lines(log: Path) -> list[tuple[int, str]]:
    """(step, line) of each complete line of a jsonl log (a line cut short by a crash is skipped)."""
    lines = []
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else ():
        with suppress(ValueError, KeyError, TypeError):
            lines.append((int(json.loads(line)["step"]), line))
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


def remember_command(argv) -> None:  # this run's arguments, for the commands a stop prints
    _ARGV[:] = list(sys.argv[1:] if argv is None else argv)


def start_command(args=None) -> str:
    launcher = "torchrun [the same launcher flags]" if scale.world() > 1 else "python"
    return " ".join([launcher, "train.py", *map(shlex.quote, _ARGV if args is None else args)])


def resume_command() -> str:
    """This run's command with --resume=true instead of any --resume."""
    args = [a for i, a in enumerate(_ARGV) if a != "--resume" and not a.startswith("--resume=")
            and not (i and _ARGV[i - 1] == "--resume" and not a.startswith("--"))]  # "--resume false": value too
    return start_command([*args, "--resume=true"])


def continue_command(out: Path) -> str:
    """After a failure: --resume=true with a checkpoint or logged steps, else as typed."""
    return resume_command() if checkpoint.latest(out) or step_lines(out / "log.jsonl") else start_command()


def kept_line(out: Path) -> str:
    last = checkpoint.latest(out)
    return f"the last checkpoint, {last}, is kept" if last else "no checkpoint of this run exists"


class Stopped(BaseException):
    """A caught signal, raised on every rank at once; a BaseException, so that no `except Exception` swallows it."""

    __init__ = checkpoint.Aborted.__init__  # str() is the signal's name; .signum its number


class Stop:
    """stop(), a collective atop each evaluation batch, raises Stopped after a signal on any rank; prints progress."""

    PROGRESS_EVERY = 30.0

    def __init__(self, flag: dict, device, total: int = 0, label: str = ""):
        self.flag, self.device = flag, device
        self.counting(total, label)

    def counting(self, total: int, label: str) -> None:
        self.total, self.label, self.calls = total, label, 0
        self.t0 = self.shown_at = time.time()

    def __call__(self) -> None:
        if s := int(scale.all_max(torch.tensor([self.flag["signal"]], device=self.device)).item()):
            raise Stopped(s)
        if self.total and self.calls and time.time() - self.shown_at >= self.PROGRESS_EVERY:
            spent = time.time() - self.t0
            print0(f"{self.label}: batch {self.calls + 1} of about {self.total}, {duration(spent)} so far, "
                   f"about {duration(spent / self.calls * max(0, self.total - self.calls))} left")
            self.shown_at = time.time()
        self.calls += 1

    def saving(self) -> None:
        """A last check; from here on a signal lets the final save finish."""
        self()
        self.flag["doing"] = "finishing the final save first (the run is then complete)"


def _exit(e: BaseException, what: str):
    """Say what a stop kept ("stopped by SIG during ...", a second signal "aborted by") and exit 128 + the signal."""
    how = f"stopped by {e}" if isinstance(e, Stopped) else f"aborted by a second {e}" \
        if isinstance(e, checkpoint.Aborted) else "aborted by Ctrl-C"
    print0(f"{how} {what}")
    raise SystemExit(128 + getattr(e, "signum", signal.SIGINT)) from None


@contextmanager
def start_up():
    """Until RL a signal stops the run at once (SFT's handler takes over inside; the SFT model saves in holding())."""
    def handler(signum, frame):
        checkpoint.away_from_gone_output()  # the line below must not fail on a closed terminal
        if not _START_UP["holding"]:
            raise Stopped(signum)
        _START_UP["pending"] = _START_UP.get("pending") or signum
    previous = {sig: signal.signal(sig, handler) for sig in checkpoint.STOP_SIGNALS}
    try:
        yield
    except (Stopped, KeyboardInterrupt) as e:  # KeyboardInterrupt: a second signal during SFT (its handler raises it)
        how = "start-up (loading data or the model, before any RL step): no checkpoint was touched" if isinstance(
            e, Stopped) else "start-up or SFT: SFT keeps no checkpoint and nothing was written to the sft_dir"
        _exit(e, f"during {how}; start it again with: {start_command()}")
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


@contextmanager
def holding():
    """Inside start_up: a signal waits until the block (the SFT model's save) is done, then stops."""
    _START_UP["holding"] = True
    try:
        yield
    finally:
        _START_UP["holding"], pending = False, _START_UP.pop("pending", 0)
    if pending:
        raise Stopped(pending)


@contextmanager
def before_rl(run):
    """A signal stops the evaluation before RL after a batch, a second one at once; the empty logs are removed."""
    doing, run.signal["doing"] = run.signal["doing"], "finishing this evaluation batch, then stopping"
    try:
        yield
    except (Stopped, KeyboardInterrupt) as s:
        for p in (run.out / "log.jsonl", run.out / "times.jsonl") if scale.rank() == 0 else ():
            if p.is_file() and p.stat().st_size == 0:
                p.unlink()
        kept = f"the SFT model in {run.cfg.sft_dir or run.out / 'sft'} is kept; " * (run.cfg.init_from == "scratch")
        _exit(s, "during the held-out evaluation before RL: no RL step was taken, so no checkpoint was written "
              f"({kept}the evaluation starts again); continue with: {resume_command()}")
    finally:
        run.signal["doing"] = doing


@contextmanager
def rl_steps(run):
    """A signal sets run.signal (Run.after_step checkpoints and exits); a second drops the step at once."""
    def lost() -> tuple[Path | None, str, bool]:  # the newest checkpoint, the steps lost, whether several
        last = checkpoint.latest(run.out)
        many = run.done > step_of(last)
        return last, f"steps {step_of(last)} to {run.done}" if many else f"step {run.done}", many

    def abort() -> str:
        if run.state["before"] is None:  # in the evaluation before RL (before_rl)
            return "no RL step was taken, so nothing more is lost (the evaluation before RL starts again)"
        last, steps, _ = lost()
        return (f"{steps} would be lost and the run would continue from {last}" if last else
                f"no checkpoint exists yet, so {steps} would be lost and the run would restart from step 0")
    try:
        with checkpoint.graceful_stop(abort=abort) as run.signal:
            yield
    except KeyboardInterrupt as e:
        last, steps, many = lost()
        _exit(e, f"during RL step {run.done}: {steps} {'are' if many else 'is'} lost; " + (f"{last} is kept; "
              "continue with: " if last else "no checkpoint was written, so the run restarts from step 0 with: ")
              + resume_command())


@contextmanager
def final(run):
    """`with final(run) as stop:` checkpoints the last RL step first; a signal stops the evaluation after a batch."""
    def last_step():  # the checkpoint of the run's last RL step, or None
        return last if step_of(last := checkpoint.latest(run.out)) == run.cfg.rl_steps else None

    def abort() -> str:
        return f"{kept} is kept and finishes the run" if (kept := last_step()) else \
            "no checkpoint of the last RL step exists (checkpoint_every=0), so all RL steps would be lost"
    try:
        with checkpoint.graceful_stop("finishing this evaluation batch, then stopping", abort) as flag:
            try:
                if run.cfg.checkpoint_every and run.start < run.cfg.rl_steps and last_step() is None:
                    print0(f"checkpoint {run._save_checkpoint(run.cfg.rl_steps)} (the last RL step, before evaluation)")
                yield Stop(flag, run.device)
            except Stopped as s:
                kept = last_step() or run._save_checkpoint(run.cfg.rl_steps)
                _exit(s, f"during the final held-out evaluation: {kept} holds the model after all "
                      f"{run.cfg.rl_steps} RL steps; finish the run with: {resume_command()}")
    except KeyboardInterrupt as e:  # a second signal (checkpoint.Aborted), also in the stop's save: say what is kept
        kept = last_step()
        _exit(e, "during the final evaluation or save: " + (f"{kept} holds the model after all {run.cfg.rl_steps} "
              f"RL steps; finish the run with: {resume_command()}" if kept else "no checkpoint of the last RL step "
              f"was written (checkpoint_every=0), so the RL steps are lost; restart the run with: {resume_command()}"))
    if flag["signal"]:
        _exit(Stopped(flag["signal"]), f"after the final save: the run is complete ({run.out / 'final'})")


def print_held_out(when: str, rewards: dict, summary: dict | None = None) -> None:
    """The held-out mean reward per task in one line; after RL with the gain and its paired standard error."""
    if not rewards and when == "before RL":
        print0("no held-out set, so no held-out reward: pass --eval_data=TASK=PATH (and --eval_prompts > 0)")
    shown = []
    for k, v in (rewards or {}).items():
        s = (summary or {}).get(k, {})
        known = None not in (s.get("gain_se"), s.get("before"), s.get("after"))
        gain = f" ({v - s['before']:+.3f} ± {s['gain_se']:.3f})" if known else ""
        shown.append(f"{k} {f'{v:.3f}' if math.isfinite(v) else 'not measured'}{gain}")  # NaN: the scorer was down
    if shown:
        print0(f"held-out mean reward {when}:{' ' * (when == 'after RL')} {', '.join(shown)}")


def show(b, rewards, tok, ids) -> None:
    """Print the first decoded rollout with its reward (a toy image in ANSI colours)."""
    out, prompt = tasks.decode_window(b, tok, ids)[0], b.examples[0]["prompt"]
    said = repr(prompt) if b.task in tasks.IMAGE_TASKS else f"{prompt[-200:]!r} -> {out!r}"
    print0(f"  [{b.task}] {said}  reward {rewards[0]:.2f}")
    if b.task == "image":  # toy palette codes; real VQ codes need the image decoder
        print0(plots.text_image(out, int(math.isqrt(len(out)))))


def write_pictures(cfg, out: Path, grid_before, grid_after, summary: dict) -> None:
    """curves.png (reward, KL, clip fraction per step) and images.png (toy images before and after RL)."""
    if (log := out / "log.jsonl").is_file() and "/reward" in log.read_text():  # a step that was taken
        plots.plot_curves(log, out / "curves.png")
    if grid_before is not None and grid_after is not None:  # a score not measured (null) is left off the panel
        summary = {k: v for k, v in summary.items() if not isinstance(v, dict) or None not in v.values()}
        plots.toy_image_panel([("before RL", grid_before), ("after RL", grid_after)], data.eval_examples(
            "image", cfg, {})[:data.GRID_PROMPTS], cfg.image_width, out / "images.png", summary)


def closing_summary(run, seconds: float) -> None:
    """The run's last lines: the time, where the model and pictures are, the next commands."""
    out, pictures = run.out, [str(run.out / n) for n in ("curves.png", "images.png") if (run.out / n).is_file()]
    print0(f"done in {duration(seconds)} (RL {duration(run.rl_end)}{' over every resumed segment' if run.start else ''}"
           f"): model {out / 'final'}, summary {out / 'summary.json'}, log {out / 'log.jsonl'}, " + (f"pictures "
           f"{', '.join(pictures)}" if pictures else "no pictures (no plots extra: pip install -e '.[plots]')"))
    print0(f"next: python -m tools.sample --ckpt={out / 'final'} --prompt=\"...\" (add --image for a picture); "
           f"python evaluate.py --run={out} re-scores it")
