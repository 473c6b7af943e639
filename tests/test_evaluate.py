"""evaluate.py: --run reproduces a run's summary.json, the per-completion JSONL of every benchmark task,
pass@k on hand-made records, and one-line errors for bad input.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_evaluate.py
"""
import json
import re
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from infra import data
import evaluate
import train

pytestmark = pytest.mark.usefixtures("undrawn_figures")  # no test here checks a picture's pixels

FIXTURES = Path(__file__).parent / "fixtures" / "data"
ROOT = Path(__file__).resolve().parent.parent
KEYS = {"task", "mode", "prompt_index", "sample", "prompt", "output", "reward"}
# Short rollouts for the benchmark prompts (the toy model is not expected to solve them).
FAST = ["--preset", "smoke", "--threads=1", "--gen_length=16", "--block_length=16", "--steps=8"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, smoke_sft_run):
    """A finished smoke run of train.py (final/, config.json and summary.json) from the session's smoke SFT
    model, passed as --sft_dir (so --run finds the before-RL model there)."""
    d = tmp_path_factory.mktemp("run")
    train.main(["--preset", "smoke", f"--out_dir={d}", "--threads=1", "--rl_steps=1", "--eval_prompts=8",
                "--eval_samples=2", f"--sft_dir={smoke_sft_run / 'sft'}"])
    return d


def test_summary_gain_se_is_paired_by_prompt(run_dir, smoke_sft_run, tmp_path):
    """summary.json's gain_se is sd(after - before) / sqrt(prompts) over the per-prompt mean rewards: here
    from evaluate.py --out records of sft/ and final/, averaged per prompt and differenced by hand."""
    import statistics
    summary = json.loads((run_dir / "summary.json").read_text())
    seen = []
    for task in ("text", "image"):
        per = {}
        for label, ckpt in (("sft", smoke_sft_run / "sft"), ("final", run_dir / "final")):
            out = tmp_path / f"{task}-{label}.jsonl"
            assert evaluate.main(["--preset", "smoke", "--threads=1", "--eval_prompts=8", "--eval_samples=2",
                                  "--ckpt", str(ckpt), "--task", task, "--out", str(out)]) == 0
            for r in map(json.loads, out.read_text().splitlines()):
                per.setdefault((r["mode"], label), {}).setdefault(r["prompt_index"], []).append(r["reward"])
        for mode, key in (("sampled", task), ("greedy", f"{task}_greedy")):
            if (mode, "sft") not in per:
                continue
            before, after = per[(mode, "sft")], per[(mode, "final")]
            assert len(before) == 8 and all(len(v) == (2 if mode == "sampled" else 1) for v in before.values())
            d = [statistics.mean(after[j]) - statistics.mean(before[j]) for j in sorted(before)]
            assert summary[key]["after"] - summary[key]["before"] == pytest.approx(statistics.mean(d), abs=1e-12)
            assert summary[key]["gain_se"] == pytest.approx(statistics.stdev(d) / len(d) ** 0.5, abs=1e-12)
            seen.append(summary[key]["gain_se"])
    assert len(seen) == 3


