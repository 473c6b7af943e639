"""The data: local benchmark files -> checked example dicts with their prompt; the held-out evaluation on them.
MaskGRPO (arXiv:2510.02880) uses GSM8K, MATH(500), MBPP-style code, d1's countdown and 4x4 sudoku, and GenEval
prompts; files are never downloaded, every row is checked before any model loads (`file:line: problem`). An example
is what `rewards.REWARDS[task](completion, example)` receives, plus "prompt", the user turn before the chat template:

    gsm8k      {"task", "prompt", "question", "answer": "1200"}               (the `#### N` number, no commas)
    math       {"task", "prompt", "question", "answer": "\\frac{1}{2}"}       (LaTeX; `answer` or last \\boxed{})
    mbpp       {"task", "prompt", "question", "test_list": [str], "test_setup_code": str}   (+ "entry_point")
    countdown  {"task", "prompt", "numbers": [30, 100, 93], "target": 23}
    sudoku     {"task", "prompt", "puzzle": "3102...", "solution": "3142..."}  (16 digits row by row, 0 = empty)
    geneval    {"task", "prompt": "a photo of a cow", "spec": {"tag", "include", ...}}
"""
import csv
import json
import random
import re
import sys
from pathlib import Path

import torch

import tasks
from infra import cli, scale
from rewards import extract_boxed
from sample import derive_seed, generator, rollout
from infra.cli import data_paths

TASKS = ("gsm8k", "math", "mbpp", "countdown", "sudoku", "geneval")
MAX_REPORTED = 5  # problems listed per error; the rest are only counted
# the user turn, paraphrasing the official instructions (d1, arXiv:2504.12216, for countdown and sudoku)
REPLY_FORMAT = "Reply in this format:\n<reasoning>\nyour step-by-step reasoning\n</reasoning>\n{}"
MATH_INSTRUCTION = ("You are good at mathematics. Work through the question below step by step and put the final "
                    "answer inside \\boxed{}. " + REPLY_FORMAT.format("\\boxed{final answer}"))
CODER = "You are an expert Python programmer."


def _collect(path: Path, numbered, parse) -> list:
    """parse(item) for each (line number, item); ValueErrors become `file:line: problem`, raised together."""
    out, problems = [], []
    for lineno, item in numbered:
        try:
            out.append(parse(item))
        except ValueError as e:
            problems.append(f"{path}:{lineno}: {e}")
    if problems:
        more = len(problems) - MAX_REPORTED
        raise ValueError(f"{len(problems)} malformed row(s) in {path}:\n  " + "\n  ".join(problems[:MAX_REPORTED])
                         + (f"\n  ... and {more} more" if more > 0 else ""))
    if not out:
        raise ValueError(f"{path}: the file is empty (no rows); expected one example per line")
    return out


def _json_object(line: bytes) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"bad JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e.reason})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    return row


def _csv_rows(path: Path):
    # utf-8-sig: spreadsheet exports start with a BOM; a bad byte becomes U+FFFD and fails the digit check
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        reader = csv.DictReader(f)
        header = [name.strip().lower() for name in reader.fieldnames or []]
        if not header:
            return  # _collect reports the empty file
        if missing := [c for c in ("puzzle", "solution") if c not in header]:
            raise ValueError(f"{path}:1: missing column {missing[0]!r} (header: {','.join(reader.fieldnames)})")
        reader.fieldnames = header
        yield from ((reader.line_num, row) for row in reader)


def _get(row: dict, name: str, types):
    """row[name], or ValueError saying which field is missing or has the wrong type."""
    if name not in row:
        raise ValueError(f"missing field {name!r} (the row has: {', '.join(sorted(row)) or 'nothing'})")
    if not isinstance(value := row[name], types) or isinstance(value, bool):
        wanted = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise ValueError(f"field {name!r} should be {wanted}, got {type(value).__name__} {value!r:.60}")
    return value


def _int(value, name: str) -> int:
    if type(value) is int or isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):  # JSON: bool is no int
        return int(value)
    raise ValueError(f"{name} should be an integer, got {value!r:.60}")


