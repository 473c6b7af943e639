"""Reliability: kill a run anywhere and resume it bit-identically; same seed, same log;
non-finite losses and rewards skipped, counted and, when they persist, stopped; SIGTERM writes a
checkpoint; every user-facing input error has its message.

    python -m pytest tests/test_resume.py -q        # ~1 min on 2 CPU cores (the subprocess kill / SIGTERM /
                                                    # torchrun tests are marked slow: CI runs them)
"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infra import checkpoint
import grpo
import tasks
import train
from model import Transformer
from infra import hf

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels


ROOT = Path(__file__).resolve().parents[1]
RUN = ["--preset=smoke", "--threads=1", "--sample_every=0", "--rl_steps=6", "--checkpoint_every=1", "--keep_last=2"]


@pytest.fixture(scope="module")
def sft_dir(smoke_sft_run):
    """One SFT model shared by every run below (the SFT stage is not what is being tested)."""
    return smoke_sft_run / "sft"


# train.py as its own __main__, SIGKILLed once checkpoint 3's tensors and state.json are written, before the rename
KILL_IN_CHECKPOINT_3 = """
import os, runpy, signal, sys
from infra import checkpoint
fsync_tree = checkpoint.fsync_tree
def dying(path, entries_only=False):
    if path.name == "step-00000003.tmp":
        os.kill(os.getpid(), signal.SIGKILL)
    fsync_tree(path, entries_only)
checkpoint.fsync_tree = dying
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def spawn(args, script=("train.py",)):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, *script, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def weights(path):
    return dict(hf.from_pretrained(path).named_parameters())


@pytest.mark.slow
def test_killed_anywhere_resumes_bit_identical(sft_dir, tmp_path):
    """SIGKILL (1) in the middle of writing checkpoint 3, (2) in the middle of step 5, (3) during the
    held-out evaluation right after a resume; each time --resume=true continues, and the final weights
    and log.jsonl equal those of an uninterrupted run bit for bit."""
    base = RUN + [f"--sft_dir={sft_dir}"]
    ref = tmp_path / "uninterrupted"
    train.main(base + [f"--out_dir={ref}"])

    out = tmp_path / "killed"
    args = base + [f"--out_dir={out}"]
    # (1) the process kills itself after the tensors of checkpoint 3 are written, before the rename
    p = spawn(args, ("-c", KILL_IN_CHECKPOINT_3))
    p.communicate(timeout=600)
    assert p.returncode == -signal.SIGKILL
    assert (out / "checkpoints" / "step-00000003.tmp").is_dir()
    assert checkpoint.latest(out).name == "step-00000002"  # the half-written one is never chosen
    # (2) killed from outside while it runs step 5. The run is told to go on far beyond step 6 and to
    # keep every checkpoint, so however late the kill lands on a loaded machine it lands mid-run; any
    # checkpoint newer than step 4 is then removed (resuming from any complete checkpoint must give the
    # same result), so (3) resumes at step 3 or 4 (the kill may land while checkpoint 4 is written).
    p = spawn(args + ["--resume=true", "--rl_steps=1000", "--keep_last=0"])
    for line in p.stdout:
        if line.startswith("step 3/"):  # 0-based: printed once 4 steps are done
            p.kill()
            break
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert not any(d.name.endswith(".tmp") and d.name.startswith("step-00000003")
                   for d in (out / "checkpoints").iterdir())  # the next save cleaned the leftover
    for d in checkpoint.complete(out):
        if int(d.name.removeprefix(checkpoint.PREFIX)) > 4:
            shutil.rmtree(d)
    assert checkpoint.latest(out).name in ("step-00000003", "step-00000004")
    # (3) killed as soon as it says it resumed (during the first rollouts; if the kill came late, the
    # run may even have finished, which the last resume below handles too)
    p = spawn(args + ["--resume=true"])
    for line in p.stdout:
        if line.startswith("resumed from"):
            p.kill()
            break
    p.wait(timeout=60)
    # and finally to the end
    p = spawn(args + ["--resume=true"])
    text, _ = p.communicate(timeout=600)
    assert p.returncode == 0, text[-3000:]
    assert "resumed from" in text

    a, b = weights(ref / "final"), weights(out / "final")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (ref / "log.jsonl").read_text() == (out / "log.jsonl").read_text()
    assert json.loads((ref / "summary.json").read_text())["image"] == json.loads((out / "summary.json").read_text())["image"]
    assert len(checkpoint.complete(out)) == 2  # keep_last


