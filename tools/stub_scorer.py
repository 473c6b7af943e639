"""A model-free stand-in for the image reward server, to try the geneval pipeline without any model.

    python -m tools.stub_scorer --port 8765      # then: train.py ... --image_scorer_url=http://127.0.0.1:8765

It answers infra/sandbox.py's protocol (RemoteScorer) with a rule simple enough to check by hand: the fraction of
distinct codes in each image. Standard library only.
"""
from __future__ import annotations

import argparse
import http.server
import json
import sys
import threading


def stub_score(codes: list[int]) -> float:
    """The stub's rule: the fraction of distinct codes, 0.0 for none; [3, 3, 5, 1] -> 0.75, [7] * 16 -> 0.0625."""
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
    """Start the stub scorer on host:port (0: a free one, server.server_address[1]) in a daemon thread; stop it
    with server.shutdown() then server.server_close()."""
    server = http.server.ThreadingHTTPServer((host, port), handler)
    # shutdown() waits for the serving loop's next poll: 0.05 s instead of the default 0.5 s keeps tests quick
    threading.Thread(target=server.serve_forever, args=(0.05,), name="stub-scorer", daemon=True).start()
    return server


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Serve the stub image scorer for RemoteScorer (no models needed)")
    cli.add_argument("--port", type=int, default=8765)
    cli.add_argument("--host", default="127.0.0.1", help="0.0.0.0 lets other machines reach it")
    args = cli.parse_args()
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
