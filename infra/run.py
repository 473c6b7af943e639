"""The run's lifecycle around train.py's loop: its start-up (start), logs, checkpoints and resume, signals,
bad-step guard, and the final save (the out_dir's start-up checks and ownership are infra/outdir.py).

A Run keeps the state a resumed run must continue from (step, the held-out rewards before RL, bad-step
counters, RL seconds, the last good checkpoint), writes log.jsonl (one line per RL step; wall times go to
times.jsonl so that a repeated run gives an identical log.jsonl), stops after max_bad_steps consecutive bad
steps, and on SIGTERM/SIGINT writes a checkpoint and exits 128 + signal (checkpoint.py). Every rank makes
the same decisions: flags are reduced over ranks before they are acted on.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

import tasks
from infra import checkpoint, claims, heldout, lora, phases, scale
from infra.data import load_data
from infra.fast_sample import FastSampler
from infra.load import WriteFailed, load_policy, reference_identity, report_truncation, save_model, writer_error
from infra.outdir import logged_steps, release_out_dir, resume_point, startup_checks
from infra.scale import print0
from infra.scorer import RemoteScorer
from infra.settings import resume_changes, setup
from tasks import IMAGE_TASKS, task_list


EVAL_BATCH = 64  # rows per heldout.evaluate batch


def start(cfg, argv, sft):
    """train.py's start-up, from the parsed flags to the first RL step: (model, ref, opt, ctx, dtype, sft_seconds),
    the SFT stage first for a toy run (sft: train.sft), or, for --resume of a run that had finished, its summary."""
    phases.remember_command(argv)   # for the messages that name the command continuing this run
    claims.check_paths(cfg)         # out_dir, init_from, sft_dir: nothing of anyone else's is written over
    with phases.start_up():             # a signal before RL stops at once and names the command to rerun
        finished = claims.check_resume(cfg)  # --resume: a run to continue, or a finished one (nothing to do)
        if finished is not None:
            return finished
        device, dtype = setup(cfg)
        datasets = load_data(cfg)       # malformed data fails here, before any model is loaded
        with claims.sft_dir_claimed(cfg):  # a folder, writable, and this run's alone until its SFT model is saved
            startup_checks(cfg, device)     # out_dir, disk room, sequence lengths, resume compatibility
            scorer = RemoteScorer(cfg.image_scorer_url, cfg.image_scorer_timeout) if cfg.image_scorer_url else None
            model, ref, tok, ids, sft_seconds = load_policy(cfg, device, dtype, sft)
        fast = cfg.kv_cache != "none" or cfg.threshold > 0  # Fast-dLLM text rollouts in RL steps
        text_sampler = FastSampler(cfg.kv_cache, cfg.threshold) if fast else None
        ctx = tasks.Ctx(cfg, tok, ids, device, datasets, scorer, text_sampler)
        report_truncation(cfg, tok, datasets)  # --max_prompt_len cuts long prompts from the left: say how many
        opt = torch.optim.AdamW(lora.trainable_parameters(model), lr=cfg.lr, betas=(0.9, 0.99),
                                weight_decay=cfg.weight_decay)
    print0(f"RL: {cfg.rl_steps} rollout batches x {cfg.mu} optimizer steps, {cfg.prompts_per_step} "
           f"prompts x G={cfg.group_size} per task ({', '.join(task_list(cfg))}), {scale.world()} process(es); "
           f"steps count from 0, as in log.jsonl")
    return model, ref, opt, ctx, dtype, sft_seconds


def eval_batches(ctx) -> int:
    """How many batches heldout.evaluate_all takes on ctx's held-out sets (sampled, and greedy for text)."""
    n = 0
    for task in task_list(ctx.cfg):
        rows = len(heldout.eval_examples(task, ctx.cfg, ctx.datasets))
        for k in ((ctx.cfg.eval_samples,) if task in tasks.IMAGE_TASKS else (ctx.cfg.eval_samples, 1)):
            n += -(-rows * k // EVAL_BATCH) if rows else 0
    return n


def paired_se(d: list) -> float:
    """Standard error of the mean of per-prompt differences d (after - before on the same prompts):
    sd(d) / sqrt(n), so that the prompt-to-prompt spread both scores share cancels."""
    n = len(d)
    assert n > 1, "a standard error needs two or more prompts"
    m = sum(d) / n
    return math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1) / n)


