"""Score a checkpoint on one task without training: greedy pass@1, sampled pass@k and mean reward.

    python evaluate.py --ckpt DIR --task gsm8k --data gsm8k_test.jsonl [--limit N] [--samples K]
                       [--out FILE.jsonl] [--preset llada8b] [--gen_length=256 ...]    # any train.Config field
    python evaluate.py --ckpt out/toy/final --task text      # toy tasks draw held-out prompts from --seed
    python evaluate.py --run out/toy                         # re-score a run's sft/ and final/ vs summary.json
    python evaluate.py --compare=before.jsonl,after.jsonl    # gain of two --out files, paired by prompt

Completions come from data.evaluate, as in train.py, so under one Config the numbers are the run's own (`--run`
checks it). pass@k: arXiv:2107.03374 §2.1 with n = k. A training checkpoint becomes a --ckpt folder with
`python -m infra.load OUT_DIR/checkpoints/step-N DEST`."""
import fcntl
import json
import math
import os
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

import tasks
import train
from infra import cli, data, hf, load, run, scale
from infra.sandbox import RemoteScorer

CORRECT_TOL = 1e-6  # reward >= 1 - CORRECT_TOL is a solved prompt (float32 rewards of exactly 1 pass)
TASKS = tasks.TOY_TASKS + data.TASKS
NOT_MEASURED = "not measured"
NOT_MEASURED_EXIT = 3


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n completions of which c are correct: 1 - C(n - c, k) / C(n, k)."""
    cli.need(0 <= c <= n and 1 <= k <= n, f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # comb(n - c, k) is 0 when k > n - c


def summarize(records: list[dict]) -> dict:
    """One task's row: n prompts, k samples each, greedy pass@1, pass@k, mean sampled reward (None: no such
    records) and the unscored (NaN) completions; a metric over one is NOT_MEASURED, never a measured 0."""
    greedy = [r["reward"] for r in records if r["mode"] == "greedy"]
    by_prompt: dict[int, list[float]] = {}
    for r in records:
        if r["mode"] == "sampled":
            by_prompt.setdefault(r["prompt_index"], []).append(r["reward"])
    ks = {len(v) for v in by_prompt.values()}
    cli.need(len(ks) <= 1, f"prompts have different numbers of samples {sorted(ks)}; pass@k needs the same k for all")
    k = ks.pop() if ks else 0
    sampled = [x for v in by_prompt.values() for x in v]
    unscored = [sum(not math.isfinite(x) for x in xs) for xs in (greedy, sampled)]
    mean = lambda xs, bad=0: NOT_MEASURED if bad else sum(xs) / len(xs) if xs else None
    solved = [pass_at_k(k, sum(x >= 1 - CORRECT_TOL for x in v), k) for v in by_prompt.values()]
    return {"n": len(by_prompt) or len(greedy), "k": k,
            "greedy_pass@1": mean([x >= 1 - CORRECT_TOL for x in greedy], unscored[0]),
            "pass@k": mean(solved, unscored[1]), "mean_reward": mean(sampled, unscored[1]), "unscored": sum(unscored)}


def table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: "-" if v is None else NOT_MEASURED if isinstance(v, float) and not math.isfinite(v) else \
        f"{v:.6f}" if isinstance(v, float) else str(v)
    lines = [header, ["---"] * len(header)] + [[fmt(v) for v in row] for row in rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


@dataclass
class Options(train.Config):
    """evaluate.py's flags: its own below, and the train.Config fields an evaluation uses (SHARED)."""
    ckpt: str = ""          # checkpoint directory (config.json, *.safetensors, tokenizer.json)
    task: str = ""          # text | image (toy: no --data) | gsm8k | math | mbpp | countdown | sudoku | geneval
    data: str = ""          # local benchmark file in its public format (infra/data.py); not for toy tasks
    limit: int = 0          # first N prompts (0: the whole file; toy tasks: eval_prompts)
    samples: int = -1       # k sampled completions per prompt for pass@k (-1: the task's default, 0: greedy only)
    out: str = ""           # write one JSON line per completion here
    run: str = ""           # out_dir of a train.py run: re-score it and compare with its summary.json
    compare: str = ""       # BEFORE.jsonl,AFTER.jsonl: two --out files of the same prompts; the paired gain


# The train.Config settings an evaluation reads; the training-only ones are refused, never silently ignored.
SHARED = {"seed", "device", "dtype", "threads", "max_prompt_len", "prompt_prefill", "system_prompt", "image_text_len",
          "image_scorer_url", "text_max_steps", "text_reward", "attend_padding", "gen_length", "block_length", "steps",
          "temperature", "image_sampler", "image_steps", "cfg_scale", "image_width", "eval_prompts", "eval_samples",
          "device_batch_size"}
