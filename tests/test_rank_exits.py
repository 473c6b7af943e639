"""How a torchrun rank ends: scale.process_exit gives each rank Python's status and output, a rank that raises,
refuses a stale sft_dir or fails to save the SFT model ends every rank at once, scale.close never waits after an
error; a torch older than the floor is refused at start-up in one line (the torchrun tests are slow; each has a
fast sibling)."""
import errno
import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from test_distributed import ROOT, launch


PROCESS_EXIT = """
import atexit, sys, torch
from infra import scale
atexit.register(print, "interpreter teardown ran", flush=True)
with scale.process_exit():
    scale.init("cpu")
    print(f"rank {scale.rank()} worked")
    scale.all_sum(torch.ones(3))  # a collective before the way out
    if sys.argv[1] == "raise":
        raise RuntimeError(f"rank {scale.rank()} failed")
    if sys.argv[1] == "message":
        raise SystemExit(f"error: rank {scale.rank()} stops")
"""


@pytest.mark.slow
def test_process_exit_ends_every_rank_with_python_status(tmp_path):
    """Under torchrun, scale.process_exit ends each rank with the status and output Python would give it
    (0; 1 with the traceback; 1 with the message), without interpreter teardown (the atexit line never
    prints); in one process it leaves the exit to Python (the atexit line prints)."""
    script = tmp_path / "process_exit.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + PROCESS_EXIT)
    for how, status, err in (("return", 0, ""), ("raise", 1, "RuntimeError: rank 1 failed"),
                             ("message", 1, "error: rank 1 stops")):
        res = launch([how], nproc=2, script=str(script))
        assert res.returncode == status, (how, res.stdout[-3000:], res.stderr[-3000:])
        assert "rank 0 worked" in res.stdout and "rank 1 worked" in res.stdout, (how, res.stdout)
        assert err in res.stderr and "terminate called" not in res.stderr, (how, res.stderr[-3000:])
        assert "interpreter teardown ran" not in res.stdout, how
    res = launch(["message"], script=str(script))
    assert res.returncode == 1 and "error: rank 0 stops" in res.stderr
    assert "rank 0 worked" in res.stdout and "interpreter teardown ran" in res.stdout


ONE_RANK_FAILS = """
import sys, time
import torch
from infra import scale
with scale.process_exit():
    scale.init("cpu")
    scale.all_sum(torch.ones(3))
    if scale.rank() == 1:
        print(f"raised at {time.time()}", flush=True)
        raise RuntimeError("rank 1 failed")
    scale.all_sum(torch.ones(3))  # rank 0 waits in a collective that rank 1 never joins
"""


@pytest.mark.slow
def test_a_rank_that_raises_ends_every_rank_within_seconds(tmp_path):
    """Rank 1 raises while rank 0 waits in a collective: torchrun exits 1 within 10 s of the raise (with a
    collective timeout of 2 minutes, so a rank that waited for the other, at a barrier or in
    destroy_process_group, would show as a timeout), with rank 1's traceback."""
    import time
    script = tmp_path / "one_rank_fails.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + ONE_RANK_FAILS)
    os.environ["MASKGRPO_COLLECTIVE_TIMEOUT_MIN"], saved = "2", os.environ.get("MASKGRPO_COLLECTIVE_TIMEOUT_MIN")
    try:
        res = launch([], nproc=2, script=str(script))
    finally:
        os.environ.pop("MASKGRPO_COLLECTIVE_TIMEOUT_MIN") if saved is None else \
            os.environ.__setitem__("MASKGRPO_COLLECTIVE_TIMEOUT_MIN", saved)
    ended = time.time()
    assert res.returncode == 1 and "RuntimeError: rank 1 failed" in res.stderr, res.stderr[-3000:]
    raised = float(res.stdout.split("raised at ")[1].split()[0])
    assert ended - raised < 10, ended - raised


def stale_sft_dir(where: Path) -> tuple[Path, str]:
    """An SFT cache of the smoke preset whose toy data changed since (its source hash differs): (the folder, the
    refusal every rank must exit with)."""
    from infra import load
    where.mkdir()
    key = load.sft_key(train.parse_args(["--preset=smoke"])) | {"toy_sha1": "0" * 40}
    (where / "sft_meta.json").write_text(json.dumps(key))
    return where, (f"error: sft_dir {where} holds an SFT model trained with other settings: infra/toy.py or "
                   "tasks.py (the toy data or its encoding) changed; pass --retrain_sft=true to replace it, or give "
                   "this run its own --sft_dir")