def _gsm8k(row: dict) -> dict:
    # openai/gsm8k: the worked solution ends in "#### 1,200"; a bare number is accepted too.
    question, solution = _get(row, "question", str), _get(row, "answer", str)
    final = solution.rsplit("####", 1)[-1].strip().replace(",", "")
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", final):
        raise ValueError(f"field 'answer' should end in '#### <number>', got ...{solution[-60:]!r}")
    return {"task": "gsm8k", "question": question, "answer": final,
            "prompt": f"{MATH_INSTRUCTION}\n\nQuestion: {question}"}


def _math(row: dict) -> dict:
    # MATH500 rows carry "answer"; Hendrycks MATH rows carry a "solution" whose last \boxed{} is the answer.
    question = _get(row, "problem", str)
    if "answer" not in row and "solution" not in row:
        raise ValueError(f"missing field 'answer' or 'solution' (the row has: {', '.join(sorted(row))})")
    answer = _get(row, "answer", str) if "answer" in row else extract_boxed(_get(row, "solution", str))
    if answer is None:
        raise ValueError("field 'solution' has no closed \\boxed{...} final answer")
    if not answer.strip():
        raise ValueError("the answer is empty")
    return {"task": "math", "question": question, "answer": answer.strip(),
            "prompt": f"{MATH_INSTRUCTION}\n\nQuestion: {question}"}


def _mbpp(row: dict) -> dict:
    if "entry_point" in row:  # HumanEval-style: `test` defines check(candidate); calling it is the one test
        entry, question = _get(row, "entry_point", str), _get(row, "prompt", str)
        return {"task": "mbpp", "question": question, "entry_point": entry,
                "test_list": [f"{_get(row, 'test', str)}\n\ncheck({entry})\n"], "test_setup_code": "",
                "prompt": f"{CODER} Complete the function below; keep its name `{entry}` and its signature, and reply "
                f"with the whole function in one ```python code block.\n\n{question}"}
    tests = _get(row, "test_list", list)
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"field 'test_list' should be a non-empty list of str, got {tests!r:.60}")
    setup = _get(row, "test_setup_code", str) if "test_setup_code" in row else ""
    question, listed = _get(row, "text", str), "\n".join(tests)
    return {"task": "mbpp", "question": question, "test_list": tests, "test_setup_code": setup,
            "prompt": f"{CODER} Your task: {question}\nYour code should pass these tests:\n\n{listed}\n\n"
            "Reply with the solution in one ```python code block."}


def _countdown(row: dict) -> dict:
    # d1 test files: {"input": "30,100,93", "output": "23"}; {"nums": [...], "target": 23} is accepted too.
    numbers = _get(row, "input" if "input" in row or "nums" not in row else "nums", (str, list))
    numbers = numbers.split(",") if isinstance(numbers, str) else numbers
    target = _get(row, "output" if "output" in row or "target" not in row else "target", (str, int))
    if not numbers:
        raise ValueError("the list of numbers is empty")
    numbers, target = [_int(n, "each number") for n in numbers], _int(target, "the target")
    return {"task": "countdown", "numbers": numbers, "target": target,
            "prompt": f"Using the numbers {numbers}, each exactly once, and the operations +, -, * and / (parentheses "
            f"allowed), write an expression equal to {target}. "
            + REPLY_FORMAT.format("<answer>\nthe expression\n</answer>")}


# rows, columns and 2x2 boxes of a 4x4 grid stored row by row
_UNITS = ([[4 * r + c for c in range(4)] for r in range(4)] + [[4 * r + c for r in range(4)] for c in range(4)]
          + [[4 * (r0 + r) + c0 + c for r in (0, 1) for c in (0, 1)] for r0 in (0, 2) for c0 in (0, 2)])


