"""Several slow-but-passing tests in one infra/sandbox.run_code call: each test gets its own timeout, one after
the other, so the call may take up to the sum of them; the backstop that kills a wedged supervisor must
allow at least that sum (a backstop of one test's timeout would fail every test after the first).

    python -m pytest tests/test_sandbox_several.py -q
"""
import subprocess

from infra.sandbox import run_code


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
