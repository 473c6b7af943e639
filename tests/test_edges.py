"""Settings and inputs at the edges where a bug shows, each against an expectation written by hand:

- the model fingerprint (infra/load.file_fingerprint, reference_identity) on files LARGER than its sample:
  a change in the tail of a weight file changes the starting model's identity, a copy elsewhere does not;
- the dry run's memory verdict against every GPU of its table (H100 80 GB, H200 141 GB), at world sizes where
  the verdicts differ between the cards;
- the command printed after a failure with logged steps but no checkpoint (--resume=true, which restarts from
  step 0), and without logged steps (the command as typed);
- --sft_dir against out_dir in both directions: a --sft_dir holding the out_dir is refused, an --sft_dir inside
  a folder the run writes (final/, checkpoints/) is refused, out_dir/sft (the default) is accepted.

    python -m pytest tests/test_edges.py -q
"""
import dataclasses
import errno
import hashlib
import json
import random
import shlex
import shutil
import types

import pytest
import torch

import train
from infra import load, outdir, run

# -----------------------------------------------------------------------------
# the fingerprint past its sample

SAMPLE = 256 * 65536  # the documented sample: 256 blocks of 64 KiB


def naive_fingerprint(data: bytes) -> str:
    """The documented rule, written out: the size, then the whole file up to 256 blocks of 64 KiB, else 256
    blocks of 64 KiB at evenly spaced offsets from the head to the tail."""
    h = hashlib.sha1(f"{len(data)}:".encode())
    if len(data) <= SAMPLE:
        h.update(data)
    else:
        for i in range(256):
            start = (len(data) - 65536) * i // 255
            h.update(data[start:start + 65536])
    return h.hexdigest()


def fingerprint(path) -> str:
    h = hashlib.sha1()
    load.file_fingerprint(path, h)
    return h.hexdigest()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 20 MiB weight file of random bytes (past the 16 MiB sample) in a model folder."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps({"d_model": 32}))
    data = random.Random(0).randbytes(20 * 2 ** 20)
    (folder / "model.safetensors").write_bytes(data)
    return folder, data


def test_the_fingerprint_of_a_file_past_its_sample_reads_its_tail(big, tmp_path):
    folder, data = big
    f = tmp_path / "w.safetensors"
    assert len(data) > SAMPLE
    f.write_bytes(data)
    assert fingerprint(f) == naive_fingerprint(data)
    tail = data[:-1] + bytes([data[-1] ^ 1])            # the last byte: inside the last sampled block
    middle_at = (len(data) - 65536) * 128 // 255 + 100  # inside block 128, far from the head
    middle = data[:middle_at] + bytes([data[middle_at] ^ 1]) + data[middle_at + 1:]
    for changed in (tail, middle):
        f.write_bytes(changed)
        assert fingerprint(f) == naive_fingerprint(changed) != naive_fingerprint(data)


def test_a_starting_model_changed_in_its_tail_is_another_model(big, tmp_path):
    """reference_identity (what a resume and an export compare): the same bytes at another path are the same
    model; one byte changed at the end of a 20 MiB weight file is another."""
    folder, data = big
    cfg = lambda p: types.SimpleNamespace(init_from=str(p))
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert load.reference_identity(cfg(copy)) == load.reference_identity(cfg(folder))
    (copy / "model.safetensors").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert load.reference_identity(cfg(copy)) != load.reference_identity(cfg(folder))


# -----------------------------------------------------------------------------
# the dry run's verdict against each card

# GiB of memory per GPU as nvidia-smi reports it (H100 SXM 81,559 MiB; H200 143,771 MiB): the dry run's figures are
# GiB, so its headroom is taken against these totals, not the datasheets' 80 and 141 GB
CARDS = {"H100": 81559 / 1024, "H200": 143771 / 1024}


@pytest.mark.parametrize("gpus, flags", [(1, ["--lora_rank=0"]), (2, ["--lora_rank=0"]), (4, ["--lora_rank=0"]),
                                         (8, [])], ids=["full-1", "full-2", "full-4", "lora-8"])
def test_the_dry_run_verdict_for_each_card(capsys, gpus, flags):
    """LLaDA-8B full fine-tuning on 1 GPU fits neither card, on 2 only the H200, on 4 both; LoRA on 8 both. The
    verdict of each card is its own size against the peak of this GPU count's column."""
    res = train.main(["--preset=llada8b", "--dry_run=true", f"--dry_run_gpus={gpus}", *flags])
    text = capsys.readouterr().out
    kind = "full" if "--lora_rank=0" in flags else "lora"
    peak = res["budget"][gpus][f"{kind}_peak"]
    line = next(s for s in text.splitlines() if s.startswith("device_batch_size") and f"on {gpus} GPUs" in s)
    assert f"peak {peak:.1f} GiB" in line, line
    fits = {name: peak <= gb for name, gb in CARDS.items()}
    assert fits == {1: {"H100": False, "H200": False}, 2: {"H100": False, "H200": True},
                    4: {"H100": True, "H200": True}, 8: {"H100": True, "H200": True}}[gpus]  # the cases meant
    for name, gb in CARDS.items():
        if fits[name]:
            assert f"{gb - peak:.0f} GiB of {gb:.1f} on an {name}" in line and f"not fit on an {name}" not in line, line
        else:
            assert f"does not fit on an {name} ({gb:.1f} GiB, {peak - gb:.0f} GiB short)" in line, line
            assert f"GiB of {gb:.1f} on an {name}" not in line, line
    assert (f"this run does not fit on {gpus} GPU(s) of any size listed" in text) == (not any(fits.values())), text


