"""Fast siblings of slow checks of a behaviour, so that the suite a developer runs after every change sees it:

- Signals (the slow tests/test_signals.py runs them on a trained model): train.py as the command line runs it,
  from a tiny --init_from model, in two short-lived child processes. A Ctrl-C pressed twice in a long RL step
  aborts at once (exit 130) naming what is lost and a command; that command, run, continues from the kept
  checkpoint, and SIGHUP during its long step stops like SIGTERM (the step finishes, a checkpoint, exit
  128 + 1, the same command printed), with every step logged once.
- FSDP2's reduction settings (the slow two-process tests/test_distributed.py shows their effect): infra/scale.shard
  on a model in a one-rank gloo group, read off the wrapped modules: one unit per block and the root, gradients
  summed over ranks (a SUM op, divide factor 1) in float32, computing in the compute dtype, inputs not cast;
  and the wrapped model's gradient equals the plain model's.

    OMP_NUM_THREADS=1 python -m pytest tests/test_fast_siblings.py -q
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tasks
import train
from infra import budget, checkpoint, load, scale, toy
from model import Transformer
from test_rl_step import save_tiny_checkpoint
from test_signals import printed_command, read_until

ROOT = Path(__file__).resolve().parents[1]

# train.py as the command line runs it; RL step SLOW_STEP waits (a large model's step) until the file GO exists;
# a second signal counts as a new one after REPEAT_WINDOW seconds (5 in train.py; shorter here).
WRAPPER = """
import os, sys, time
from pathlib import Path
sys.argv[0] = "train.py"
import train
from infra import checkpoint, cli, scale
checkpoint.REPEAT_WINDOW = float(os.environ["REPEAT_WINDOW"])
real, slow, go = train.rl_step, int(os.environ["SLOW_STEP"]), Path(os.environ["GO"])
def rl_step(model, ref, opt, ctx, step, prompts):
    if step == slow:
        print("slow step begins", flush=True)
        for _ in range(1200):
            if go.exists():
                break
            time.sleep(0.05)
    return real(model, ref, opt, ctx, step, prompts)
train.rl_step = rl_step
with scale.process_exit(), cli.user_errors():
    train.main()
"""
REPEAT = 1.0


def spawn(args, go: Path, slow_step=-1):
    env = dict(os.environ, OMP_NUM_THREADS="1", SLOW_STEP=str(slow_step), GO=str(go), REPEAT_WINDOW=str(REPEAT))
    return subprocess.Popen([sys.executable, "-c", WRAPPER, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(p, timeout=120) -> str:
    try:
        rest, _ = p.communicate(timeout=timeout)
    finally:
        p.kill()
    return rest


def test_a_second_ctrl_c_names_a_command_that_continues_and_sighup_stops_it(tmp_path):
    model, out = save_tiny_checkpoint(tmp_path / "model"), tmp_path / "run"
    args = ["--preset=smoke", "--threads=1", "--sample_every=0", "--eval_prompts=0", "--tasks=text", "--rl_steps=4",
            "--checkpoint_every=1", f"--init_from={model}", f"--out_dir={out}"]
    step1 = out / "checkpoints" / "step-00000001"

    # 1. Ctrl-C during a long step 1, then Ctrl-C again: exit 130 at once, step 1 lost, step-1 (after step 0) kept
    p = spawn(args, tmp_path / "never", slow_step=1)
    text = read_until(p, "slow step begins")
    p.send_signal(signal.SIGINT)
    text += read_until(p, "caught SIGINT")
    time.sleep(REPEAT + 0.5)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    text += finish(p)
    assert p.returncode == 130 and time.monotonic() - t0 < 30, text  # at once: the step never finished
    first = next(line for line in text.splitlines() if line.startswith("caught SIGINT"))
    assert "finishing this step" in first and "a second signal" in first, first
    assert f"step 1 would be lost and the run would continue from {step1}" in first, first
    assert f"aborted by a second SIGINT during RL step 1: step 1 is lost; {step1} is kept" in text, text
    assert "Traceback" not in text and "interrupted (Ctrl-C)" not in text, text
    assert checkpoint.latest(out) == step1
    command = printed_command(text, "aborted by a second SIGINT")
    assert command == args + ["--resume=true"], command

    # 2. that command continues from step-1; SIGHUP during its long step 2: the step finishes, checkpoint step-3,
    # exit 128 + 1, and the same command (shown to continue in 2) is printed
    go = tmp_path / "go"
    p = spawn(command, go, slow_step=2)
    text = read_until(p, "slow step begins")
    assert f"resumed from {step1} at step 1" in text, text
    p.send_signal(signal.SIGHUP)
    text += read_until(p, "caught SIGHUP")
    go.touch()
    text += finish(p)
    assert p.returncode == 128 + signal.SIGHUP, text
    assert "caught SIGHUP: finishing this step" in text and "stopped by SIGHUP after step 2" in text, text
    assert checkpoint.latest(out).name == "step-00000003" and not (out / "run.pid").exists(), text
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert printed_command(text, "stopped by SIGHUP") == args + ["--resume=true"]


# -----------------------------------------------------------------------------
# FSDP2's settings, in one process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist
    assert not dist.is_initialized(), "another test left a process group behind"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_model():
    tok = toy.build_tokenizer()
    cfg = train.parse_args(["--preset=smoke"])
    m = Transformer(budget.scratch_config(cfg, **tasks.model_config_overrides(tok)))
    m.init_weights(torch.Generator().manual_seed(0))
    return m


def loss_of(m):
    x = torch.arange(24).reshape(2, 12) % 50
    return m(x).float().log_softmax(-1)[..., 3].mean()


def test_fsdp2_sums_gradients_in_float32(one_rank_group, monkeypatch):
    from torch.distributed.fsdp import FSDPModule
    plain = tiny_model()
    wrapped = tiny_model()
    with monkeypatch.context() as m:  # the wrap train.py uses under torchrun (scale.shard is the identity at world 1)
        m.setattr(scale, "world", lambda: 2)
        scale.shard(wrapped, compute_dtype=torch.float32)
    units = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]
    assert units[0] is wrapped and set(units[1:]) == set(wrapped.blocks) and len(units) == len(wrapped.blocks) + 1
    for unit in units:
        groups = unit._get_fsdp_state()._fsdp_param_groups
        assert len(groups) == 1
        for g in groups:
            assert g.gradient_divide_factor == 1.0  # the sum over ranks, not their mean
            assert g.force_sum_reduction_for_comms is True  # a SUM op on every backend (gloo's AVG summed)
            assert g.mp_policy.reduce_dtype == torch.float32 and g.mp_policy.param_dtype == torch.float32
            assert g.mp_policy.cast_forward_inputs is False  # float32 RoPE tables reach the blocks uncast
    # one rank: the summed gradient is this rank's, the plain model's
    loss_of(plain).backward()
    loss_of(wrapped).backward()
    got = {n: p.grad.full_tensor() for n, p in wrapped.named_parameters()}
    for n, p in plain.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7)
    assert any(p.grad.abs().max() > 0 for p in plain.parameters())
    # a forward without gradient leaves the root sharded (its parameters the optimizer's DTensors)
    with torch.no_grad():
        loss_of(wrapped)
    assert all(type(p).__name__ == "DTensor" for p in wrapped.parameters())