@pytest.mark.slow  # two runs
def test_same_seed_same_log(sft_dir, tmp_path):
    args = ["--preset=smoke", "--threads=1", "--sample_every=0", f"--sft_dir={sft_dir}", "--rl_steps=2"]
    train.main(args + [f"--out_dir={tmp_path / 'a'}"])
    train.main(args + [f"--out_dir={tmp_path / 'b'}"])
    assert (tmp_path / "a" / "log.jsonl").read_text() == (tmp_path / "b" / "log.jsonl").read_text()


@pytest.mark.slow
def test_sigterm_writes_checkpoint_and_resumes(sft_dir, tmp_path):
    """SIGTERM after step 2 (the run is set to 1000 steps, so the signal arrives mid-run however slow the
    machine): the step finishes, a checkpoint is written, exit status 128 + 15; a resume continues."""
    out = tmp_path / "term"
    args = RUN + [f"--sft_dir={sft_dir}", f"--out_dir={out}", "--checkpoint_every=0"]
    p = spawn(args + ["--rl_steps=1000"])
    for line in p.stdout:
        if line.startswith("step 1/"):  # 0-based: printed once 2 steps are done
            p.send_signal(signal.SIGTERM)
            break
    text = p.stdout.read()
    p.wait(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, text
    assert "stopped by SIGTERM" in text and "--resume=true" in text
    state = json.loads((checkpoint.latest(out) / "state.json").read_text())
    assert 2 <= state["step"] < 1000
    p = spawn(args + ["--resume=true", f"--rl_steps={state['step'] + 1}"])
    text, _ = p.communicate(timeout=600)
    assert p.returncode == 0 and f"resumed from {checkpoint.latest(out)}" in text


def inject(monkeypatch, reward_steps=(), loss_steps=()):
    """NaN rewards from the reward function during RL steps `reward_steps`, NaN losses in `loss_steps`."""
    now = {"step": None}
    rl_step, score, policy_loss = train.rl_step, tasks.score, grpo.policy_loss

    def rl_step_(model, ref, opt, ctx, step, prompts):
        now["step"] = step
        try:
            return rl_step(model, ref, opt, ctx, step, prompts)
        finally:
            now["step"] = None

    def score_(b, *args, **kw):
        r = score(b, *args, **kw)
        return torch.full_like(r, math.nan) if now["step"] in reward_steps else r

    def policy_loss_(*args, **kw):
        loss, stats = policy_loss(*args, **kw)
        return (loss * math.nan, stats) if now["step"] in loss_steps else (loss, stats)

    monkeypatch.setattr(tasks, "score", score_)
    monkeypatch.setattr(grpo, "policy_loss", policy_loss_)
    monkeypatch.setattr(train, "rl_step", rl_step_)


def test_nan_reward_and_loss_are_skipped_and_logged(sft_dir, tmp_path, monkeypatch, capsys):
    inject(monkeypatch, reward_steps={1}, loss_steps={2})
    out = tmp_path / "nan"
    train.main(RUN + [f"--sft_dir={sft_dir}", f"--out_dir={out}", "--max_bad_steps=3"])
    logs = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines()]
    assert [l["step"] for l in logs] == list(range(6))
    assert "not a finite number in [0, 1]" in logs[1]["bad_reward"] and "text/loss" not in logs[1]
    assert logs[2]["skipped_updates"] == 2 and logs[3]["skipped_updates"] == 0  # both mu updates of step 2
    assert [l["bad_steps"] for l in logs] == [0, 1, 2, 2, 2, 2]
    text = capsys.readouterr().out
    # The console counts steps and updates from 0, as log.jsonl does.
    assert "warning: step 1 skipped" in text and "warning: step 2: 2 of 2 updates skipped for a non-finite loss" in text
    # The skipped steps left the weights finite.
    assert all(torch.isfinite(p).all() for p in weights(out / "final").values())