def _sudoku(row: dict) -> dict:
    puzzle, solution = (str(row.get(k) or "").strip() for k in ("puzzle", "solution"))
    for name, grid, digits, note in (("puzzle", puzzle, "0-4", " (0 = empty cell)"), ("solution", solution, "1-4", "")):
        if not re.fullmatch(f"[{digits}]{{16}}", grid):
            raise ValueError(f"{name} {grid!r:.40} should be 16 digits {digits}{note}")
    if any(p not in ("0", s) for p, s in zip(puzzle, solution)):
        raise ValueError("the solution contradicts a given digit of the puzzle")
    if any(sorted(solution[i] for i in unit) != list("1234") for unit in _UNITS):
        raise ValueError("the solution repeats a digit in a row, column or 2x2 box")
    rows = "\n".join(puzzle[i:i + 4] for i in range(0, 16, 4))
    return {"task": "sudoku", "puzzle": puzzle, "solution": solution,
            "prompt": "Solve this 4x4 Sudoku: every row, every column and every 2x2 box must hold the digits 1-4 "
            f"exactly once. The grid, row by row, with 0 for an empty cell:\n{rows}\n"
            + REPLY_FORMAT.format("<answer>\nthe 16 digits of the solved grid, row by row\n</answer>")}


def _geneval(row: dict) -> dict:
    # GenEval metadata: {"tag", "include": [{"class", "count", ...}], "exclude"?, "prompt"}
    prompt, include = _get(row, "prompt", str), _get(row, "include", list)
    if not include or not all(isinstance(o, dict) and isinstance(o.get("class"), str) for o in include):
        raise ValueError(f"field 'include' should be a non-empty list of {{'class': ...}} objects, got {include!r:.60}")
    return {"task": "geneval", "prompt": prompt, "spec": {k: v for k, v in row.items() if k != "prompt"}}


_PARSERS = {parse.__name__[1:]: parse for parse in (_gsm8k, _math, _mbpp, _countdown, _sudoku, _geneval)}


def load_dataset(task: str, path) -> list[dict]:
    """Checked examples of a local `task` file, each with its "prompt": sudoku's a puzzle,solution CSV, else .jsonl."""
    if task not in _PARSERS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path} (this project never downloads data; "
                                f"give the path of a local copy in the public format, see data.py)")
    if task == "sudoku":
        return _collect(path, _csv_rows(path), _sudoku)
    with open(path, "rb") as f:  # bytes: a non-UTF-8 line is then one reported problem, not a crash
        lines = [(lineno, line) for lineno, line in enumerate(f, 1) if line.strip()]
    return _collect(path, lines, lambda line: _PARSERS[task](_json_object(line)))


def load_data(cfg) -> dict:
    """{task: {"train": examples, "test": examples}} for the benchmark tasks, read and checked before any model."""
    evals = data_paths(cfg.eval_data, "eval_data")
    return {task: {"train": load_dataset(task, path), "test": load_dataset(task, evals[task]) if task in evals else []}
            for task, path in data_paths(cfg.train_data, "train_data").items()}


# held-out evaluation: the mean reward on held-out prompts before and after RL, and of checkpoints (evaluate.py)
GRID_PROMPTS = 6  # toy image prompts drawn before and after RL for out_dir/images.png


def eval_examples(task: str, cfg, datasets: dict) -> list:
    """The held-out prompts: fixed toy draws from the test split, or the first eval_prompts of eval_data."""
    if task in tasks.TOY_TASKS:
        rng = random.Random(derive_seed(cfg.seed, "eval", task))
        return [tasks.make_example(task, rng, cfg, "test") for _ in range(cfg.eval_prompts)]
    return datasets.get(task, {}).get("test", [])[: cfg.eval_prompts]


