"""Regenerate every table and figure of docs/results.md from the kept run data in docs/data/.

    python -m tools.report            # rewrites the tables in docs/results.md and the figures in docs/
    python -m tools.report --print    # prints the tables, writes nothing

Each docs/data/<name>.json holds one result: per run its summary.json, the sums and medians of its
times.jsonl and log.jsonl, and the per-step points its figure needs ("source": "table" where only the
printed table was kept, e.g. a benchmark's output). A table sits in docs/results.md between
`<!-- table: NAME -->` and `<!-- /table -->`; tests/test_report.py checks that the committed tables and
figures are what this command makes. The figures are drawn by infra/plots.py from the kept points,
written back as the log.jsonl / times.jsonl / summary.json a run writes.
"""
import shlex
import sys

if __name__ == "__main__" and not __package__:  # run as a file, tools/ would shadow the project's modules
    sys.exit("run it from the project's root as a module: "
             + shlex.join(["python", "-m", "tools.report", *sys.argv[1:]]))

import argparse
import itertools
import json
import re
import statistics as st
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA, DOCS = ROOT / "docs" / "data", ROOT / "docs"
BEGIN, END = re.compile(r"<!-- table: ([\w-]+) -->"), "<!-- /table -->"


def load(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def md(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


f3 = "{:.3f}".format
sg = "{:+.3f}".format
g3 = "{:.3g}".format


def mean_sd(xs) -> str:  # mean ± sd over seeds, as a gain
    return f"{st.mean(xs):+.3f} ± {st.stdev(xs):.3f}" if len(xs) > 1 else sg(xs[0])


def mean_se(xs) -> str:  # mean ± its standard error over seeds
    return f"{st.mean(xs):+.3f} ± {st.stdev(xs) / len(xs) ** 0.5:.3f}" if len(xs) > 1 else sg(xs[0])


def gain(run: dict, key: str = "text") -> float:
    s = run["summary"][key]
    return s["after"] - s["before"]


def gain_se(run: dict, key: str = "text") -> str:
    return f"{sg(gain(run, key))} ± {run['summary'][key]['gain_se']:.3f}"


def per_seed(rows, fmt, sep=" / ") -> str:
    return sep.join(fmt(r) for r in rows)


def kl_pair(r) -> str:  # median / largest step of the k3 KL to the reference over a run's steps
    return f"{g3(r['kl_median'])} / {g3(r['kl_max'])}"


def groups(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["row"], []).append(r)
    return out


# -----------------------------------------------------------------------------
# tables


def t_toy_seeds() -> str:
    runs = load("toy_seeds")["runs"]
    rows = []
    for s, r in enumerate(runs):
        t, g, i = (r["summary"][k] for k in ("text", "text_greedy", "image"))
        rows.append([s, f"{f3(t['before'])} -> {f3(t['after'])}", f"**{gain_se(r)}**",
                     f"{f3(g['before'])} -> {f3(g['after'])}", f"{f3(i['before'])} -> {f3(i['after'])}",
                     f"**{gain_se(r, 'image')}**", round(r["summary"]["seconds"]["sft"]),
                     round(r["summary"]["seconds"]["rl"]), round(r["cpu_s"])])
    rows.append(["mean ± sd", "", mean_sd([gain(r) for r in runs]), "", "", mean_sd([gain(r, "image") for r in runs]),
                 "", "", ""])
    return md(["seed", "text before -> after", "gain ± paired SE", "text greedy before -> after",
               "image before -> after", "gain ± paired SE", "SFT s", "RL s", "RL CPU s"], rows)


def _toy_step() -> str:
    p = load("toy_seeds")["runs"][0]["phases"]
    return md(["rollouts", "rewards", "old and reference log-probs", "mu = 4 updates", "whole step", "whole step, CPU s"],
              [[f"{p[k]:.3g}" for k in ("rollout_s", "reward_s", "logprob_s", "update_s", "seconds", "cpu_s")]])


def t_toy_ablation() -> str:
    g = groups(load("toy_ablation")["rows"])
    base = {r["seed"]: gain(r) for r in g["MaskGRPO, AR-like, gamma 0.6 (default)"]}
    rows = []
    for name, runs in g.items():
        gg = [r["summary"]["text_greedy"]["after"] - r["summary"]["text_greedy"]["before"] for r in runs]
        diff = "" if name.endswith("(default)") else per_seed(runs, lambda r: sg(gain(r) - base[r["seed"]]))
        rows.append([name, f"`{runs[0]['flags']}`" if runs[0]["flags"] else "",
                     f"{st.mean(r['summary']['text']['after'] for r in runs):.3f}", mean_sd([gain(r) for r in runs]),
                     diff, mean_sd(gg), f"{st.mean(r['kl_median'] for r in runs):.3f}",
                     per_seed(runs, lambda r: g3(r["kl_max"]))])
    return md(["row", "FLAGS", "after RL", "gain (mean ± sd)", "minus the default's gain, per seed", "greedy gain",
               "median KL", "largest KL step, per seed"], rows)


def _diag(key: str, label: str) -> str:
    rows = load("diagnosis")["tables"][key]
    head = list(rows[0])
    return md([label] + head[1:], [list(r.values()) for r in rows])


def t_diagnosis_toy() -> str:
    return _diag("toy_text", "text estimator")


def t_diagnosis_long() -> str:
    return _diag("long_text", "text estimator, long toy")


def t_toy_long_ablation() -> str:
    g = groups(load("toy_long_ablation")["rows"])
    order = ["d1", "UniGRPO", "MaskGRPO, random reversing", "MaskGRPO, AR-like, gamma 0.6 (default)",
             "MaskGRPO, official AR-like operator", "exact trajectory"]

    def gn(r):
        return r["gain"] if r.get("source") == "table" else gain(r)

    def cell(r):
        if r.get("source") == "table":
            return f"s{r['seed']} {sg(r['gain'])} ± {r['gain_se']:.3f} ({r['greedy_after']:.3f})"
        return f"s{r['seed']} {gain_se(r)} ({r['summary']['text_greedy']['after']:.3f})"

    base = {r["seed"]: gn(r) for r in g[order[3]]}
    rows = []
    for name in order:
        runs = sorted(g[name], key=lambda r: r["seed"])
        diff = "" if name == order[3] else per_seed(runs, lambda r: sg(gn(r) - base[r["seed"]]))
        rows.append([name, f"`{runs[0]['flags']}`" if runs[0]["flags"] else "", "; ".join(cell(r) for r in runs),
                     mean_sd([gn(r) for r in runs]), diff, per_seed(runs, lambda r: g3(r["kl_max"]))])
    return md(["row", "FLAGS", "per seed: gain ± paired SE (greedy after)", "gain (mean ± sd)",
               "minus the default's gain, per seed", "largest KL step, per seed"], rows)


def _num(cell: str) -> float:
    return float(cell.replace("**", "").split(" ±")[0])


def t_toy_compute() -> str:
    g = groups(load("toy_compute")["rows"])
    base = {r["seed"]: _num(r["gain ± paired SE"]) for r in g["MaskGRPO (default)"]}
    rows = []
    for name, runs in g.items():
        gains = [_num(r["gain ± paired SE"]) for r in runs]
        diff = "" if name == "MaskGRPO (default)" else per_seed(runs, lambda r: sg(_num(r["gain ± paired SE"]) - base[r["seed"]]))
        rows.append([name, runs[0]["FLAGS"], runs[0]["steps"], per_seed(runs, lambda r: r["gain ± paired SE"]),
                     mean_se(gains), diff, per_seed(runs, lambda r: r["RL CPU s"]),
                     per_seed(runs, lambda r: r["median / largest KL"].split(" / ")[1])])
    return md(["row", "FLAGS", "steps", "gain ± paired SE, seeds 0 / 1 / 2", "mean ± SE over seeds",
               "minus MaskGRPO's gain, per seed", "RL CPU s, per seed", "largest KL step, per seed"], rows)


def _runs_table(rows: list[dict], versus: dict[str, str], base_name: str = "MaskGRPO (default)") -> str:
    """One line per row name over its seeds; its gain minus that of the row it is paired with (versus, else
    the default row), seed by seed from the same SFT model."""
    g = groups(rows)
    out = []
    for name, runs in g.items():
        other = versus.get(name, base_name)
        base = {r["seed"]: gain(r) for r in g[other]}
        diff = "" if name == base_name else f"vs {other}: " + per_seed(runs, lambda r: sg(gain(r) - base[r["seed"]]))
        out.append([name, f"`{runs[0]['flags']}`" if runs[0]["flags"] else "", ", ".join(str(r["seed"]) for r in runs),
                    per_seed(runs, lambda r: str(r["steps"])) if len({r["steps"] for r in runs}) > 1 else runs[0]["steps"],
                    per_seed(runs, gain_se), mean_se([gain(r) for r in runs]), diff,
                    per_seed(runs, lambda r: str(round(r["cpu_s"]))), per_seed(runs, kl_pair, "; ")])
    return md(["row", "FLAGS", "seeds", "steps", "gain ± paired SE, per seed", "mean ± SE over seeds",
               "gain minus the paired row's, per seed", "RL CPU s, per seed", "median / largest KL, per seed"], out)


def t_toy_equal_time() -> str:
    return _runs_table(load("toy_equal_time")["rows"], {
        "MaskGRPO, 425 steps (the exact trajectory's CPU time)": "exact trajectory, 80 steps"})


def t_toy_long_compute() -> str:
    rows = load("toy_long_compute")["rows"]
    return md(list(rows[0]), [list(r.values()) for r in rows])


def t_toy_long_equal_time() -> str:
    return _runs_table(load("toy_long_equal_time")["rows"], {
        "MaskGRPO, 64 steps": "trajectory, K = 3", "MaskGRPO, 72 steps": "trajectory, K = 3",
        "MaskGRPO at the exact trajectory's CPU time": "exact trajectory"})


def t_fast_rollouts() -> str:
    g = groups(load("fast_rollouts")["rows"])
    base = {r["seed"]: gain(r) for r in g["exact"]}
    out = []
    for name, runs in g.items():
        diff = "" if name == "exact" else per_seed(runs, lambda r: sg(gain(r) - base[r["seed"]]))
        out.append([name, f"`{runs[0]['flags']}`" if runs[0]["flags"] else "", ", ".join(str(r["seed"]) for r in runs),
                    per_seed(runs, gain_se), mean_sd([gain(r) for r in runs]), diff,
                    per_seed(runs, lambda r: f"{r.get('committed_per_step', 1.0):.2f}"),
                    per_seed(runs, lambda r: f"{r['rollout_cpu_s']:.1f}"), per_seed(runs, lambda r: str(round(r["cpu_s"]))),
                    per_seed(runs, kl_pair, "; ")])
    return md(["rollouts", "FLAGS", "seeds", "gain ± paired SE, per seed", "gain (mean ± sd)", "minus exact, per seed",
               "tokens per decoding step", "rollout CPU s", "RL CPU s", "median / largest KL"], out)


def t_rollout_speed() -> str:
    rows = load("rollout_speed")["rows"]
    return (md(list(rows[0]), [list(r.values()) for r in rows]) + "\n\nOne toy RL step by phase, wall seconds (median of "
            "steps 2-8 of the default toy's seed-0 run, `times.jsonl`):\n\n" + _toy_step())


def _dry_run(*flags: str) -> tuple[dict, list[str]]:
    """(figures, printed lines) of `python train.py FLAGS --dry_run`: the dry run is computed, not measured,
    so its table is made by running it, and the docs cannot drift from the code."""
    import contextlib
    import io

    import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        figures = train.main([*flags, "--dry_run=true"])
    return figures, out.getvalue().splitlines()


def t_dry_run_8b() -> str:
    f, lines = _dry_run("--preset=llada8b")
    shown = ("schedule:", "settings:", "global FLOPs", "time on")
    block = "```\n" + "\n".join(line for line in lines if line.startswith(shown)) + "\n```"
    # each phase's is in --dry_run; a LoRA run's table has no full fine-tuning rows: those of --lora_rank=0
    full = _dry_run("--preset=llada8b", "--lora_rank=0")[1]
    peaks = [line for line in lines if line.startswith(("| GiB per GPU", "|---"))] + \
        [line for line in full if line.startswith("| full fine-tuning, peak")] + \
        [line for line in lines if line.startswith("| LoRA, peak")]
    step = f["flops"]["step"]
    rows = []
    for label, flags in (("exact trajectory at 8B, FLOPs per RL step", ["--estimator=trajectory"]),
                         ("the same with 12 decoding states per update",
                          ["--estimator=trajectory", "--trajectory_states=12"])):
        t = _dry_run("--preset=llada8b", *flags)[0]["flops"]["step"]
        cmd = "`python train.py --preset llada8b --dry_run " + " ".join(flags) + "`"
        rows.append([label, cmd, f"{t:.2e}, {t / step:.2f} x MaskGRPO's {step:.2e}"])
    m = _dry_run("--preset=mmada8b")[0]
    rows.append(["MMaDA-8B text-to-image, FLOPs per RL step", "`python train.py --preset mmada8b --dry_run`",
                 f"{m['flops']['step']:.2e} ({m['seqs_per_step']} sequences of {m['seq_len']:,} tokens), about "
                 f"{m['gpu_hours']:,.0f} GPU-hours per run at {m['mfu']:.0%} MFU"])
    other = load("dry_run_8b")["other"]  # measured rows (benchmarks), kept as printed
    rows += [list(r.values()) for r in other if "dry_run" not in r["command"]]
    return "\n\n".join([block, "\n".join(peaks), md(["measurement", "command", "result"], rows)])


TABLES = {name[2:]: fn for name, fn in globals().items() if name.startswith("t_")}


# -----------------------------------------------------------------------------
# figures


def _write_run(folder: Path, run: dict) -> str:
    """A run directory as train.py writes it, from the kept points, for infra/plots.py to read."""
    folder.mkdir(parents=True)
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run["log"]))
    if "times" in run:
        (folder / "times.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run["times"]))
    (folder / "summary.json").write_text(json.dumps(run["summary"]))
    return str(folder)


def figures(out: Path) -> list[Path]:
    """Write every figure of docs/results.md into out; returns their paths."""
    from infra import plots

    if not plots.have_matplotlib():
        raise ValueError('no figure written: matplotlib is missing; pip install -e ".[plots]"')
    out.mkdir(parents=True, exist_ok=True)
    written, n = [], itertools.count()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def runs(rows, key, labels):  # {label: [run dirs]}: per (label, name), the rows whose key is name, in order
            return {lab: [_write_run(tmp / str(next(n)), r) for r in rows if r[key] == name and "log" in r]
                    for lab, name in labels}

        seed0 = load("toy_seeds")["runs"][0]
        written.append(plots.plot_curves(Path(_write_run(tmp / "toy-s0", seed0)) / "log.jsonl", out / "toy_curves.png"))
        abl = load("toy_ablation")["rows"]
        written.append(plots.compare_runs(runs(abl, "row", [
            ("d1", "d1"), ("UniGRPO", "UniGRPO"), ("random", "MaskGRPO, random reversing"),
            ("MaskGRPO", "MaskGRPO, AR-like, gamma 0.6 (default)"), ("official", "MaskGRPO, official AR-like operator"),
            ("trajectory", "exact trajectory")]), out / "toy_ablation_kl.png"))
        et = load("toy_equal_time")["rows"]
        written.append(plots.compare_runs(runs(et, "row", [
            ("MaskGRPO (425 steps)", "MaskGRPO, 425 steps (the exact trajectory's CPU time)"),
            ("exact trajectory (80 steps)", "exact trajectory, 80 steps")]), out / "toy_traj_time.png", x="cpu_seconds"))
        lc = load("toy_long_compute")["figure"]
        written.append(plots.compare_runs(runs(lc, "label", [(r["label"], r["label"]) for r in lc]),
                                          out / "toy_long_compute.png", x="cpu_seconds"))
        lt = load("toy_long_equal_time")["rows"]
        written.append(plots.compare_runs(runs(lt, "row", [
            ("MaskGRPO, 360 steps", "MaskGRPO at the exact trajectory's CPU time"), ("exact trajectory", "exact trajectory"),
            ("trajectory K3", "trajectory, K = 3"), ("MaskGRPO, dual cache", "MaskGRPO, dual-cache rollouts")]),
            out / "toy_long_traj40.png", x="cpu_seconds"))
    return written


# -----------------------------------------------------------------------------
# docs/results.md


def fill(text: str, tables: dict[str, str]) -> str:
    """text with each marked table replaced by tables[name]; a marker naming no table is an error."""
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        if m.start() < pos:
            continue
        end = text.find(END, m.end())
        if m[1] not in tables or end < 0:
            raise ValueError(f"docs/results.md: table marker {m[1]!r} has no table in tools/report.py or no {END}")
        out += [text[pos:m.end()], "\n", tables[m[1]], "\n"]
        pos = end
    return "".join(out) + text[pos:]


def marked(text: str) -> dict[str, str]:
    """{name: table} as committed between the markers of text."""
    return {m[1]: text[m.end():text.find(END, m.end())].strip("\n") for m in BEGIN.finditer(text)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--print", action="store_true", help="print the tables; write nothing")
    parser.add_argument("--results", type=Path, default=DOCS / "results.md", help="the file whose tables to rewrite")
    parser.add_argument("--figures", type=Path, default=DOCS, help="where to write the figures")
    args = parser.parse_args(argv)
    args.results, args.figures = args.results.expanduser(), args.figures.expanduser()
    text = None if args.print else args.results.read_text()
    named = [] if args.print else [m[1] for m in BEGIN.finditer(text)]
    if not args.print and not named:  # checked before anything is computed or written
        raise ValueError(f"{args.results} holds no table markers (<!-- table: NAME --> ... {END}), so no table "
                         "would be written; pass the project's docs/results.md, or --print")
    tables = {name: fn() for name, fn in TABLES.items()}
    if args.print:
        for name, table in tables.items():
            print(f"<!-- table: {name} -->\n{table}\n{END}\n")
        return 0
    args.results.write_text(fill(text, tables))
    for p in figures(args.figures):
        print(f"wrote {p}")
    print(f"wrote {len(named)} table(s) into {args.results}: {', '.join(named)}")
    return 0


if __name__ == "__main__":
    from infra import cli

    with cli.user_errors():  # a missing data file or a stray marker: one line, exit status 2
        sys.exit(main())