class TrainingStopped(RuntimeError):
    """Too many consecutive bad steps: the run stops with a message naming the last good checkpoint."""


class RunFailed(RuntimeError):
    """The machine failed the run (disk full, out of memory, a dead rank): one line naming the cause, what
    was kept and the command that continues."""


def root_causes(e: BaseException) -> list[BaseException]:
    """e and what it wraps: its cause and context chain, and the per-rank failures a
    torch.distributed.checkpoint CheckpointException (a BaseException) carries."""
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


def continue_command(out: Path) -> str:
    """The one command that goes on with this run after a failure: --resume=true when it has a checkpoint
    or logged steps (which then restart from step 0), else the command as typed."""
    if checkpoint.latest(out) is not None or logged_steps(out / "log.jsonl"):
        return phases.resume_command()
    return phases.start_command()


def kept_line(out: Path) -> str:
    last = checkpoint.latest(out)
    return f"the last checkpoint, {last}, is kept" if last else "no checkpoint of this run exists"


@contextmanager
def failures_in_one_line(cfg):
    """Out of memory, a full disk, a dead rank: RunFailed with one line naming what is kept and the command
    that continues (explain_failure), instead of a traceback; any other error is raised as it is."""
    try:
        yield
    except (RunFailed, TrainingStopped):
        raise
    except Exception as e:
        message = explain_failure(e, cfg)
        if message is None:
            raise
        raise RunFailed(message) from None


def print_held_out(when: str, rewards: dict, summary: dict | None = None) -> None:
    """The held-out mean reward per task before or after RL in one line; after RL with the gain over before and
    its standard error paired by prompt, where both were measured."""
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
           ", ".join(f"{k} {phases.shown(v)}{gain(k, v)}" for k, v in rewards.items()))


def check_measured(run, after: dict) -> None:
    """A complete run whose held-out reward could not be measured (a scorer down) ends with RunFailed, so that
    its exit status says so; the model is saved."""
    unmeasured = [k for k, v in {**run.state["before"], **after}.items() if not math.isfinite(v)]
    if unmeasured:
        cfg = run.cfg
        raise RunFailed(f"not measured: the held-out reward of {', '.join(sorted(set(unmeasured)))} (see the "
                        "warnings above: " + (f"the image scorer at {cfg.image_scorer_url} failed" if cfg.image_scorer_url
                                              else "a reward was not finite") + f"); the model is saved in "
                        f"{run.out / 'final'}; score it again with: python evaluate.py --run={run.out}")


