"""The run's bookkeeping at non-default settings, checked against hand-written expectations: checkpoint
names and discovery (partial `.tmp` directories, numeric order), the cadence and rotation of checkpoints,
the bad-step guard with good and bad steps interleaved, the complete list of settings a resume may change,
what a resume restores (step, held-out rewards, weights, the new --lr, the log truncated to the steps
before it), and the rows each rank takes under torchrun (the pure function, rank and world patched).

Everything drives infra/run.Run (the object train.main wraps its loop in) with a two-weight model, so the
whole file takes a few seconds.

    python -m pytest tests/test_bookkeeping.py -q
"""
import json
import re
import shutil
import signal
from dataclasses import asdict, fields
from pathlib import Path

import pytest
import torch

import sample
import train
from infra import checkpoint, scale
from infra.load import check_sft_cache
from infra.outdir import PID_FILE, RESUMABLE, release
from infra.run import Run, TrainingStopped, check_resume, startup_checks

CPU = torch.device("cpu")

# The settings a resume may change, written out by hand (README: a resumed run continues the same run;
# only where it runs, how often it logs and checkpoints, how it batches its forwards, how many steps it
# takes (and --extend, which lets a finished run take more), and --change_on_resume, which lets lr and
# grad_clip change on purpose (tests/test_resume_refusals.py). Any other change would alter the result and must
# be refused.
MAY_CHANGE = {"resume", "extend", "change_on_resume", "retrain_sft", "rl_steps", "threads", "device", "sample_every",
              "checkpoint_every", "keep_last", "max_bad_steps", "device_batch_size", "out_dir",
              # paths of the starting model: a copy elsewhere resumes; its content is the reference identity
              "init_from", "sft_dir",
              # where the curves go besides log.jsonl (infra/tracker.py): the run's numbers are the same
              "tracker", "tracker_project", "tracker_run"}


def config(out, *flags):
    return train.parse_args(["--preset=smoke", f"--out_dir={out}", "--sample_every=0", *flags])


def tiny():
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model, torch.optim.AdamW(model.parameters(), lr=1.0)


GOOD = lambda s: {"step": s, "skipped_updates": 0, "seconds": 0.0}
BAD_REWARD = lambda s: {"step": s, "bad_reward": "1 text reward(s) not a finite number in [0, 1]"}
BAD_UPDATE = lambda s: {"step": s, "skipped_updates": 1, "seconds": 0.0}


def names(out):
    return [p.name for p in checkpoint.complete(out)]


def log_steps(out):
    return [json.loads(l)["step"] for l in (out / "log.jsonl").read_text().splitlines()]


def split_times(log: dict) -> tuple[dict, dict]:
    """(log.jsonl's line, times.jsonl's) of a step, as train.main's loop hands them to Run.record."""
    return {k: v for k, v in log.items() if k != "seconds"}, {"seconds": log.get("seconds", 0.0)}


def run_steps(cfg, logs, model=None, opt=None, before_record=None):
    """Drive a Run through `logs` (one dict per step, from `start`); returns the Run."""
    if model is None:
        model, opt = tiny()
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)  # startup_checks makes it in train.main
    with Run(cfg, model, opt, CPU) as run:
        for log in logs:
            if before_record:
                before_record(run, log["step"])
            run.record(log["step"], *split_times(log), [], None, None)
    return run


# -----------------------------------------------------------------------------------------------------
# checkpoint names and discovery


def test_checkpoint_names_count_the_steps_done(tmp_path):
    """--checkpoint_every=3 over 7 steps (0..6): checkpoints after 3 and 6 completed steps, named with the
    count of steps done, zero-padded to 8 digits (the layout checkpoint.py documents), state.json's step
    the same count; keep_last=0 keeps both."""
    out = tmp_path / "run"
    run_steps(config(out, "--checkpoint_every=3", "--keep_last=0", "--rl_steps=7"), [GOOD(s) for s in range(7)])
    assert names(out) == ["step-00000003", "step-00000006"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    for n in (3, 6):
        assert json.loads((out / "checkpoints" / f"step-{n:08d}" / "state.json").read_text())["step"] == n
    assert log_steps(out) == list(range(7))


def test_keep_last_one_keeps_the_newest(tmp_path):
    out = tmp_path / "run"
    run_steps(config(out, "--checkpoint_every=2", "--keep_last=1", "--rl_steps=6"), [GOOD(s) for s in range(6)])
    assert names(out) == ["step-00000006"]


def _fake_checkpoint(path, step):
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"step": step}))


