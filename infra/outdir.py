"""A run's out_dir: the start-up checks before anything is written (a folder that holds a model, another run or
anything else is refused, naming what it holds and the fix), the pid file that makes the folder this process's
alone, and where a resumed run continues from. infra/run.Run calls these at start and end; train.main calls
startup_checks once, on every rank.
"""
from __future__ import annotations

import atexit
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from infra import budget, checkpoint, hf, scale
from infra.budget import scratch_config
from infra.load import check_sft_cache, reference_identity, refuse_training_checkpoint
from infra.scale import print0
from infra.cli import resume_changes
from tasks import IMAGE_TASKS, task_list


# Fields that may differ between a run and its resumption (how it runs, not what it computes); lr and grad_clip
# too when --change_on_resume names them (may_change); any other difference is refused. init_from and sft_dir are
# paths: the model they hold is compared by content (load.reference_identity), so a copy of it at another path
# (a cluster job's local disk) resumes.
RESUMABLE = ("resume", "extend", "change_on_resume", "retrain_sft", "rl_steps", "threads", "device", "sample_every",
             "checkpoint_every", "keep_last", "max_bad_steps", "device_batch_size", "out_dir", "init_from", "sft_dir",
             "tracker", "tracker_project", "tracker_run")


def may_change(cfg) -> tuple:
    """The fields this resumption may change: RESUMABLE and what --change_on_resume names."""
    return RESUMABLE + resume_changes(cfg)


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
    check_shared(out, device)
    print0("\n".join(f"  {k} = {v}" for k, v in sorted(asdict(cfg).items())))
    budget.warn_kill_delay(cfg, scale.world())  # SIGTERM's checkpoint must fit in the launcher's kill delay


def check_shared(out: Path, device) -> None:
    """Every rank reads what rank 0 writes in out_dir (checkpoints to resume from, the SFT model): an out_dir on a
    node-local disk would let the ranks of other nodes see no checkpoint, take other branches and hang. Rank 0
    leaves a file named by a fresh random number; each rank must see it. No-op in one process."""
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
        refuse_training_checkpoint(cfg.init_from, "--init_from")
        if not (Path(cfg.init_from) / "config.json").is_file():
            raise FileNotFoundError(f"{Path(cfg.init_from) / 'config.json'} not found: --init_from must be a "
                                    "LLaDA/MMaDA checkpoint directory")
        mc = hf.read_config(cfg.init_from)
        name, preset = getattr(cfg, "_preset", None), getattr(cfg, "_preset_values", {})
        other = {k: (preset[k], getattr(mc, k)) for k in ("d_model", "n_layers", "n_heads", "mlp_hidden_size")
                 if k in preset and getattr(mc, k) != preset[k]}
        if other:  # the preset's lr, lengths and batch sizes were chosen for a model of its shape
            print0(f"warning: --preset {name} is set for a model with "
                   + ", ".join(f"{k}={v}" for k, (v, _) in other.items()) + f", but {cfg.init_from} has "
                   + ", ".join(f"{k}={m}" for k, (_, m) in other.items())
                   + "; its config.json is used, and the preset's other settings may not suit it")
        image = any(t in IMAGE_TASKS for t in task_list(cfg))
        need = (cfg.image_text_len or 64) + cfg.image_width ** 2 + 2 if image else cfg.max_prompt_len + cfg.gen_length
        if need > mc.max_sequence_length:
            raise ValueError(f"sequences of up to {need} tokens exceed the model's max_sequence_length "
                             f"({mc.max_sequence_length}); lower --max_prompt_len / --gen_length (or image sizes)")
    else:
        check_sft_cache(cfg)
    if cfg.checkpoint_every:
        present = len(checkpoint.complete(out)) if cfg.resume else 0  # already on the disk
        budget.check_disk(cfg, out, mc or scratch_config(cfg, vocab_size=128), present)
    any_checkpoint = checkpoint.latest(out)
    if any_checkpoint is not None and not cfg.resume:
        raise ValueError(f"out_dir {out} already holds checkpoints (latest {any_checkpoint.name}): pass "
                         "--resume=true to continue that run, or choose another --out_dir")
    finished = [f"{n}/" if (out / n).is_dir() else n for n in FINISHED[:1] + FINISHED[2:] if (out / n).exists()]
    if finished and any_checkpoint is None:
        # A finished run without checkpoints (checkpoint_every=0, or fewer steps than it): nothing to continue
        # from, and a new start would replace its model and summary.
        raise ValueError(f"out_dir {out} holds a finished run ({', '.join(finished)}) and no checkpoint to "
                         "continue from; choose another --out_dir")
    logged = logged_steps(out / "log.jsonl")
    if logged and any_checkpoint is None:
        # An unfinished run that wrote no checkpoint (a crash or an abort before the first): it can only
        # restart from step 0, replacing its log, which --resume=true says it wants.
        if not cfg.resume:
            raise ValueError(f"out_dir {out} holds an unfinished run ({logged} RL step(s) in log.jsonl) with no "
                             "checkpoint to continue from; --resume=true restarts it from step 0 (its log is "
                             "rewritten), or choose another --out_dir")
    elif (out / "log.jsonl").exists() and any_checkpoint is None:
        print0(f"out_dir {out} holds a run that took no RL step (its log.jsonl is empty): starting it again")
    if any_checkpoint is not None:  # before anything is loaded or config.json is overwritten
        last = resume_point(out)
        state = hf.read_json(last / "state.json", "remove that checkpoint directory")
        checkpoint.check_resumable(last, state, asdict(cfg), reference_identity(cfg), may_change(cfg))
    if scale.rank() == 0:
        _claim_out_dir(out)


def logged_steps(log: Path) -> int:
    """How many complete step lines log.jsonl holds (0 when it is missing or empty)."""
    if not log.is_file():
        return 0
    n = 0
    for line in log.read_text(errors="replace").splitlines():
        try:
            n += "step" in json.loads(line)
        except ValueError:
            continue
    return n


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


# Fault injection for tests/test_failures.py: "RANK:STEP" SIGKILLs that rank when it has taken that step (a
# dead torchrun worker). Unset in normal use.