# -----------------------------------------------------------------------------
# the command after a failure


def failed_run_dir(tmp_path, log: str):
    """An out_dir as a run leaves it when it fails before any checkpoint: its config.json and log.jsonl."""
    out = tmp_path / "run"
    argv = ["--preset=smoke", f"--out_dir={out}", "--rl_steps", "5", "--checkpoint_every=0"]
    out.mkdir()
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(train.parse_args(argv))))
    (out / "log.jsonl").write_text(log)
    outdir.remember_command(argv)
    return out, argv


@pytest.mark.parametrize("failure", ["oom", "disk"])
def test_logged_steps_without_a_checkpoint_name_resume(tmp_path, failure):
    out, argv = failed_run_dir(tmp_path, '{"step": 0, "text/reward": 0.5}\n{"step": 1, "text/reward": 0.25}\n')
    want = f"python train.py --preset=smoke --out_dir={out} --rl_steps 5 --checkpoint_every=0 --resume=true"
    assert run.continue_command(out) == want
    cfg = train.parse_args(argv)
    e = (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB") if failure == "oom" else
         OSError(errno.ENOSPC, "No space left on device", str(out / "log.jsonl")))
    message = run.explain_failure(e, cfg)
    assert "no checkpoint of this run exists" in message, message
    command = shlex.split(message.split("continue with: ", 1)[1])
    extra = ["--device_batch_size=4"] if failure == "oom" else []  # 8 sequences in one pass: half of them
    assert command == shlex.split(want) + extra, message
    # the printed command is this run's settings with resume = true, and --resume accepts this out_dir
    again = train.parse_args(command[2:])
    assert again == dataclasses.replace(cfg, resume=True, device_batch_size=4 if extra else 0)
    assert run.check_resume(again) is None


def test_a_dead_rank_with_logged_steps_names_resume_under_torchrun(tmp_path, monkeypatch):
    """The fast sibling of test_failures.py's slow dead-worker test: gloo's error on the surviving rank, with
    logged steps and no checkpoint: one line naming the cause and the torchrun command with --resume=true."""
    out, argv = failed_run_dir(tmp_path, '{"step": 0}\n')
    monkeypatch.setattr(run.scale, "world", lambda: 2)
    e = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    message = run.explain_failure(e, train.parse_args(argv))
    assert message == ("another process of this torchrun run stopped (Connection closed by peer [127.0.0.1]:4242; "
                       "torchrun's report names it); no checkpoint of this run exists; once the cause is fixed, "
                       "--resume=true continues: torchrun [the same launcher flags] train.py --preset=smoke "
                       f"--out_dir={out} --rl_steps 5 --checkpoint_every=0 --resume=true"), message


@pytest.mark.parametrize("log", ["", "not json\n"], ids=["empty-log", "no-step-line"])
def test_no_logged_step_names_the_command_as_typed(tmp_path, log):
    out, argv = failed_run_dir(tmp_path, log)
    want = f"python train.py --preset=smoke --out_dir={out} --rl_steps 5 --checkpoint_every=0"
    assert run.continue_command(out) == want


# -----------------------------------------------------------------------------
# --sft_dir against out_dir, both directions


def check(tmp_path, sft_dir, out="run"):
    outdir.check_paths(train.parse_args(["--preset=smoke", f"--out_dir={tmp_path / out}", f"--sft_dir={sft_dir}"]))


def test_an_sft_dir_holding_the_out_dir_is_refused(tmp_path):
    with pytest.raises(ValueError, match=f"--sft_dir {tmp_path} holds --out_dir {tmp_path / 'run'}: "):
        check(tmp_path, tmp_path)
    with pytest.raises(ValueError, match=f"--sft_dir {tmp_path / 'run'} is --out_dir {tmp_path / 'run'}: "):
        check(tmp_path, tmp_path / "run")


@pytest.mark.parametrize("inside", ["final", "checkpoints", "final/sft"])
def test_an_sft_dir_inside_what_the_run_writes_is_refused(tmp_path, inside):
    """An SFT model in out_dir/final would be replaced by the RL model (under its own sft_meta.json, so the
    next run sharing --sft_dir would take the RL model as its SFT model); checkpoints/ is rotated."""
    top = inside.split("/")[0]
    what = "is" if inside == top else "lies inside"
    with pytest.raises(ValueError, match=f"--sft_dir {tmp_path / 'run' / inside} {what} {tmp_path / 'run' / top}, "
                                         "which the run writes"):
        check(tmp_path, tmp_path / "run" / inside)


@pytest.mark.parametrize("sft", ["run/sft", "sft", "elsewhere/sft"])
def test_an_sft_dir_of_its_own_is_accepted(tmp_path, sft):
    check(tmp_path, tmp_path / sft)  # out_dir/sft is the default place, spelled out