def explain_failure(e: BaseException, cfg) -> str | None:
    """The one-line message of a machine failure (out of memory, a full disk, a dead torchrun rank), or None
    for anything else (a bug keeps its traceback)."""
    out = Path(cfg.out_dir)
    for x in root_causes(e):
        text = str(x).splitlines()[0] if str(x) else type(x).__name__
        if isinstance(x, torch.OutOfMemoryError) or (isinstance(x, RuntimeError) and (
                "out of memory" in text.lower() or "can't allocate memory" in text.lower())):
            from infra import budget  # the state's size: when it alone is over the GPU, no batch size helps
            total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
            too_big = total and budget.state_over_memory(cfg, scale.world(), total)
            if too_big:
                return f"out of memory ({text[:160]}): {too_big}; {kept_line(out)}"
            fewer = max(1, (cfg.device_batch_size or cfg.group_size * cfg.prompts_per_step) // 2)
            return (f"out of memory ({text[:160]}) with group_size={cfg.group_size}, prompts_per_step="
                    f"{cfg.prompts_per_step}, device_batch_size={cfg.device_batch_size or 'all'}: fewer sequences per "
                    f"forward pass need less memory (--device_batch_size={fewer}; or a lower --group_size in a new "
                    f"run); {kept_line(out)}; continue with: {continue_command(out)} --device_batch_size={fewer}")
        if isinstance(x, OSError) and x.errno == errno.EFBIG:
            return (f"a file outgrew the file-size limit ({x.strerror}{': ' + str(x.filename) if x.filename else ''}); "
                    f"{kept_line(out)}; raise the limit (ulimit -f), then continue with: {continue_command(out)}")
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return (f"the disk is full ({x.strerror}{': ' + str(x.filename) if x.filename else ''}); "
                    f"{kept_line(out)}; free space there (or lower --keep_last), then continue with: "
                    f"{continue_command(out)}")
        if scale.world() > 1 and isinstance(x, RuntimeError) and any(w in text.lower() for w in (
                "connection closed", "connection reset", "broken pipe", "timed out", "timeout", "peer")):
            text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text).split(". ")[0]  # gloo's source location
            return (f"another process of this torchrun run stopped ({text[:120]}; torchrun's report names it); "
                    f"{kept_line(out)}; once the cause is fixed, --resume=true continues: {continue_command(out)}")
    for x in root_causes(e):  # a model folder (SFT, final/) whose writer failed, whatever it raised
        if isinstance(x, WriteFailed):
            return (f"{x}; {kept_line(out)}; free space there (or raise the file-size limit, ulimit -f), then "
                    f"continue with: {continue_command(out)}")
    return None


def log_line(log: dict, seconds: float, total: int) -> str:
    # 0-based, as log.jsonl and the plots count: the last step of a 50-step run is "step 49/50".
    parts = [f"step {log['step']}/{total}"]
    for t in sorted({k.split("/")[0] for k in log if k.endswith("/reward")}):
        if f"{t}/reward" in log:
            parts.append(f"{t} reward {log[f'{t}/reward']:.3f} loss {log[f'{t}/loss']:+.4f} "
                         f"clip {log[f'{t}/clipfrac']:.3f} kl {log[f'{t}/kl']:.4f}")
    parts.append(f"{seconds:.1f}s")
    return " | ".join(parts)


def keep_steps_before(path: Path, start: int) -> Path:
    """Rewrite a jsonl log to its lines with step < start (all of it is dropped when start is 0), atomically
    (temporary file, then rename), skipping a line cut short by a crash; returns path for appending."""
    kept = []
    if start and path.is_file():
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] < start:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(l + "\n" for l in kept))
    os.replace(tmp, path)
    return path