def test_paired_se_by_hand():
    # d = [1, 0, 0]: mean 1/3, sample variance ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, SE = sqrt(1/3) / sqrt(3) = 1/3
    from infra.run import paired_se
    assert paired_se([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)


def test_run_mode_reproduces_summary(run_dir, tmp_path, capsys):
    """sft/ and final/ re-scored with the run's config give summary.json's numbers;
    a summary that disagrees exits 1, and a config field train.Config lacks is named (exit 2)."""
    assert evaluate.main(["--run", str(run_dir)]) == 0
    out = capsys.readouterr().out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"all {2 * (len(summary) - 1)} numbers match" in out and "| text_greedy |" in out

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    summary["image"]["after"] += 0.01
    (copy / "summary.json").write_text(json.dumps(summary))
    assert evaluate.main(["--run", str(copy)]) == 1
    assert "NOT all" in capsys.readouterr().out

    config = json.loads((copy / "config.json").read_text()) | {"bogus_field": 1}
    (copy / "config.json").write_text(json.dumps(config))
    assert evaluate.main(["--run", str(copy)]) == 2
    assert "['bogus_field']" in capsys.readouterr().err


@pytest.mark.parametrize("task,file,limit", [("gsm8k", "gsm8k.jsonl", None), ("math", "math.jsonl", 2),
                                             ("countdown", "countdown.jsonl", None), ("sudoku", "sudoku.csv", None),
                                             ("mbpp", "mbpp.jsonl", None)])
def test_benchmark_jsonl(run_dir, tmp_path, capsys, task, file, limit):
    """One row per (prompt, sample): greedy once and k = 2 samples per prompt, the documented keys, rewards
    in [0, 1], prompts in file order (the whole file, or the first --limit rows), and the table row."""
    out = tmp_path / "rows.jsonl"
    argv = ["--ckpt", str(run_dir / "final"), "--task", task, "--data", str(FIXTURES / file), "--samples", "2",
            "--out", str(out), *FAST] + (["--limit", str(limit)] if limit else [])
    assert evaluate.main(argv) == 0
    examples = data.load_dataset(task, FIXTURES / file)[:limit]
    n = len(examples)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["mode"], r["prompt_index"], r["sample"]) for r in rows) == sorted(
        [("greedy", i, 0) for i in range(n)] + [("sampled", i, s) for i in range(n) for s in range(2)])
    for r in rows:
        assert set(r) == KEYS and r["task"] == task and isinstance(r["output"], str)
        assert 0.0 <= r["reward"] <= 1.0 and r["prompt"] == examples[r["prompt_index"]]["prompt"]
    mean = sum(r["reward"] for r in rows if r["mode"] == "sampled") / (2 * n)
    assert f"| {task} | {n} | " in capsys.readouterr().out
    assert evaluate.summarize(rows)["mean_reward"] == pytest.approx(mean)


def test_pass_at_k_by_hand():
    """Three prompts, k = 2: prompt 0 has a correct sample, prompt 1 only near misses (0.999 is below the
    1 - 1e-6 bar), prompt 2 a sample within the tolerance; greedy solves prompt 0 only."""
    def rec(mode, i, s, reward):
        return {"task": "t", "mode": mode, "prompt_index": i, "sample": s, "prompt": "", "output": "", "reward": reward}
    records = [rec("greedy", 0, 0, 1.0), rec("greedy", 1, 0, 0.0), rec("greedy", 2, 0, 0.5),
               rec("sampled", 0, 0, 0.0), rec("sampled", 0, 1, 1.0),
               rec("sampled", 1, 0, 0.5), rec("sampled", 1, 1, 0.999),
               rec("sampled", 2, 0, 1 - 1e-7), rec("sampled", 2, 1, 0.0)]
    row = evaluate.summarize(records)
    assert (row["n"], row["k"]) == (3, 2)
    assert row["greedy_pass@1"] == pytest.approx(1 / 3) and row["pass@k"] == pytest.approx(2 / 3)
    assert row["mean_reward"] == pytest.approx((1.0 + 0.5 + 0.999 + 1 - 1e-7) / 6)
    # Image tasks have no greedy rows: the greedy column is empty, the rest is unchanged.
    assert evaluate.summarize(records[3:])["greedy_pass@1"] is None
    # Chen et al.'s estimator: 1 - C(n - c, k) / C(n, k); with n = k it is "any correct".
    assert evaluate.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert evaluate.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert evaluate.pass_at_k(3, 0, 3) == 0.0 and evaluate.pass_at_k(3, 1, 3) == 1.0
    with pytest.raises(ValueError, match="different numbers of samples"):
        evaluate.summarize(records + [rec("sampled", 0, 2, 1.0)])


