"""Image rewards from a remote scorer: MMaDA's CLIP / HPS / UnifiedReward models run elsewhere, behind HTTP.

MaskGRPO's text-to-image rewards (the paper's image experiments) need models this project cannot ship, so the trainer
POSTs each rollout batch to a reward server. Standard library only (urllib, http.server).

    scorer = RemoteScorer("http://127.0.0.1:8765")          # train.py --image_scorer_url
    scorer(["three green blocks"], [[3, 3, 5, 1]])          # -> [0.75]
    python -m infra.scorer --stub --port 8765                     # a model-free stand-in server

Test: python -m pytest tests/test_scorer.py -q
"""
from __future__ import annotations

import argparse
import http.client
import http.server
import json
import math
import operator
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

# -----------------------------------------------------------------------------------------------------
# protocol
#
# One POST per call, JSON both ways, one row per image:
#   request  {"prompts": ["three green blocks", ...], "image_codes": [[3, 3, 5, 1, ...], ...]}
#   reply    {"scores": [0.75, ...]}   same length as the request, every score a finite number
# A real server decodes the VQ codes with its own image tokenizer and runs its reward models. The stub
# below answers by a rule simple enough to check by hand, so the pipeline runs without any model.

_STUB_HINT = "python -m infra.scorer --stub --port 8765, then use http://127.0.0.1:8765"


class RemoteScorer:
    """Scores text-to-image rollouts by POSTing prompts and VQ codes to a reward server (protocol above).

    scorer = RemoteScorer("http://127.0.0.1:8765");  scorer(["three green blocks"], [[3, 3, 5, 1]]) -> [0.75]
    Connection errors, timeouts, HTTP 429 and 5xx are tried again up to `retries` more times, sleeping
    backoff * 2**k seconds before the k-th retry, then raise ConnectionError; any other HTTP error raises
    RuntimeError at once, and a reply that breaks the protocol raises ValueError (a retry would not fix it).
    """

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 3, backoff: float = 1.0):
        try:
            parts = urllib.parse.urlsplit(url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        except (TypeError, ValueError, AttributeError):  # not a str, or a port that is not a number
            ok = False
        if not ok:
            raise ValueError(f"image scorer url must look like http(s)://host[:port][/path], got {url!r}; "
                             f"to try the pipeline without models: {_STUB_HINT}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"image scorer timeout must be > 0 seconds, got {timeout!r}; set "
                             "--image_scorer_timeout (default 30)")
        if not (isinstance(retries, int) and retries >= 0):
            raise ValueError(f"image scorer retries must be an int >= 0 (0 = one attempt), got {retries!r}")
        if not (isinstance(backoff, (int, float)) and backoff >= 0):
            raise ValueError(f"image scorer backoff must be >= 0 seconds, got {backoff!r}")
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    def __call__(self, prompts: list[str], image_codes: list[list[int]]) -> list[float]:
        """One score per (prompt, image); image_codes is a list of code lists or anything with .tolist()."""
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
        """The RL step's rewards, float32 (B,): the scores, or NaN for every row when the server is down, refuses or
        breaks the protocol, which train.rl_step's gathered check turns into a skipped step on every rank (a rank
        that raised alone would leave the others waiting)."""
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
        if type(score) is not float:  # bool and str are not scores
            raise ValueError(f"image scorer at {url} returned a non-numeric score {score!r} at index {i}")
        if not math.isfinite(score):
            raise ValueError(f"image scorer at {url} returned a non-finite score {score!r} at index {i}")
    return scores


def stub_score(codes: list[int]) -> float:
    """The stub server's rule: the fraction of distinct codes in the image, 0.0 for an empty one.

    [3, 3, 5, 1] -> 0.75;  [7] * 16 -> 0.0625;  list(range(16)) -> 1.0
    """
    return len(set(codes)) / len(codes) if codes else 0.0


class _StubHandler(http.server.BaseHTTPRequestHandler):
    """Answers the protocol with stub_score per image; a malformed request gets HTTP 400 and the reason."""

    def do_POST(self):
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            rows = request["image_codes"]
            if len(request["prompts"]) != len(rows):
                raise ValueError(f"{len(request['prompts'])} prompts but {len(rows)} images")
            status, reply = 200, {"scores": [stub_score(row) for row in rows]}
        except (ValueError, KeyError, TypeError) as err:
            status, reply = 400, {"error": f"{type(err).__name__}: {err}"}
        self.reply(status, reply)

    def reply(self, status: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # one line per request would drown the trainer's log
        pass


def serve_stub(port: int = 0, host: str = "127.0.0.1", handler=_StubHandler) -> http.server.ThreadingHTTPServer:
    """Start the stub scorer on host:port (port 0 picks a free one) in a daemon thread and return the server.

    The port is server.server_address[1]; server.shutdown() then server.server_close() stop it.
    """
    server = http.server.ThreadingHTTPServer((host, port), handler)
    # shutdown() waits for the serving loop's next poll: 0.05 s instead of the default 0.5 s keeps tests quick
    threading.Thread(target=server.serve_forever, args=(0.05,), name="stub-scorer", daemon=True).start()
    return server


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Serve the stub image scorer for RemoteScorer (no models needed)")
    cli.add_argument("--stub", action="store_true", help="serve the stub (the only thing this file runs)")
    cli.add_argument("--port", type=int, default=8765)
    cli.add_argument("--host", default="127.0.0.1", help="0.0.0.0 lets other machines reach it")
    args = cli.parse_args()
    if not args.stub:
        cli.error("nothing to run: pass --stub to serve the stub image scorer")
    try:
        stub = serve_stub(args.port, args.host)
    except OSError as e:  # a busy port (another stub still running), or a host this machine does not have
        print(f"error: cannot serve on {args.host}:{args.port} ({e.strerror}); stop what holds it, or pass "
              "another --port", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"stub image scorer at http://{args.host}:{stub.server_address[1]} (score = fraction of distinct "
          "codes per image); Ctrl-C stops it", flush=True)
    try:
        threading.Event().wait()  # the server runs in its thread; this one waits for Ctrl-C
    except KeyboardInterrupt:
        stub.shutdown()