class Run:
    """The bookkeeping around train.py's loop, used as `with Run(cfg, model, opt, device) as run:`.
    Construction resumes from the latest complete checkpoint when --resume is set (run.start is the first
    step to take, run.state["before"] the held-out rewards measured before RL); inside the block SIGTERM and
    SIGINT only set a flag; `record` is called once per RL step with that step's log; `finish` writes the
    model, summary.json and the pictures."""

    def __init__(self, cfg, model, opt, device):
        self.cfg, self.model, self.opt, self.device = cfg, model, opt, device
        self.out = Path(cfg.out_dir)
        self.identity = reference_identity(cfg)
        # What a resumed run must continue from (startup_checks has refused incompatible settings already).
        self.state = {"step": 0, "before": None, "before_by_prompt": None, "bad_steps": 0, "bad_run": 0,
                      "rl_seconds": 0.0, "last_good": None, "grid_before": None}
        last = resume_point(self.out, quiet=False) if cfg.resume and checkpoint.latest(self.out) else None
        self.changed = {}  # {setting: [the run's value, this segment's]}: --change_on_resume, logged at run.start
        if last is not None:
            saved = checkpoint.load(last, model, opt, trainable_only=cfg.lora_rank > 0)
            self.state.update(saved)
            for group in opt.param_groups:  # the saved optimizer carries the run's lr; --change_on_resume=lr a new one
                group["lr"] = cfg.lr
            self.changed = {k: [saved["config"].get(k), getattr(cfg, k)] for k in resume_changes(cfg)
                            if saved["config"].get(k) != getattr(cfg, k)}
            print0(f"resumed from {last} at step {self.state['step']}" + "".join(
                f"; {k} changes from {a} to {b} at this step (log.jsonl records it)"
                for k, (a, b) in self.changed.items()))
            same = [k for k in resume_changes(cfg) if k not in self.changed]
            if same:
                print0(f"warning: --change_on_resume names {', '.join(same)}, which the run already has; "
                       "nothing changes")
        elif cfg.resume:
            print0(f"--resume: no complete checkpoint in {self.out / checkpoint.DIRNAME}; starting from step 0 "
                   "(the log of any earlier attempt is rewritten)")
        self.start = self.state["step"]
        self.t0 = time.time()
        self.logf = self.timef = None
        if scale.rank() == 0:
            # The logs keep the steps before `start` (a resumed run rewrites what came later).
            self.logf, self.timef = (open(keep_steps_before(self.out / name, self.start), "a")
                                     for name in ("log.jsonl", "times.jsonl"))
        self.done = self.start  # RL steps taken so far (the step in progress is this one)
        self.last_bad = "a non-finite loss or gradient"  # why the last skipped step was skipped
        self.step_seconds: list[float] = []
        self._stop = checkpoint.graceful_stop(abort=self._abort_loses)

    def __enter__(self):
        self.signal = self._stop.__enter__()
        return self

    def _time_left(self, step: int, seconds: float) -> str:
        """" | about 3m10s left": the mean time of this process's steps so far times the steps to go."""
        self.step_seconds.append(seconds)
        left = self.cfg.rl_steps - step - 1
        if not left or not self.step_seconds:
            return ""
        return f" | about {phases.duration(sum(self.step_seconds) / len(self.step_seconds) * left)} left"

    def _abort_loses(self) -> str:
        """What a second signal during an RL step would lose, and where the run would continue from."""
        last = checkpoint.latest(self.out)
        since = int(last.name[len(checkpoint.PREFIX):]) if last else 0
        lost = f"steps {since} to {self.done}" if self.done > since else f"step {self.done}"
        return (f"{lost} would be lost and the run would continue from {last}" if last else
                f"no checkpoint exists yet, so {lost} would be lost and the run would restart from step 0")

    def __exit__(self, kind, exc, tb):
        self.rl_end = self.rl_seconds()
        self._stop.__exit__(kind, exc, tb)
        for f in (self.logf, self.timef):
            if f:
                f.close()
        if kind is not None and issubclass(kind, (checkpoint.Aborted, KeyboardInterrupt)):
            # A second signal dropped the step in progress: the newest checkpoint (or none) is where the
            # printed command goes on from; --resume=true rewrites the log past it.
            last = checkpoint.latest(self.out)
            since = int(last.name[len(checkpoint.PREFIX):]) if last else 0
            name = f"a second {exc}" if isinstance(exc, checkpoint.Aborted) else "Ctrl-C"
            lost = f"steps {since} to {self.done}" if self.done > since else f"step {self.done}"
            print0(f"aborted by {name} during RL step {self.done}: {lost} {'are' if self.done > since else 'is'} lost; " +
                   (f"{last} is kept; continue with: " if last else "no checkpoint was written, so the run "
                    "restarts from step 0 with: ") + phases.resume_command())
            raise SystemExit(128 + getattr(exc, "signum", signal.SIGINT)) from None
        return False

    def rl_seconds(self) -> float:
        return self.state["rl_seconds"] + time.time() - self.t0  # over every segment of a resumed run

    def record(self, step: int, log: dict, times: dict, rolls: list, tok, ids, tracker=None) -> None:
        """After RL step `step`: its line on the screen, `log` (with the run's bad-step count) to log.jsonl and
        `times` (its seconds) to times.jsonl, both to the tracker (infra/tracker.py); then the bad-step guard,
        a sample every sample_every steps, and a checkpoint on cadence or on a signal (after_step)."""
        self.done = step + 1
        log["bad_steps"] = self.count_bad(step, log, times["seconds"])
        if step == self.start and self.changed:  # where the run's settings changed (--change_on_resume)
            log["changed"] = self.changed
        if self.logf:
            self.logf.write(json.dumps(log) + "\n")
            self.logf.flush()
            self.timef.write(json.dumps({"step": step, **times}) + "\n")
            self.timef.flush()
        if tracker is not None:  # before a stop below, so that a resumed run does not miss this step
            tracker.step(step, log, times)
        self.after_step(step, rolls, tok, ids)

    def count_bad(self, step: int, log: dict, seconds: float) -> int:
        """Print the step's line, or why it was skipped; returns the run's count of bad steps so far."""
        state, bad = self.state, "bad_reward" in log or log.get("skipped_updates", 0) > 0
        if "bad_reward" in log:
            self.last_bad = log["bad_reward"]
            print0(f"warning: step {step} skipped: {log['bad_reward']}")
        else:
            print0(log_line(log, seconds, self.cfg.rl_steps) + self._time_left(step, seconds))
        if log.get("skipped_updates", 0) > 0:
            print0(f"warning: step {step}: {log['skipped_updates']} of {self.cfg.mu} updates skipped for a non-finite "
                   f"loss or gradient norm (largest gradient norm {log.get('grad_norm_max')}); the others stand")
        state["bad_run"] = state["bad_run"] + 1 if bad else 0
        state["bad_steps"] += bad
        return state["bad_steps"]

    def after_step(self, step: int, rolls: list, tok, ids) -> None:
        """Stop after max_bad_steps bad steps in a row; show a sample; checkpoint on cadence or on a signal."""
        cfg, state = self.cfg, self.state
        if state["bad_run"] >= cfg.max_bad_steps:
            raise TrainingStopped(
                f"{state['bad_run']} consecutive bad steps (non-finite loss, gradient or reward; see the "
                f"warnings above), stopping at step {step}. Last good checkpoint: "
                f"{state['last_good'] or 'none (set --checkpoint_every)'}; fix the cause (a lower --lr or "
                "--grad_clip with --change_on_resume=lr,grad_clip, the reward function or scorer) and continue from "
                "it with --resume=true (delete the newer checkpoints first)")
        if cfg.sample_every and (step + 1) % cfg.sample_every == 0:
            for r in rolls:
                show(r.batch, r.rewards[scale.shard_rows(len(r.rewards))], tok, ids)
        # Every rank must stop at the same step: the flag is reduced over ranks.
        stopping = scale.all_max(torch.tensor([self.signal["signal"]], device=self.device)).item()
        if (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or stopping:
            print0(f"checkpoint {self._save_checkpoint(step + 1)}")
        if stopping:
            print0(f"stopped by {signal.Signals(int(stopping)).name} after step {step}; continue with: "
                   f"{phases.resume_command()}")
            raise SystemExit(128 + int(stopping))

    def _save_checkpoint(self, step: int) -> Path:
        saved = {**self.state, "step": step, "config": asdict(self.cfg), "reference": self.identity,
                 "world_size": scale.world(), "rl_seconds": self.rl_seconds()}
        # After a good step the checkpoint being written is itself the last good one (the newest, which
        # rotation keeps): the previous one needs no protection, or --keep_last=1 would keep two.
        protect = self.state["last_good"] if self.state["bad_run"] else None
        try:
            path = checkpoint.save(self.out, step, self.model, self.opt, saved, keep_last=self.cfg.keep_last,
                                   trainable_only=self.cfg.lora_rank > 0, protect=protect)
        except BaseException as e:  # DCP wraps a writer's OSError in CheckpointException, a BaseException
            if isinstance(e, KeyboardInterrupt) or not isinstance(e, Exception) and not hasattr(e, "failures"):
                raise
            # whatever the writer raised: the machine's reason when it is one, else the writer's own words
            cause = ([x for x in root_causes(e) if isinstance(x, Exception)] or [e])[-1]
            message = explain_failure(e, self.cfg) or (f"{writer_error(cause)}; {kept_line(self.out)}; fix the "
                                                       f"cause, then continue with: {continue_command(self.out)}")
            if scale.rank() == 0:  # the half-written directory, never loaded, would only take the room
                shutil.rmtree(checkpoint._step_dir(self.out, step, tmp=True), ignore_errors=True)
            raise RunFailed(f"writing checkpoint step {step}: {message}") from None
        if self.state["bad_run"] == 0:  # written after a good step: where to go back to if things go wrong
            self.state["last_good"] = str(path)
        return path

    def finish(self, after: dict, after_by_prompt: dict, grid_after, tok, dtype, sft_seconds: float) -> dict:
        """Write out_dir/final (the policy, with tokenizer.json and generation.json), summary.json (held-out
        mean reward before/after RL per task, the gain's standard error paired by prompt, and seconds) and
        the pictures; returns the summary."""
        before, before_by_prompt = self.state["before"], self.state.get("before_by_prompt") or {}
        save_model(self.model, self.cfg, self.out / "final", tok, dtype)
        # A reward that could not be measured (a scorer down: NaN) is null in summary.json, never a number.
        summary = {k: {"before": measured(before[k]), "after": measured(after[k])} for k in before}
        for k in summary:
            if len(before_by_prompt.get(k, ())) == len(after_by_prompt.get(k, ())) > 1:
                gains = [a - b for a, b in zip(after_by_prompt[k], before_by_prompt[k])]
                summary[k]["gain_se"] = measured(paired_se(gains))
        summary["seconds"] = {"sft": sft_seconds, "rl": self.rl_end}
        if scale.rank() == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            write_pictures(self.cfg, self.out, [("before RL", self.state["grid_before"]), ("after RL", grid_after)])
        print0(f"wrote {self.out / 'final'} and {self.out / 'summary.json'}")
        if scale.rank() == 0:
            release_out_dir(self.out)
        return summary


def measured(x):
    """x when it is a finite number, else None (not measured)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def all_skipped(run) -> str | None:
    """When every RL step of the run was skipped (nothing was trained), the one-line reason, else None."""
    cfg = run.cfg
    if not cfg.rl_steps or run.state["bad_steps"] < cfg.rl_steps:
        return None
    scorer = f"; is the image scorer at {cfg.image_scorer_url} up? (`python -m infra.scorer --stub` serves a " \
        "stand-in)" if cfg.image_scorer_url else ""
    return (f"every one of the {cfg.rl_steps} RL steps was skipped (the last: {run.last_bad}){scorer}; nothing was "
            f"trained, so no final/ or summary.json is written and no reward after RL is reported; fix the cause "
            "and start again with another --out_dir")


def show(b, rewards, tok, ids, n: int = 1) -> None:
    """Print n decoded rollouts with their rewards."""
    outs = tasks.decode_window(b, tok, ids)
    for i in range(n):
        prompt = b.examples[i]["prompt"]
        if b.task not in IMAGE_TASKS:
            print0(f"  [{b.task}] {prompt[-200:]!r} -> {outs[i]!r}  reward {rewards[i]:.2f}")
        else:
            print0(f"  [{b.task}] {prompt!r}  reward {rewards[i]:.2f}")
            if b.task == "image":  # toy palette codes; real VQ codes need the image decoder
                from infra import plots  # (ANSI colours on a terminal only, letters in a log file)

                print0(plots.text_image(outs[i], int(math.isqrt(len(outs[i])))))


def write_pictures(cfg, out: Path, grid: list) -> None:
    """out_dir/curves.png (reward, KL, clip fraction per step) and out_dir/images.png (toy images before
    and after RL, prompt under each), when the plots extra is installed (matplotlib for the curves, Pillow for the
    grid; plots.py says how to get it otherwise)."""
    from infra import plots

    log = out / "log.jsonl"
    if log.is_file() and any("/reward" in line for line in log.read_text().splitlines()):  # a step that was taken
        plots.plot_curves(log, out / "curves.png")
    if grid[0][1] is not None and grid[1][1] is not None:
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else None
        if summary:  # a score that was not measured (null) is left off the panel, never drawn as a number
            summary = {k: v for k, v in summary.items() if not isinstance(v, dict) or None not in v.values()}
        plots.toy_image_panel(grid, heldout.eval_examples("image", cfg, {})[:heldout.GRID_PROMPTS], cfg.image_width,
                              out / "images.png", summary)
