"""The run's lifecycle around train.py's loop: start-up checks (out_dir, disk room, sequence lengths,
resume compatibility), logs, checkpoints and resume, signals, bad-step guard, and the final save.

A Run keeps the state a resumed run must continue from (step, the held-out rewards before RL, bad-step
counters, RL seconds, the last good checkpoint), writes log.jsonl (one line per RL step; wall times go to
times.jsonl so that a repeated run gives an identical log.jsonl), stops after max_bad_steps consecutive bad
steps, and on SIGTERM/SIGINT writes a checkpoint and exits 128 + signal (checkpoint.py). Every rank makes
the same decisions: flags are reduced over ranks before they are acted on.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch

import tasks
from infra import budget, checkpoint, heldout, hf, phases, scale
from infra.budget import scratch_config
from infra.load import check_sft_cache, reference_identity, save_model
from infra.scale import print0
from tasks import IMAGE_TASKS, task_list


def paired_se(d: list) -> float:
    """Standard error of the mean of per-prompt differences d (after - before on the same prompts):
    sd(d) / sqrt(n), so that the prompt-to-prompt spread both scores share cancels."""
    n = len(d)
    assert n > 1, "a standard error needs two or more prompts"
    m = sum(d) / n
    return math.sqrt(sum((x - m) ** 2 for x in d) / (n - 1) / n)


class TrainingStopped(RuntimeError):
    """Too many consecutive bad steps: the run stops with a message naming the last good checkpoint."""


def log_line(log: dict, total: int) -> str:
    # 0-based, as log.jsonl and the plots count: the last step of a 50-step run is "step 49/50".
    parts = [f"step {log['step']}/{total}"]
    for t in sorted({k.split("/")[0] for k in log if k.endswith("/reward")}):
        if f"{t}/reward" in log:
            parts.append(f"{t} reward {log[f'{t}/reward']:.3f} loss {log[f'{t}/loss']:+.4f} "
                         f"clip {log[f'{t}/clipfrac']:.3f} kl {log[f'{t}/kl']:.4f}")
    parts.append(f"{log['seconds']:.1f}s")
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


# Fields that may change between a run and its resumption; any other difference is refused.
# lr and grad_clip may change so that a run stopped by bad steps can continue more carefully.
RESUMABLE = ("resume", "extend", "retrain_sft", "rl_steps", "threads", "device", "sample_every", "checkpoint_every", "keep_last",
             "max_bad_steps", "device_batch_size", "out_dir", "lr", "grad_clip")


def startup_checks(cfg, device) -> None:
    """On every rank, and agreed: if one rank fails (a node-local disk, say), all stop here together.
    Then rank 0 writes out_dir/config.json."""
    out = Path(cfg.out_dir)
    error = None
    try:
        _check_out_dir(cfg, out)
    except (ValueError, OSError) as e:
        error = e
    if scale.all_max(torch.tensor([int(error is not None)], device=device)).item():
        raise error or ValueError("another rank failed its start-up checks (its message is above)")
    if scale.rank() == 0:
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    scale.barrier()
    print0("\n".join(f"  {k} = {v}" for k, v in sorted(asdict(cfg).items())))
    budget.warn_kill_delay(cfg, scale.world())  # SIGTERM's checkpoint must fit in the launcher's kill delay


# What a run leaves besides checkpoints (config.json is written at start-up, so a run that failed early has one).
FINISHED = ("final", "log.jsonl", "summary.json")


def _check_out_dir(cfg, out: Path) -> None:
    """Before any heavy work: out_dir writable with room for a checkpoint, sequence lengths that fit the
    model, no finished run or stale checkpoints that a fresh run would silently overwrite or mix with,
    and an SFT cache that is this run's or none."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"out_dir {out} is not writable ({e.strerror}); pass --out_dir=a writable directory") from None
    mc = None
    if cfg.init_from != "scratch":
        if not (Path(cfg.init_from) / "config.json").is_file():
            raise FileNotFoundError(f"{Path(cfg.init_from) / 'config.json'} not found: --init_from must be a "
                                    "LLaDA/MMaDA checkpoint directory")
        mc = hf.read_config(cfg.init_from)
        image = any(t in IMAGE_TASKS for t in task_list(cfg))
        need = (cfg.image_text_len or 64) + cfg.image_width ** 2 + 2 if image else cfg.max_prompt_len + cfg.gen_length
        if need > mc.max_sequence_length:
            raise ValueError(f"sequences of up to {need} tokens exceed the model's max_sequence_length "
                             f"({mc.max_sequence_length}); lower --max_prompt_len / --gen_length (or image sizes)")
    else:
        check_sft_cache(cfg)
    if cfg.checkpoint_every:
        budget.check_disk(cfg, out, mc or scratch_config(cfg, vocab_size=128))
    any_checkpoint = checkpoint.latest(out)
    if any_checkpoint is not None and not cfg.resume:
        raise ValueError(f"out_dir {out} already holds checkpoints (latest {any_checkpoint.name}): pass "
                         "--resume=true to continue that run, or choose another --out_dir")
    finished = [f"{n}/" if (out / n).is_dir() else n for n in FINISHED if (out / n).exists()]
    if finished and any_checkpoint is None:
        # Without checkpoints (checkpoint_every=0, or fewer steps than it) there is nothing to resume from:
        # this run would start again and replace the files.
        raise ValueError(f"out_dir {out} holds a run ({', '.join(finished)}) and no checkpoint to "
                         f"resume from{'' if cfg.resume else ' (--resume=true continues from checkpoints only)'}"
                         "; choose another --out_dir, or delete that run")
    if any_checkpoint is not None:  # before anything is loaded or config.json is overwritten
        last = resume_point(out)
        state = hf.read_json(last / "state.json", "remove that checkpoint directory")
        checkpoint.check_resumable(last, state, asdict(cfg), reference_identity(cfg), RESUMABLE)
    if scale.rank() == 0:
        _claim_out_dir(out)