def test_discovery_skips_partial_directories_and_orders_by_number(tmp_path):
    """Only `step-N` directories holding state.json are checkpoints; a `step-N.tmp` (a kill before the
    rename, state.json already written), a directory without state.json and other names are not. The
    newest is the largest N, not the last name in some other order."""
    root = tmp_path / "checkpoints"
    for n in (2, 9, 10):
        _fake_checkpoint(root / f"step-{n:08d}", n)
    _fake_checkpoint(root / "step-00000011.tmp", 11)
    (root / "step-00000012").mkdir()
    (root / "notes").mkdir()
    assert names(tmp_path) == ["step-00000002", "step-00000009", "step-00000010"]
    assert checkpoint.latest(tmp_path).name == "step-00000010"
    assert checkpoint.latest(tmp_path / "nowhere") is None


def test_a_leftover_tmp_directory_neither_blocks_a_fresh_start_nor_a_resume(tmp_path):
    """A kill between writing checkpoint N's files and its rename leaves `step-N.tmp`: a fresh run in that
    out_dir starts (nothing complete to protect), and --resume continues from the newest complete one."""
    fresh = tmp_path / "fresh"
    _fake_checkpoint(fresh / "checkpoints" / "step-00000004.tmp", 4)
    try:
        with startup_checks(config(fresh, "--checkpoint_every=0"), CPU):  # no ValueError
            pass
    finally:
        release(fresh / PID_FILE)

    out = tmp_path / "run"
    run_steps(config(out, "--checkpoint_every=1", "--rl_steps=1"), [GOOD(0)])
    shutil.copytree(out / "checkpoints" / "step-00000001", out / "checkpoints" / "step-00000002.tmp")
    cfg = config(out, "--checkpoint_every=1", "--rl_steps=3", "--resume=true")
    assert check_resume(cfg) is None
    try:
        with startup_checks(cfg, CPU):
            pass
    finally:
        release(out / PID_FILE)
    run = run_steps(cfg, [])
    assert run.start == 1


# -----------------------------------------------------------------------------------------------------
# the bad-step guard


def test_interleaved_bad_steps_never_stop_the_run(tmp_path):
    """bad, good, bad, good, bad with --max_bad_steps=2: never two in a row, so the run goes on; the log
    counts every bad step (both kinds: a bad reward, a skipped update)."""
    out = tmp_path / "run"
    cfg = config(out, "--checkpoint_every=0", "--max_bad_steps=2", "--rl_steps=5")
    run_steps(cfg, [BAD_REWARD(0), GOOD(1), BAD_UPDATE(2), GOOD(3), BAD_REWARD(4)])
    logs = [json.loads(l) for l in (out / "log.jsonl").read_text().splitlines()]
    assert [l["bad_steps"] for l in logs] == [1, 1, 2, 2, 3]


@pytest.mark.parametrize("limit", [2, 4])
def test_consecutive_bad_steps_stop_at_max_bad_steps(tmp_path, limit):
    """good, bad, good, then `limit` bad steps in a row: the run stops at the limit-th, naming the count
    and the last checkpoint written after a good step (after step 2, so step-00000003), which keep_last=1
    does not rotate away."""
    out = tmp_path / "run"
    cfg = config(out, "--checkpoint_every=1", "--keep_last=1", f"--max_bad_steps={limit}", "--rl_steps=20")
    logs = [GOOD(0), BAD_UPDATE(1), GOOD(2)] + [BAD_REWARD(3 + i) for i in range(limit)] + [GOOD(3 + limit)]
    last = 2 + limit
    with pytest.raises(TrainingStopped, match=rf"^{limit} consecutive bad steps .* stopping at step {last}\. "
                                              r"Last good checkpoint: \S*step-00000003;"):
        run_steps(cfg, logs)
    assert log_steps(out) == list(range(last + 1))
    assert names(out)[0] == "step-00000003"


