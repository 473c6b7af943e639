"""A run's lifecycle around train.py's loop: start-up and its refusals, the Run, machine failures in one line."""
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
from infra import budget, checkpoint, data, hf, load, outdir, scale
from sample import FastSampler
from infra.outdir import continue_command, kept_line, root_causes, step_lines
from infra.scale import duration, print0
from infra.sandbox import RemoteScorer
from infra.cli import SCRATCH_SHAPE, resume_changes, setup


DISK_ERRORS = {errno.EFBIG: ("a file outgrew the file-size limit", "raise the limit (ulimit -f)"), **dict.fromkeys(
    (errno.ENOSPC, errno.EDQUOT), ("the disk is full", "free space there (or lower --keep_last)"))}


def start(cfg, argv, sft):
    """train.py's start-up: (model, ref, opt, ctx, dtype, sft_seconds), or a finished run's summary (--resume)."""
    outdir.remember_command(argv)  # for the messages that name the command continuing this run
    outdir.check_paths(cfg)  # nothing of anyone else's is written over
    with outdir.start_up():  # a signal before RL stops at once and names the command to rerun
        finished = check_resume(cfg)
        if finished is not None:
            return finished
        device, dtype = setup(cfg)
        datasets = data.load_data(cfg)       # malformed data fails here, before any model is loaded
        with startup_checks(cfg, device):
            scorer = RemoteScorer(cfg.image_scorer_url, cfg.image_scorer_timeout) if cfg.image_scorer_url else None
            model, ref, tok, ids, sft_seconds = load.load_policy(cfg, device, dtype, sft)
        fast = FastSampler(cfg.kv_cache, cfg.threshold) if cfg.kv_cache != "none" or cfg.threshold > 0 else None
        ctx = tasks.Ctx(cfg, tok, ids, device, datasets, scorer, fast)  # fast: Fast-dLLM text rollouts
        load.report_truncation(cfg, tok, datasets)  # --max_prompt_len cuts long prompts from the left: say how many
        opt = torch.optim.AdamW(hf.trainable_parameters(model), lr=cfg.lr, betas=(0.9, 0.99),
                                weight_decay=cfg.weight_decay)
    print0(f"RL: {cfg.rl_steps} rollout batches x {cfg.mu} optimizer steps, {cfg.prompts_per_step} "
           f"prompts x G={cfg.group_size} per task ({', '.join(tasks.task_list(cfg))}), {scale.world()} process(es); "
           f"steps count from 0, as in log.jsonl")
    return model, ref, opt, ctx, dtype, sft_seconds


def check_resume(cfg) -> dict | None:
    """--resume: refuse an out_dir with no run or other settings; a finished run's summary unless --extend."""
    if cfg.extend and not cfg.resume:
        raise ValueError("--extend=true continues a finished run: pass --resume=true with it (and a larger --rl_steps)")
    if not cfg.resume:
        return None
    out, may_change = Path(cfg.out_dir), outdir.RESUMABLE + resume_changes(cfg)
    last, config, summary = checkpoint.latest(out), out / "config.json", out / "summary.json"
    if last is None and not config.is_file():
        raise ValueError(f"--resume: out_dir {out} holds no run (no config.json, no {checkpoint.DIRNAME}/); check "
                         "the path, or drop --resume to start a new run there")
    # The real conflicts first (the SFT cache check names only SFT settings); no checkpoint yet: config.json's settings
    last = outdir.resume_point(out) if last is not None else None
    state = hf.read_json(last / "state.json", "remove that checkpoint directory") if last else {
        "config": hf.read_json(config, f"delete {config} to start a new run there"), "reference": None}
    checkpoint.check_resumable(last or config, state, asdict(cfg), last and load.reference_identity(cfg), may_change)
    # An unfinished extension (config.json: its larger --rl_steps; summary.json: the earlier finish's) continues.
    saved = hf.read_json(config, f"re-create {config}") if summary.is_file() and config.is_file() else None
    extending = last is not None and saved is not None and state["step"] < saved.get("rl_steps", 0)
    if extending and not cfg.extend:
        raise ValueError(f"out_dir {out} holds an extension stopped at step {state['step']}: pass --extend=true")
    if last is not None and (extending or not summary.is_file()) and cfg.rl_steps < state["step"]:
        raise ValueError(f"cannot resume {out} at --rl_steps={cfg.rl_steps}: its checkpoint {last.name} has taken "
                         f"{state['step']} RL steps already; pass --rl_steps={state['config']['rl_steps']} (the run's "
                         "own) or more, or start a new run with another --out_dir")
    if not summary.is_file() or extending:
        return None
    done = (state["config"] if saved is None else saved).get("rl_steps")
    if cfg.rl_steps == done:
        if os.environ.get("RANK", "0") == "0":  # before the process group exists: RANK says who speaks
            print(f"out_dir {out} holds a finished run ({done} RL steps): nothing to do; `python evaluate.py "
                  f"--run={out}` scores it again, --extend=true with a larger --rl_steps trains it further", flush=True)
        return hf.read_json(summary, f"delete {summary} and resume to redo the final evaluation")
    if cfg.rl_steps < done or not cfg.extend:
        raise ValueError(f"out_dir {out} holds a finished run of {done} RL steps; --rl_steps={cfg.rl_steps} " + (
            "asks for fewer, and a finished run is final: drop --rl_steps, or choose another --out_dir"
            if cfg.rl_steps < done else "would train it further and replace its final/ and summary.json: pass "
            "--extend=true to do that, or start a new run with another --out_dir"))
    if last is None or outdir.step_of(last) != done:
        raise ValueError(f"--extend: out_dir {out} has no checkpoint of its last step ({done}) to continue from "
                         f"(latest: {last.name if last else 'none'}); start a new run with another --out_dir")