PID_FILE = "run.pid"


_HELD: set[Path] = set()


def take_pid_file(pid_file: Path) -> int | None:
    """Create pid_file atomically (O_EXCL) holding this process id; a file left by a dead process (or by an
    earlier main() of this one) is taken over. 0: taken; a pid: the live process that holds it; None: the
    file kept reappearing (three tries)."""
    for _ in range(3):
        try:
            fd = os.open(pid_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                holder = int(pid_file.read_text().strip() or 0)
            except (OSError, ValueError):
                holder = 0
            if holder and holder != os.getpid() and pid_alive(holder):
                return holder
            pid_file.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        return 0
    return None


def _claim_out_dir(out: Path) -> None:
    """Two runs started at once in one out_dir would both pass the checks above and then overwrite each
    other's logs and model. The first to create out/run.pid (atomically) holds the directory until it
    exits; a pid file whose process is gone (a killed run) is taken over."""
    pid_file = out / PID_FILE
    holder = take_pid_file(pid_file)
    if holder:
        raise ValueError(f"out_dir {out} is in use by the running process {holder} ({pid_file}); wait "
                         "for it to end, choose another --out_dir, or delete that file if no run holds it")
    if holder == 0:
        if out not in _HELD:  # one exit hook per directory, however often main() runs in this process
            _HELD.add(out)
            atexit.register(release_out_dir, out)
        return
    raise ValueError(f"out_dir {out}: could not create {pid_file}; choose another --out_dir")


def pid_alive(pid: int) -> bool:
    """Whether process pid still runs (a pid file's holder)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def release_out_dir(out: Path) -> None:
    """Remove out/run.pid if this process holds it."""
    pid_file = Path(out) / PID_FILE
    try:
        if int(pid_file.read_text().strip()) == os.getpid():
            pid_file.unlink()
    except (OSError, ValueError):
        pass


def resume_point(out: Path, quiet: bool = True) -> Path:
    """The newest intact checkpoint of out (checkpoint.latest_intact); newer damaged ones are named, with
    the fix, unless quiet. None intact: a ValueError listing every problem."""
    last, skipped = checkpoint.latest_intact(out)
    if last is None:
        raise ValueError(f"--resume: no intact checkpoint in {out / checkpoint.DIRNAME}: " + "; ".join(skipped)
                         + "; remove the damaged directories, or choose another --out_dir")
    if not quiet:
        for line in skipped:
            print0(f"warning: {line}; resuming from the newest intact checkpoint, {last.name} (remove the "
                   "damaged one to silence this)")
    return last


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
        if last is not None:
            self.state.update(checkpoint.load(last, model, opt, trainable_only=cfg.lora_rank > 0))
            for group in opt.param_groups:  # the saved optimizer carries the old lr; --lr may change on resume
                group["lr"] = cfg.lr
            print0(f"resumed from {last} at step {self.state['step']}")
        elif cfg.resume:
            print0(f"--resume: no complete checkpoint in {self.out / checkpoint.DIRNAME}; starting from step 0")
        self.start = self.state["step"]
        self.t0 = time.time()
        self.logf = self.timef = None
        if scale.rank() == 0:
            # The logs keep the steps before `start` (a resumed run rewrites what came later).
            self.logf, self.timef = (open(keep_steps_before(self.out / name, self.start), "a")
                                     for name in ("log.jsonl", "times.jsonl"))
        self._stop = checkpoint.graceful_stop()

    def __enter__(self):
        self.signal = self._stop.__enter__()
        return self

    def __exit__(self, *exc):
        self.rl_end = self.rl_seconds()
        self._stop.__exit__(*exc)
        for f in (self.logf, self.timef):
            if f:
                f.close()

    def rl_seconds(self) -> float:
        return self.state["rl_seconds"] + time.time() - self.t0  # over every segment of a resumed run

    def record(self, step: int, log: dict, rolls: list, tok, ids) -> None:
        """Count bad steps, write the logs, show samples, checkpoint on cadence or on a signal."""
        cfg, state = self.cfg, self.state
        bad = "bad_reward" in log or log.get("skipped_updates", 0) > 0
        if "bad_reward" in log:
            print0(f"warning: step {step} skipped: {log['bad_reward']}")
        else:
            print0(log_line(log, cfg.rl_steps))
        state["bad_run"] = state["bad_run"] + 1 if bad else 0
        state["bad_steps"] += bad
        log["bad_steps"] = state["bad_steps"]
        times = {k: log.pop(k) for k in list(log) if k == "seconds" or k.endswith("_s")}
        if self.logf:
            self.logf.write(json.dumps(log) + "\n")
            self.logf.flush()
            self.timef.write(json.dumps({"step": step, **times}) + "\n")
            self.timef.flush()
        if state["bad_run"] >= cfg.max_bad_steps:
            raise TrainingStopped(
                f"{state['bad_run']} consecutive bad steps (non-finite loss, gradient or reward; see the "
                f"warnings above), stopping at step {step}. Last good checkpoint: "
                f"{state['last_good'] or 'none (set --checkpoint_every)'}; fix the cause (a lower --lr or "
                "--grad_clip, the reward function or scorer) and continue from it with --resume=true "
                "(delete the newer checkpoints first)")
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
        path = checkpoint.save(self.out, step, self.model, self.opt, saved, keep_last=self.cfg.keep_last,
                               trainable_only=self.cfg.lora_rank > 0, protect=protect)
        if self.state["bad_run"] == 0:  # written after a good step: where to go back to if things go wrong
            self.state["last_good"] = str(path)
        return path

    def finish(self, after: dict, after_by_prompt: dict, grid_after, tok, dtype, sft_seconds: float) -> dict:
        """Write out_dir/final (the policy, with tokenizer.json and generation.json), summary.json (held-out
        mean reward before/after RL per task, the gain's standard error paired by prompt, and seconds) and
        the pictures; returns the summary."""
        before, before_by_prompt = self.state["before"], self.state.get("before_by_prompt") or {}
        save_model(self.model, self.cfg, self.out / "final", tok, dtype)
        summary = {k: {"before": before[k], "after": after[k]} for k in before}
        for k in summary:
            if len(before_by_prompt.get(k, ())) == len(after_by_prompt.get(k, ())) > 1:
                summary[k]["gain_se"] = paired_se([a - b for a, b in zip(after_by_prompt[k], before_by_prompt[k])])
        summary["seconds"] = {"sft": sft_seconds, "rl": self.rl_end}
        if scale.rank() == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            write_pictures(self.cfg, self.out, [("before RL", self.state["grid_before"]), ("after RL", grid_after)])
        print0(f"wrote {self.out / 'final'} and {self.out / 'summary.json'}")
        if scale.rank() == 0:
            release_out_dir(self.out)
        return summary


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
    and after RL, prompt under each), when Pillow is installed (plots.py says how to get it otherwise)."""
    from infra import plots

    if (out / "log.jsonl").is_file() and (out / "log.jsonl").stat().st_size:
        plots.plot_curves(out / "log.jsonl", out / "curves.png")
    if grid[0][1] is not None and grid[1][1] is not None:
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else None
        plots.toy_image_panel(grid, heldout.eval_examples("image", cfg, {})[:heldout.GRID_PROMPTS], cfg.image_width,
                              out / "images.png", summary)