# -----------------------------------------------------------------------------------------------------
# resume: what may change, what is restored


def _other_value(f, v):
    """A value of field f other than v, of the same type."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1
    return v + "x"


def test_resume_refuses_every_setting_but_the_listed_ones():
    """Each Config field changed alone against a saved run: refused, naming it, unless it is one of
    MAY_CHANGE; a changed reference policy is refused too."""
    saved = asdict(train.Config())
    state = {"config": saved, "reference": {"sft_meta": {"seed": 0}}}
    for f in fields(train.Config):
        now = dict(saved, **{f.name: _other_value(f, saved[f.name])})
        if f.name in MAY_CHANGE:
            checkpoint.check_resumable("ckpt", state, now, state["reference"], RESUMABLE)
        else:
            with pytest.raises(ValueError, match=rf"settings differ from the saved run: {f.name} "):
                checkpoint.check_resumable("ckpt", state, now, state["reference"], RESUMABLE)
    with pytest.raises(ValueError, match="the reference policy changed"):
        checkpoint.check_resumable("ckpt", state, saved, {"sft_meta": {"seed": 1}}, RESUMABLE)


@pytest.mark.parametrize("flag,refused", [
    ("--seed=1", "seed 0 -> 1"), ("--clip_eps=0.3", "clip_eps 0.2 -> 0.3"),
    ("--lr=0.5", "lr 0.0001 -> 0.5 (to change lr from here on, which log.jsonl then records, add --change_on_resume=lr)"),
    ("--grad_clip=0.05", "grad_clip 1.0 -> 0.05 (to change grad_clip from here on, which log.jsonl then records, add "
                         "--change_on_resume=grad_clip)"),
    ("--lr=0.5 --change_on_resume=lr", None), ("--grad_clip=0.05 --change_on_resume=grad_clip", None)])
def test_check_resume_applies_the_list(tmp_path, flag, refused):
    """The check train.main runs before loading anything, on a real checkpoint: a seed-0 run resumed with
    --seed=1 is refused (every random draw derives from it); --lr and --grad_clip change only when
    --change_on_resume names them."""
    out = tmp_path / "run"
    run_steps(config(out, "--checkpoint_every=1", "--rl_steps=1"), [GOOD(0)])
    cfg = config(out, "--checkpoint_every=1", "--rl_steps=2", "--resume=true", *flag.split())
    if refused:
        with pytest.raises(ValueError, match=rf"these settings differ from the saved run: {re.escape(refused)}$"):
            check_resume(cfg)
    else:
        assert check_resume(cfg) is None


def test_resume_restores_the_run_and_takes_the_new_lr(tmp_path):
    """A run checkpointed every 2 steps, logged to step 4, its step-4 checkpoint removed: the resume
    starts at step 2 with the weights and the held-out rewards saved there, AdamW at the new --lr, and
    log.jsonl cut back to steps 0 and 1 (the resumed run writes 2 onwards again)."""
    out = tmp_path / "run"
    model, opt = tiny()

    def mark(run, step):  # weight = step + 1 while step `step` is recorded: the checkpoint of 2 saves 2.0
        with torch.no_grad():
            model.weight.fill_(step + 1.0)
        run.state["before"] = {"text": 0.25}

    run_steps(config(out, "--checkpoint_every=2", "--keep_last=0", "--rl_steps=5"), [GOOD(s) for s in range(5)],
              model, opt, mark)
    assert names(out) == ["step-00000002", "step-00000004"] and log_steps(out) == [0, 1, 2, 3, 4]
    shutil.rmtree(out / "checkpoints" / "step-00000004")

    model2, opt2 = tiny()
    cfg = config(out, "--checkpoint_every=2", "--keep_last=0", "--rl_steps=5", "--resume=true", "--lr=0.125")
    with Run(cfg, model2, opt2, CPU) as run:
        assert run.start == 2 and run.state["before"] == {"text": 0.25}
        assert torch.equal(model2.weight, torch.full((1, 2), 2.0))
        assert [g["lr"] for g in opt2.param_groups] == [0.125]
        assert log_steps(out) == [0, 1]


# -----------------------------------------------------------------------------------------------------
# rows per rank


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("group_size", [3, 4])
def test_shard_rows_keeps_each_group_on_one_rank(monkeypatch, world, group_size):
    """Under torchrun rank r keeps rows [r n / W, (r + 1) n / W) of the n = prompts x G global rows:
    contiguous, in rank order, together all rows once, so the G completions of a prompt (consecutive
    rows) are on one rank and its advantages compare them with each other."""
    prompts = 2 * world
    n = prompts * group_size
    got = []
    for r in range(world):
        monkeypatch.setattr(scale, "rank", lambda r=r: r)
        monkeypatch.setattr(scale, "world", lambda: world)
        rows = list(range(n))[scale.shard_rows(n)]
        assert rows == list(range(r * n // world, (r + 1) * n // world))
        got.append(rows)
    assert [i for rows in got for i in rows] == list(range(n))
    for g in range(prompts):
        owners = {r for r, rows in enumerate(got) for i in rows if i // group_size == g}
        assert len(owners) == 1, (g, owners)


@pytest.mark.parametrize("n,size,want", [(7, 3, [(0, 3), (3, 6), (6, 7)]), (6, 0, [(0, 6)]), (4, 8, [(0, 4)])])
def test_chunks_split_rows_by_device_batch_size(n, size, want):
    """--device_batch_size=size: forwards of at most `size` rows, all n with 0."""
    rows = list(range(n))
    assert [rows[s] for s in sample.chunks(n, size)] == [list(range(a, b)) for a, b in want]


@pytest.mark.parametrize("raw,minutes", [("2.5", 2.5), ("60", 60.0), ("0", None), ("-1", None), ("soon", None)])
def test_collective_timeout_from_the_environment(monkeypatch, raw, minutes):
    """MASKGRPO_COLLECTIVE_TIMEOUT_MIN sets how long a collective waits, in minutes; anything but a
    positive number is a one-line error naming the variable."""
    monkeypatch.setenv(scale.TIMEOUT_ENV, raw)
    if minutes is None:
        with pytest.raises(ValueError, match=rf"{scale.TIMEOUT_ENV}='{raw}' must be a positive number"):
            scale.collective_timeout()
    else:
        assert scale.collective_timeout().total_seconds() == minutes * 60


def test_one_process_needs_no_process_group(monkeypatch):
    """Without WORLD_SIZE (or with 1) init joins nothing: --device=cpu is the CPU, auto is CUDA only when
    there is one; reductions are the identity and fill_shard copies a plain tensor whole."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert scale.init("cpu") == CPU
    assert scale.init("auto") == (torch.device("cuda") if torch.cuda.is_available() else CPU)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert scale.init("cpu") == CPU and (scale.rank(), scale.world()) == (0, 1)
    t = torch.tensor([1.0, 2.0])
    assert scale.all_sum(t) is t and scale.all_max(t) is t and scale.all_gather_rows(t) is t
    target = torch.zeros(2, 3, dtype=torch.float64)
    scale.fill_shard(target, torch.arange(6.0).view(2, 3))
    assert target.tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="does not match rows"):
        scale.fill_shard(torch.zeros(3, 3), torch.zeros(2, 3))


