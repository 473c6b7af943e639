"""Tests for sandbox.py: hostile programs each return a pass rate quickly and leave no process behind; the
sandbox hides the parent's environment and, as root, blocks writes outside its directory and the network;
several slow-but-passing tests in one call each get their own timeout (last section).

The MBPP case reads the real benchmark file in ../shared/data (skipped when absent).

Run: python -m pytest tests/test_sandbox.py -q
"""
import json
import os
import secrets
import subprocess

import pytest

import rewards
from infra import sandbox
from conftest import shared_path
from rewards import REWARDS
from infra.sandbox import run_code


ROOT = os.geteuid() == 0  # the uid switch and the private mount/network namespaces need root (see sandbox.py)


def read_jsonl(*parts):
    with open(shared_path(*parts)) as f:
        return [json.loads(line) for line in f]



def processes():
    """pid -> (real uid, parent pid, command line) of every process, zombies included."""
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                table[int(pid)] = (int(fields["Uid"].split()[0]), int(fields["PPid"]), f.read())
        except (OSError, KeyError, ValueError):
            continue
    return table


@pytest.fixture
def no_leftovers(monkeypatch):
    """Pins the sandbox uid of this test, then fails it if a process of that uid (live or zombie) or one of our
    supervisor children survives. Pinning keeps concurrent test runs on the same machine out of the count."""
    first, count = sandbox._SANDBOX_UIDS
    uid = first + secrets.randbelow(count)
    monkeypatch.setattr(sandbox, "_SANDBOX_UIDS", (uid, 1))
    yield
    flag = sandbox._SANDBOX_FLAG.encode()
    left = {pid: info for pid, info in processes().items()
            if info[0] == uid or (info[1] == os.getpid() and flag in info[2])}
    assert not left, f"sandbox processes left behind: {left}"


@pytest.mark.parametrize("program, tests, expected, timeout", [
    ("def f(x):\n    return x + 1", ["assert f(1) == 2", "assert f(2) == 4"], 0.5, 5.0),
    ("while True: pass", ["assert True"], 0.0, 1.0),
    ("import time\ntime.sleep(100)", ["assert True"], 0.0, 1.0),
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", ["assert True"], 0.0, 1.0),
    ("x = bytearray(8 * 1024**3)", ["assert True"], 0.0, 5.0),
    ("x = []\nwhile True:\n    x.append(bytearray(10**7))", ["assert True"], 0.0, 1.0),
    ("print('x' * 10**8)", ["assert True"], 1.0, 5.0),  # goes to /dev/null, never through our memory
    ("open('big', 'w').write('x' * 10**8)", ["assert True"], 0.0, 5.0),  # RLIMIT_FSIZE
    ("import os, time\nif os.fork() == 0:\n    time.sleep(100)", ["assert True"], 1.0, 5.0),  # background child
    ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)", ["assert True"], 1.0, 5.0),
    ("import os\nos._exit(0)", ["assert True"], 0.0, 5.0),  # exiting early is not passing
    ("import sys\nsys.exit(0)", ["assert True"], 0.0, 5.0),
    ("def f():\n    while True: pass", ["f()", "assert True", "assert False"], 1 / 3, 1.0),  # one hang, others run
    ("def f(n): return f(n + 1)\nf(0)", ["assert True"], 0.0, 5.0),
    ("x = 1\x00", ["assert True"], 0.0, 5.0),
    ("syntax error(", ["assert True"], 0.0, 5.0),
])
def test_sandbox_hostile_programs(program, tests, expected, timeout, no_leftovers, monkeypatch):
    """Each test is ended by the supervisor at its own timeout, never by run_code's backstop kill."""
    backstop = []
    kill = sandbox._kill_everything
    monkeypatch.setattr(sandbox, "_kill_everything", lambda *a: (backstop.append(a), kill(*a)))
    assert run_code(program, tests, timeout=timeout) == pytest.approx(expected)
    assert not backstop


def test_sandbox_cannot_see_parent_environment(monkeypatch, no_leftovers):
    monkeypatch.setenv("MASKGRPO_TEST_SECRET", secrets.token_hex(8))
    program = ("import os\nseen = str(dict(os.environ))\n"
               f"for pid in (os.getppid(), {os.getpid()}):\n"
               "    try:\n        seen += open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace')\n"
               "    except OSError:\n        pass\n")
    assert run_code(program, ["assert 'PATH' in seen"]) == 1.0  # the probe itself ran
    leaked = run_code(program, ["assert 'MASKGRPO_TEST_SECRET' in seen"])
    # without root the sandbox shares our uid, so /proc/<our pid>/environ stays readable (see run_code)
    assert leaked == 0.0 or not ROOT


