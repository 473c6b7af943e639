"""Resumable training state: atomic, sharded, rotated checkpoints; what a resume may change; stopping on a
signal with a checkpoint.

    out_dir/checkpoints/step-00000010/      a complete checkpoint: the state after 10 RL steps
        .metadata, __0_0.distcp, ...        model (or, with LoRA, adapter) and AdamW tensors
        state.json                          step, config, held-out rewards before RL, reference identity
    out_dir/checkpoints/step-00000020.tmp/  being written (or left by a crash): never loaded, removed later

The tensors go through torch.distributed.checkpoint (DCP), PyTorch's own sharded format: under FSDP2
every rank writes its shards in parallel, and DCP reshards on load, so a run saved on 8 GPUs resumes on
4 (or on one process). A single process uses the same two calls, so there is one code path.

Atomicity: everything is written into `step-N.tmp`, fsynced, then the directory is renamed to `step-N`
and its parent fsynced. A rename is atomic on POSIX file systems, so a checkpoint directory without the
`.tmp` suffix is complete by construction; a kill at any moment leaves at worst a `.tmp` directory,
which `latest` ignores and the next `save` deletes. A complete checkpoint damaged afterwards (a shard
deleted or cut short by a full disk or a partial copy, state.json edited) is found by `damage` from DCP's
own index of every tensor's file, offset and length, without reading the tensors; `--resume` then falls
back to the newest intact checkpoint and says which one to remove (`latest_intact`).

Randomness needs no saved RNG state: every random draw in train.py comes from a generator seeded by
(seed, step, index), and the data position is the step itself (tasks.draw_prompts), so a resumed step
draws exactly what the uninterrupted run drew.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path


from infra import cli, scale

DIRNAME, PREFIX, TMP = "checkpoints", "step-", ".tmp"
# Fault injection for tests/test_resume.py: SIGKILL this process in the middle of writing the
# checkpoint of this step (tensors written, directory not yet renamed). Unset in normal use.
KILL_ENV = "MASKGRPO_KILL_DURING_CHECKPOINT"
REPEAT_WINDOW = 5.0  # seconds in which a second signal is torchrun's copy of the first, not a new one


def _dcp():
    """torch.distributed.checkpoint, imported on first use: the import takes about a second, and sampling,
    evaluation and most tests never save or load a checkpoint."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (get_state_dict, StateDictOptions)
    return dcp


@contextmanager
def _quiet():
    """DCP warns that it 'assumes a single process' whenever there is no process group: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _step_dir(out_dir, step: int, tmp: bool = False) -> Path:
    return Path(out_dir) / DIRNAME / f"{PREFIX}{step:08d}{TMP if tmp else ''}"


def complete(out_dir) -> list[Path]:
    """Complete checkpoints in out_dir, oldest first."""
    root = Path(out_dir) / DIRNAME
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(TMP)
             and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(out_dir) -> Path | None:
    done = complete(out_dir)
    return done[-1] if done else None


def damage(path) -> str | None:
    """What is wrong with the complete checkpoint `path`, or None when it is intact: state.json must be a
    JSON object, and every byte range DCP's .metadata assigns to a shard file must lie inside that file."""
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text())
        if not isinstance(state, dict) or "step" not in state:
            return f"{path / 'state.json'} holds no checkpoint state"
    except (ValueError, OSError) as e:
        return f"{path / 'state.json'} is unreadable ({e})"
    try:
        storage = _dcp().FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as e:  # DCP raises whatever its unpickler met: a missing or truncated .metadata
        return f"{path / '.metadata'} is unreadable ({type(e).__name__}: {e})"
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            return f"its shard {f} is missing"
        if f.stat().st_size < size:
            return f"its shard {f} is truncated ({f.stat().st_size} of at least {size} bytes)"
    return None


def latest_intact(out_dir) -> tuple[Path | None, list[str]]:
    """(the newest complete checkpoint that is not damaged, or None; one line per newer damaged one)."""
    skipped = []
    for path in reversed(complete(out_dir)):
        problem = damage(path)
        if problem is None:
            return path, skipped
        skipped.append(f"{path} is damaged: {problem}")
    return None, skipped


def fsync_tree(path: Path) -> None:
    """Flush every file of a directory, then the directory entries themselves, to stable storage."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            _fsync(p)
    _fsync(path)


def _fsync(path: Path) -> None:
    """Flush one file, or a directory's entries, to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _options(trainable_only: bool):
    # With LoRA the frozen base is the --init_from checkpoint, already on disk: save only the adapters.
    return _dcp().state_dict.StateDictOptions(ignore_frozen_params=trainable_only)


def save(out_dir, step: int, model, opt, state: dict, *, keep_last: int, trainable_only: bool = False,
         protect=None) -> Path:
    """Write the checkpoint of `step` atomically and keep only the newest keep_last complete ones
    (0 keeps all), and `protect` (the last one written after a good step) whatever its age. A collective
    under FSDP2: every rank calls it. Returns the final directory."""
    tmp, final = _step_dir(out_dir, step, tmp=True), _step_dir(out_dir, step)
    if scale.rank() == 0:
        for stale in (tmp, final):  # a crash's leftovers, or a checkpoint of a run we were told to redo
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    scale.barrier()
    model_sd, optim_sd = _dcp().state_dict.get_state_dict(model, opt, options=_options(trainable_only))
    with _quiet():
        _dcp().save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    scale.barrier()
    if scale.rank() == 0:
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        if os.environ.get(KILL_ENV) == str(step):
            os.kill(os.getpid(), signal.SIGKILL)
        fsync_tree(tmp)
        os.rename(tmp, final)
        _fsync(final.parent)
        if keep_last:
            keep = Path(protect).resolve() if protect else None
            for old in complete(out_dir)[:-keep_last]:
                if old.resolve() == keep:
                    continue
                # Renamed first: a kill during the delete leaves a .tmp directory, never a checkpoint
                # directory with state.json but missing shards.
                doomed = old.with_name(old.name + TMP)
                os.rename(old, doomed)
                shutil.rmtree(doomed, ignore_errors=True)
        for p in final.parent.glob(f"{PREFIX}*{TMP}"):  # older crash leftovers
            shutil.rmtree(p, ignore_errors=True)
    scale.barrier()
    return final


