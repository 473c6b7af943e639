"""Atomic, sharded, rotated checkpoints (out_dir/checkpoints/step-N/: DCP shards of model and AdamW, and
state.json; step-N.tmp/ is one being written or a crash's, never loaded); stopping on a signal with one; output
that survives its reader going away. DCP reshards on load (8 GPUs resume on 4). No RNG state: draws are seeded."""
import errno
import io
import json
import os
import select
import shutil
import signal
import sys
import time
import warnings
from contextlib import contextmanager, suppress
from pathlib import Path

from infra import scale

DIRNAME, PREFIX, TMP = "checkpoints", "step-", ".tmp"
# A scheduler's SIGTERM, Ctrl-C's SIGINT, and the SIGHUP of a closed terminal or a dropped ssh session.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
REPEAT_WINDOW = 5.0  # seconds in which a second signal is torchrun's copy of the first, not a new one


def _dcp():  # imported on first use (about a second; sampling and evaluation never need it)
    import torch.distributed.checkpoint.state_dict
    return torch.distributed.checkpoint


def _transfer(how: str, path, model, opt, trainable_only: bool) -> tuple:
    """DCP save or load of the model's and AdamW's state (LoRA: the adapters only, the frozen base left as it is)."""
    options = _dcp().state_dict.StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    model_sd, optim_sd = _dcp().state_dict.get_state_dict(model, opt, options=options)
    with warnings.catch_warnings():  # DCP's "assumes a single process" without a process group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        getattr(_dcp(), how)({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    return model_sd, optim_sd, options


def _step_dir(out_dir, step: int, tmp: bool = False) -> Path:
    return Path(out_dir) / DIRNAME / f"{PREFIX}{step:08d}{TMP if tmp else ''}"


def complete(out_dir) -> list[Path]:  # oldest first (the step is zero-padded)
    return sorted(p for p in (Path(out_dir) / DIRNAME).glob(f"{PREFIX}*")
                  if not p.name.endswith(TMP) and (p / "state.json").is_file())


def latest(out_dir) -> Path | None:
    return (complete(out_dir) or [None])[-1]


def damage(path) -> str | None:
    """What is wrong with the checkpoint `path` (None: intact), down to DCP's byte ranges within each shard."""
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
    for name in sorted({info.relative_path for info in storage.values()}):
        f, size = path / name, max(i.offset + i.length for i in storage.values() if i.relative_path == name)
        if not f.is_file():
            return f"its shard {f} is missing"
        if f.stat().st_size < size:
            return f"its shard {f} is truncated ({f.stat().st_size} of at least {size} bytes)"
    return None


def fsync_tree(path: Path, entries_only: bool = False) -> None:
    """Flush every file under path (unless entries_only), then its entries, to stable storage."""
    for p in [*(() if entries_only else sorted(p for p in path.rglob("*") if p.is_file())), path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(out_dir, step: int, model, opt, state: dict, *, keep_last: int, trainable_only: bool = False,
         protect=None) -> Path:
    """Write step's checkpoint atomically, keeping the newest keep_last (0: all) and `protect`; every rank calls it."""
    tmp, final = _step_dir(out_dir, step, tmp=True), _step_dir(out_dir, step)
    if scale.rank() == 0:
        for stale in (tmp, final):  # a crash's leftovers, or a checkpoint of a run we were told to redo
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    scale.barrier()
    _transfer("save", tmp, model, opt, trainable_only)
    scale.barrier()
    if scale.rank() == 0:
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_tree(final.parent, entries_only=True)
        if keep_last:
            keep = Path(protect).resolve() if protect else None
            for old in [p for p in complete(out_dir)[:-keep_last] if p.resolve() != keep]:
                os.rename(old, old.with_name(old.name + TMP))  # so that a kill while deleting it damages no checkpoint
        for p in final.parent.glob(f"{PREFIX}*{TMP}"):  # those, and a crash's leftovers
            shutil.rmtree(p, ignore_errors=True)
    scale.barrier()
    return final


def load(path, model, opt, *, trainable_only: bool = False) -> dict:
    """Restore model (or adapter) and optimizer in place, at any world size; returns state.json."""
    path = Path(path)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no state.json)")
    if (problem := damage(path)) is not None:
        raise ValueError(f"checkpoint {path} is damaged: {problem}; remove it to resume from an older one")
    model_sd, optim_sd, options = _transfer("load", path, model, opt, trainable_only)
    _dcp().state_dict.set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    return json.loads((path / "state.json").read_text())