def test_persistent_failures_stop_the_run(sft_dir, tmp_path, monkeypatch):
    inject(monkeypatch, reward_steps={2, 4}, loss_steps={3})
    out = tmp_path / "stop"
    # Checkpoints after steps 3 and 4 were written during the bad streak: the last good one is step 2's.
    with pytest.raises(train.TrainingStopped, match=r"3 consecutive bad steps .* stopping at step 4\. Last good "
                                                    r"checkpoint: .*step-00000002;"):
        train.main(RUN + [f"--sft_dir={sft_dir}", f"--out_dir={out}", "--max_bad_steps=3"])
    logs = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines()]
    assert [l["bad_steps"] for l in logs] == [0, 0, 1, 2, 3]
    # keep_last=2 rotated step 1 away but kept the last good checkpoint beside the two newest.
    assert [p.name for p in checkpoint.complete(out)] == ["step-00000002", "step-00000003", "step-00000004"]


@pytest.mark.slow
def test_resume_at_another_world_size(sft_dir, tmp_path):
    """A checkpoint written by 2 FSDP2 processes resumes in one process (DCP reshards) and ends where a
    single-process run ends, to float32 rounding."""
    base = ["--preset=smoke", "--threads=1", "--sample_every=0", f"--sft_dir={sft_dir}", "--checkpoint_every=1"]
    one = tmp_path / "one"
    train.main(base + [f"--out_dir={one}", "--rl_steps=3"])
    two = tmp_path / "two"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "train.py", *base, f"--out_dir={two}", "--rl_steps=2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    summary = train.main(base + [f"--out_dir={two}", "--rl_steps=3", "--resume=true", "--extend=true"])
    a, b = weights(one / "final"), weights(two / "final")
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6), name
    assert summary["image"]["before"] == pytest.approx(json.loads((one / "summary.json").read_text())["image"]["before"])


def _with_checkpoint(out, sft_dir):
    train.main(["--preset=smoke", "--threads=1", "--sample_every=0", f"--sft_dir={sft_dir}", f"--out_dir={out}",
                "--rl_steps=1", "--checkpoint_every=1", "--eval_prompts=1"])


def _tamper_reference(out, sft_dir):
    _with_checkpoint(out, sft_dir)
    state_file = checkpoint.latest(out) / "state.json"
    state = json.loads(state_file.read_text())
    state["reference"] = {"init_from": "/somewhere/else", "sha1": "0"}
    state_file.write_text(json.dumps(state))


def _bad_jsonl(out, sft_dir):
    (out.parent / "bad.jsonl").write_text('{"question": "q", "answer": "#### 3"}\n{"question": 1}\nnot json\n')


def _no_space(out, sft_dir, monkeypatch):
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 1000))