def load(path, model, opt, *, trainable_only: bool = False) -> dict:
    """Restore model (or adapter) and optimizer tensors in place from a complete checkpoint; returns its
    state.json. Works at any world size (DCP reshards)."""
    path = Path(path)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no state.json)")
    problem = damage(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} is damaged: {problem}; remove it to resume from an older one")
    model_sd, optim_sd = _dcp().state_dict.get_state_dict(model, opt, options=_options(trainable_only))
    with _quiet():
        _dcp().load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    # Loading adapters only leaves the frozen base (from --init_from) as it is: not strict then.
    _dcp().state_dict.set_state_dict(
        model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
        options=_dcp().state_dict.StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only))
    return json.loads((path / "state.json").read_text())


def check_resumable(path, state: dict, config: dict, reference: dict, may_change) -> None:
    """Refuse to continue a run under settings that would change its result (any config field not in
    may_change), or against another reference policy (the KL anchor), listing what differs."""
    changed = sorted(k for k, v in config.items() if k not in may_change and state["config"].get(k) != v)
    if changed:
        raise ValueError(f"cannot resume {path}: these settings differ from the saved run: "
                         + ", ".join(f"{k} {state['config'].get(k)!r} -> {config[k]!r}" for k in changed)
                         + changeable_hint(changed))
    if state["reference"] != reference:
        old = "" if "init_from" not in state["reference"] else " (that checkpoint identifies its model by path " \
            "and file times, as older versions of train.py did: resume it with that version, or start again)"
        raise ValueError(f"cannot resume {path}: the reference policy changed (saved {state['reference']}, "
                         f"now {reference}){old}; resume with the same --init_from / SFT model (its content, "
                         "wherever it is)")


def changeable_hint(changed) -> str:
    """The way to change lr or grad_clip on purpose, when they are among the refused differences."""
    names = [k for k in changed if k in ("lr", "grad_clip")]
    return (f" (to change {' and '.join(names)} from here on, which log.jsonl then records, add "
            f"--change_on_resume={','.join(names)})") if names else ""


def _say_in_handler(text: str) -> None:
    """Print from a signal handler (rank 0), never raising: the signal can arrive while this thread is inside a
    print, and re-entering the buffered sys.stdout there raises "reentrant call", so the line goes straight to
    the file descriptor (print0 flushes every line, so the order holds); output nobody can read any more (a
    closed terminal: EIO; a pipe whose reader left: EPIPE; a full one) is dropped, as the checkpoint the
    handler leads to matters more than the line. A stdout with no descriptor (a test's capture) gets an
    ordinary print."""
    if scale.rank() != 0:
        return
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
        fd = None
    try:
        if fd is None:
            print(text, flush=True)
        else:
            os.write(fd, (text + "\n").encode())
    except (OSError, ValueError):
        pass


# The signals a run stops on with a checkpoint: a scheduler's or launcher's SIGTERM, Ctrl-C's SIGINT, and the
# SIGHUP of a closed terminal or a dropped ssh session (which would otherwise kill the run at once).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Aborted(KeyboardInterrupt):
    """A second stop signal: the work in progress is dropped at once (what it loses was said on the first).
    A KeyboardInterrupt, so that every handler of Ctrl-C on the way treats it as one."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def away_from_gone_output() -> None:
    """A stop signal may come with the terminal gone (SIGHUP of a closed window) or after the reader of a pipe
    left: stdout and stderr that nobody reads go to /dev/null, so that the run can still finish its step, write
    its checkpoint and exit cleanly instead of dying at its next print."""
    for fd in (1, 2):
        if cli.output_gone(fd):
            cli.silence(fd)


@contextmanager
def graceful_stop(doing: str = "finishing this step, then writing a checkpoint", abort=None):
    """SIGTERM / SIGINT / SIGHUP (pre-emption, Ctrl-C, a closed terminal) set a flag: the current step
    finishes, a checkpoint is written, and the run exits (`doing` is what the caught signal's line says
    happens next; flag["doing"] may change it as the phase moves on; infra/outdir.py lists every phase's).
    A second signal more than REPEAT_WINDOW seconds later raises Aborted at once; abort() (if given) says,
    in the first signal's line, what that would lose. Under torchrun the launcher SIGKILLs its workers
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) after forwarding a signal: set it above one step plus
    a checkpoint write (README)."""
    flag = {"signal": 0, "at": 0.0, "doing": doing}

    def handler(signum, frame):
        # torchrun forwards the signal it gets to every worker, so Ctrl-C or a scheduler that signals
        # every task arrives twice within moments: only a later one means "stop now".
        if flag["signal"] and time.monotonic() - flag["at"] > REPEAT_WINDOW:
            raise Aborted(signum)
        if not flag["signal"]:
            flag["signal"], flag["at"] = signum, time.monotonic()
            again = f"; a second signal (Ctrl-C again, after {REPEAT_WINDOW:.0f} s) stops at once: {abort()}" \
                if abort else ""
            away_from_gone_output()
            _say_in_handler(f"caught {signal.Signals(signum).name}: {flag['doing']}{again}")
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield flag
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
