"""A rank that fails ends every rank promptly, also where its peers cannot see it go (NCCL).

On gloo a rank blocked in a collective sees its peer's connection close and fails at once. On NCCL it does
not: it waits in the collective (or in the CUDA sync behind it) until torchrun SIGKILLs it, 30 s after a
SIGTERM it cannot act on (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, minutes with the pre-emption advice). infra/scale.py
has the failing rank write to torchrun's store and every rank watch it. Here rank 0 stands for such a peer:
blocked in one long call that releases the GIL, with train.py's kind of SIGTERM handler (a flag, no exit), so
nothing but the watcher can end it before the kill. What only a GPU can show, and none has yet: that a rank
blocked in an NCCL collective (or the CUDA sync behind it) releases the GIL as this sleep does, so that its
watcher runs.

    python -m pytest tests/test_peer_failure.py -q
"""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCKED_PEER = """
import signal, sys, time
sys.path.insert(0, {root!r})
import torch
from infra import scale
with scale.process_exit():
    scale.init("cpu")
    scale.all_sum(torch.ones(3))
    if scale.rank() == 1:
        time.sleep(1.0)
        print(f"raised at {{time.time()}}", flush=True)
        raise RuntimeError("rank 1 failed")
    signal.signal(signal.SIGTERM, lambda *_: None)  # as train.py's graceful stop: a flag, no exit
    time.sleep(300)                                 # blocked, and told nothing of rank 1
"""


def test_a_failing_rank_ends_a_peer_that_cannot_see_it(tmp_path):
    script = tmp_path / "blocked_peer.py"
    script.write_text(BLOCKED_PEER.format(root=str(ROOT)))
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="60")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ended = time.time()
    assert p.returncode == 1 and "RuntimeError: rank 1 failed" in p.stderr, p.stderr[-3000:]
    assert "rank 0: ending, because rank 1 failed (its error is above)" in p.stderr, p.stderr[-3000:]
    raised = float(p.stdout.split("raised at ")[1].split()[0])
    # the watcher reads the store every second; torchrun's kill would come 60 s after its SIGTERM
    assert ended - raised < 10, ended - raised