@pytest.mark.skipif(not ROOT, reason="writes outside the sandbox dir are only blocked as root (uid switch + tmpfs)")
def test_sandbox_cannot_write_outside(tmp_path, no_leftovers):
    token = secrets.token_hex(6)
    targets = [f"/tmp/x_outside_{token}", f"/dev/shm/x_outside_{token}", f"/var/tmp/x_outside_{token}",
               os.path.join(os.getcwd(), f"x_outside_{token}"), str(tmp_path / f"x_outside_{token}")]
    program = "import os\n" + "".join(
        f"try:\n    open({path!r}, 'w').write('x')\nexcept OSError:\n    pass\n" for path in targets)
    program += f"for up in ('../x_outside_{token}', '../../x_outside_{token}'):\n" \
               "    try:\n        open(up, 'w').write('x')\n    except OSError:\n        pass\n" \
               "open('inside', 'w').write('x')\n"
    try:
        assert run_code(program, ["assert open('inside').read() == 'x'"]) == 1.0  # its own dir works
        assert not [path for path in targets if os.path.exists(path)]
    finally:  # should the sandbox ever fail, do not leave litter in the project or /tmp
        for path in filter(os.path.exists, targets):
            os.remove(path)


@pytest.mark.skipif(not ROOT, reason="the private network namespace needs root (unprivileged: user namespaces)")
def test_sandbox_has_no_network(no_leftovers):
    # /proc/self/net/dev lists the interfaces of the reader's network namespace: ours has eth0 and more
    program = "ifaces = [line.split(':')[0].strip() for line in open('/proc/self/net/dev').readlines()[2:]]"
    assert run_code(program, ["assert ifaces == ['lo']"]) == 1.0


def test_mbpp_reference_solutions_pass(no_leftovers):
    rows = read_jsonl("data", "mbpp.jsonl")[:5]
    for row in rows:
        assert run_code(row["code"] + "\n" + row["test_setup_code"], row["test_list"]) == 1.0, row["task_id"]
    wrong = [run_code(rows[i]["code"], rows[i + 1]["test_list"]) for i in range(4)]  # another task's tests
    assert all(score < 1.0 for score in wrong)
    row = {"test_list": ["assert f(2) == 4"]}
    assert REWARDS["mbpp"]("```python\ndef f(x):\n    return 2 * x\n```", row) == 1.0
    assert REWARDS["mbpp"]("I cannot help with that.", row) == 0.0


@pytest.mark.parametrize("tests, timeout, memory_mb", [
    ("assert True", 1.0, 512), ([], 1.0, 512), ([1], 1.0, 512), (["assert True"], 0, 512), (["assert True"], 1.0, 8),
])
def test_run_code_bad_config_raises(tests, timeout, memory_mb):
    with pytest.raises(ValueError):
        run_code("x = 1", tests, timeout=timeout, memory_mb=memory_mb)


def test_supervisor_runs_sandbox_py_and_rewards_reexports_run_code(monkeypatch, no_leftovers):
    commands, popen = [], subprocess.Popen

    def spy(args, **kwargs):
        commands.append(args)
        return popen(args, **kwargs)

    monkeypatch.setattr(sandbox.subprocess, "Popen", spy)
    assert rewards.run_code is run_code  # the API: rewards.run_code(program, tests, timeout)
    assert rewards.run_code("x = 1", ["assert x == 1"], 5.0) == 1.0
    assert commands[0][-2:] == [os.path.abspath(sandbox.__file__), "--sandbox-supervisor"], commands


# -----------------------------------------------------------------------------
# Several slow-but-passing tests in one infra/sandbox.run_code call: each test gets its own timeout, one after
# the other, so the call may take up to the sum of them; the backstop that kills a wedged supervisor must
# allow at least that sum (a backstop of one test's timeout would fail every test after the first).


def test_slow_passing_tests_all_pass_in_one_call():
    """3 tests of 0.5 s each at a 1 s timeout: 1.5 s in all, every one passes."""
    tests = ["import time; time.sleep(0.5)"] * 2 + ["import time; time.sleep(0.5); assert f() == 1"]
    assert run_code("def f(): return 1", tests, timeout=1.0) == 1.0


def test_the_backstop_allows_every_test_its_timeout(monkeypatch):
    """The wait for the supervisor (Popen.communicate's timeout) is at least the sum of the per-test
    timeouts, read from the real call; 10 quick tests at the default 5 s: at least 50 s."""
    seen, real = [], subprocess.Popen.communicate

    def spy(self, input=None, timeout=None):
        seen.append(timeout)
        return real(self, input, timeout)
    monkeypatch.setattr(subprocess.Popen, "communicate", spy)
    assert run_code("x = 1", ["assert x == 1"] * 10) == 1.0
    assert run_code("x = 1", ["assert x == 1"] * 3, timeout=20.0) == 1.0
    assert len(seen) == 2 and seen[0] >= 10 * 5.0 and seen[1] >= 3 * 20.0


def test_a_test_may_compute_for_its_whole_timeout(tmp_path):
    """The CPU-time limit a worker sets on itself (sandbox._isolate, the one call into its internals) is at
    least the test's timeout, so a test that computes rather than sleeps is not cut short: read in a forked
    child, which applies the limits and reports them through a pipe."""
    import os
    import resource

    from infra import sandbox
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            sandbox._isolate(str(tmp_path), None, 7.0, 512, None)
            os.write(write, str(resource.getrlimit(resource.RLIMIT_CPU)[0]).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert int(os.read(read, 100) or -1) >= 7