REFUSED = "a train.py setting that evaluate.py does not use (it scores a checkpoint, it does not train)"
RUN_OVERRIDES = ("threads", "device")  # what --run takes beside the run's config.json: speed, not results
# The paper code's official evaluation settings (toy tasks keep their checkpoint's generation.json).
_READING = {"gen_length": 256, "block_length": 16, "steps": 128, "prompt_prefill": "<reasoning>", "samples": 0}
OFFICIAL = {"gsm8k": _READING, "math": _READING,
            "geneval": {"image_steps": 32, "image_sampler": "emerge", "cfg_scale": 3.5, "samples": 4}}


def parse_options(argv=None) -> Options:
    """Flags over the preset over the task's official settings over the checkpoint's generation.json."""
    kw = dict(description=__doc__.split("\n")[0], presets=train.PRESETS, inherited=SHARED, refused=REFUSED)
    first = cli.parse(Options, argv, **kw)
    load.refuse_training_checkpoint(first.ckpt, "--ckpt")
    saved = cli.read_generation_settings(first.ckpt) if first.ckpt and not first.run else {}
    saved.pop("tasks", None)
    return cli.parse(Options, argv, defaults={**saved, **OFFICIAL.get(first.task, {})}, **kw)


def build_config(o: Options) -> tuple[train.Config, int]:
    """The train.Config that evaluates o.ckpt on o.task, checked as a run's, and the samples per prompt."""
    cli.need(o.task in TASKS, f"unknown task {o.task!r}; choose one of {', '.join(TASKS)}")
    cli.need(Path(o.ckpt).is_dir(), f"checkpoint directory not found: {o.ckpt} (pass a folder with config.json, "
             "*.safetensors and tokenizer.json, e.g. out/toy/final)")
    toy = o.task in tasks.TOY_TASKS
    cli.need(toy != bool(o.data), f"task {o.task!r} " + ("draws its held-out prompts from --seed: drop --data" if toy
                                                         else "reads its prompts from a local file: pass --data PATH"))
    cli.need(o.limit >= 0 and o.samples >= -1, f"--limit ({o.limit}) must be >= 0 and --samples ({o.samples}) >= 0")
    samples = o.eval_samples if o.samples == -1 else o.samples
    cli.need(samples or o.task not in tasks.IMAGE_TASKS, f"--samples 0 scores greedy completions only, and image "
             f"tasks ({o.task}) have none (the image samplers always draw): pass --samples >= 1")
    cli.need(not samples or o.temperature > 0,  # data.evaluate would draw one completion per prompt: no pass@k
             f"temperature ({o.temperature}) must be > 0 for sampled pass@k; e.g. --temperature=1")
    implied = {"init_from": o.ckpt, "tasks": o.task, "eval_samples": max(samples, 1),
               "eval_prompts": o.limit or o.eval_prompts}
    if not toy:  # load_data keys on train_data, so the evaluation file is given as both (only "test" is scored)
        implied.update(train_data=f"{o.task}={o.data}", eval_data=f"{o.task}={o.data}")
    cfg = replace(train.Config(**{f.name: getattr(o, f.name) for f in fields(train.Config)}), **implied)
    cli.validate(cfg)
    return cfg, samples