# (name, prepare(out, sft_dir[, monkeypatch]), argv (with {out}, {sft}, {fix} filled in), error type, message)
FIX = Path(__file__).parent / "fixtures" / "data"
INPUTS = [
    ("out_dir is a file", lambda o, s: o.parent.joinpath("file").write_text("x"), ["--out_dir={out}/../file/run"],
     ValueError, r"out_dir .* is not writable .* pass --out_dir=a writable directory"),
    ("checkpoints without --resume", _with_checkpoint, [], ValueError,
     r"already holds checkpoints \(latest step-00000001\): pass --resume=true"),
    ("resume with other settings", _with_checkpoint, ["--resume=true", "--lr=0.5", "--group_size=2", "--beta=0.5"],
     ValueError, r"these settings differ from the saved run: beta 0.01 -> 0.5, group_size 4 -> 2, lr 0.0001 -> 0.5 \(to "
     r"change lr from here on, which log.jsonl then records, add --change_on_resume=lr\)$"),
    ("resume with another reference", _tamper_reference, ["--resume=true"], ValueError,
     r"the reference policy changed"),
    ("no room for a checkpoint", _no_space, ["--checkpoint_every=1"], ValueError,
     r"has 1000 bytes free, but a checkpoint needs about .* MB .*; .* --checkpoint_every=0"),
    ("malformed data file", _bad_jsonl, ["--init_from={out}/../model", "--tasks=gsm8k",
                                         "--train_data=gsm8k={out}/../bad.jsonl"],
     ValueError, r"2 malformed row\(s\) in .*bad.jsonl:\n  .*bad.jsonl:2: .*\n  .*bad.jsonl:3: bad JSON"),
    ("missing data file", None, ["--init_from={out}/../model", "--tasks=gsm8k", "--train_data=gsm8k={out}/none.jsonl"],
     FileNotFoundError, r"dataset file not found: .*none.jsonl .* never downloads"),
    ("init_from without config.json", None, ["--init_from={out}/../model", "--tasks=gsm8k",
                                             f"--train_data=gsm8k={FIX}/gsm8k.jsonl"],
     FileNotFoundError, r"config.json not found: --init_from must be a LLaDA/MMaDA checkpoint directory \(config.json\)"),
    ("sequence longer than the model", None, ["--init_from={sft}", "--tasks=gsm8k", f"--train_data=gsm8k={FIX}/gsm8k.jsonl",
                                              "--max_prompt_len=5000"],
     ValueError, r"sequences of up to 5012 tokens exceed the model's max_sequence_length \(4096\)"),
    pytest.param("CUDA asked for, absent", None, ["--device=cuda"], ValueError, r"asks for CUDA, but torch sees no GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    ("max_bad_steps 0", None, ["--max_bad_steps=0"], ValueError, r"max_bad_steps \(0\) must be >= 1"),
    ("keep_last negative", None, ["--keep_last=-1"], ValueError, r"keep_last \(-1\) must be >= 0"),
    ("checkpoint_every negative", None, ["--checkpoint_every=-2"], ValueError, r"checkpoint_every \(-2\) must be >= 0"),
    ("group of one", None, ["--group_size=1"], ValueError, r"group_size \(1\) must be >= 2"),
    ("mu 0", None, ["--mu=0"], ValueError, r"mu \(0\) must be >= 1"),
    ("gamma 1", None, ["--gamma_image=1"], ValueError, r"gamma_image \(1.0\) must be in \[0, 1\)"),
    ("clip 0", None, ["--clip_eps=0"], ValueError, r"clip_eps \(0.0\) must be > 0"),
    ("blocks", None, ["--gen_length=12", "--block_length=5"], ValueError, r"gen_length \(12\) must be divisible"),
    ("steps per block", None, ["--block_length=4", "--steps=4"], ValueError,
     r"steps \(4\) must be a positive multiple of the number of blocks \(3\)"),
    ("unknown preset", None, ["--preset=llama"], ValueError, r"unknown preset 'llama'"),
    ("bad threshold", None, ["--threshold=1.5"], ValueError, r"threshold \(1.5\) must be in \[0, 1\)"),
    ("bad kv cache", None, ["--kv_cache=full"], ValueError, r"kv_cache \('full'\) must be none, prefix or dual"),
]


@pytest.mark.parametrize("name,prepare,argv,error,match", INPUTS,
                         ids=[row.values[0] if hasattr(row, "values") else row[0] for row in INPUTS])
def test_user_input_errors(name, prepare, argv, error, match, sft_dir, tmp_path, monkeypatch):
    """Every user-facing input error, with the message it gets (before any heavy work)."""
    out = tmp_path / "run"
    out.mkdir()
    if prepare is not None:
        prepare(out, sft_dir, *((monkeypatch,) if prepare is _no_space else ()))
    args = ["--preset=smoke", "--threads=1", "--sample_every=0", f"--sft_dir={sft_dir}", f"--out_dir={out}",
            "--rl_steps=1", "--eval_prompts=1"]
    args += [a.format(out=out, sft=sft_dir) for a in argv]
    with pytest.raises(error, match=match):
        train.main(args)


@pytest.mark.slow  # three LoRA runs
def test_lora_resume_bit_identical(sft_dir, tmp_path):
    """With LoRA the checkpoint holds only the adapters and their optimizer state (the frozen base is
    --init_from); stopping after step 2 and resuming to step 4 equals running 4 steps at once."""
    base = ["--preset=smoke", "--threads=1", "--sample_every=0", f"--init_from={sft_dir}", "--lora_rank=4",
            "--lora_alpha=8", "--lora_dropout=0.1", "--lr=1e-2", "--checkpoint_every=1", "--eval_prompts=2"]
    train.main(base + [f"--out_dir={tmp_path / 'ref'}", "--rl_steps=4"])
    train.main(base + [f"--out_dir={tmp_path / 'cut'}", "--rl_steps=2"])
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(checkpoint.latest(tmp_path / "cut"))).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(k.endswith((".lora_A", ".lora_B")) for k in model_keys), model_keys[:5]
    train.main(base + [f"--out_dir={tmp_path / 'cut'}", "--rl_steps=4", "--resume=true", "--extend=true"])
    a, b = weights(tmp_path / "ref" / "final"), weights(tmp_path / "cut" / "final")
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (tmp_path / "ref" / "log.jsonl").read_text() == (tmp_path / "cut" / "log.jsonl").read_text()


