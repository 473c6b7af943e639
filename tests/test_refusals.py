"""Refusals that protect a user's files, and a scorer's failures through the path the RL step uses:

- `python -m infra.load CHECKPOINT DEST` (infra/load.main) refuses, in one line and exit 2, a DEST that is a
  file or a non-empty folder (left as it is), and a checkpoint whose starting model (--init_from) has changed
  since (nothing written); the same export succeeds once the model is back.
- RemoteScorer.rewards (what tasks.score calls for geneval): a scorer that is down, too slow, refusing
  (HTTP 4xx, not retried) or failing (5xx, retried) gives NaN for every row, never 0 and never an exception,
  and train.check_rewards then skips the step; a working scorer's scores come back as they are. Every server
  runs on 127.0.0.1 in a thread of this process, with timeouts of a fraction of a second.

    python -m pytest tests/test_refusals.py -q
"""
import math
import shutil
import socket
import time

import pytest
import torch

import train
from infra import cli, load, sandbox
from infra.sandbox import RemoteScorer
from tools.stub_scorer import _StubHandler
from test_rl_step import save_tiny_checkpoint
from test_scorer import no_proxy, serve  # noqa: F401 (fixtures: requests stay on 127.0.0.1; a stub server per test)

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels

# -----------------------------------------------------------------------------
# python -m infra.load


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step RL run from a tiny --init_from model (a folder of its own, so a test can change it) with a
    checkpoint of that step."""
    root = tmp_path_factory.mktemp("export")
    model = save_tiny_checkpoint(root / "model")
    out = root / "run"
    train.main(["--preset=smoke", "--threads=1", "--sample_every=0", "--eval_prompts=0", "--tasks=text",
                f"--init_from={model}", f"--out_dir={out}", "--rl_steps=1", "--checkpoint_every=1", "--lr=1e-2"])
    return model, out / "checkpoints" / "step-00000001"


def export(capsys, *argv) -> str:
    """infra.load's command line (its entry point wraps main in cli.user_errors): the one-line error, exit 2."""
    with pytest.raises(SystemExit) as e, cli.user_errors():
        load.main([str(a) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def tree(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_destination_that_holds_something_is_refused_and_left(trained, tmp_path, capsys):
    _, ckpt = trained
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("my notes")
    (tmp_path / "a_file").write_text("not a folder")
    for dest in (full, tmp_path / "a_file"):
        before = tree(tmp_path)
        assert f"{dest} already exists and is not an empty folder (it is left as it is)" in export(capsys, ckpt, dest)
        assert tree(tmp_path) == before


def test_a_changed_starting_model_is_refused_then_exports_once_restored(trained, tmp_path, capsys):
    model, ckpt = trained
    weights = next(model.glob("*.safetensors"))
    saved = tmp_path / "saved"
    shutil.copy2(weights, saved)
    data = weights.read_bytes()
    try:
        weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the last byte of the last tensor
        dest = tmp_path / "exported"
        err = export(capsys, ckpt, dest)
        assert f"the starting model of this run ({model}) is not the one the checkpoint was trained from" in err, err
        assert not dest.exists()
    finally:
        shutil.copy2(saved, weights)
    assert load.main([str(ckpt), str(dest)]) == dest and (dest / "config.json").is_file()


# -----------------------------------------------------------------------------
# RemoteScorer.rewards

PROMPTS = ["three green blocks", "a red block", "an empty image"]
CODES = [[3, 3, 5, 1], [7, 7, 7, 7], [1, 2, 3, 4]]


def answering(status, calls):
    class Handler(_StubHandler):
        def do_POST(self):
            calls.append(status)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.reply(status, {"error": "no"})
    return Handler


class Slow(_StubHandler):
    def do_POST(self):
        time.sleep(0.3)
        try:
            super().do_POST()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting, as it should
            pass


def down_url():
    with socket.socket() as s:  # a port that was free a moment ago and has no listener
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def assert_not_measured(r, capsys, what):
    assert isinstance(r, torch.Tensor) and r.shape == (3,) and all(math.isnan(v) for v in r.tolist()), r
    out = capsys.readouterr().out
    assert out.startswith("warning: image scorer failed (") and what in out and out.count("\n") == 1, out
    with pytest.raises(train.BadStep, match="3 geneval reward\\(s\\) not a finite number"):
        train.check_rewards(r, "geneval", 3)  # the step is skipped, on every rank (r is gathered first)


@pytest.mark.parametrize("status, attempts, what", [(400, 1, "refused the request: HTTP 400"),
                                                   (404, 1, "refused the request: HTTP 404"),
                                                   (503, 2, "failed 2 attempts")])
def test_a_refusing_or_failing_scorer_gives_nan(serve, capsys, status, attempts, what):
    calls = []
    r = RemoteScorer(serve(answering(status, calls)), timeout=2, retries=1, backoff=0.0).rewards(PROMPTS, CODES)
    assert_not_measured(r, capsys, what)
    assert calls == [status] * attempts  # 4xx is not retried, 5xx is


def test_a_scorer_that_is_down_gives_nan(monkeypatch, capsys):
    monkeypatch.setattr(sandbox.time, "sleep", lambda s: None)
    r = RemoteScorer(down_url(), timeout=0.5, retries=1, backoff=1.0).rewards(PROMPTS, CODES)
    assert_not_measured(r, capsys, "failed 2 attempts")


def test_a_slow_scorer_gives_nan(serve, capsys):
    t0 = time.monotonic()
    r = RemoteScorer(serve(Slow), timeout=0.1, retries=1, backoff=0.0).rewards(PROMPTS, CODES)
    assert time.monotonic() - t0 < 2.0
    assert_not_measured(r, capsys, "failed 2 attempts")


def test_a_working_scorer_gives_its_scores(serve, capsys):
    r = RemoteScorer(serve(), timeout=2).rewards(PROMPTS, CODES)
    assert r.dtype == torch.float32 and r.tolist() == [0.75, 0.25, 1.0]  # distinct codes / codes, by hand
    assert capsys.readouterr().out == ""
    train.check_rewards(r, "geneval", 3)