def open_out(out: str):
    """The --out file, opened and locked now: a bad or busy path is refused before, not after, hours of scoring."""
    path = Path(out)
    cli.need(not path.is_dir(), f"--out {out} is a directory; give a file in it, e.g. --out {path / 'eval.jsonl'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # never truncates: the checks below decide
    except OSError as e:
        raise ValueError(f"--out {out} is not writable ({e.strerror}: {e.filename}); choose a writable path") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ValueError(f"--out {out} is being written by another evaluate.py (it holds the file's lock); wait "
                         "for it to end, or choose another --out") from None
    if os.fstat(fd).st_size:
        os.close(fd)
        raise ValueError(f"--out {out} already exists (an earlier evaluation?); choose another path, or delete it")
    return os.fdopen(fd, "a")


class Scored(list):
    """The records data.evaluate extends per scored batch, each flushed to --out at once (Ctrl-C keeps them)."""

    def __init__(self, task: str, mode: str, k: int, file=None):
        self.task, self.mode, self.k, self.file = task, mode, k, file

    def extend(self, rows):
        # data.evaluate repeats each prompt k times consecutively: row index = prompt index * k + sample.
        recs = [{"task": self.task, "mode": self.mode, "prompt_index": r["index"] // self.k,
                 "sample": r["index"] % self.k, "prompt": r["prompt"], "output": r["output"], "reward": r["reward"]}
                for r in rows]
        super().extend(recs)
        if self.file is not None:
            self.file.writelines(json.dumps(r) + "\n" for r in recs)
            self.file.flush()


def score_checkpoint(cfg: train.Config, out: str = "", limit: int = 0, samples: int = 1) -> dict:
    """Greedy and sampled completions of cfg.init_from on cfg's one task: its table row (records to `out`)."""
    task, sink = cfg.tasks, open_out(out) if out else None
    try:
        device, dtype = cli.setup(cfg)
        datasets = data.load_data(cfg)  # a missing or malformed file fails here, before the model loads
        if task in datasets and not limit:  # benchmarks: every row of the file unless --limit
            cfg = replace(cfg, eval_prompts=len(datasets[task]["test"]))
        scorer = RemoteScorer(cfg.image_scorer_url, cfg.image_scorer_timeout) if cfg.image_scorer_url else None
        model, tok, ids, _ = load.load_model(cfg, device, dtype, train.sft)
        load.report_truncation(cfg, tok, datasets)
        n = len(data.eval_examples(task, cfg, datasets))
        why = f"--eval_prompts={cfg.eval_prompts}" if task in tasks.TOY_TASKS else \
            f"the test split of {cfg.eval_data.split('=', 1)[-1]} is empty"
        cli.need(n, f"no {task} prompts to score ({why}); pass at least one")  # 0 samples would look like a result
        ctx = tasks.Ctx(cfg, tok, ids, device, datasets, scorer)
        modes = ([("greedy", 0.0, 1)] if task not in tasks.IMAGE_TASKS else []) + (  # images: no greedy decoding
            [("sampled", cfg.temperature, cfg.eval_samples)] if samples else [])
        records = []
        with cli.progress_bar(total=n * sum(k for *_, k in modes), desc=f"eval {task}", unit="completion",
                              leave=False) as bar:  # data.evaluate reports after each batch of (up to) 64
            for mode, temperature, k in modes:
                rows = Scored(task, mode, k, sink)
                data.evaluate(model, ctx, task, temperature, rows, bar.update)
                records += rows
    except KeyboardInterrupt:
        if sink is not None:
            sink.flush()
            print(f"interrupted (Ctrl-C): {sum(1 for _ in open(out))} scored completions in {out}", file=sys.stderr)
        raise
    finally:
        if sink is not None:
            sink.close()
    row = summarize(records)
    print(table(["task", "n", "greedy pass@1", f"pass@{row['k']}", "mean reward"],
                [[task, row["n"], row["greedy_pass@1"], row["pass@k"], row["mean_reward"]]]))
    return row


def compare(before: str, after: str) -> list[list]:
    """Rows [mode, prompts, before, after, gain, paired SE, gain / SE] of two --out files of the same prompts; the
    SE is sd(per-prompt difference) / sqrt(prompts): the spread both files share cancels."""
    def read(path):
        per: dict = {}
        for i, line in enumerate(Path(path).read_text().splitlines(), 1):
            try:
                r = json.loads(line)
                per.setdefault(r["mode"], {}).setdefault(r["prompt_index"], (r["prompt"], []))[1].append(r["reward"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path} line {i} is not an evaluate.py --out record; pass two --out files")
        return per
    a, b = read(before), read(after)
    mean = lambda per: sum(sum(v) for _, v in per.values()) / sum(len(v) for _, v in per.values())
    rows = []
    for mode in [m for m in ("greedy", "sampled") if m in a or m in b]:
        same = a.get(mode, {}).keys() == b.get(mode, {}).keys() and all(a[mode][j][0] == b[mode][j][0] for j in a[mode])
        cli.need(same, f"{before} and {after} hold other {mode} prompts; score both with the same Config (seed, "
                 "eval_prompts or --limit)")
        d = [sum(b[mode][j][1]) / len(b[mode][j][1]) - sum(a[mode][j][1]) / len(a[mode][j][1]) for j in a[mode]]
        n, gain = len(d), sum(d) / len(d)
        se = run.paired_se(d) if n > 1 else float("nan")
        rows.append([mode, n, mean(a[mode]), mean(b[mode]), gain, se, gain / se if se > 0 else None])
    return rows


def check_run(run_dir: str, **overrides) -> bool | None:
    """Re-score a run's before-RL and final models: True if all agree with summary.json, None if one is not measured."""
    out_dir = Path(run_dir)
    for f in ("config.json", "summary.json"):
        cli.need((out_dir / f).is_file(), f"{out_dir / f} not found; --run takes a finished train.py run's out_dir")
    raw = json.loads((out_dir / "config.json").read_text())
    unknown = sorted(set(raw) - {f.name for f in fields(train.Config)})
    cli.need(not unknown, f"{out_dir / 'config.json'} has fields unknown to train.Config: {unknown}; it was written "
             f"by another version of train.py (check it out, or delete those fields)")
    cfg = replace(train.Config(**raw), **overrides)  # RUN_OVERRIDES: threads, device
    cli.validate(cfg)
    summary = json.loads((out_dir / "summary.json").read_text())
    cli.need([k for k in summary if k != "seconds"],  # "all 0 numbers match" would pass on nothing
             f"{out_dir / 'summary.json'} holds no held-out reward (eval_prompts={cfg.eval_prompts}, eval_data="
             f"{cfg.eval_data!r}): nothing for --run to compare; score it with --ckpt={out_dir / 'final'} --task=TASK")
    device, dtype = cli.setup(cfg)
    datasets = data.load_data(cfg)
    scorer = RemoteScorer(cfg.image_scorer_url, cfg.image_scorer_timeout) if cfg.image_scorer_url else None
    # as train.main; LoRA: init_from + final/adapters.* is the trained policy (final/'s merged weights are rounded)
    start = cfg.init_from if cfg.init_from != "scratch" else cfg.sft_dir or str(out_dir / "sft")
    evals = {}
    for label in cli.progress_bar(("before", "after"), desc="checkpoints", leave=False):
        ckpt = start if label == "before" or cfg.lora_rank else str(out_dir / "final")
        cli.need(Path(ckpt).is_dir(), f"checkpoint directory not found: {ckpt} (the run's {label}-RL model)")
        model, tok, ids, _ = load.load_model(replace(cfg, init_from=ckpt), device, dtype, train.sft)
        if label == "after" and cfg.lora_rank:
            hf.load_adapters(model, out_dir / "final")
        evals[label] = data.evaluate_all(model.eval(), tasks.Ctx(cfg, tok, ids, device, datasets, scorer))
    keys = [k for k in summary if k != "seconds"] + sorted(set(evals["before"]) - set(summary))
    rows = [[k, *[x for s in ("before", "after") for x in (summary.get(k, {}).get(s), evals[s].get(k))]] for k in keys]
    ok = all(a is not None and b is not None and abs(a - b) <= 1e-6 for r in rows for a, b in (r[1:3], r[3:5]))
    print(table(["key", "summary before", "eval before", "summary after", "eval after"], rows))
    unmeasured = [f"{k} {s}" for s in evals for k, v in evals[s].items() if not math.isfinite(v)]
    if unmeasured:
        say_unmeasured(f"not measured: {', '.join(unmeasured)}", cfg)
        return None
    print(f"{'all' if ok else 'NOT all'} {2 * len(keys)} numbers match {out_dir / 'summary.json'} to 1e-6")
    return ok


def say_unmeasured(what: str, cfg) -> None:
    why = f"the image scorer at {cfg.image_scorer_url} failed" if cfg.image_scorer_url else "a reward was not finite"
    print(f"error: {what} ({why}, see the warnings above); fix that and evaluate again", file=sys.stderr)


def main(argv=None) -> int:
    """Exit code: 0 done (--run: all match), 1 a --run mismatch, 2 a user error, 3 a metric not measured, 130 Ctrl-C."""
    try:
        o = parse_options(argv)
        argv = argv if argv is not None else sys.argv[1:]
        if o.compare:
            extra = [a for i, a in enumerate(argv) if not a.startswith("--compare") and argv[i - 1:i] != ["--compare"]]
            cli.need(not extra, f"--compare reads two --out files and takes no other flag; drop {extra}")
            files = [f for f in o.compare.split(",") if f]
            cli.need(len(files) == 2 and all(Path(f).is_file() for f in files),
                     f"--compare takes two existing --out files, BEFORE.jsonl,AFTER.jsonl; got {o.compare!r}")
            print(table(["mode", "prompts", "before", "after", "gain", "paired SE", "gain / SE"], compare(*files)))
            return 0
        if o.run:
            given = [a.split("=")[0] for a in argv if a.startswith("--") and not a.startswith("--run")]
            extra = [g for g in given if g[2:] not in RUN_OVERRIDES]
            cli.need(not extra, f"--run re-scores with the run's own config.json, which {', '.join(extra)} would "
                     f"change; drop {'it' if len(extra) == 1 else 'them'} (it takes --{' and --'.join(RUN_OVERRIDES)})")
            ok = check_run(o.run, **{k: getattr(o, k) for k in RUN_OVERRIDES if f"--{k}" in given})
            return NOT_MEASURED_EXIT if ok is None else 0 if ok else 1
        cli.need(o.ckpt and o.task, "pass --ckpt DIR --task TASK [--data PATH], or --run OUT_DIR")
        cfg, samples = build_config(o)
        row = score_checkpoint(cfg, o.out, o.limit, samples)
        if row["unscored"]:
            say_unmeasured(f"{row['unscored']} completion(s) got no reward: their metrics are not measured", cfg)
        return NOT_MEASURED_EXIT if row["unscored"] else 0
    except (ValueError, OSError) as e:  # user errors (bad flag, missing file, scorer down): one line
        print(f"error: {e}", file=sys.stderr)
        return cli.USER_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    with scale.process_exit():  # leaves the process group on every path (infra/scale.py)
        sys.exit(main())
