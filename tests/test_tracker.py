"""--tracker (infra/tracker.py): each tracker, offline, receives every step's log.jsonl line and times.jsonl
line, the held-out rewards and the pictures, read back with the tracker's own reader (TensorBoard's
EventAccumulator, `wandb leet inspect` on wandb's offline run files, trackio's SQLite store) and compared with
the run's own files, through a resume; a missing package is refused in one line; a tracker that fails leaves
training and log.jsonl as they are without it.

    OMP_NUM_THREADS=1 python -m pytest tests/test_tracker.py -q      # ~18 s on a shared 2-core machine
"""
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import train
from infra import cli, tracker
from infra.run import Run

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels

RUN = ["--preset=smoke", "--threads=1", "--sample_every=0", "--checkpoint_every=1", "--eval_prompts=2",
       "--prompts_per_step=1", "--group_size=4"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """wandb offline and trackio's store in a temporary folder (trackio reads TRACKIO_DIR when imported)."""
    root = tmp_path_factory.mktemp("stores")
    assert "trackio" not in sys.modules, "trackio was imported before TRACKIO_DIR could point it at a test folder"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRACKIO_DIR", str(root / "trackio"))
        mp.setenv("WANDB_MODE", "offline")
        for d in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(d, str(root / d.lower()))
        yield root


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def untracked(smoke_sft_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("untracked")
    train.main([*RUN, f"--sft_dir={smoke_sft_run / 'sft'}", f"--out_dir={out}", "--rl_steps=2"])
    return read_jsonl(out / "log.jsonl")


@pytest.fixture(scope="module", params=list(tracker.TRACKERS))
def tracked(request, stores, smoke_sft_run, tmp_path_factory):
    """A tracked run of 2 steps dies after logging step 1, before its checkpoint; resumed, it takes step 1 a
    second time and finishes; then it is extended to 3 steps (--resume --extend). Returns its out_dir, the
    seconds of step 1's first taking (times.jsonl), and the 2-step run's log.jsonl and summary.json."""
    name = request.param
    out = tmp_path_factory.mktemp(name)
    args = [*RUN, f"--sft_dir={smoke_sft_run / 'sft'}", f"--out_dir={out}", f"--tracker={name}"]
    save = Run._save_checkpoint

    def dies_at_2(self, step):
        if step == 2:
            raise RuntimeError("the machine went away")
        return save(self, step)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(RuntimeError, match="went away"):
        mp.setattr(Run, "_save_checkpoint", dies_at_2)
        train.main([*args, "--rl_steps=2"])
    assert [r["step"] for r in read_jsonl(out / "log.jsonl")] == [0, 1]
    first_taking = read_jsonl(out / "times.jsonl")[1]
    train.main([*args, "--rl_steps=2", "--resume=true"])
    two = read_jsonl(out / "log.jsonl"), json.loads((out / "summary.json").read_text())
    train.main([*args, "--rl_steps=3", "--resume=true", "--extend=true"])
    return name, out, first_taking, two


def expected(out: Path, first_taking: dict, two_summary: dict) -> dict:
    """{step: {key: value}} as the tracker must hold it, from the run's own files: log.jsonl, times.jsonl
    (under time/), the held-out rewards before RL (step 0) and after each complete run (its last step).
    Step 1, taken twice, is logged once, the first time: its seconds are those of the first taking."""
    want = {r["step"]: {k: v for k, v in r.items() if k != "step"} for r in read_jsonl(out / "log.jsonl")}
    times = read_jsonl(out / "times.jsonl")
    for r in [times[0], first_taking, *times[2:]]:
        want[r["step"]].update({f"time/{k}": v for k, v in r.items() if k != "step"})
    final = json.loads((out / "summary.json").read_text())
    for when, step, summary in (("before", 0, final), ("after", 1, two_summary), ("after", 2, final)):
        want[step].update({f"heldout/{k}/{when}": v[when] for k, v in summary.items() if "before" in v})
    return want


def tensorboard_values(out: Path) -> tuple[dict, dict, str]:
    """The event files' scalars, images and text, read by TensorBoard's EventAccumulator. TensorBoard keeps
    scalars as float32, so the values to compare with are log.jsonl's rounded to float32."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    ea = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    ea.Reload()
    got, pictures = {}, {}
    for tag in ea.Tags()["scalars"]:
        for e in ea.Scalars(tag):
            assert tag not in got.get(e.step, {}), f"{tag} logged twice at step {e.step}"
            got.setdefault(e.step, {})[tag] = e.value
    for tag in ea.Tags()["tensors"]:  # text: a skipped step's reason (and the config, below)
        for e in ea.Tensors(tag) if tag != "config/text_summary" else ():
            got.setdefault(e.step, {})[tag.removesuffix("/text_summary")] = \
                tensor_util.make_ndarray(e.tensor_proto).item().decode()
    for tag in ea.Tags()["images"]:
        for e in ea.Images(tag):
            pictures.setdefault(e.step, set()).add(tag)
    config = tensor_util.make_ndarray(ea.Tensors("config/text_summary")[-1].tensor_proto).item().decode()
    return got, pictures, config


def float32(want: dict) -> dict:
    return {s: {k: v if isinstance(v, str) else float(np.float32(v)) for k, v in row.items()}
            for s, row in want.items()}


def leet_inspect(run_dir: Path) -> list[str]:
    """The lines of `wandb leet inspect --json RUN_DIR`: the command's function, called in this process (starting
    `python -m wandb` costs 0.8 s of CPU), runs wandb's reader binary, whose stdout goes to a file here."""
    from wandb.cli.leet import launch_inspect

    sys.stdout.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            with pytest.raises(SystemExit) as e:
                launch_inspect(str(run_dir), json_output=True)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        assert e.value.code == 0, f"wandb leet inspect {run_dir}: exit status {e.value.code}"
        f.seek(0)
        return f.read().decode().splitlines()


def wandb_values(out: Path) -> tuple[dict, dict, str]:
    """The rows of every offline run file (one per segment: wandb keeps a resumed offline run apart), read by
    wandb's own reader; log.jsonl's step is the row's `step` (wandb's own, `_step`, counts rows)."""
    got, pictures, config, ids = {}, {}, None, set()
    for run_dir in sorted((out / "wandb").glob("offline-run-*")):
        for rec in map(json.loads, leet_inspect(run_dir)):
            if rec["type"] == "run":
                ids.add(rec["run"]["run_id"])
                config = rec["run"]["config"]["update"]
            if rec["type"] != "history":
                continue
            row = dict(rec["history"]["item"])
            step = row.pop("step")
            for k, v in row.items():
                if k.endswith("._type") and v == "image-file":
                    pictures.setdefault(step, set()).add(k.removesuffix("._type"))
                elif not k.startswith(("_", "pictures/")):
                    assert k not in got.get(step, {}), f"{k} logged twice at step {step}"
                    got.setdefault(step, {})[k] = v
    assert len(ids) == 1, f"one run id across the resume, not {ids}"
    return got, pictures, json.dumps(config)


def trackio_values(out: Path) -> tuple[dict, dict, str]:
    from trackio.sqlite_storage import SQLiteStorage

    run_id = json.loads((out / "tracker.json").read_text())["trackio"]["id"]
    got, pictures = {}, {}
    for row in SQLiteStorage.get_logs("maskgrpo", run_id=run_id):
        step = row.pop("step")
        for k, v in row.items():
            if k == "timestamp":
                continue
            if k.startswith("pictures/"):
                assert v["_type"] == "trackio.image", v
                pictures.setdefault(step, set()).add(k)
                continue
            assert k not in got.get(step, {}), f"{k} logged twice at step {step}"
            got.setdefault(step, {})[k] = v
    return got, pictures, json.dumps(SQLiteStorage.get_run_config("maskgrpo", run_id=run_id))


READ = {"tensorboard": tensorboard_values, "wandb": wandb_values, "trackio": trackio_values}


def test_every_step_reaches_the_tracker_once_through_a_resume(tracked, untracked):
    name, out, first_taking, (two_log, two_summary) = tracked
    want = expected(out, first_taking, two_summary)
    got, pictures, config = READ[name](out)
    if name == "tensorboard":
        want = float32(want)
    assert sorted(want) == [0, 1, 2] and len(want[0]) > 30
    assert got == want  # every key of every step, nothing more, equal to the run's own files
    assert want[0]["text/num_tokens"] != want[1]["text/num_tokens"]  # steps that differ: a mix-up would show
    assert pictures == {1: {"pictures/curves", "pictures/images"}, 2: {"pictures/curves", "pictures/images"}}
    assert f'"tracker": "{name}"' in config.replace("\\", "") and '"group_size": 4' in config
    assert two_log == untracked  # the tracker changes nothing in log.jsonl


@pytest.mark.parametrize("argv,match", [
    (["--tracker=mlflow"], r"^tracker \('mlflow'\) must be one of none, tensorboard, wandb, trackio$"),
    (["--tracker=tensorboard", "--tracker_project= "], r"^tracker_project is empty"),
])
def test_bad_tracker_settings_are_refused(argv, match):
    with pytest.raises(ValueError, match=match):
        train.parse_args(argv)


@pytest.mark.parametrize("name", list(tracker.TRACKERS))
def test_missing_package_is_refused_in_one_line_before_anything_runs(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, name, None)  # import fails, find_spec says missing
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        with cli.user_errors():
            train.main(["--preset=smoke", f"--out_dir={out}", f"--tracker={name}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err, err
    assert err == (f"error: --tracker={name} needs the {name} package, which is not installed: "
                   f"pip install {name} (or pip install -e '.[track]'), or drop --tracker")
    assert not out.exists()


def test_a_tracker_failing_mid_run_costs_nothing(smoke_sft_run, untracked, tmp_path, monkeypatch, capsys):
    """The event writer raises at step 1: one line says so, the run finishes, log.jsonl is the untracked run's,
    and the tracker kept what it had (step 0) and was told nothing after."""
    log = tracker.TensorBoard.log

    def dies_at_step_1(self, values, step):
        if step == 1:
            raise OSError(28, "No space left on device")
        log(self, values, step)
    monkeypatch.setattr(tracker.TensorBoard, "log", dies_at_step_1)
    out = tmp_path / "run"
    train.main([*RUN, f"--sft_dir={smoke_sft_run / 'sft'}", f"--out_dir={out}", "--rl_steps=2",
                "--tracker=tensorboard"])
    said = [line for line in capsys.readouterr().out.splitlines() if "tracker" in line and "warning" in line]
    assert said == ["warning: the tensorboard tracker failed (OSError: [Errno 28] No space left on device); "
                    "training goes on without it, log.jsonl is the record"]
    assert read_jsonl(out / "log.jsonl") == untracked and (out / "summary.json").is_file()
    got, pictures, _ = tensorboard_values(out)
    assert sorted(got) == [0] and not pictures
    assert json.loads((out / "tracker.json").read_text())["tensorboard"]["done"] == {"before": 0, "step": 0}


def test_a_tracker_that_cannot_start_is_one_line(tmp_path, capsys):
    """out_dir/tensorboard is a file, so the event writer cannot make its folder: one line, and every later
    call is a no-op."""
    (tmp_path / "tensorboard").write_text("in the way")
    cfg = train.Config(out_dir=str(tmp_path), tracker="tensorboard")
    track = tracker.Tracker(cfg)
    track.held_out("before", {"text": 0.5})
    track.step(0, {"step": 0, "text/reward": 0.5}, {"seconds": 1.0})
    track.finish(tmp_path)
    out = capsys.readouterr().out.strip()
    assert out.startswith("warning: the tensorboard tracker failed (FileExistsError") and "\n" not in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tensorboard"]


def test_only_rank_0_logs(tmp_path, monkeypatch):
    """Under torchrun every rank makes the calls; on a rank other than 0 they do nothing and write nothing."""
    monkeypatch.setattr(tracker.scale, "rank", lambda: 1)
    track = tracker.Tracker(train.Config(out_dir=str(tmp_path), tracker="tensorboard"))
    track.held_out("before", {"text": 0.5})
    track.step(0, {"step": 0, "text/reward": 0.5}, {"seconds": 1.0})
    track.finish(tmp_path)
    assert list(tmp_path.iterdir()) == [] and track.backend is None


@pytest.mark.parametrize("name", list(tracker.TRACKERS))
def test_a_skipped_steps_reason_goes_as_text(name, stores, tmp_path):
    """A step skipped for a bad reward logs its reason, a string, beside numbers (Run.record's line)."""
    cfg = train.Config(out_dir=str(tmp_path), tracker=name, rl_steps=2)
    track = tracker.Tracker(cfg)
    line = {"step": 0, "bad_reward": "1 text reward(s) not a finite number in [0, 1]", "bad_steps": 1}
    track.step(0, line, {"seconds": 0.25})
    track.finish(tmp_path)
    got, _, _ = READ[name](tmp_path)
    assert got == {0: {"bad_reward": line["bad_reward"], "bad_steps": 1, "time/seconds": 0.25}}


@pytest.mark.parametrize("name", list(tracker.TRACKERS))
def test_a_changed_setting_goes_as_its_json_text(name, stores, tmp_path):
    """The first step after a resume with --change_on_resume logs {"lr": [old, new]}: no tracker takes a dict as a
    scalar, so it goes as text, and the tracker is not dropped for it (the next step still arrives)."""
    cfg = train.Config(out_dir=str(tmp_path), tracker=name, rl_steps=3)
    track = tracker.Tracker(cfg)
    track.step(1, {"step": 1, "changed": {"lr": [0.0001, 0.05]}, "text/reward": 0.5}, {"seconds": 0.5})
    track.step(2, {"step": 2, "text/reward": 0.75}, {"seconds": 0.25})
    track.finish(tmp_path)
    got, _, _ = READ[name](tmp_path)
    assert got == {1: {"changed": '{"lr": [0.0001, 0.05]}', "text/reward": 0.5, "time/seconds": 0.5},
                   2: {"text/reward": 0.75, "time/seconds": 0.25}}
