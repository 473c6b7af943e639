"""Score a checkpoint on one task without training: greedy pass@1, sampled pass@k and mean reward.

    python evaluate.py --ckpt DIR --task gsm8k --data ../shared/data/gsm8k.jsonl [--limit N] [--samples K]
                       [--out FILE.jsonl] [--preset llada8b] [--gen_length=256 ...]    # any train.Config field
    python evaluate.py --ckpt out/toy/final --task text      # toy tasks draw held-out prompts from --seed
    python evaluate.py --run out/toy                         # re-score a run's sft/ and final/ vs summary.json

Tasks: gsm8k, math, countdown, sudoku, mbpp (sandboxed, rewards.REWARDS) and geneval (--image_scorer_url),
which read --data; the toy tasks text and image, which need none. Every completion comes from episodes.evaluate,
the function train.py scores its held-out sets with, so under the same Config the numbers are the run's own
(`--run` checks exactly that, and exits 1 if any differs by more than 1e-6). A completion counts as correct
when its reward is >= 1 - 1e-6; pass@k is Chen et al.'s unbiased estimator (arXiv:2107.03374, §2.1) with
n = k samples per prompt at the config temperature; mean reward averages the sampled completions (the
number train.py logs as the held-out reward). Image tasks have no greedy decoding (the image samplers always
draw), so their greedy column is empty. Single process; user errors print one line and exit with code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields, replace
from pathlib import Path

from tqdm import tqdm

from infra import data
from infra import episodes
from infra import lora
from infra import scale
import train
from infra.scorer import RemoteScorer

CORRECT_TOL = 1e-6  # reward >= 1 - CORRECT_TOL is a solved prompt (float32 rewards of exactly 1 pass)
TASKS = episodes.TOY_TASKS + data.TASKS


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n completions of which c are correct (Chen et al. 2021, §2.1):
    1 - C(n - c, k) / C(n, k). With n = k it is 1 when c > 0, else 0."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # comb(n - c, k) is 0 when k > n - c


def summarize(records: list[dict]) -> dict:
    """One task's table row from its records (mode, prompt_index, reward): n prompts, k samples per
    prompt, greedy pass@1, pass@k and the mean sampled reward (None where there are no such records)."""
    greedy = [r["reward"] >= 1 - CORRECT_TOL for r in records if r["mode"] == "greedy"]
    by_prompt: dict[int, list[float]] = {}
    for r in records:
        if r["mode"] == "sampled":
            by_prompt.setdefault(r["prompt_index"], []).append(r["reward"])
    ks = {len(v) for v in by_prompt.values()}
    if len(ks) > 1:
        raise ValueError(f"prompts have different numbers of samples {sorted(ks)}; pass@k needs the same k for all")
    k = ks.pop() if ks else 0
    solved = [pass_at_k(k, sum(x >= 1 - CORRECT_TOL for x in v), k) for v in by_prompt.values()]
    rewards_all = [x for v in by_prompt.values() for x in v]
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    return {"n": len(by_prompt) or len(greedy), "k": k, "greedy_pass@1": mean(greedy), "pass@k": mean(solved),
            "mean_reward": mean(rewards_all)}


def table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.6f}" if isinstance(v, float) else str(v)
    lines = [header, ["---"] * len(header)] + [[fmt(v) for v in row] for row in rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def build_config(args, overrides: list[str]) -> train.Config:
    """train.parse_args over --preset / --field=value overrides, plus what --ckpt/--task/--data imply."""
    known = {f.name for f in fields(train.Config)} | {"preset"}
    bad, takes_value = [], False  # a bare token is only allowed as the value of a preceding --field
    for a in overrides:
        if a.startswith("--"):
            bad += [] if a[2:].split("=")[0] in known else [a]
            takes_value = "=" not in a
        else:
            bad += [] if takes_value else [a]
            takes_value = False
    if bad:
        raise ValueError(f"unknown argument(s) {bad}; evaluate.py takes --ckpt/--task/--data/--limit/--samples/"
                         f"--out/--run, --preset NAME and train.Config fields as --field=value")
    if args.task not in TASKS:
        raise ValueError(f"unknown task {args.task!r}; choose one of {', '.join(TASKS)}")
    if not Path(args.ckpt).is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {args.ckpt} (pass a folder with config.json, "
                                f"*.safetensors and tokenizer.json, e.g. out/toy/final)")
    toy = args.task in episodes.TOY_TASKS
    if toy == bool(args.data):
        raise ValueError(f"task {args.task!r} " + ("draws its held-out prompts from --seed: drop --data" if toy
                                                   else "reads its prompts from a local file: pass --data PATH"))
    for name in ("limit", "samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name} ({getattr(args, name)}) must be >= 1")
    # load_data keys on train_data, so the evaluation file is given as both (only "test" is scored).
    implied = [f"--init_from={args.ckpt}", f"--tasks={args.task}"]
    implied += [] if toy else [f"--train_data={args.task}={args.data}", f"--eval_data={args.task}={args.data}"]
    implied += [f"--eval_samples={args.samples}"] if args.samples else []
    implied += [f"--eval_prompts={args.limit}"] if args.limit else []
    cfg = train.parse_args(overrides + implied)  # ours last: argparse keeps the last value of a flag
    if cfg.temperature <= 0:  # episodes.evaluate then draws one completion per prompt: there is no pass@k
        raise ValueError(f"temperature ({cfg.temperature}) must be > 0 for sampled pass@k; e.g. --temperature=1")
    return cfg


def score_checkpoint(cfg: train.Config, out: str | None = None, limit: int | None = None) -> tuple[dict, list]:
    """Greedy and sampled completions of cfg.init_from on the single task of cfg: (table row, records)."""
    task = cfg.tasks
    device, dtype = train.setup(cfg)
    datasets = episodes.load_data(cfg)  # a missing or malformed file fails here, before the model loads
    if task in datasets and limit is None:  # benchmarks: every row of the file unless --limit
        cfg = replace(cfg, eval_prompts=len(datasets[task]["test"]))
    scorer = RemoteScorer(cfg.image_scorer_url) if cfg.image_scorer_url else None
    model, tok, sp, _ = train.load_model(cfg, device, dtype)
    n = len(episodes.eval_examples(task, cfg, datasets))
    modes = [("sampled", cfg.temperature, cfg.eval_samples)]
    if task not in episodes.IMAGE_TASKS:  # as episodes.evaluate_all: images have no greedy decoding
        modes.insert(0, ("greedy", 0.0, 1))
    records = []
    # The bar counts completions; episodes.evaluate reports after each batch of (up to) 64.
    with tqdm(total=n * sum(k for *_, k in modes), desc=f"eval {task}", unit="completion", leave=False) as bar:
        for mode, temperature, k in modes:
            rows: list[dict] = []
            episodes.evaluate(model, tok, sp, cfg, device, task, temperature, datasets, scorer, rows, bar.update)
            # episodes.evaluate repeats each prompt k times consecutively: row index = prompt index * k + sample.
            records += [{"task": task, "mode": mode, "prompt_index": r["index"] // k, "sample": r["index"] % k,
                         "prompt": r["prompt"], "output": r["output"], "reward": r["reward"]} for r in rows]
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    row = summarize(records)
    print(table(["task", "n", "greedy pass@1", f"pass@{row['k']}", "mean reward"],
                [[task, row["n"], row["greedy_pass@1"], row["pass@k"], row["mean_reward"]]]))
    return row, records


def check_run(run_dir: str) -> bool:
    """Re-score a train.py run with its own config.json: the model before RL (the SFT model, or init_from)
    and final/ after, through episodes.evaluate_all; print them beside summary.json. True if all agree."""
    run = Path(run_dir)
    for f in ("config.json", "summary.json"):
        if not (run / f).is_file():
            raise FileNotFoundError(f"{run / f} not found; --run takes the out_dir of a finished train.py run")
    raw = json.loads((run / "config.json").read_text())
    unknown = sorted(set(raw) - {f.name for f in fields(train.Config)})
    if unknown:
        raise ValueError(f"{run / 'config.json'} has fields unknown to train.Config: {unknown}; it was written by "
                         f"another version of train.py (check it out, or delete those fields)")
    cfg = train.Config(**raw)
    train.validate(cfg)
    summary = json.loads((run / "summary.json").read_text())
    device, dtype = train.setup(cfg)
    datasets = episodes.load_data(cfg)
    scorer = RemoteScorer(cfg.image_scorer_url) if cfg.image_scorer_url else None
    # As train.main: the RL start is the SFT model for scratch runs, else init_from. LoRA runs start from
    # init_from with zero adapters (the same outputs) and end as init_from + final/adapters.*, the exact
    # record of the trained policy (final/'s merged weights differ from it by rounding).
    start = cfg.init_from if cfg.init_from != "scratch" else cfg.sft_dir or str(run / "sft")
    evals = {}
    for label in tqdm(("before", "after"), desc="checkpoints", leave=False):
        ckpt = start if label == "before" or cfg.lora_rank else str(run / "final")
        if not Path(ckpt).is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {ckpt} (the run's {label}-RL model)")
        model, tok, sp, _ = train.load_model(replace(cfg, init_from=ckpt), device, dtype)
        if label == "after" and cfg.lora_rank:
            lora.load_adapters(model, run / "final")
        evals[label] = episodes.evaluate_all(model.eval(), tok, sp, cfg, device, datasets, scorer)
    keys = [k for k in summary if k != "seconds"] + sorted(set(evals["before"]) - set(summary))
    rows, ok = [], True
    for k in keys:
        pair = [(summary.get(k, {}).get(s), evals[s].get(k)) for s in ("before", "after")]
        ok &= all(a is not None and b is not None and abs(a - b) <= 1e-6 for a, b in pair)
        rows.append([k, pair[0][0], pair[0][1], pair[1][0], pair[1][1]])
    print(table(["key", "summary before", "eval before", "summary after", "eval after"], rows))
    print(f"{'all' if ok else 'NOT all'} {2 * len(keys)} numbers match {run / 'summary.json'} to 1e-6")
    return ok


def main(argv=None) -> int:
    """Exit code: 0 done (and, with --run, every number matches), 1 a --run mismatch, 2 a user error."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Any train.Config field may follow as --field=value, and --preset NAME.")
    p.add_argument("--ckpt", help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--task", help=f"one of {', '.join(TASKS)}")
    p.add_argument("--data", help="local benchmark file in its public format (data.py); not for toy tasks")
    p.add_argument("--limit", type=int, help="first N prompts (default: the whole file; toy: eval_prompts)")
    p.add_argument("--samples", type=int, help="k, sampled completions per prompt (default: eval_samples)")
    p.add_argument("--out", help="write one JSON line per completion here")
    p.add_argument("--run", help="out_dir of a train.py run: re-score it and compare with its summary.json")
    args, overrides = p.parse_known_args(argv)
    try:
        if args.run:
            given = [f"--{n}" for n in ("ckpt", "task", "data", "limit", "samples", "out") if getattr(args, n)]
            if given or overrides:
                raise ValueError(f"--run re-scores with the run's own config.json; drop {given + overrides}")
            return 0 if check_run(args.run) else 1
        if not (args.ckpt and args.task):
            raise ValueError("pass --ckpt DIR --task TASK [--data PATH], or --run OUT_DIR")
        score_checkpoint(build_config(args, overrides), args.out, args.limit)
        return 0
    except (ValueError, OSError) as e:  # user errors (bad flag, missing file, scorer down): one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        scale.close()


if __name__ == "__main__":
    sys.exit(main())