def evaluate(model, ctx: tasks.Ctx, task: str, temperature: float, records: list | None = None,
             progress=lambda n: None, prompt_means: list | None = None, stop=lambda: None) -> float | None:
    """Held-out mean reward (None without a held-out set) of eval_samples completions per prompt (1 greedy), each
    seeded by its index, ranks interleaving each 64-row batch. records gets this rank's rows; prompt_means each
    prompt's mean (for a paired standard error); progress(n) follows each batch of n rows, stop() precedes it."""
    cfg, device = ctx.cfg, ctx.device
    exs = eval_examples(task, cfg, ctx.datasets)
    if not exs:
        return None
    k = cfg.eval_samples if temperature > 0 else 1
    per_prompt = torch.zeros(len(exs), dtype=torch.float64, device=device)  # summed reward of each prompt
    exs = [ex for ex in exs for _ in range(k)]
    total = torch.zeros(1, dtype=torch.float64, device=device)  # the sum of the rewards (every row is one rank's)
    with scale.full_weights(model):  # on every rank, also one without rows in a batch (sample.rollout's is a no-op)
        for i in range(0, len(exs), 64):
            stop()
            mine = slice(scale.rank(), None, scale.world())
            b = tasks.make_batch(task, exs[i:i + 64], ctx.tok, ctx.ids, cfg, device, with_targets=False).rows(mine)
            idx = list(range(i, min(i + 64, len(exs))))[mine]
            if not idx:
                continue
            gens = [generator(device, cfg.seed, "eval-sampling", task, temperature, j) for j in idx]
            b, _ = rollout(model, b, ctx, gens, temperature)
            r = tasks.score(b, tasks.verifier(task, cfg.text_reward), ctx.tok, ctx.ids, ctx.scorer)
            total += r.sum().item()
            per_prompt.index_add_(0, torch.tensor([j // k for j in idx], device=device), r.to(device, torch.float64))
            progress(len(idx))
            if records is not None:
                outs = tasks.decode_window(b, ctx.tok, ctx.ids)
                records.extend({"index": j, "prompt": ex["prompt"], "output": o, "reward": float(v)}
                               for j, ex, o, v in zip(idx, b.examples, outs, r.tolist()))
    if prompt_means is not None:
        prompt_means.extend((scale.all_sum(per_prompt) / k).tolist())
    return (scale.all_sum(total) / len(exs)).item()


def evaluate_all(model, ctx: tasks.Ctx, prompt_means: dict | None = None, stop=lambda: None) -> dict:
    """Held-out mean reward per task, sampled and (text) greedy, if it has held-out data; prompt_means: per key."""
    res = {}
    for task in tasks.task_list(ctx.cfg):
        greedy = () if task in tasks.IMAGE_TASKS else ((f"{task}_greedy", 0.0),)  # images have no greedy decoding
        for key, temperature in ((task, ctx.cfg.temperature), *greedy):
            means = []
            if (r := evaluate(model, ctx, task, temperature, prompt_means=means, stop=stop)) is None:
                break
            res[key] = r
            if prompt_means is not None:
                prompt_means[key] = means
    return res


def image_snapshot(model, ctx: tasks.Ctx) -> list | None:
    """Toy images of the first GRID_PROMPTS held-out prompts, fixed generators: before and after differ by policy."""
    if "image" not in tasks.task_list(ctx.cfg) or not (exs := eval_examples("image", ctx.cfg, {})[:GRID_PROMPTS]):
        return None
    b = tasks.make_batch("image", exs, ctx.tok, ctx.ids, ctx.cfg, ctx.device, with_targets=False)
    gens = [generator(ctx.device, ctx.cfg.seed, "grid", i) for i in range(len(exs))]
    return tasks.decode_window(rollout(model, b, ctx, gens, ctx.cfg.temperature)[0], ctx.tok, ctx.ids)


def main(argv=None) -> list[dict]:
    """python -m infra.data TASK PATH: check a file, print its size and first prompt."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: python -m infra.data TASK PATH\n\nCheck a {' | '.join(TASKS)} file in its public format "
              "(every malformed row is named with its line), print its size and first prompt.")
        return []
    if len(argv) != 2:
        raise ValueError(f"usage: python -m infra.data TASK PATH   (TASK: {' | '.join(TASKS)}); got {argv}")
    data = load_dataset(*argv)
    print(f"{len(data)} valid {argv[0]} examples; the first prompt:\n\n{data[0]['prompt']}")
    return data


if __name__ == "__main__":
    with cli.user_errors():
        main()