def check_resumable(path, state: dict, config: dict, reference: dict, may_change) -> None:
    """Refuse to continue under other settings (but may_change) or another reference policy, listing what differs."""
    changed = sorted(k for k, v in config.items() if k not in may_change and state["config"].get(k) != v)
    names = [k for k in changed if k in ("lr", "grad_clip")]
    if changed:
        raise ValueError(f"cannot resume {path}: these settings differ from the saved run: "
                         + ", ".join(f"{k} {state['config'].get(k)!r} -> {config[k]!r}" for k in changed)
                         + (f" (to change {' and '.join(names)} from here on, which log.jsonl then records, add "
                            f"--change_on_resume={','.join(names)})" if names else ""))
    if state["reference"] != reference:
        raise ValueError(f"cannot resume {path}: the reference policy changed (saved {state['reference']}, now "
                         f"{reference}); resume with the same --init_from / SFT model (its content, wherever it is)")


def silence(fd: int) -> None:
    """Point fd at /dev/null: later prints succeed (and go nowhere) instead of raising."""
    with suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


class Unbroken:
    """A real stdout/stderr nobody reads (EIO, EPIPE, EBADF) is silenced, a full non-blocking pipe (EAGAIN) drops
    the line: losing a message must not lose the run or its checkpoint."""

    def __init__(self, stream):
        self._stream = stream

    def _guarded(self, call, *text):
        try:
            return call(*text)
        except OSError as e:
            if not isinstance(e, BlockingIOError):
                if e.errno not in (errno.EIO, errno.EPIPE, errno.EBADF, errno.ENXIO):
                    raise
                silence(self._stream.fileno())
                with suppress(OSError, ValueError):
                    self._stream.flush()  # what the buffer still holds goes to /dev/null
            return len(text[0]) if text else None

    def write(self, text):
        return self._guarded(self._stream.write, text)

    def flush(self):
        self._guarded(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def away_from_gone_output(fds=(1, 2)) -> None:
    """Output nobody reads (hung-up terminal, pipe reader gone) goes to /dev/null: a SIGHUP'd run still checkpoints."""
    for fd in fds:
        with suppress(OSError, ValueError):
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            if any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in poller.poll(0)):
                silence(fd)


def _say_in_handler(text: str) -> None:
    """Print from a signal handler (rank 0) straight to the descriptor: re-entering sys.stdout would raise."""
    if scale.rank() == 0:
        with suppress(OSError, ValueError):
            try:
                os.write(sys.stdout.fileno(), (text + "\n").encode())
            except (AttributeError, io.UnsupportedOperation):
                print(text, flush=True)


class Aborted(KeyboardInterrupt):
    """A second stop signal: the work in progress is dropped at once (a KeyboardInterrupt, handled as Ctrl-C)."""

    def __init__(self, signum: int):  # outdir.Stopped shares it
        BaseException.__init__(self, signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def graceful_stop(doing: str = "finishing this step, then writing a checkpoint", abort=None):
    """A stop signal sets flag["signal"] (its line says flag["doing"] happens next); a second one REPEAT_WINDOW
    seconds later raises Aborted, and abort() says in the first line what that would lose."""
    flag = {"signal": 0, "at": 0.0, "doing": doing}

    def handler(signum, frame):
        # torchrun forwards the signal to every worker, so one Ctrl-C may arrive twice: only a later one stops.
        if flag["signal"] and time.monotonic() - flag["at"] > REPEAT_WINDOW:
            raise Aborted(signum)
        if not flag["signal"]:
            flag["signal"], flag["at"] = signum, time.monotonic()
            how = "Ctrl-C again" if signum == signal.SIGINT else f"another {signal.Signals(signum).name} or Ctrl-C"
            again = f"; a second signal ({how}, after {REPEAT_WINDOW:.0f} s) stops at once: {abort()}" if abort else ""
            away_from_gone_output()
            _say_in_handler(f"caught {signal.Signals(signum).name}: {flag['doing']}{again}")
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield flag
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