# -----------------------------------------------------------------------------------------------------
# damaged checkpoints


def test_damage_is_named_and_load_refuses_it(tmp_path):
    """A checkpoint's state.json that is not a JSON object with a step, or unreadable, and a missing
    .metadata are each named; load refuses a directory without state.json and a damaged checkpoint."""
    out = tmp_path / "run"
    run_steps(config(out, "--checkpoint_every=1", "--rl_steps=1"), [GOOD(0)])
    ckpt = out / "checkpoints" / "step-00000001"
    model, opt = tiny()
    assert checkpoint.damage(ckpt) is None
    state = (ckpt / "state.json").read_text()
    (ckpt / "state.json").write_text("[1, 2]")
    assert checkpoint.damage(ckpt).endswith("state.json holds no checkpoint state")
    (ckpt / "state.json").write_text("{")
    assert "state.json is unreadable" in checkpoint.damage(ckpt)
    with pytest.raises(ValueError, match=r"checkpoint .*step-00000001 is damaged: .*; remove it"):
        checkpoint.load(ckpt, model, opt)
    (ckpt / "state.json").write_text(state)
    (ckpt / ".metadata").unlink()
    assert ".metadata is unreadable" in checkpoint.damage(ckpt)
    (ckpt / "state.json").unlink()
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        checkpoint.load(ckpt, model, opt)


