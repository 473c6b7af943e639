"""Tests for sandbox.RemoteScorer and tools/stub_scorer.py: scores come back by the stub's rule, a server that
is down fails with a clear error after the retries, 5xx is retried, and replies that break the protocol raise.

Every server runs on 127.0.0.1 on a free port in a thread of this process; tiny timeouts and backoffs keep
each test well under a second.

Run: python -m pytest tests/test_scorer.py -q
"""
import contextlib
import json
import socket
import time

import pytest

from infra import sandbox
from infra.sandbox import RemoteScorer
from tools.stub_scorer import _StubHandler, serve_stub, stub_score

PROMPTS = ["three green blocks", "a red block left of a blue block", "an empty image"]
CODES = [[3, 3, 5, 1], [7] * 16, []]


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    """A proxy set in the environment would catch requests to 127.0.0.1: keep these tests local."""
    monkeypatch.setenv("no_proxy", "127.0.0.1")


@pytest.fixture
def serve():
    """serve(handler) -> url of a server on a free port; every server is stopped after the test."""
    servers = []

    def start(handler=_StubHandler):
        servers.append(serve_stub(0, handler=handler))
        return f"http://127.0.0.1:{servers[-1].server_address[1]}/score"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def replying(status, body):
    """A handler class that answers every POST with `status` and the raw bytes `body`."""
    class Handler(_StubHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    return Handler


def test_stub_scores_follow_the_documented_rule(serve):
    scores = RemoteScorer(serve())(PROMPTS, CODES)
    assert scores == [0.75, 1 / 16, 0.0] == [stub_score(row) for row in CODES]
    assert RemoteScorer(serve())([], []) == []  # nothing to score: no request


def test_codes_may_be_numpy_rows(serve):
    np = pytest.importorskip("numpy")
    assert RemoteScorer(serve())(PROMPTS[:2], np.array([[1, 2, 2, 2], [4, 5, 6, 7]])) == [0.5, 1.0]


def test_server_down_raises_after_retries(monkeypatch):
    with socket.socket() as s:  # a port that was free a moment ago and now has no listener
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    slept = []
    monkeypatch.setattr(sandbox.time, "sleep", slept.append)
    with pytest.raises(ConnectionError, match="failed 3 attempts") as info:
        RemoteScorer(url, timeout=0.5, retries=2, backoff=0.01)(PROMPTS, CODES)
    assert url in str(info.value) and "tools.stub_scorer" in str(info.value) and "last error" in str(info.value)
    assert slept == [0.01, 0.02]  # backoff * 2**k before the k-th retry, and no other wait


def test_timeout_is_retried_then_raises(serve):
    class Slow(_StubHandler):
        def do_POST(self):
            time.sleep(0.5)
            super().do_POST()
    with pytest.raises(ConnectionError, match="failed 2 attempts"):
        RemoteScorer(serve(Slow), timeout=0.1, retries=1, backoff=0.0)(PROMPTS, CODES)


def test_500_then_200_is_retried(serve):
    calls = []

    class FlakyOnce(_StubHandler):
        def do_POST(self):
            calls.append(self.path)
            if len(calls) == 1:
                self.rfile.read(int(self.headers["Content-Length"]))
                self.reply(500, {"error": "warming up"})
            else:
                super().do_POST()
    assert RemoteScorer(serve(FlakyOnce), retries=1, backoff=0.01)(PROMPTS, CODES) == [0.75, 1 / 16, 0.0]
    assert calls == ["/score", "/score"]


def test_client_error_is_not_retried(serve):
    calls = []

    class NotFound(_StubHandler):
        def do_POST(self):
            calls.append(1)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.reply(404, {"error": "no such route"})
    with pytest.raises(RuntimeError, match="HTTP 404.*no such route"):
        RemoteScorer(serve(NotFound), retries=3, backoff=0.01)(PROMPTS, CODES)
    assert calls == [1]


@pytest.mark.parametrize("body, problem", [
    (b"<html>Bad Gateway</html>", "not JSON"),
    (b"\xff\xfe\x00", "not JSON"),
    (b"[0.5, 0.5, 0.5]", "without a 'scores' list"),
    (b'{"score": [0.5, 0.5, 0.5]}', "without a 'scores' list"),
    (b'{"scores": 0.5}', "without a 'scores' list"),
    (b'{"scores": [0.5, 0.5]}', "returned 2 scores for 3 images"),
    (b'{"scores": [0.5, 0.5, 0.5, 0.5]}', "returned 4 scores for 3 images"),
    (b'{"scores": [0.5, "0.5", 0.5]}', "non-numeric score '0.5' at index 1"),
    (b'{"scores": [0.5, 0.5, true]}', "non-numeric score True at index 2"),
    (b'{"scores": [0.5, null, 0.5]}', "non-numeric score None at index 1"),
    (b'{"scores": [NaN, 0.5, 0.5]}', "non-finite score nan at index 0"),
    (b'{"scores": [0.5, -Infinity, 0.5]}', "non-finite score -inf at index 1"),
    (b'{"scores": [0.5, 0.5, 1' + b"0" * 400 + b"]}", "non-finite score inf at index 2"),
])
def test_malformed_replies_raise_value_error(serve, body, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        RemoteScorer(serve(replying(200, body)), retries=0)(PROMPTS, CODES)


def test_integer_scores_are_accepted(serve):
    assert RemoteScorer(serve(replying(200, b'{"scores": [1, 0, 1]}')))(PROMPTS, CODES) == [1.0, 0.0, 1.0]


def test_stub_rejects_malformed_requests(serve):
    import urllib.error
    import urllib.request
    request = urllib.request.Request(serve(), data=json.dumps({"prompts": ["a"]}).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    assert info.value.code == 400 and b"image_codes" in info.value.read()
    info.value.close()


@pytest.mark.parametrize("url", ["127.0.0.1:8765", "ftp://host/x", "http://", "http://host:notaport", 8765, None])
def test_bad_url_raises(url):
    with pytest.raises(ValueError, match="image scorer url.*tools.stub_scorer"):
        RemoteScorer(url)


@pytest.mark.parametrize("kwargs", [{"timeout": 0}, {"retries": -1}, {"retries": 1.5}, {"backoff": -1.0}])
def test_bad_settings_raise(kwargs):
    with pytest.raises(ValueError, match="image scorer " + next(iter(kwargs))):
        RemoteScorer("http://127.0.0.1:8765", **kwargs)


@pytest.mark.parametrize("prompts, codes, problem", [
    (["a", "b"], [[1]], "one row per prompt"),
    ("a", [[1]], "prompts must be a list of str"),
    ([1], [[1]], "prompts must be a list of str"),
    (["a"], [[1.5]], "lists of int codes"),
    (["a"], [None], "lists of int codes"),
])
def test_bad_arguments_raise_before_any_request(prompts, codes, problem):
    # port 9 (discard) on localhost has no scorer: reaching it would fail with ConnectionError, not ValueError
    with pytest.raises(ValueError, match=problem):
        RemoteScorer("http://127.0.0.1:9", retries=0)(prompts, codes)


def test_the_timeout_is_a_flag(monkeypatch, tmp_path):
    """--image_scorer_timeout reaches the scorer train.main builds (every rank posts at once, so a busy scorer
    may need more than 30 s), and a timeout that is not > 0 is refused at the boundary, naming the flag."""
    import pytest
    import train
    from infra import run
    from infra import sandbox as scorer_module
    cfg = train.parse_args(["--preset=mmada8b", "--dry_run=true", "--image_scorer_timeout=120"])
    assert cfg.image_scorer_timeout == 120.0
    with pytest.raises(ValueError, match=r"image_scorer_timeout \(0.0\) must be > 0 seconds"):
        train.parse_args(["--preset=mmada8b", "--dry_run=true", "--image_scorer_timeout=0"])
    built = []

    class Spy(scorer_module.RemoteScorer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.timeout)
            raise SystemExit("stop after the scorer is built")

    monkeypatch.setattr(run, "RemoteScorer", Spy)
    monkeypatch.setattr(run.data, "load_data", lambda cfg: {})
    monkeypatch.setattr(run, "startup_checks", lambda cfg, device: contextlib.nullcontext())
    monkeypatch.setattr(run, "check_resume", lambda cfg: None)
    with pytest.raises(SystemExit, match="stop after the scorer"):
        train.main(["--preset=mmada8b", f"--train_data=geneval={tmp_path / 'unread.jsonl'}", "--threads=1",
                    f"--init_from={tmp_path / 'unread_model'}",
                    f"--out_dir={tmp_path / 'out'}", "--image_scorer_url=http://127.0.0.1:9",
                    "--image_scorer_timeout=7.5"])
    assert built == [7.5]