@pytest.mark.parametrize("argv,match", [
    (["--ckpt", "/no/such/dir", "--task", "gsm8k", "--data", "x.jsonl"], "checkpoint directory not found: /no/such/dir"),
    (["--task", "gsm9k", "--data", "x.jsonl"], "unknown task 'gsm9k'; choose one of"),
    (["--task", "gsm8k", "--data", "/no/such/file.jsonl"], "dataset file not found: /no/such/file.jsonl"),
    (["--task", "gsm8k"], "pass --data PATH"),
    (["--task", "text", "--data", "x.jsonl"], "drop --data"),
    (["--task", "text", "--no_such_field=1"], r"unknown argument\(s\) \['--no_such_field=1'\]"),
    (["--task", "text", "--temperature=0"], r"temperature \(0.0\) must be > 0"),
    (["--run", "/no/such/run"], "/no/such/run/config.json not found"),
    (["--task", "text", "--limit=-1"], r"--limit \(-1\) must be >= 0"),
    (["--task", "text", "--samples=-2"], r"--samples \(-2\) >= 0"),
    ([], r"pass --ckpt DIR --task TASK"),
    (["--compare=a.jsonl"], r"--compare takes two existing --out files"),
    (["--run", "/no/such/run", "--seed=1"], r"--run re-scores with the run's own config.json, which --seed would change; drop it"),
])
def test_bad_input_is_one_line(run_dir, capsys, argv, match):
    if "--task" in argv and "--ckpt" not in argv:
        argv = ["--ckpt", str(run_dir / "final"), *argv]
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert re.search(match, err), err


@pytest.mark.slow  # a new interpreter that imports torch: seconds on a shared CPU
def test_cli_exit_code():
    """The command itself: exit code 2 and one line on stderr, no traceback."""
    p = subprocess.run([sys.executable, str(ROOT / "evaluate.py"), "--ckpt", "/no/such/dir", "--task", "text"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: checkpoint directory not found")
    assert "\n" not in p.stderr.strip()


@pytest.mark.parametrize("task,want", [
    # The official MaskGRPO evaluation of GSM8K / MATH500: greedy, 256 tokens in blocks of 16 with
    # 128 steps, the answer turn opened with "<reasoning>"; GenEval: 4 images per prompt, 32 emerge
    # steps, CFG 3.5.
    ("gsm8k", {"gen_length": 256, "block_length": 16, "steps": 128, "prompt_prefill": "<reasoning>", "samples": 0}),
    ("math", {"gen_length": 256, "block_length": 16, "steps": 128, "prompt_prefill": "<reasoning>", "samples": 0}),
    ("geneval", {"image_steps": 32, "image_sampler": "emerge", "cfg_scale": 3.5, "samples": 4}),
])
def test_official_evaluation_defaults(task, want, tmp_path):
    o = evaluate.parse_options(["--ckpt", str(tmp_path), "--task", task])
    assert {k: getattr(o, k) for k in want} == want
    # a flag still wins
    assert evaluate.parse_options(["--ckpt", str(tmp_path), "--task", task, "--steps=64"]).steps == 64


def test_checkpoint_generation_settings_are_the_defaults(tmp_path):
    """A toy checkpoint's generation.json sets the defaults of a toy task; a benchmark task's official
    settings come on top of it."""
    (tmp_path / "generation.json").write_text(json.dumps({"tasks": "text", "gen_length": 12, "block_length": 12,
                                                          "steps": 12}))
    o = evaluate.parse_options(["--ckpt", str(tmp_path), "--task", "text"])
    assert (o.gen_length, o.block_length, o.steps) == (12, 12, 12)
    o = evaluate.parse_options(["--ckpt", str(tmp_path), "--task", "gsm8k"])
    assert (o.gen_length, o.block_length, o.steps) == (256, 16, 128)


def test_compare_pairs_prompts_by_hand(tmp_path, capsys):
    """--compare on hand-made records. Prompt 0: 2 samples 0,0 -> 1,1 (diff +1); prompt 1: 1,1 -> 1,0
    (diff -0.5); prompt 2: 0,1 -> 1,1 (diff +0.5). Gain = 1/3; the diffs' sd = sqrt(((2/3)^2 + (5/6)^2 +
    (1/6)^2) / 2) = sqrt(7) / (2 sqrt(3)) = 0.7638, so the paired SE is 0.7638 / sqrt(3) = 0.4410."""
    def write(name, rewards):
        p = tmp_path / name
        p.write_text("".join(json.dumps({"task": "text", "mode": "sampled", "prompt_index": j, "sample": s,
                                         "prompt": f"q{j}", "output": "", "reward": r}) + "\n"
                             for j, rs in enumerate(rewards) for s, r in enumerate(rs)))
        return str(p)
    a, b = write("a.jsonl", [[0, 0], [1, 1], [0, 1]]), write("b.jsonl", [[1, 1], [1, 0], [1, 1]])
    [row] = evaluate.compare(a, b)
    assert row[:2] == ["sampled", 3] and row[2] == pytest.approx(0.5) and row[3] == pytest.approx(5 / 6)
    assert row[4] == pytest.approx(1 / 3) and row[5] == pytest.approx(0.44096, abs=1e-5)
    assert row[6] == pytest.approx((1 / 3) / 0.44096, abs=1e-4)
    assert evaluate.main([f"--compare={a},{b}"]) == 0 and "| sampled | 3 | 0.500000 | 0.833333 |" in capsys.readouterr().out
    c = write("c.jsonl", [[1, 1], [1, 0]])  # another prompt set
    assert evaluate.main([f"--compare={a},{c}"]) == 2
    assert "hold other sampled prompts" in capsys.readouterr().err
    assert evaluate.main([f"--compare={a}"]) == 2
    assert "--compare takes two existing --out files" in capsys.readouterr().err
    assert evaluate.main([f"--compare={a},{b}", "--seed=3"]) == 2  # not silently ignored
    assert "takes no other flag; drop ['--seed=3']" in capsys.readouterr().err


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((2, 3, 1), (2, 1, 3), (2, 1, 0)):
        with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
            evaluate.pass_at_k(n, c, k)


def test_compare_refuses_other_files(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    rec = lambda i, prompt: json.dumps({"mode": "greedy", "prompt_index": i, "prompt": prompt, "reward": 1.0})
    a.write_text(rec(0, "p") + "\n")
    b.write_text(rec(0, "q") + "\n")
    with pytest.raises(ValueError, match="hold other greedy prompts"):
        evaluate.compare(str(a), str(b))
    b.write_text("not json\n")
    with pytest.raises(ValueError, match="b.jsonl line 1 is not an evaluate.py --out record"):
        evaluate.compare(str(a), str(b))


def test_run_mode_refuses_a_config_of_another_version(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**asdict(train.Config()), "old_field": 1}))
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match=r"fields unknown to train.Config: \['old_field'\]"):
        evaluate.check_run(str(tmp_path))


