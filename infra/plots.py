"""The run's pictures, drawn with matplotlib (an optional extra, `pip install -e '.[plots]'`): curves.png and the
toy's image grid, images.png. `python -m infra.plots RUN_DIR` redraws curves.png; `--compare LABEL=DIR[,DIR...]
--png FILE [--x=cpu_seconds]` draws several runs' KL and rollout reward on one axis (docs/usage.md)."""
import argparse
import importlib.util
import itertools
import json
import math
import statistics
import sys
import textwrap
from pathlib import Path

from infra import cli

# RGB of a toy image code: 0 is the background, c >= 1 is toy.COLOURS[c - 1].
PALETTE = ((48, 48, 48), (230, 50, 50), (40, 190, 70), (50, 100, 240), (250, 210, 30),
           (150, 60, 200), (40, 210, 220), (245, 245, 245))
TASK_COLOURS = {"text": (30, 110, 190), "image": (230, 110, 20)}
# tasks beyond the toy's two, and --compare labels beyond two
OTHER_COLOURS = [(40, 150, 60), (180, 40, 150), (110, 110, 110), (200, 40, 40), (150, 120, 30)]
PANELS = [("reward", "reward"), ("solved", "accuracy (reward = 1)"), ("kl", "KL to reference (k3)"),
          ("clipfrac", "clip fraction")]
INVALID = (150, 150, 150)  # the image grid's cell of a code outside PALETTE (a leftover mask), crossed
PANEL_W, PANEL_H = 300, 300  # curves: pixels per panel
X_AXES = {"step": "RL step", "seconds": "cumulative RL seconds (wall)", "cpu_seconds": "cumulative RL CPU seconds"}


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def text_image(codes: list[int], width: int, stream=None) -> str:
    """A toy image for the console: ANSI colour blocks on a terminal, else letters (. background, ? invalid) in logs."""
    from infra import toy

    if getattr(stream or sys.stdout, "isatty", bool)():
        return toy.render_image(codes, width)
    letters = "." + "".join(c[0] for c in toy.COLOURS)  # r g b y p c w: the initials differ
    return "\n".join(" ".join(letters[c] if 0 <= c < len(letters) else "?" for c in codes[r:r + width])
                     for r in range(0, len(codes), width))


def _extra(name: str, module: str):
    # the extra's module, imported only when a picture is drawn; None after the one-line hint without it
    try:
        return importlib.import_module(module)
    except ImportError:
        print(f'plots.py: no picture written, {name} is missing; pip install -e ".[plots]" gives the pictures')
        return None


