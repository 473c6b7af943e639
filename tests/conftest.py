"""Shared test fixtures.

The LLaDA reference checkpoint ships in tests/fixtures/tiny-llada (REFERENCE), so every clone runs the
equivalence tests. The real benchmark files live in a `../shared` folder beside the project in development
and CI; a user who cloned the project alone does not have it, so tests that need it skip with a reason.
With MASKGRPO_REQUIRE_SHARED=1 (set by .ci/run) a missing file fails the test instead."""
import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

# Under pytest-xdist (`-n 2`) each worker is its own process: one thread each, unless OMP_NUM_THREADS says
# otherwise, so that two workers on two cores do not run four OpenMP threads that wait on each other.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    import torch
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED = Path(os.environ.get("MASKGRPO_SHARED", ROOT.parent / "shared"))
REFERENCE = ROOT / "tests" / "fixtures" / "tiny-llada"


def shared_path(*parts: str) -> Path:
    """Path inside ../shared, or skip the calling test when it is absent."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        if os.environ.get("MASKGRPO_REQUIRE_SHARED") == "1":
            pytest.fail(f"{p} not found, and MASKGRPO_REQUIRE_SHARED=1 forbids skipping")
        pytest.skip(f"{p} not found (the ../shared folder ships with the dev/CI checkout only)")
    return p


class OverBudget(BaseException):
    """Raised into code under test by cpu_budget; a BaseException so that the code's own `except Exception`
    (a parser that turns any error into "no value") cannot swallow it."""


@contextlib.contextmanager
def cpu_budget(seconds: float):
    """Fail the block when this process spends more than `seconds` of CPU time in it: a hang guard that
    load from other processes cannot trip, as a wall-clock limit can on a shared 2-core machine (CPU
    time of child processes is not counted)."""
    def over(signum, frame):
        raise OverBudget(f"more than {seconds} s of CPU time: a hang?")

    previous = signal.signal(signal.SIGPROF, over)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


@pytest.fixture(scope="session")
def smoke_sft_run(tmp_path_factory):
    """One finished smoke run with no RL steps (out_dir with sft/ and final/, the same weights), trained once
    per test process and shared by the modules that need a small trained model but do not test SFT itself.
    Tests must not write into it: pass it as --sft_dir or --init_from, or copy it."""
    import train
    out = tmp_path_factory.mktemp("smoke-sft")
    train.main(["--preset=smoke", f"--out_dir={out}", "--threads=1", "--rl_steps=0", "--eval_prompts=1"])
    return out


@pytest.fixture(scope="module")
def undrawn_figures():
    """matplotlib figures built but saved as a 1-pixel PNG, for modules whose runs finish but which test something
    else: laying out and rendering curves.png costs 0.3-0.5 s of CPU a run. The figure is still built by
    infra/plots.py (every call it makes but the drawing); tests/test_plots.py and test_report.py draw real ones.
    Module-scoped, so that it covers the module's own fixtures (use it as the module's pytestmark)."""
    from matplotlib.figure import Figure
    from PIL import Image

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, "savefig", lambda self, fname, **kw: Image.new("RGB", (1, 1)).save(fname))
        yield


def run_main(args: list[str], monkeypatch) -> int:
    """`python ARGS` in the project's root (a file of the project, or -m and a module, then its arguments) run in
    this process: the entry point's __main__ block without an interpreter's start (1-2 s of CPU, importing torch).
    Its exit status as the interpreter gives it: 0 at the block's end; a message passed to sys.exit goes to
    stderr, 1."""
    import runpy
    import warnings

    module = args[1] if args[0] == "-m" else None
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [module or args[0], *args[2 if module else 1:]])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before it ran as __main__
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(args[0], run_name="__main__")  # sys.argv[0] is args[0], as for the command
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    return 0
