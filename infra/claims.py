"""Paths a run is given that hold someone else's work: the SFT model cache (--sft_dir), which several runs
may share, and the out_dir a --resume continues. Checked before any heavy work, so that a mistyped or
shared path is refused in one line instead of being overwritten, replaced or moved aside.

    check_paths        before anything is written: out_dir must be new, empty or a run's own folder (never a
                       model, an SFT model, the --init_from model or a folder of other things), and
                       --init_from must not be the out_dir or inside what it writes, and --sft_dir must
                       not hold the out_dir nor lie inside what it writes (final/, checkpoints/; its sft/ is
                       the default place)
    check_resume       --resume: the out_dir must hold a run; its settings must be the run's (every
                       difference is named); a finished run is final (nothing is rewritten) unless
                       --extend=true asks to train it further
    sft_dir_claimed    the SFT model about to be trained: sft_dir must be a folder (or not exist yet) in a
                       writable place, and is held by this run (SFT_DIR.run.pid) until its model is saved,
                       so that two runs never train into one sft_dir at once
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from infra import checkpoint, data, hf, scale, tracker
from infra.load import check_sft_cache, reference_identity, refuse_training_checkpoint, sft_dir_of
from infra.outdir import may_change, resume_point, take_pid_file


# What a run writes at the top of its out_dir (run.py, checkpoint.py, load.py's SFT cache), and the
# temporary names of those writes. Anything else in an out_dir that holds none of them is someone else's.
RUN_NAMES = {"config.json", "log.jsonl", "times.jsonl", "summary.json", "final", "checkpoints", "curves.png",
             "images.png", "run.pid", "sft", "sft.run.pid", "log.tmp", "times.tmp", *tracker.FILES}
RUN_TEMPORARY = (".write-test-", ".sft.tmp-", ".sft.old-")
# Files that make a folder a model (a Hugging Face checkpoint, or an SFT model this code wrote).
MODEL_FILES = ("sft_meta.json", "tokenizer.json", "model.safetensors.index.json", "generation.json")


def is_run_config(file: Path) -> bool:
    """Whether config.json is train.py's settings (a run's out_dir) rather than a model's."""
    try:
        saved = json.loads(file.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and "rl_steps" in saved and "out_dir" in saved


def _inside(a: Path, b: Path) -> bool:
    """a is b or lies under it (after resolving links, so two spellings of one folder are the same)."""
    a, b = a.resolve(), b.resolve()
    return a == b or b in a.parents


def check_paths(cfg) -> None:
    """Refuse, before anything is written, an out_dir that this run would damage: a model folder (weights,
    tokenizer.json, a model's config.json, an SFT model), the --init_from model or a folder holding it,
    the --sft_dir, or a non-empty folder holding no run of this project. Read-only, on every rank."""
    if not cfg.out_dir.strip():
        raise ValueError("--out_dir is empty: pass the folder this run writes into, e.g. --out_dir=out/run1")
    out = Path(cfg.out_dir)
    init = Path(cfg.init_from).resolve()
    # The out_dir itself, or a folder the run writes into (final/, checkpoints/, sft/): a model there is replaced.
    if cfg.init_from not in ("", "scratch") and (init == out.resolve() or any(
            _inside(init, out / name) for name in RUN_NAMES)):
        what = "is" if init == out.resolve() else "lies inside"
        raise ValueError(f"--init_from {cfg.init_from} {what} --out_dir {out}: the run would write its config.json, "
                         f"logs and final/ over the model it starts from; pass a new folder as --out_dir "
                         f"(e.g. --out_dir={out.resolve().parent / (out.resolve().name + '-rl')})")
    if cfg.init_from == "scratch" and cfg.sft_dir and _inside(out, Path(cfg.sft_dir)):
        raise ValueError(f"--sft_dir {cfg.sft_dir} {'is' if Path(cfg.sft_dir).resolve() == out.resolve() else 'holds'} "
                         f"--out_dir {out}: the SFT model and the run would share files; give the SFT model its own "
                         f"folder (e.g. --sft_dir={out.resolve().parent / 'sft'}) or drop --sft_dir (out_dir/sft)")
    # The other direction: an SFT model inside a folder the run writes (final/ is replaced by the RL model under
    # the SFT model's sft_meta.json, checkpoints/ rotated); out_dir/sft is the default and is the SFT model's own.
    written = [n for n in sorted(RUN_NAMES - {"sft"}) if cfg.init_from == "scratch" and cfg.sft_dir
               and _inside(Path(cfg.sft_dir), out / n)]
    if written:
        what = "is" if Path(cfg.sft_dir).resolve() == (out / written[0]).resolve() else "lies inside"
        raise ValueError(f"--sft_dir {cfg.sft_dir} {what} {out / written[0]}, which the run writes: the SFT model "
                         f"would be overwritten; give it its own folder (e.g. --sft_dir={out / 'sft'}) or drop "
                         "--sft_dir (out_dir/sft)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out_dir {out} is a file, not a folder (it is left as it is); pass a new folder")
    if not out.is_dir():
        return
    names = {p.name for p in out.iterdir()}
    model = [n for n in MODEL_FILES if n in names] + sorted(n for n in names if n.endswith(".safetensors"))
    config = out / "config.json"
    if config.is_file() and not is_run_config(config):
        model.insert(0, "config.json (a model's, not a run's)")
    if model:
        raise ValueError(f"--out_dir {out} holds a model ({', '.join(model)}), not a run: a run would write its "
                         "settings and logs into it; pass a new folder as --out_dir (is it meant as --init_from?)")
    ours = {n for n in names if n in RUN_NAMES or n.startswith(RUN_TEMPORARY)}
    if names and not ours:
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise ValueError(f"--out_dir {out} is not empty and holds no run of train.py ({shown}): a run writes only "
                         "into a new, empty or its own folder; pass a new folder as --out_dir")


def check_resume(cfg) -> dict | None:
    """--resume: refuse an out_dir that holds no run, and settings that differ from the run's (all of them
    named, before the SFT cache check could name only its own); a finished run (summary.json) is reported
    and its summary returned, nothing rewritten, unless --extend=true continues it to a larger --rl_steps.
    None: go on."""
    if cfg.extend and not cfg.resume:
        raise ValueError("--extend=true continues a finished run: pass --resume=true with it (and a larger --rl_steps)")
    if not cfg.resume:
        return None
    out = Path(cfg.out_dir)
    last = checkpoint.latest(out)
    if last is None and not (out / "config.json").is_file():
        raise ValueError(f"--resume: out_dir {out} holds no run (no config.json, no {checkpoint.DIRNAME}/); check "
                         "the path, or drop --resume to start a new run there")
    # The real conflicts first: the SFT cache check that follows would name only the SFT settings (and
    # advise retraining the reference).
    here = asdict(cfg)
    if last is not None:
        last = resume_point(out)  # the newest intact one, which the run resumes from
        state = hf.read_json(last / "state.json", "remove that checkpoint directory")
        checkpoint.check_resumable(last, state, here, reference_identity(cfg), may_change(cfg))
    else:
        saved = hf.read_json(out / "config.json", f"delete {out / 'config.json'} to start a new run there")
        changed = sorted(k for k, v in here.items() if k not in may_change(cfg) and saved.get(k) != v)
        if changed:
            raise ValueError(f"cannot resume {out}: these settings differ from the saved run ({out / 'config.json'}): "
                             + ", ".join(f"{k} {saved.get(k)!r} -> {here[k]!r}" for k in changed)
                             + checkpoint.changeable_hint(changed))
    summary = out / "summary.json"
    # An extension stopped before it finished: config.json already holds its --rl_steps (written at start-up)
    # while summary.json is still the earlier finish's, and its newest checkpoint is behind both. It is an
    # unfinished run: it continues (and is checked) as one, never reported as finished.
    config = out / "config.json"
    extending = (last is not None and summary.is_file() and config.is_file()
                 and state["step"] < hf.read_json(config, f"re-create {config}").get("rl_steps", 0))
    if extending and not cfg.extend:
        raise ValueError(f"out_dir {out} holds an extension of a finished run stopped at step {state['step']}: "
                         "pass --extend=true, as it was started, to continue it")
    if last is not None and (extending or not summary.is_file()) and cfg.rl_steps < state["step"]:
        # an unfinished run would end with a final/ of more steps than its config.json says
        raise ValueError(f"cannot resume {out} at --rl_steps={cfg.rl_steps}: its checkpoint {last.name} has taken "
                         f"{state['step']} RL steps already, and a resumed run continues from there; pass "
                         f"--rl_steps={state['config']['rl_steps']} (the run's own) or more, or start a new run "
                         "with another --out_dir")
    if summary.is_file() and not extending:  # config.json: the finished run's own settings (a checkpoint may be older)
        done = (hf.read_json(config, f"re-create {config}") if config.is_file() else state["config"]).get("rl_steps")
        if cfg.rl_steps == done:
            if os.environ.get("RANK", "0") == "0":  # before the process group exists: RANK says who speaks
                print(f"out_dir {out} holds a finished run ({done} RL steps; {summary}, {out / 'final'}): nothing "
                      f"to do, nothing rewritten. `python evaluate.py --run={out}` scores it again; --extend=true "
                      "with a larger --rl_steps trains it further", flush=True)
            return hf.read_json(summary, f"delete {summary} and resume to redo the final evaluation")
        if cfg.rl_steps < done:
            raise ValueError(f"out_dir {out} holds a finished run of {done} RL steps; --rl_steps={cfg.rl_steps} asks "
                             f"for fewer, and a finished run is final: drop --rl_steps, or choose another --out_dir")
        if not cfg.extend:
            raise ValueError(f"out_dir {out} holds a finished run of {done} RL steps; --rl_steps={cfg.rl_steps} would "
                             "train it further and replace its final/ and summary.json: pass --extend=true to do "
                             "that, or start a new run with another --out_dir")
        if last is None or int(last.name[len(checkpoint.PREFIX):]) != done:
            raise ValueError(f"--extend: out_dir {out} has no checkpoint of its last step ({done}) to continue from "
                             f"(latest: {last.name if last else 'none'}); start a new run with another --out_dir")
    return None


@contextmanager
def sft_dir_claimed(cfg):
    """Around start-up and model loading: when the toy SFT model is to be trained, check sft_dir and hold it
    (rank 0, which trains it) until the model is saved; a model trained with the same settings is reused,
    read-only, without a claim."""
    if cfg.init_from != "scratch" or scale.rank() != 0:
        yield
        return
    sft_dir = sft_dir_of(cfg)
    existing = next(p for p in (sft_dir, *sft_dir.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"sft_dir {sft_dir}: {'it' if existing == sft_dir else existing} is a file, not a folder "
                         "(it is left as it is); pass --sft_dir=a folder for the SFT model")
    if check_sft_cache(cfg):
        yield
        return
    pid_file = sft_dir.with_name(sft_dir.name + ".run.pid")
    _claim(pid_file, sft_dir)
    try:
        yield
    finally:
        _release(pid_file)


def _claim(pid_file: Path, sft_dir: Path) -> None:
    """Claim sft_dir through pid_file (outdir.take_pid_file), or say in one line why not."""
    try:
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        if sft_dir.is_dir() and not os.access(sft_dir, os.W_OK):
            raise PermissionError(13, "Permission denied")
        holder = take_pid_file(pid_file)
        if holder:
            raise ValueError(f"sft_dir {sft_dir} is being trained by the running process {holder} "
                             f"({pid_file}); wait for it to end (a run with the same settings then reuses "
                             "its model), pass another --sft_dir, or delete that file if no run holds it")
        if holder == 0:
            return
    except OSError as e:
        raise ValueError(f"sft_dir {sft_dir} is not writable ({e.strerror}); pass --sft_dir=a writable folder") \
            from None
    raise ValueError(f"sft_dir {sft_dir}: could not create {pid_file}; pass another --sft_dir")


def _release(pid_file: Path) -> None:
    try:
        if int(pid_file.read_text().strip()) == os.getpid():
            pid_file.unlink()
    except (OSError, ValueError):
        pass


def dry_run(cfg, report):
    """--dry_run: report(cfg) on one process (under torchrun the process group is not joined, so RANK
    says which), after checking that the files a real run reads exist: the --init_from folder and the
    data files (the recipe is "check, then run")."""
    if cfg.init_from not in ("", "scratch"):
        refuse_training_checkpoint(cfg.init_from, "--init_from")
    if cfg.init_from not in ("", "scratch") and not (Path(cfg.init_from) / "config.json").is_file():
        where = Path(cfg.init_from)
        raise ValueError(f"--init_from {where} {'has no config.json' if where.is_dir() else 'does not exist'}: the "
                         "run would stop there; pass the LLaDA/MMaDA checkpoint folder (or no --init_from for the "
                         "preset's model shape)")
    for flag in ("train_data", "eval_data"):
        for task, path in data.data_paths(getattr(cfg, flag), flag).items():
            if not Path(path).is_file():
                raise ValueError(f"--{flag} {task}={path}: no such file; the run would stop there")
    if os.environ.get("RANK", "0") != "0":
        return {}
    return report(cfg)
