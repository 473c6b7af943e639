"""Running and scoring what the model generates: `run_code(program, tests)` runs unit tests in a process sandbox;
`RemoteScorer(url)` asks an HTTP reward server to score text-to-image rollouts (arXiv:2510.02880 §6). Standard
library only: the supervisor runs this file as `python -I -S sandbox.py`.

The supervisor (new session, empty environment, private cwd, child subreaper) forks one worker per test, which
isolates itself and reports "<index> <nonce>" only if program + test finished: exits, crashes, hangs and fork
bombs fail, a hang costs one timeout. Always: rlimits, stdio on /dev/null, the group killed at its timeout. As
root, also a fresh random uid (all it spawned dies by uid), no_new_privs, a private network and mount namespace
with small tmpfs scratch dirs; not root, a private network only if user namespaces are allowed, and a setsid()
child escapes the group kill. Known gaps: world-readable files stay readable; after the uid switch, modules not
in _PRELOAD may fail to import; a program that finds the nonce in memory can fake a pass. Damage control, not a jail.
"""
import contextlib
import json
import math
import operator
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse

_SANDBOX_FLAG = "--sandbox-supervisor"
_SANDBOX_UIDS = (1 << 30, 1 << 24)  # (first, count): random per call, so concurrent calls never share a uid
_MAX_PROCS, _SCRATCH_MB, _MAX_OPEN_FILES = 4, 16, 64
_SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_PRELOAD = ("re", "math", "cmath", "collections", "heapq", "itertools", "functools", "operator", "array",
            "bisect", "copy", "datetime", "string", "statistics", "fractions", "decimal", "random", "typing")
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x20000, 0x10000000, 0x40000000  # linux/sched.h
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 1 << 14, 1 << 18  # linux/mount.h
_PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 36, 38  # linux/prctl.h
_STUB_HINT = "python -m tools.stub_scorer --port 8765, then use http://127.0.0.1:8765"


def run_code(program: str, tests: list[str], timeout: float = 5.0, memory_mb: int = 512) -> float:
    """Fraction of `tests` (e.g. asserts) passing after `program` in a sandbox; timeout (wall s), memory_mb per test."""
    if not (isinstance(tests, (list, tuple)) and tests and all(isinstance(t, str) for t in tests)):
        raise ValueError(f"tests must be a non-empty list of str, got {tests!r:.200}")
    if not (isinstance(timeout, (int, float)) and 0 < timeout <= 600):
        raise ValueError(f"timeout must be in (0, 600] seconds, got {timeout!r}")
    if not (isinstance(memory_mb, int) and memory_mb >= 64):
        raise ValueError(f"memory_mb must be an int >= 64 (the interpreter alone needs ~30 MB), got {memory_mb!r}")
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    uid = _SANDBOX_UIDS[0] + secrets.randbelow(_SANDBOX_UIDS[1]) if root else None
    nonce = secrets.token_hex(16)
    job = json.dumps({"program": program, "tests": list(tests), "timeout": timeout, "memory_mb": memory_mb,
                      "uid": uid, "nonce": nonce}).encode()  # ensure_ascii: lone surrogates survive the trip
    try:
        with tempfile.TemporaryDirectory(prefix="maskgrpo-sandbox-", ignore_cleanup_errors=True) as cwd, \
                tempfile.TemporaryFile() as out:
            proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), _SANDBOX_FLAG],
                                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.DEVNULL, cwd=cwd,
                                    env={"PATH": "/usr/bin:/bin"}, start_new_session=True)
            try:  # the supervisor enforces the per-test timeouts; this is only a backstop if it wedges
                proc.communicate(job, timeout=len(tests) * (timeout + 2.0) + 10.0)
            except subprocess.TimeoutExpired:
                _kill_everything(proc, uid)
            out.seek(0)
            lines = set(out.read(1 << 16).decode(errors="replace").splitlines())
    except (OSError, subprocess.SubprocessError):
        return 0.0
    return sum(f"{i} {nonce}" in lines for i in range(len(tests))) / len(tests)


