"""A process sandbox for untrusted programs: `run_code(program, tests)` -> fraction of the tests that pass.

MaskGRPO (arXiv:2510.02880) §6 scores code by the fraction of MBPP-style unit tests that pass, run in E2B;
we run them locally. Each test runs program + test in its own process group with CPU-time, address-space,
file-size, open-file and process limits, a private temporary directory, no inherited environment (so no
secrets), no network where the OS allows it, and a kill of the whole group at its timeout. `run_code` never
raises on what the program does (a crash, a hang, sys.exit, a fork bomb are all failed tests) and never
leaves a process behind; only a malformed argument raises ValueError. Standard library only, and nothing
from this project: the supervisor runs this file as `python -I -S sandbox.py`, which cannot import it.

How it works. run_code (this process) starts one supervisor, `python -I -S sandbox.py --sandbox-supervisor`,
in a new session with an empty environment, a private temporary directory as cwd, the job on stdin and an
anonymous result file as stdout. The supervisor forks one worker per test. A worker isolates itself, then
runs program + that one test and writes "<test index> <nonce>" to the result file only if both finished
without an exception, so sys.exit/os._exit/crashes count as failures and a hanging test costs one timeout,
not all. Isolation is set up inside the forked worker rather than in Popen's preexec_fn, which Python
documents as unsafe when the caller has threads (the trainer does).
  * always: rlimits on CPU seconds, address space, file size, open files, processes and core dumps;
    stdin/stdout/stderr on /dev/null (a 100 MB print is never buffered); no inherited environment.
  * as root: the worker also takes a fresh random uid (so RLIMIT_NPROC binds, writes outside its own
    directory and other processes' /proc entries are refused, and every process it spawned can be killed
    by uid, even if it left its session), no_new_privs, a private network namespace (no network), and a
    private mount namespace whose cwd, /tmp, /var/tmp, /dev/shm and /run/lock are small private tmpfs.
  * not root: no uid switch and no mount namespace; a private network only if user namespaces are allowed.
    RLIMIT_NPROC then counts all of the user's processes, so forks mostly fail, but a setsid() child that
    got through escapes the group kill, and writes to /tmp or anywhere the user may write are not stopped.
The supervisor is a child subreaper, so whatever the worker forked is re-parented to it and reaped: no
process and no zombie survives a call (PID 1 of a container often reaps nothing). Only if the supervisor
itself wedges past a generous backstop are processes killed from here, and their zombies may remain.
Known gaps: world-readable files stay readable; after the uid switch, stdlib modules not in _PRELOAD fail
to import when the interpreter lives in an unreadable directory (e.g. /root/.pyenv); a program that
searches the harness's memory for the nonce can fake a pass. This is damage control, not a jail.

Test: python -m pytest tests/test_sandbox.py -q;  throughput: python -m tools.bench --sandbox
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

_SANDBOX_FLAG = "--sandbox-supervisor"
_SANDBOX_UIDS = (1 << 30, 1 << 24)  # (first, count): random per call, so concurrent calls never share a uid
_MAX_PROCS, _SCRATCH_MB, _MAX_OPEN_FILES = 4, 16, 64
_SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_PRELOAD = ("re", "math", "cmath", "collections", "heapq", "itertools", "functools", "operator", "array",
            "bisect", "copy", "datetime", "string", "statistics", "fractions", "decimal", "random", "typing")
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x20000, 0x10000000, 0x40000000  # linux/sched.h
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 1 << 14, 1 << 18  # linux/mount.h
_PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 36, 38  # linux/prctl.h


def run_code(program: str, tests: list[str], timeout: float = 5.0, memory_mb: int = 512) -> float:
    """Fraction of `tests` (Python statements, e.g. asserts) that pass after `program`, each in a sandboxed process.

    `timeout` is wall-clock seconds per test; `memory_mb` caps each process's address space.
    ("def f(x): return x + 1", ["assert f(1) == 2", "assert f(2) == 4"]) -> 0.5;  ("while True: pass", [...]) -> 0.0
    """
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
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    if uid is not None:  # root: every process whose real uid is the sandbox's
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/status") as status:
                    if any(line.split()[1:2] == [str(uid)] for line in status if line.startswith("Uid:")):
                        os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
    proc.wait()


def _libc():
    """The C library through ctypes when it offers the Linux calls we use (unshare, mount, prctl), else None."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "unshare") and hasattr(libc, "prctl") else None
    except (ImportError, OSError):
        return None


def _supervise() -> None:
    """Supervisor process: fork, time, kill and reap one sandboxed worker per test (see the module docstring)."""
    job = json.loads(sys.stdin.buffer.read())
    libc, uid = _libc(), job["uid"]
    if libc is not None:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the worker come back to us to be reaped
    for name in _PRELOAD:  # after the uid switch the stdlib may be unreadable (e.g. under /root): import now
        try:
            __import__(name)
        except ImportError:
            pass
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
        _kill_worker(pid, uid)
        reap_until = time.monotonic() + 2.0
        while time.monotonic() < reap_until:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    time.sleep(0.002)
            except ChildProcessError:
                break  # the worker, the killer and every re-parented descendant are gone
    os._exit(0)


def _kill_worker(pid: int, uid: int | None) -> None:
    """SIGKILL the worker and all it spawned: as root by uid, since kill(-1) from that uid reaches every process
    of it in any session or group; otherwise the worker's process group, which a setsid() child escapes."""
    try:
        killer = os.fork() if uid is not None else -1
    except OSError:
        killer = -1
    if killer == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    try:
        os.killpg(pid, signal.SIGKILL)  # the worker leads its own process group
    except OSError:
        pass


def _work(job: dict, index: int, workdir: str, libc) -> None:
    """Worker process: isolate, run program + test `index`, report a pass with the nonce. Never returns."""
    try:
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
    except BaseException:  # SystemExit, MemoryError, KeyboardInterrupt... raised by untrusted code: a failed test
        pass
    finally:
        os._exit(0)


def _isolate(workdir: str, uid: int | None, timeout: float, memory_mb: int, libc) -> None:
    """Apply the sandbox to the current (worker) process; raises if a required step fails, so nothing runs."""
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
    cpu = int(timeout) + 1
    limits = {resource.RLIMIT_CPU: (cpu, cpu + 1), resource.RLIMIT_AS: (memory_mb << 20,) * 2,
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


if __name__ == "__main__":
    if sys.argv[1:] != [_SANDBOX_FLAG]:
        sys.exit(f"sandbox.py is started by run_code as `python -I -S sandbox.py {_SANDBOX_FLAG}` with a job on "
                 "stdin; to use the sandbox, call sandbox.run_code(program, tests) from Python")
    _supervise()