def _read_log(log_path) -> list[dict]:
    # One dict per RL step; a truncated last line is a run still writing it, skipped.
    path = Path(log_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; train.py writes log.jsonl into its --out_dir")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i < len(lines) - 1:
                raise ValueError(f"{path} line {i + 1} is not JSON ({e}); is this a train.py log?") from None
    if not records:
        raise ValueError(f"{path} has no records; train.py writes one per RL step, so no step is logged yet")
    return records


def _points(records: list[dict], key: str) -> list[tuple]:
    pts = [(r.get("step", i), r.get(key)) for i, r in enumerate(records)]  # NaN or missing values are skipped
    return [(x, float(y)) for x, y in pts if isinstance(y, (int, float)) and math.isfinite(y)]


def plot_curves(log_path, png_path) -> Path | None:
    """A panel per logged metric (PANELS) by RL step, and summary.json's held-out gain; None without matplotlib."""
    records = _read_log(log_path)
    tasks = sorted({k.split("/")[0] for r in records for k in r if "/" in k},
                   key=lambda t: ((list(TASK_COLOURS) + [t]).index(t), t))  # text, image, then the rest A-Z
    colours = {t: TASK_COLOURS.get(t, OTHER_COLOURS[k % len(OTHER_COLOURS)]) for k, t in enumerate(tasks)}
    panels = []
    for metric, title in PANELS:
        series = {t: pts for t in tasks if (pts := _points(records, f"{t}/{metric}"))}
        ys = sorted(y for pts in series.values() for _, y in pts)
        if metric == "kl" and len(ys) >= 10 and (p90 := ys[int(0.9 * (len(ys) - 1))]) > 0 and ys[-1] > 5 * p90:
            cap = float(f"{2 * p90:.2g}")  # so that one spike does not flatten every other step
            title = f"KL k3 (axis cut at {cap:g})"
            series = {t: [(x, min(y, cap)) for x, y in pts] for t, pts in series.items()}
        if series:
            panels.append((title, series))
    if not panels:
        raise ValueError(f"{log_path} logs none of " + ", ".join(f"<task>/{m}" for m, _ in PANELS))
    summary = Path(log_path).with_name("summary.json")
    held = held_out_lines(json.loads(summary.read_text())) if summary.is_file() else None
    return _save_panels(panels, colours, len(records), png_path, held)


def held_out_lines(summary: dict) -> list[tuple[str, str]]:
    """(task, "before -> after (gain +- paired SE)") per held-out key of a summary.json."""
    shown = lambda x: "not measured" if x is None else f"{x:.3f}"  # null: a scorer down
    out = []
    for key, v in summary.items():
        if isinstance(v, dict) and "before" in v and "after" in v:
            gain = f" ({v['after'] - v['before']:+.3f} ± {v['gain_se']:.3f})" if "gain_se" in v and None not in (
                v["before"], v["after"], v["gain_se"]) else ""
            out.append((key, f"{shown(v['before'])} -> {shown(v['after'])}{gain}"))
    return out


def _save_panels(panels: list, colours: dict, steps: int, png_path, held=None, xlabel: str = "RL step") -> Path | None:
    """(title, series) panels side by side, PANEL_W x PANEL_H pixels each, under one legend, and held_out_lines as
    a last panel. Raw values are drawn faint under a trailing mean; None without matplotlib."""
    if (matplotlib := _extra("matplotlib", "matplotlib")) is None:
        return None
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    rgb = {k: tuple(c / 255 for c in v) for k, v in colours.items()}
    window, n = max(1, steps // 10), len(panels) + bool(held)  # window: a tenth of the run, 5 steps of the toy's 50
    with matplotlib.rc_context({"font.size": 8}):
        fig = Figure(figsize=(PANEL_W * n / 100, PANEL_H / 100), dpi=100, layout="constrained")
        axes = fig.subplots(1, n, squeeze=False)[0]
        for ax, (title, series) in zip(axes, panels):
            for name, pts in series.items():
                xs, ys = zip(*pts)
                avg = [statistics.fmean(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
                marker = "o" if len(pts) == 1 else None  # a single logged step: a dot
                ax.plot(xs, ys, color=rgb[name], alpha=0.3, lw=1, marker=marker, ms=3, zorder=1.8)  # under every mean
                ax.plot(xs, avg, color=rgb[name], lw=2, marker=marker, ms=3, label=name)
            ax.margins(x=0)  # exactly the logged steps: the curves reach both edges
            ax.set_title(title, fontsize=9, loc="left")
            ax.set_xlabel(xlabel)
            ax.grid(axis="y", color=(0.9, 0.9, 0.9))
        labels = [name for name in colours if any(name in series for _, series in panels)]
        labels += [f"bold: {window}-step mean"] * (window > 1)
        handles = [Line2D([], [], color=rgb.get(name, "black"), lw=2) for name in labels]
        per_column = 56 + 7 * max(len(label) for label in labels)  # pixels: 7 a character, the swatch, the spacing
        fig.legend(handles, labels, loc="outside upper center", frameon=False,
                   ncols=max(1, min(len(labels), int(PANEL_W * n // per_column))))
        if held:
            axes[-1].axis("off")
            lines = [("held-out mean reward", "black"), ("before -> after RL (summary.json)", "grey")]
            for key, text in held:
                lines += [(key, rgb.get(key.split("_")[0], "black")), ("  " + text, "black")]
            for k, (text, colour) in enumerate(lines):
                axes[-1].text(0, 1 - k * 0.08, text, color=colour, va="top", transform=axes[-1].transAxes)
        fig.savefig(png_path)
    return Path(png_path)


def image_grid(rows: list[tuple[str, list[list[int]]]], prompts: list[str], width: int, png_path,
               scores: list[list[float]] | None = None, notes: tuple = ()) -> Path | None:
    """Toy images (width*width row-major PALETTE codes, others crossed): a row per (name, images), a column per
    prompt under its caption, scores (a list per row) under the images, notes under all. None without matplotlib."""
    for name, images in rows:
        if len(images) != len(prompts):
            raise ValueError(f"row {name!r} has {len(images)} images for {len(prompts)} prompts; "
                             "give one image per prompt")
        if bad := [j for j, codes in enumerate(images) if len(codes) != width * width]:
            raise ValueError(f"row {name!r} image {bad[0]} has {len(images[bad[0]])} codes, expected width*width = "
                             f"{width * width}")
    if (matplotlib := _extra("matplotlib", "matplotlib")) is None:
        return None
    from matplotlib.figure import Figure

    edges = [k - 0.5 for k in range(width + 1)]  # dark lines between the cells: touching cells of one colour count
    with matplotlib.rc_context({"font.size": 8, "figure.dpi": 100}):
        fig = Figure(figsize=(1 + 1.5 * len(prompts), 0.4 + 1.6 * len(rows) + len(notes) / 7), layout="constrained")
        axes = fig.subplots(len(rows), len(prompts), squeeze=False)
        for i, (name, images) in enumerate(rows):
            axes[i][0].set_ylabel(name, rotation=0, ha="right", va="center")
            for j, (ax, codes) in enumerate(zip(axes[i], images)):
                rgb = [PALETTE[c] if 0 <= c < len(PALETTE) else INVALID for c in codes]
                ax.imshow([rgb[r:r + width] for r in range(0, len(rgb), width)], interpolation="nearest")
                ax.set(xticks=edges, yticks=edges, title=textwrap.fill(prompts[j], 20) if i == 0 else "",
                       xlabel=f"score {scores[i][j]:.2f}" if scores else "")
                ax.tick_params(length=0, labelbottom=False, labelleft=False)
                ax.grid(color="0.08", lw=4 / width)
                for k in (k for k, c in enumerate(codes) if not 0 <= c < len(PALETTE)):
                    ax.text(k % width, k // width, "X", color="0.35", ha="center", va="center", fontsize=48 / width)
        fig.supxlabel("\n".join(notes), x=0.01, ha="left", color="0.35", fontsize=8)
        fig.savefig(png_path)
    return Path(png_path)


def toy_image_panel(grid: list, examples: list[dict], width: int, png_path, summary: dict | None = None):
    """images.png of a toy run: held-out images, their verifier score (the RL reward) and the held-out mean."""
    import rewards

    scores = [[rewards.image_reward(codes, ex) for codes, ex in zip(images, examples)] for _, images in grid]
    notes = ["score: fraction of the prompt's checks the image passes (the RL reward); dark grey: empty cell",
             "same prompts and sampling seeds before and after RL: only the policy differs"]
    held = held_out_lines({"image": (summary or {}).get("image")})
    notes += [f"held-out mean image reward (summary.json): {text}" for _, text in held]
    return image_grid(grid, [ex["prompt"] for ex in examples], width, png_path, scores=scores, notes=tuple(notes))


def group_medians(groups: dict[str, list], key: str, x: str = "step") -> dict[str, list[tuple[float, float]]]:
    """{label: [(x, median of `key` over the label's runs)]} (a median: one seed's k3 KL can jump by orders of
    magnitude); x: the step, or the median cumulative RL seconds of times.jsonl at its end (wall or CPU)."""
    col = {"seconds": "seconds", "cpu_seconds": "cpu_s"}.get(x)  # times.jsonl: wall, or process CPU time
    out = {}
    for label, run_dirs in groups.items():
        per_step: dict = {}
        for d in run_dirs:
            times = _read_log(Path(d) / "times.jsonl") if col else []
            if any(col not in r for r in times):
                raise ValueError(f"{d}/times.jsonl has no {col!r} (runs before CPU times were logged): use --x=seconds")
            steps = [r.get("step", i) for i, r in enumerate(times)]
            clock = dict(zip(steps, itertools.accumulate(r[col] for r in times)))  # {step: seconds of steps 0..step}
            for step, y in _points(_read_log(Path(d) / "log.jsonl"), key):
                if not col or step in clock:
                    per_step.setdefault(step, []).append((clock[step] if col else step, y))
        if per_step:
            out[label] = [(statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
                          for _, v in sorted(per_step.items())]
    return out


def compare_runs(groups: dict[str, list], png_path, task: str = "text", x: str = "step",
                 metrics=(("kl", "KL to reference (k3)"), ("reward", "rollout reward"))) -> Path | None:
    """A panel per metric, a line per label: group_medians of `task/metric` (as the paper's Fig. 5, bottom)."""
    colours = dict(zip(groups, [TASK_COLOURS["text"], TASK_COLOURS["image"]] + OTHER_COLOURS))
    if len(colours) < len(groups):
        raise ValueError(f"at most {len(colours)} labels per picture, got {len(groups)}")
    panels = [(f"{task}: {title}", series) for metric, title in metrics
              if (series := group_medians(groups, f"{task}/{metric}", x))]
    if not panels:
        raise ValueError(f"no run logs {task}/" + " or ".join(m for m, _ in metrics))
    return _save_panels(panels, colours, max(len(pts) for _, ser in panels for pts in ser.values()), png_path,
                        xlabel=X_AXES[x])


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("run_dir", type=Path, nargs="?")
    parser.add_argument("--compare", nargs="+", default=[], metavar="LABEL=DIR[,DIR...]")
    parser.add_argument("--png", type=Path, help="--compare's picture (needed), or the curves' (RUN_DIR/curves.png)")
    parser.add_argument("--task", default=None, help="--compare's task (default text)")
    parser.add_argument("--x", default=None, choices=list(X_AXES), help="--compare's horizontal axis: RL step "
                        "(default), or cumulative RL seconds from each run's times.jsonl (wall, or process CPU time)")
    args = cli.parse_known(parser, argv, "infra.plots")
    if not have_matplotlib():
        raise ValueError('no picture written: matplotlib is missing; pip install -e ".[plots]" (or matplotlib)')
    png = args.png.expanduser() if args.png else None  # a path given as --png=~/x.png, which no shell expands
    if args.compare:
        bad = [g for g in args.compare if "=" not in g]
        if bad or png is None:
            raise ValueError(f"--compare takes LABEL=DIR[,DIR...] groups and needs --png; got {bad or args.compare}")
        groups = {g.split("=", 1)[0]: [str(Path(d).expanduser()) for d in g.split("=", 1)[1].split(",")]
                  for g in args.compare}
        if len(groups) < len(args.compare):
            raise ValueError(f"--compare labels must differ, got {[g.split('=', 1)[0] for g in args.compare]}")
        out = compare_runs(groups, png, args.task or "text", x=args.x or "step")
    elif args.run_dir is None:
        raise ValueError("give RUN_DIR (a train.py out_dir), or --compare LABEL=DIR[,DIR...] --png FILE")
    else:
        if idle := [f"--{k}" for k in ("task", "x") if getattr(args, k) is not None]:
            raise ValueError(f"{' and '.join(idle)} choose what --compare draws; the curves of RUN_DIR show every task "
                             f"by step: drop {'it' if len(idle) == 1 else 'them'}, or add --compare LABEL=DIR")
        run_dir = args.run_dir.expanduser()
        out = plot_curves(run_dir / "log.jsonl", png or run_dir / "curves.png")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    with cli.user_errors():
        main()