@pytest.mark.slow
def test_a_stale_sft_dir_ends_every_rank_with_the_refusal(tmp_path, monkeypatch):
    """Two ranks refused a cached SFT model of other settings: each exits 2 at once with the one line (torchrun
    exits 1), none waits in a collective for the other (a 2-minute collective timeout would show as a hang)."""
    sft_dir, line = stale_sft_dir(tmp_path / "sft")
    monkeypatch.setenv("MASKGRPO_COLLECTIVE_TIMEOUT_MIN", "2")
    res = launch(["--preset=smoke", "--threads=1", f"--sft_dir={sft_dir}", f"--out_dir={tmp_path / 'out'}"], nproc=2)
    assert res.returncode == 1, res.stderr[-3000:]
    assert [s for s in res.stderr.splitlines() if s.startswith("error:")] == [line, line], res.stderr[-3000:]
    assert res.stderr.count("exitcode  : 2") == 2, res.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]  # nothing written, no out_dir made


def test_a_stale_sft_dir_is_refused_after_the_same_collectives_on_every_rank(tmp_path, monkeypatch):
    """The fast sibling: run.start as rank 0 and as rank 1 (the collectives recorded, each giving back this rank's
    value). Both refuse the stale sft_dir with the same line after the same collectives; a rank that refused
    before a collective its peer had entered would leave the peer waiting in it."""
    from infra import run, scale
    sft_dir, line = stale_sft_dir(tmp_path / "sft")
    args = ["--preset=smoke", "--threads=1", f"--sft_dir={sft_dir}", f"--out_dir={tmp_path / 'out'}"]
    seen = []
    for rank in (0, 1):
        calls = []
        monkeypatch.setattr(scale, "rank", lambda rank=rank: rank)
        monkeypatch.setattr(scale, "all_max", lambda t, calls=calls: calls.append(("all_max", t.tolist())) or t)
        monkeypatch.setattr(scale, "barrier", lambda calls=calls: calls.append("barrier"))
        with pytest.raises(ValueError) as refused:
            run.start(train.parse_args(args), args, train.sft)
        seen.append((calls, f"error: {refused.value}"))
    assert seen[0] == seen[1] == ([("all_max", [1])], line)


@pytest.mark.slow
def test_a_failed_sft_save_ends_both_torchrun_ranks_with_rank_0s_line(tmp_path):
    """Rank 0's save of the SFT model fails over a 32 KiB file-size limit (a SafetensorError, no OSError): both
    ranks exit 1 with rank 0's one line, none with a line of its own (a dead peer) or a wait in a collective."""
    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, 32 << 10))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           "--preset=smoke", "--threads=1", "--sft_steps=2", "--rl_steps=0", f"--out_dir={out}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASKGRPO_COLLECTIVE_TIMEOUT_MIN="2")
    res = subprocess.run(cmd, cwd=ROOT, env=env, preexec_fn=small_files, capture_output=True, text=True, timeout=300)
    lines = [s for s in res.stderr.splitlines() if s.startswith("error:")]
    assert res.returncode == 1 and len(lines) == 2 and lines[0] == lines[1], res.stderr[-3000:]
    assert lines[0].startswith(f"error: saving the SFT model to {out / 'sft'} failed (SafetensorError"), lines[0]
    assert res.stderr.count("exitcode  : 1") == 2, res.stderr[-3000:]