def test_resume_follows_the_models_content_not_its_path(smoke_sft_run, tmp_path):
    """A cluster job copies the --init_from model to local disk: the same bytes at another path, with new
    file times, resume; one changed weight byte (another model) is refused as another reference."""
    a = tmp_path / "a"
    shutil.copytree(smoke_sft_run / "final", a)
    out = tmp_path / "run"
    args = ["--preset=smoke", "--threads=1", "--sample_every=0", "--tasks=text", "--eval_prompts=1",
            "--checkpoint_every=1", f"--out_dir={out}"]
    train.main(args + [f"--init_from={a}", "--rl_steps=1"])
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(a)
    os.utime(next(b.glob("*.safetensors")), (1, 1))
    more = ["--resume=true", "--extend=true", "--rl_steps=2"]
    train.main(args + [f"--init_from={b}", *more])
    assert checkpoint.latest(out).name == "step-00000002"
    weights_file = next(b.glob("*.safetensors"))
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor
    weights_file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="the reference policy changed"):
        train.main(args + [f"--init_from={b}", "--resume=true", "--extend=true", "--rl_steps=3"])


# -----------------------------------------------------------------------------
# A run stopped after a checkpoint and continued with --resume ends exactly where the uninterrupted run does
# (the fast sibling of the slow kill-anywhere test above): the same log.jsonl, the same final weights
# and the same held-out score, bit for bit, with mu = 2 updates per step on both toy tasks. The stop is a
# finished 2-step run, extended to 3 steps (--resume --extend), which continues from its step-2 checkpoint
# with the optimiser state, the step counter and every seed of the run.


EXTEND_RUN = ["--preset=smoke", "--threads=1", "--sample_every=0", "--checkpoint_every=1", "--eval_prompts=2",
              "--prompts_per_step=1", "--group_size=4"]


def test_extended_run_equals_the_uninterrupted_one(smoke_sft_run, tmp_path):
    base = [*EXTEND_RUN, f"--sft_dir={smoke_sft_run / 'sft'}"]
    ref, out = tmp_path / "uninterrupted", tmp_path / "stopped"
    train.main([*base, f"--out_dir={ref}", "--rl_steps=3"])
    train.main([*base, f"--out_dir={out}", "--rl_steps=2"])
    train.main([*base, f"--out_dir={out}", "--rl_steps=3", "--resume=true", "--extend=true"])
    logs = [[json.loads(line) for line in (d / "log.jsonl").read_text().splitlines()] for d in (ref, out)]
    assert [r["step"] for r in logs[0]] == [0, 1, 2] and logs[0] == logs[1]
    assert logs[0][2]["text/loss"] != logs[0][1]["text/loss"]
    a, b = (dict(hf.from_pretrained(d / "final").named_parameters()) for d in (ref, out))
    assert all(torch.equal(a[k], b[k]) for k in a)
    s = [json.loads((d / "summary.json").read_text()) for d in (ref, out)]
    assert {k: s[0][k]["after"] for k in ("text", "image")} == {k: s[1][k]["after"] for k in ("text", "image")}