def test_a_signal_writes_a_checkpoint_off_cadence_and_exits(tmp_path):
    """SIGTERM during step 1 with --checkpoint_every=0: the step is logged, a checkpoint of the 2 steps
    done is written anyway, and the run exits with 128 + 15."""
    out = tmp_path / "run"
    cfg = config(out, "--checkpoint_every=0", "--rl_steps=5")
    out.mkdir()
    model, opt = tiny()
    with pytest.raises(SystemExit) as e, Run(cfg, model, opt, CPU) as run:
        run.record(0, *split_times(GOOD(0)), [], None, None)
        run.signal["signal"] = signal.SIGTERM
        run.record(1, *split_times(GOOD(1)), [], None, None)
    assert e.value.code == 128 + signal.SIGTERM
    assert names(out) == ["step-00000002"] and log_steps(out) == [0, 1]


def test_resume_without_a_checkpoint_starts_at_zero_and_drops_a_cut_log_line(tmp_path, capsys):
    """--resume in an out_dir with no complete checkpoint starts at step 0 and says so; a resume keeps
    the log lines before its start and skips one cut short by a kill."""
    out = tmp_path / "run"
    assert run_steps(config(out, "--checkpoint_every=0", "--resume=true"), []).start == 0
    assert "no complete checkpoint" in capsys.readouterr().out
    run_steps(config(out, "--checkpoint_every=2", "--rl_steps=3"), [GOOD(s) for s in range(3)])
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 3, "text/rew')
    with Run(config(out, "--checkpoint_every=2", "--rl_steps=5", "--resume=true"), *tiny(), CPU) as run:
        assert run.start == 2 and log_steps(out) == [0, 1]


def test_the_next_save_removes_older_crash_leftovers(tmp_path):
    """A `step-N.tmp` of an earlier crash is deleted by the next checkpoint save (checkpoint.py)."""
    out = tmp_path / "run"
    _fake_checkpoint(out / "checkpoints" / "step-00000007.tmp", 7)
    run_steps(config(out, "--checkpoint_every=1", "--rl_steps=1"), [GOOD(0)])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]


def test_a_second_signal_later_interrupts_at_once(monkeypatch):
    """The first SIGTERM sets the flag; a copy within REPEAT_WINDOW seconds (torchrun forwards the one it
    got) changes nothing; one later than that raises KeyboardInterrupt."""
    now = [100.0]
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: now[0])
    with checkpoint.graceful_stop() as flag:
        handler = signal.getsignal(signal.SIGTERM)
        handler(signal.SIGTERM, None)
        assert flag["signal"] == signal.SIGTERM
        now[0] += checkpoint.REPEAT_WINDOW / 2
        handler(signal.SIGINT, None)
        assert flag["signal"] == signal.SIGTERM
        now[0] += checkpoint.REPEAT_WINDOW
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGTERM, None)


def test_an_sft_dir_with_foreign_files_is_refused(tmp_path):
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "notes.txt").write_text("mine")
    for retrain in ([], ["--retrain_sft=true"]):  # never replaced: no flag deletes someone's files
        with pytest.raises(ValueError, match=r"holds files \(notes.txt\) but no sft_meta.json.*left as it is") as e:
            check_sft_cache(config(tmp_path / "run", f"--sft_dir={sft}", *retrain))
        assert "--retrain_sft" not in str(e.value)
    assert check_sft_cache(config(tmp_path / "run", f"--sft_dir={tmp_path / 'empty'}")) is False
