"""The live experiment tracker (--tracker, docs/usage.md) beside log.jsonl, which stays the record: a tracker that
fails is reported in one line and dropped. The trackers are optional extras (`pip install -e '.[track]'`)."""
import atexit
import contextlib
import importlib.util
import json
import os
from dataclasses import asdict
from pathlib import Path

from infra import scale

STATE = "tracker.json"  # {tracker: {"id", "done": {event: last step logged}}}: a resume logs no step twice
FILES = (STATE, "tracker.tmp", "tensorboard", "wandb")  # what a tracker writes at the top of out_dir


def check(cfg) -> None:
    """Refuse an unknown tracker, or one whose package is missing, in one line naming the install command."""
    if cfg.tracker == "none":
        return
    if cfg.tracker not in TRACKERS:
        raise ValueError(f"tracker ({cfg.tracker!r}) must be one of none, {', '.join(TRACKERS)}")
    if importlib.util.find_spec(cfg.tracker) is None:  # each is its package's name (torch's SummaryWriter included)
        raise ValueError(f"--tracker={cfg.tracker} needs the {cfg.tracker} package, which is not installed: "
                         f"pip install {cfg.tracker} (or pip install -e '.[track]'), or drop --tracker")
    if not cfg.tracker_project.strip():
        raise ValueError("tracker_project is empty: name the run's project, e.g. --tracker_project=maskgrpo")


_OPEN: list = []  # the tracker this process has open: closed when the next one opens


class Tracker:
    """train.py's calls (no-ops with tracking off, on ranks but 0, once failed); a resume reuses tracker.json's id."""

    def __init__(self, cfg):
        while _OPEN:  # an earlier main() in this process that ended early (tests; a notebook)
            _OPEN.pop().close()
        self.cfg, self.backend, self.state = cfg, None, {"done": {}}
        self.last = max(cfg.rl_steps - 1, 0)  # the step of the held-out rewards after RL and the pictures
        if cfg.tracker == "none" or scale.rank() != 0:
            return
        saved = read_state(Path(cfg.out_dir)).get(cfg.tracker, {})
        self.state["done"].update(saved.get("done", {}))
        try:
            self.backend = TRACKERS[cfg.tracker](cfg, saved.get("id"))
        except Exception as e:
            return self.fail(e)
        self.state["id"] = self.backend.id
        self._save()
        _OPEN.append(self)
        atexit.register(self.close)  # a run that ends early (an error, a signal): its tracker writes what it holds

    def step(self, step: int, log: dict, times: dict) -> None:
        """One step's log.jsonl and times.jsonl (as time/) lines; a value neither number nor text goes as JSON text."""
        values = {k: v if isinstance(v, (int, float, str)) else json.dumps(v) for k, v in log.items() if k != "step"}
        values.update({f"time/{k}": v for k, v in times.items() if k != "step"})
        self._send("step", step, values)

    def held_out(self, when: str, rewards: dict) -> None:
        """The held-out mean reward per task, when = before (at step 0) or after (at the last step) RL."""
        step = 0 if when == "before" else self.last
        if rewards:  # none without a held-out set
            self._send(when, step, {f"heldout/{k}/{when}": v for k, v in rewards.items()})

    def finish(self, out: Path) -> None:
        """A complete run: send the pictures it drew (with the plots extra), close the tracked run."""
        pictures = {f"pictures/{n}": out / f"{n}.png" for n in ("curves", "images") if (out / f"{n}.png").is_file()}
        if pictures:
            self._send("pictures", self.last, pictures, "images")
        self.close()

    def close(self) -> None:
        if self.backend is not None:
            self._call("finish")
            self.backend = None

    def _send(self, event: str, step: int, values: dict, method: str = "log") -> None:
        """backend.method(values, step) once per (event, step): a resumed run re-takes steps; recorded in STATE."""
        done = self.state["done"]
        if self.backend is not None and step > done.get(event, -1) and self._call(method, values, step):
            done[event] = step
            self._save()

    def _call(self, method: str, *args) -> bool:
        try:
            getattr(self.backend, method)(*args)
        except Exception as e:  # whatever the tracker raises: log.jsonl is the record, training goes on
            self.fail(e)
        return self.backend is not None

    def fail(self, e: Exception) -> None:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        scale.print0(f"warning: the {self.cfg.tracker} tracker failed ({type(e).__name__}: {first}); training goes "
                     "on without it, log.jsonl is the record")
        with contextlib.suppress(Exception):  # a tracker that never opened (None) raises too
            self.backend.finish()
        self.backend = None

    def _save(self) -> None:
        out = Path(self.cfg.out_dir)
        (out / "tracker.tmp").write_text(json.dumps({**read_state(out), self.cfg.tracker: self.state}, indent=1) + "\n")
        os.replace(out / "tracker.tmp", out / STATE)


def read_state(out: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads((out / STATE).read_text())
        return saved if isinstance(saved, dict) else {}
    return {}


def run_name(cfg) -> str:
    return cfg.tracker_run or Path(cfg.out_dir).resolve().name


class TensorBoard:
    """Event files in out_dir/tensorboard. A number is kept as a float32 scalar: log.jsonl keeps the float64."""

    def __init__(self, cfg, run_id: str | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(cfg.out_dir) / "tensorboard"))
        self.id = "tensorboard"  # TensorBoard has no run id: a run is its folder
        self.writer.add_text("config", "```\n" + json.dumps(asdict(cfg), indent=1) + "\n```")
        self.writer.flush()

    def log(self, values: dict, step: int) -> None:
        for k, v in values.items():
            (self.writer.add_text if isinstance(v, str) else self.writer.add_scalar)(k, v, step)
        self.writer.flush()  # a killed run keeps every step it has counted as logged (tracker.json)

    def images(self, paths: dict, step: int) -> None:
        import numpy as np
        from PIL import Image

        for k, path in paths.items():
            with Image.open(path) as im:
                self.writer.add_image(k, np.asarray(im.convert("RGB")), step, dataformats="HWC")
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class Wandb:
    """Weights & Biases, files in out_dir/wandb. log.jsonl's `step` is the charts' x axis (define_metric): wandb's
    own step only grows, and a resumed run's held-out rewards after RL belong to a step it has logged."""

    def __init__(self, cfg, run_id: str | None):
        import wandb

        self.lib = wandb
        self.run = wandb.init(project=cfg.tracker_project, name=run_name(cfg), id=run_id,  # None: wandb draws one
                              resume="allow" if run_id else None, dir=cfg.out_dir, config=asdict(cfg),
                              settings=wandb.Settings(console="off", quiet=True))  # the terminal keeps our lines
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.id = self.run.id

    def log(self, values: dict, step: int) -> None:
        self.run.log({**values, "step": step})

    def images(self, paths: dict, step: int) -> None:
        self.log({k: self.lib.Image(str(p)) for k, p in paths.items()}, step)

    def finish(self) -> None:
        self.lib.finish()  # the run's own finish, and trackio's record that no run is open


class Trackio(Wandb):
    """trackio: wandb's API, a local SQLite store under TRACKIO_DIR; it reopens a run by name, not by saved id."""

    def __init__(self, cfg, run_id: str | None):
        import trackio

        self.lib = trackio
        self.run = trackio.init(project=cfg.tracker_project, name=run_name(cfg), config=asdict(cfg),
                                resume="must" if run_id else "never", embed=False)
        self.id = self.run.id
        if run_id and self.id != run_id:
            raise RuntimeError(f"trackio resumes by name, and its latest run named {run_name(cfg)!r} is {self.id}, "
                               f"not this run's {run_id}: another run took the name since")

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio}