@pytest.mark.parametrize("writer_error", ["full disk", "safetensors"])
def test_a_failed_sft_save_ends_every_rank_with_rank_0s_line(tmp_path, monkeypatch, writer_error):
    """Rank 0's save of the toy SFT model fails (a full disk; a SafetensorError, no OSError): run.start as rank 0,
    then as rank 1 (out_dir as rank 1 finds it, each collective giving back the maximum of both ranks' values).
    Both end with rank 0's line after the same collectives; a rank reading the unsaved model would end with
    another, or wait for rank 0."""
    from safetensors import SafetensorError
    from infra import hf, run, scale
    out = tmp_path / "out"
    args = ["--preset=smoke", "--threads=1", f"--out_dir={out}"]

    def failing(model, path, *a, **k):
        if writer_error == "safetensors":
            raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")
        raise OSError(errno.ENOSPC, "No space left on device", str(path / "model.safetensors"))
    monkeypatch.setattr(hf, "save_pretrained", failing)
    seen, rank0 = [], []
    for rank in (0, 1):
        calls, sent = [], []

        def all_max(t, calls=calls, sent=sent):
            calls.append(("all_max", tuple(t.shape)))
            sent.append(t)
            return torch.maximum(t, rank0[len(sent) - 1]) if rank0 else t
        monkeypatch.setattr(scale, "rank", lambda rank=rank: rank)
        monkeypatch.setattr(scale, "all_max", all_max)
        monkeypatch.setattr(scale, "barrier", lambda calls=calls: calls.append("barrier"))
        with pytest.raises(Exception) as failed, run.failures_in_one_line(train.parse_args(args)):  # as train.main
            run.start(train.parse_args(args), args, lambda *a: 0.0)  # no SFT steps: the save is what matters
        seen.append((calls, f"error: {failed.value}"))
        rank0 = sent
        shutil.rmtree(out)  # rank 1 checks out_dir while rank 0 does, before rank 0 writes to it
    assert seen[0] == seen[1], seen
    line = seen[0][1]
    assert line.startswith(f"error: the disk is full (No space left on device: {out}/.sft.tmp-" if writer_error ==
                           "full disk" else f"error: saving the SFT model to {out / 'sft'} failed (SafetensorError: "
                           "Error while serializing: I/O error: File too large (os error 27)): SFT keeps no"), line
    assert "no checkpoint of this run exists" in line and f"--out_dir={out}" in line, line


def test_close_after_an_error_neither_waits_nor_destroys(monkeypatch):
    """The fast sibling: with other ranks, scale.close after an error returns at once (no barrier, no
    destroy_process_group, either of which may wait for peers stuck in a collective); a clean exit waits
    at the barrier, then destroys the group."""
    from infra import scale
    calls = []
    monkeypatch.setattr(scale, "world", lambda: 2)
    monkeypatch.setattr(scale.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(scale.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(scale.dist, "barrier", lambda **k: calls.append("barrier"))
    monkeypatch.setattr(scale.dist, "destroy_process_group", lambda: calls.append("destroy"))
    for error in (RuntimeError("a rank's own error"), KeyboardInterrupt(), SystemExit("error: bad flag")):
        try:
            raise error
        except BaseException:
            scale.close()
    assert calls == []
    try:
        raise SystemExit(143)  # a stop every rank agreed on
    except SystemExit:
        scale.close()
    assert calls == ["barrier", "destroy"]
    scale.close()  # a clean exit
    assert calls == ["barrier", "destroy"] * 2


def test_exit_status_is_pythons(capsys):
    """The status and message process_exit gives a torchrun rank are those Python gives a script."""
    from infra import scale
    assert [scale.exit_status(e) for e in (None, SystemExit(), SystemExit(0), SystemExit(143))] == [0, 0, 0, 143]
    assert scale.exit_status(KeyboardInterrupt()) == 130
    assert scale.exit_status(SystemExit("error: bad flag")) == 1
    assert capsys.readouterr().err == "error: bad flag\n"
    try:
        raise RuntimeError("deep inside")
    except RuntimeError as e:
        assert scale.exit_status(e) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("RuntimeError: deep inside\n")


def test_process_exit_in_one_process_leaves_the_exit_to_python(monkeypatch):
    from infra import scale
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with scale.process_exit():
        pass
    with pytest.raises(SystemExit, match="stop"):
        with scale.process_exit():
            raise SystemExit("stop")


def test_close_is_safe_without_a_group():
    """scale.close is a no-op in one process and after --dry_run (no group), and may be called twice."""
    from infra import scale
    scale.close()
    try:
        raise RuntimeError("a rank's own error")
    except RuntimeError:
        scale.close()


def test_torch_older_than_the_floor_is_refused_in_one_line():
    """torchrun runs need FSDPModule.set_reshard_after_forward (torch >= 2.8, the floor in pyproject.toml):
    an older torch is refused at start-up with one line, the installed one passes."""
    from torch.distributed.fsdp import FSDPModule
    from infra import scale
    for old in ("2.6.0", "2.7.1+cu126"):
        with pytest.raises(ValueError, match=rf"torch {re.escape(old)} is too old for torchrun runs: FSDP2 needs "
                                             r"torch >= 2.8"):
            scale.check_torch(old)
    scale.check_torch("2.8.0+cu128")
    scale.check_torch()
    assert hasattr(FSDPModule, "set_reshard_after_forward")
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert tuple(map(int, floor.split("."))) == scale.MIN_TORCH