@pytest.fixture
def scorer_down(monkeypatch):
    """The toy image task scored by a remote scorer that is down (nothing listens on port 9): the path a
    geneval evaluation takes when its scorer fails (tasks.score gives NaN rewards and a warning)."""
    import dataclasses
    import tasks
    from infra.sandbox import RemoteScorer

    monkeypatch.setattr(tasks, "TASKS", {**tasks.TASKS, "image": dataclasses.replace(tasks.TASKS["image"], reward=None)})
    real = tasks.Ctx
    down = RemoteScorer("http://127.0.0.1:9", timeout=1.0, retries=0)
    monkeypatch.setattr(tasks, "Ctx", lambda cfg, tok, ids, device, datasets, scorer=None: real(
        cfg, tok, ids, device, datasets, down))


def test_scorer_down_is_not_measured_and_exits_nonzero(run_dir, scorer_down, capsys):
    """Scorer down: pass@k and the mean reward print "not measured" (they printed 0.000000 and exit 0)."""
    code = evaluate.main(["--ckpt", str(run_dir / "final"), "--task", "image", "--limit=2", "--samples=2"])
    out, err = capsys.readouterr()
    assert code == evaluate.NOT_MEASURED_EXIT, out + err
    row = next(line for line in out.splitlines() if line.startswith("| image"))
    assert row.count("not measured") == 2 and "0.000000" not in row, row
    assert "4 completion(s) got no reward" in err and "not measured" in err, err


def test_scorer_down_during_run_check_is_not_measured(run_dir, scorer_down, capsys):
    code = evaluate.main(["--run", str(run_dir)])
    out, err = capsys.readouterr()
    assert code == evaluate.NOT_MEASURED_EXIT and "not measured: image before, image after" in err, out + err
    assert "numbers match" not in out