@contextmanager
def startup_checks(cfg, device):
    """sft_dir, then out_dir, agreed by all ranks; rank 0 writes config.json, holds sft_dir while training SFT there."""
    out, pid_file = Path(cfg.out_dir), None
    try:
        with agreed(device):
            pid_file = _claim_sft_dir(cfg, load.sft_dir_of(cfg)) if cfg.init_from == "scratch" else None
        with agreed(device):
            _check_out_dir(cfg, out)
        if scale.rank() == 0:
            (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        scale.barrier()
        outdir.check_shared(out, device)
        print0("\n".join(f"  {k} = {v}" for k, v in sorted(asdict(cfg).items())))
        budget.warn_kill_delay(cfg, scale.world())  # SIGTERM's checkpoint must fit in the launcher's kill delay
        yield
    finally:
        if pid_file is not None:
            outdir.release(pid_file)


def _claim_sft_dir(cfg, sft_dir: Path) -> Path | None:
    """sft_dir's pid file, claimed on rank 0 when the SFT model is to be trained; None when it is cached."""
    existing = next(p for p in (sft_dir, *sft_dir.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"sft_dir {sft_dir}: {'it' if existing == sft_dir else existing} is a file, not a folder "
                         "(it is left as it is); pass --sft_dir=a folder for the SFT model")
    if load.check_sft_cache(cfg) or scale.rank() != 0:
        return None
    pid_file = sft_dir.with_name(sft_dir.name + ".run.pid")
    try:
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        if sft_dir.is_dir() and not os.access(sft_dir, os.W_OK):
            raise PermissionError(13, "Permission denied")
        outdir.claim(pid_file, f"sft_dir {sft_dir}", "is being trained", "pass another --sft_dir",
              " (a run with the same settings then reuses its model)")
    except OSError as e:
        raise ValueError(f"sft_dir {sft_dir} is not writable ({e.strerror}); pass a writable --sft_dir") from None
    return pid_file


@contextmanager
def agreed(device):
    """The block's ValueError / OSError, raised on every rank when any rank has one (a lone refusal hangs the rest)."""
    error = None
    try:
        yield
    except (ValueError, OSError) as e:
        error = e
    if scale.all_max(torch.tensor([int(error is not None)], device=device)).item():
        raise error or ValueError("another rank failed its start-up checks (its message is above)")


def _check_out_dir(cfg, out: Path) -> None:
    """out_dir writable with room, no run a fresh start would overwrite, sequences that fit; then claimed."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"out_dir {out} is not writable ({e.strerror}); pass --out_dir=a writable directory") from None
    mc = None
    if cfg.init_from != "scratch":
        load.refuse_training_checkpoint(cfg.init_from, "--init_from")
        mc = hf.read_config(cfg.init_from, "--init_from")  # a missing config.json is refused there
        preset = getattr(cfg, "_preset_values", {})
        other = [k for k in SCRATCH_SHAPE if k in preset and getattr(mc, k) != preset[k]]
        if other:  # the preset's lr, lengths and batch sizes were chosen for a model of its shape
            print0(f"warning: --preset {getattr(cfg, '_preset', None)} is set for a model with "
                   + ", ".join(f"{k}={preset[k]}" for k in other) + f", but {cfg.init_from} has "
                   + ", ".join(f"{k}={getattr(mc, k)}" for k in other)
                   + "; its config.json is used, and the preset's other settings may not suit it")
        image = any(t in tasks.IMAGE_TASKS for t in tasks.task_list(cfg))
        need = (cfg.image_text_len or 64) + cfg.image_width ** 2 + 2 if image else cfg.max_prompt_len + cfg.gen_length
        if need > mc.max_sequence_length:
            raise ValueError(f"sequences of up to {need} tokens exceed the model's max_sequence_length "
                             f"({mc.max_sequence_length}); lower --max_prompt_len / --gen_length (or image sizes)")
    if cfg.checkpoint_every:
        present = len(checkpoint.complete(out)) if cfg.resume else 0  # already on the disk
        budget.check_disk(cfg, out, mc or budget.scratch_config(cfg, vocab_size=128), present)
    last = checkpoint.latest(out)
    if last is not None and not cfg.resume:
        raise ValueError(f"out_dir {out} already holds checkpoints (latest {last.name}): pass --resume=true to "
                         "continue that run, or choose another --out_dir")
    finished = [f"{n}/" if (out / n).is_dir() else n for n in ("final", "summary.json") if (out / n).exists()]
    if finished and last is None:  # nothing to continue from, and a new start would replace them
        raise ValueError(f"out_dir {out} holds a finished run ({', '.join(finished)}) and no checkpoint to "
                         "continue from; choose another --out_dir")
    logged = len(step_lines(out / "log.jsonl"))
    if logged and last is None and not cfg.resume:  # a crash before the first checkpoint: only step 0 is left
        raise ValueError(f"out_dir {out} holds an unfinished run ({logged} RL step(s) in log.jsonl) and no checkpoint: "
                         "--resume=true restarts it from step 0 (rewriting its log), or choose another --out_dir")
    if not logged and (out / "log.jsonl").exists() and last is None:
        print0(f"out_dir {out} holds a run that took no RL step (its log.jsonl is empty): starting it again")
    if scale.rank() == 0:
        outdir.claim_out_dir(out)


def dry_run(cfg, report):
    """--dry_run: report(cfg) on RANK 0 (no process group) once the --init_from folder and data files are there."""
    if cfg.init_from not in ("", "scratch"):
        load.refuse_training_checkpoint(cfg.init_from, "--init_from")
        hf.read_config(cfg.init_from, "--init_from")  # no config.json (or not a model's) would stop the run there
    for flag in ("train_data", "eval_data"):
        for task, path in data.data_paths(getattr(cfg, flag), flag).items():
            if not Path(path).is_file():
                raise ValueError(f"--{flag} {task}={path}: no such file; the run would stop there")
    return report(cfg) if os.environ.get("RANK", "0") == "0" else {}


def eval_batches(ctx) -> int:
    """How many 64-row batches data.evaluate_all takes on ctx's held-out sets (sampled, and greedy for text)."""
    cfg = ctx.cfg
    return sum(-(-len(data.eval_examples(t, cfg, ctx.datasets)) * k // 64) for t in tasks.task_list(cfg)
               for k in ((cfg.eval_samples,) if t in tasks.IMAGE_TASKS else (cfg.eval_samples, 1)))


def paired_se(d: list) -> float:
    """sd(d) / sqrt(n) of per-prompt gains d (after - before): the prompt-to-prompt spread both share cancels."""
    n = len(d)
    assert n > 1, "a standard error needs two or more prompts"
    m = sum(d) / n
    return math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1) / n)


class TrainingStopped(RuntimeError):
    """Too many consecutive bad steps: the run stops with a message naming the last good checkpoint."""


class RunFailed(RuntimeError):
    """The machine failed the run (disk full, out of memory, a dead rank): one line of cause, what is kept, command."""


@contextmanager
def failures_in_one_line(cfg):
    """A machine failure ends in RunFailed with one line (explain_failure), not a traceback; a bug keeps its own."""
    try:
        yield
    except Exception as e:
        if isinstance(e, (RunFailed, TrainingStopped)) or (message := explain_failure(e, cfg)) is None:
            raise
        raise RunFailed(message) from None


def explain_failure(e: BaseException, cfg) -> str | None:
    """The one-line message of a machine failure (out of memory, a full disk, a dead torchrun rank), else None."""
    out = Path(cfg.out_dir)
    for x in root_causes(e):
        text = str(x).splitlines()[0] if str(x) else type(x).__name__
        if isinstance(x, torch.OutOfMemoryError) or (isinstance(x, RuntimeError) and (
                "out of memory" in text.lower() or "can't allocate memory" in text.lower())):
            total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
            if too_big := total and budget.state_over_memory(cfg, scale.world(), total):  # no batch size helps
                return f"out of memory ({text[:160]}): {too_big}; {kept_line(out)}"
            fewer = max(1, (cfg.device_batch_size or cfg.group_size * cfg.prompts_per_step) // 2)
            return (f"out of memory ({text[:160]}) with group_size={cfg.group_size}, prompts_per_step="
                    f"{cfg.prompts_per_step}, device_batch_size={cfg.device_batch_size or 'all'}: fewer sequences per "
                    f"forward pass need less memory (--device_batch_size={fewer}; or a lower --group_size in a new "
                    f"run); {kept_line(out)}; continue with: {continue_command(out)} --device_batch_size={fewer}")
        if isinstance(x, OSError) and x.errno in DISK_ERRORS:
            what, fix = DISK_ERRORS[x.errno]
            return f"{what} ({load.writer_error(x)}); {kept_line(out)}; {fix}; continue with: {continue_command(out)}"
        if scale.world() > 1 and isinstance(x, RuntimeError) and any(w in text.lower() for w in (
                "connection closed", "connection reset", "broken pipe", "timed out", "timeout", "peer")):
            text = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text).split(". ")[0]  # gloo's source location
            return (f"another process of this torchrun run stopped ({text[:120]}; torchrun's report names it); "
                    f"{kept_line(out)}; once the cause is fixed, --resume=true continues: {continue_command(out)}")
    written = [x for x in root_causes(e) if isinstance(x, load.WriteFailed)]  # a model folder's writer failed
    return (f"{written[0]}; {kept_line(out)}; free space there (or raise the file-size limit, ulimit -f), then "
            f"continue with: {continue_command(out)}") if written else None


def check_measured(run, after: dict) -> None:
    """A held-out reward not measured (a scorer down) ends the saved run in RunFailed: the exit status says so."""
    unmeasured = [k for k, v in {**run.state["before"], **after}.items() if not math.isfinite(v)]
    if unmeasured:
        why = f"the image scorer at {run.cfg.image_scorer_url} failed" if run.cfg.image_scorer_url else "not finite"
        raise RunFailed(f"not measured: the held-out reward of {', '.join(sorted(set(unmeasured)))} ({why}; see the "
                        f"warnings above); saved in {run.out / 'final'}; score it: python evaluate.py --run={run.out}")


class Run:
    """Around train.py's loop, `with Run(cfg, model, opt, device) as run:`: resumes under --resume (run.start is the
    first step), `record`s each step (wall times in times.jsonl keep log.jsonl repeatable), `finish` saves the model."""

    def __init__(self, cfg, model, opt, device):
        self.cfg, self.model, self.opt, self.device = cfg, model, opt, device
        self.out, self.identity = Path(cfg.out_dir), load.reference_identity(cfg)
        self.state = {"step": 0, "before": None, "before_by_prompt": None, "bad_steps": 0, "bad_run": 0,
                      "rl_seconds": 0.0, "last_good": None, "grid_before": None}
        last = outdir.resume_point(self.out, quiet=False) if cfg.resume and checkpoint.latest(self.out) else None
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
            if same := [k for k in resume_changes(cfg) if k not in self.changed]:
                print0(f"warning: --change_on_resume names {', '.join(same)}, which the run already has; nothing "
                       "changes")
        elif cfg.resume:
            print0(f"--resume: no complete checkpoint in {self.out / checkpoint.DIRNAME}; starting from step 0 "
                   "(the log of any earlier attempt is rewritten)")
        self.start = self.done = self.state["step"]  # done: RL steps taken so far
        self.t0 = time.time()
        self.logf = self.timef = None
        if scale.rank() == 0:  # the logs keep the steps before `start`, rewritten atomically
            for name in ("log", "times"):
                tmp = self.out / f"{name}.tmp"
                tmp.write_text("".join(l + "\n" for s, l in step_lines(self.out / f"{name}.jsonl") if s < self.start))
                os.replace(tmp, self.out / f"{name}.jsonl")
            self.logf, self.timef = (open(self.out / f"{name}.jsonl", "a") for name in ("log", "times"))
        self.last_bad = "a non-finite loss or gradient"  # why the last skipped step was skipped
        self.step_seconds: list[float] = []

    def __enter__(self):
        self._steps = outdir.rl_steps(self)  # a signal sets self.signal; a second one drops the step at once
        self._steps.__enter__()
        return self

    def __exit__(self, kind, exc, tb):
        self.rl_end = self.rl_seconds()
        for f in filter(None, (self.logf, self.timef)):
            f.close()
        return self._steps.__exit__(kind, exc, tb)

    def rl_seconds(self) -> float:
        return self.state["rl_seconds"] + time.time() - self.t0  # over every segment of a resumed run

    def record(self, step: int, log: dict, times: dict, rolls: list, tok, ids, tracker=None) -> None:
        """After RL step `step`: the screen, log.jsonl, times.jsonl, the tracker, then Run.after_step."""
        self.done = step + 1
        log["bad_steps"] = self.count_bad(step, log, times["seconds"])
        if step == self.start and self.changed:  # where the run's settings changed (--change_on_resume)
            log["changed"] = self.changed
        if self.logf:  # rank 0
            for f, line in ((self.logf, log), (self.timef, {"step": step, **times})):
                print(json.dumps(line), file=f, flush=True)
        if tracker is not None and tracker.backend:  # before a stop below: a resumed run misses no step
            tracker.step(step, log, times)
        self.after_step(step, rolls, tok, ids)

    def count_bad(self, step: int, log: dict, seconds: float) -> int:
        """Print the step's line, or why it was skipped; returns the run's count of bad steps so far."""
        bad = "bad_reward" in log or log.get("skipped_updates", 0) > 0
        if "bad_reward" not in log:  # 0-based, as log.jsonl and the plots count: the last of 50 steps is "step 49/50"
            self.step_seconds.append(seconds)  # the time left: this process's mean step times the steps to go
            left = self.cfg.rl_steps - step - 1
            eta = f" | about {duration(sum(self.step_seconds) / len(self.step_seconds) * left)} left" if left else ""
            print0(" | ".join([f"step {step}/{self.cfg.rl_steps}", *(
                f"{t} reward {log[f'{t}/reward']:.3f} loss {log[f'{t}/loss']:+.4f} clip {log[f'{t}/clipfrac']:.3f} "
                f"kl {log[f'{t}/kl']:.4f}" for t in sorted(k.split("/")[0] for k in log if k.endswith("/reward"))),
                f"{seconds:.1f}s"]) + eta)
        if "bad_reward" in log:
            self.last_bad = log["bad_reward"]
            print0(f"warning: step {step} skipped: {log['bad_reward']}")
        elif bad:
            print0(f"warning: step {step}: {log['skipped_updates']} of {self.cfg.mu} updates skipped for a non-finite "
                   f"loss or gradient norm (largest gradient norm {log.get('grad_norm_max')}); the others stand")
        self.state["bad_run"] = self.state["bad_run"] + 1 if bad else 0
        self.state["bad_steps"] += bad
        return self.state["bad_steps"]

    def after_step(self, step: int, rolls: list, tok, ids) -> None:
        """Stop after max_bad_steps bad steps in a row; show a sample; checkpoint on cadence or a signal (all ranks)."""
        cfg = self.cfg
        if self.state["bad_run"] >= cfg.max_bad_steps:
            raise TrainingStopped(
                f"{self.state['bad_run']} consecutive bad steps (non-finite loss, gradient or reward), stopping "
                f"at step {step}. Last good checkpoint: {self.state['last_good'] or 'none (set --checkpoint_every)'}; "
                "fix the cause (a lower --lr or --grad_clip with --change_on_resume=lr,grad_clip, the reward or the "
                "scorer), delete the newer checkpoints and continue with --resume=true")
        if cfg.sample_every and (step + 1) % cfg.sample_every == 0:
            for r in rolls:
                outdir.show(r.batch, r.rewards[scale.shard_rows(len(r.rewards))], tok, ids)
        stopping = scale.all_max(torch.tensor([self.signal["signal"]], device=self.device)).item()
        if (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or stopping:
            print0(f"checkpoint {self._save_checkpoint(step + 1)}")
        if stopping:
            print0(f"stopped by {signal.Signals(int(stopping)).name} after step {step}; continue with: "
                   f"{outdir.resume_command()}")
            raise SystemExit(128 + int(stopping))

    def _save_checkpoint(self, step: int) -> Path:
        saved = {**self.state, "step": step, "config": asdict(self.cfg), "reference": self.identity,
                 "world_size": scale.world(), "rl_seconds": self.rl_seconds()}
        # after a good step the new checkpoint is the last good one: protecting the old would keep two (keep_last=1)
        protect = self.state["last_good"] if self.state["bad_run"] else None
        try:
            path = checkpoint.save(self.out, step, self.model, self.opt, saved, keep_last=self.cfg.keep_last,
                                   trainable_only=self.cfg.lora_rank > 0, protect=protect)
        except BaseException as e:  # DCP wraps a writer's OSError in CheckpointException, a BaseException
            if isinstance(e, KeyboardInterrupt) or not isinstance(e, Exception) and not hasattr(e, "failures"):
                raise
            cause = ([x for x in root_causes(e) if isinstance(x, Exception)] or [e])[-1]  # the writer's own words
            message = explain_failure(e, self.cfg) or (f"{load.writer_error(cause)}; {kept_line(self.out)}; fix the "
                                                       f"cause, then continue with: {continue_command(self.out)}")
            if scale.rank() == 0:  # the half-written directory, never loaded, would only take the room
                shutil.rmtree(checkpoint._step_dir(self.out, step, tmp=True), ignore_errors=True)
            raise RunFailed(f"writing checkpoint step {step}: {message}") from None
        if self.state["bad_run"] == 0:  # written after a good step: where to go back to if things go wrong
            self.state["last_good"] = str(path)
        return path

    def finish(self, after: dict, after_by_prompt: dict, grid_after, tok, dtype, sft_seconds: float) -> dict:
        """Write final/ (policy, tokenizer, generation.json), summary.json (held-out rewards) and the pictures."""
        before, before_by_prompt = self.state["before"], self.state.get("before_by_prompt") or {}
        load.save_model(self.model, self.cfg, self.out / "final", tok, dtype)
        summary = {k: {"before": measured(before[k]), "after": measured(after[k])} for k in before}
        for k in summary:
            if len(before_by_prompt.get(k, ())) == len(after_by_prompt.get(k, ())) > 1:
                gains = [a - b for a, b in zip(after_by_prompt[k], before_by_prompt[k])]
                summary[k]["gain_se"] = measured(paired_se(gains))
        summary["seconds"] = {"sft": sft_seconds, "rl": self.rl_end}
        if scale.rank() == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            outdir.write_pictures(self.cfg, self.out, self.state["grid_before"], grid_after, summary)
            outdir.release(self.out / outdir.PID_FILE)
        print0(f"wrote {self.out / 'final'} and {self.out / 'summary.json'}")
        return summary


def measured(x):  # a finite number, else None: a reward not measured (a scorer down: NaN) is null in summary.json
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def all_skipped(run) -> str | None:
    """When every RL step of the run was skipped (nothing was trained), the one-line reason, else None."""
    cfg = run.cfg
    if not cfg.rl_steps or run.state["bad_steps"] < cfg.rl_steps:
        return None
    scorer = f"; is the image scorer at {cfg.image_scorer_url} up? (`python -m tools.stub_scorer` serves a " \
        "stand-in)" if cfg.image_scorer_url else ""
    return (f"every one of the {cfg.rl_steps} RL steps was skipped (the last: {run.last_bad}){scorer}; nothing was "
            "trained: no final/, summary.json or reward after RL; fix the cause and start again in another --out_dir")