def _kill_everything(proc: subprocess.Popen, uid: int | None) -> None:
    """Backstop: SIGKILL the supervisor's session and, as root, every process of the sandbox uid; then reap."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    if uid is not None:  # root: every process whose real uid is the sandbox's
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
                if any(line.split()[1:2] == [str(uid)] for line in status if line.startswith("Uid:")):
                    os.kill(int(pid), signal.SIGKILL)
    proc.wait()


def _supervise() -> None:
    """Supervisor process: fork, time, kill and reap one sandboxed worker per test (see the module docstring)."""
    job = json.loads(sys.stdin.buffer.read())
    uid = job["uid"]
    try:  # the C library, where it offers the Linux calls we use (unshare, mount, prctl)
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc = libc if hasattr(libc, "unshare") and hasattr(libc, "prctl") else None
    except (ImportError, OSError):
        libc = None
    if libc is not None:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the worker come back to us to be reaped
    for name in _PRELOAD:  # after the uid switch the stdlib may be unreadable (e.g. under /root): import now
        with contextlib.suppress(ImportError):
            __import__(name)
    for index in range(len(job["tests"])):
        workdir = os.path.join(os.getcwd(), str(index))
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
        pid = os.fork()
        if pid == 0:
            _work(job, index, workdir, libc)
        deadline = time.monotonic() + job["timeout"]
        while time.monotonic() < deadline and os.waitpid(pid, os.WNOHANG)[0] == 0:
            time.sleep(0.002)
        with contextlib.suppress(OSError):  # all the worker spawned: as root by uid (kill(-1) from it)...
            if uid is not None and os.fork() == 0:
                try:
                    os.setgid(uid)
                    os.setuid(uid)
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # ...else by the process group the worker leads
        reap_until = time.monotonic() + 2.0
        with contextlib.suppress(ChildProcessError):  # raised once the worker, the killer and all they left are gone
            while time.monotonic() < reap_until:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    time.sleep(0.002)
    os._exit(0)


def _work(job: dict, index: int, workdir: str, libc) -> None:
    """Worker process: isolate, run program + test `index`, report a pass with the nonce. Never returns."""
    try:  # an exception (SystemExit, MemoryError... from untrusted code, or a failed isolation step) fails the test
        os.setpgid(0, 0)
        out = os.dup(1)
        _isolate(workdir, job["uid"], job["timeout"], job["memory_mb"], libc)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        scope = {"__name__": "__main__"}
        exec(compile(job["program"], "<program>", "exec"), scope)
        exec(compile(job["tests"][index], "<test>", "exec"), scope)
        os.write(out, f"{index} {job['nonce']}\n".encode())
    finally:  # exits with no traceback even while an exception is in flight
        os._exit(0)


def _isolate(workdir: str, uid: int | None, timeout: float, memory_mb: int, libc) -> None:
    """Sandbox the worker, in the fork (preexec_fn is unsafe with threads); a failed required step raises."""
    import resource
    os.chdir(workdir)
    if libc is not None and uid is None:
        libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET)  # unprivileged: no network if user namespaces are allowed
    elif libc is not None and libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET) == 0:
        # make every mount private first, or the tmpfs mounts below would propagate to the host
        if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) == 0:
            options = f"size={_SCRATCH_MB}m,mode=0700,uid={uid},gid={uid}".encode()
            for path in (workdir, *_SCRATCH_DIRS):
                if os.path.isdir(path):
                    libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options)
                if path == workdir:
                    os.chdir(workdir)  # step onto the fresh tmpfs before /tmp, its parent, is covered
    limits = {resource.RLIMIT_CPU: (int(timeout) + 1, int(timeout) + 2), resource.RLIMIT_AS: (memory_mb << 20,) * 2,
              resource.RLIMIT_FSIZE: (_SCRATCH_MB << 20,) * 2, resource.RLIMIT_NOFILE: (_MAX_OPEN_FILES,) * 2,
              resource.RLIMIT_NPROC: (_MAX_PROCS,) * 2, resource.RLIMIT_CORE: (0, 0)}
    for kind, (soft, hard) in limits.items():
        ceiling = resource.getrlimit(kind)[1]
        if ceiling != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(kind, (soft, hard))
    if libc is not None:
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries cannot hand privileges back
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


class RemoteScorer:
    """Scores text-to-image rollouts on a reward server: one POST {"prompts": [...], "image_codes": [[3, 5, ...], ...]}
    -> {"scores": [0.75, ...]}, a finite number per image. Connection errors, timeouts, HTTP 429 and 5xx are retried
    `retries` times (backoff * 2**k s), then ConnectionError; other HTTP errors RuntimeError, a bad reply ValueError."""

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 3, backoff: float = 1.0):
        try:
            parts = urllib.parse.urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        except (TypeError, ValueError, AttributeError):  # not a str, or a port that is not a number
            ok = False
        if not ok:
            raise ValueError(f"image scorer url must look like http(s)://host[:port][/path], got {url!r}; "
                             f"to try the pipeline without models: {_STUB_HINT}")
        for name, (v, types, want) in {"timeout": (timeout, (int, float), "> 0 seconds (--image_scorer_timeout)"),
                                       "retries": (retries, int, "an int >= 0 (0 = one attempt)"),
                                       "backoff": (backoff, (int, float), ">= 0 seconds")}.items():
            if not (isinstance(v, types) and (v > 0 if name == "timeout" else v >= 0)):
                raise ValueError(f"image scorer {name} must be {want}, got {v!r}")
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    def __call__(self, prompts: list[str], image_codes: list[list[int]]) -> list[float]:
        """One score per (prompt, image); image_codes is a list of code lists or anything with .tolist()."""
        import http.client  # imported here: the sandbox's supervisor runs this file and must start fast
        import urllib.error
        import urllib.request
        codes = image_codes.tolist() if hasattr(image_codes, "tolist") else image_codes  # a (B, N) tensor
        if not (isinstance(prompts, (list, tuple)) and all(isinstance(p, str) for p in prompts)):
            raise ValueError(f"prompts must be a list of str, got {prompts!r:.120}")
        if not isinstance(codes, (list, tuple)) or len(codes) != len(prompts):
            raise ValueError(f"image_codes needs one row per prompt ({len(prompts)} prompts), got {codes!r:.120}")
        try:  # operator.index takes Python, numpy and integer-tensor scalars but refuses floats
            rows = [[operator.index(c) for c in row] for row in codes]
        except TypeError:
            raise ValueError(f"image_codes rows must be lists of int codes, got {codes!r:.120}") from None
        if not rows:
            return []
        body = json.dumps({"prompts": list(prompts), "image_codes": rows}).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                    return _parse_scores(reply.read(), len(rows), self.url)
            except urllib.error.HTTPError as err:
                detail = err.read(300).decode(errors="replace")
                err.close()
                if err.code < 500 and err.code != 429:  # our request or the url is wrong: retrying cannot help
                    raise RuntimeError(f"image scorer at {self.url} refused the request: HTTP {err.code} "
                                       f"{err.reason}: {detail!r}") from None
                last = err
            except (OSError, http.client.HTTPException) as err:  # refused, reset, DNS, timed out, cut short
                last = err
        raise ConnectionError(f"image scorer at {self.url} failed {self.retries + 1} attempts (last error: "
                              f"{last!r}); start the server or fix image_scorer_url, or for a model-free "
                              f"stand-in run {_STUB_HINT}") from last

    def rewards(self, prompts: list[str], image_codes) -> "torch.Tensor":
        """Float32 (B,) scores, or NaN rows when the scorer fails: a step every rank skips (a raise would hang)."""
        import torch
        try:
            return torch.tensor(self(prompts, image_codes), dtype=torch.float32)
        except (ValueError, OSError, RuntimeError) as e:
            print(f"warning: image scorer failed ({e}); this batch gets NaN rewards", flush=True)
            return torch.full((len(prompts),), math.nan)


def _parse_scores(raw: bytes, n: int, url: str) -> list[float]:
    """The scores of a reply, checked against the protocol; ValueError naming the first problem."""
    try:
        reply = json.loads(raw, parse_int=float)  # every number a float: huge ints become inf, caught below
    except ValueError:  # also UnicodeDecodeError
        raise ValueError(f"image scorer at {url} replied with something that is not JSON: {raw[:200]!r}") from None
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list):
        raise ValueError(f"image scorer at {url} replied without a 'scores' list: {raw[:200]!r}")
    if len(scores) != n:
        raise ValueError(f"image scorer at {url} returned {len(scores)} scores for {n} images")
    for i, score in enumerate(scores):
        if type(score) is not float or not math.isfinite(score):  # bool and str are not scores
            kind = "non-finite" if type(score) is float else "non-numeric"
            raise ValueError(f"image scorer at {url} returned a {kind} score {score!r} at index {i}")
    return scores


if __name__ == "__main__":
    if sys.argv[1:] != [_SANDBOX_FLAG]:
        sys.exit(f"sandbox.py is started by run_code as `python -I -S sandbox.py {_SANDBOX_FLAG}` with a job on "
                 "stdin; to use the sandbox, call sandbox.run_code(program, tests) from Python")
    _supervise()
