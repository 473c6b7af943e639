"""Pictures of a run. Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_plots.py

The drawing tests need the optional plots extra (matplotlib, in the dev extra so that CI runs them; the tests
read its pictures with Pillow, which matplotlib installs) and skip without it; the missing-package path is
tested by hiding the module."""
import json
import math
import sys

import pytest

from infra import cli, plots


def write_log(path, n=30, tasks=("text", "image")):
    # A synthetic train.py log: rising reward, a KL that grows, one NaN, and a step where image is absent.
    with open(path, "w") as f:
        for step in range(n):
            rec = {"step": step, "grad_norm": 1.0, "seconds": 2.0}
            for k, task in enumerate(tasks):
                rec[f"{task}/reward"] = 0.3 + 0.4 * step / n + 0.05 * math.sin(step + k)
                rec[f"{task}/kl"] = float("nan") if step == 3 else 0.001 * step
                rec[f"{task}/clipfrac"] = 0.02 / (1 + step)
                rec[f"{task}/loss"] = 0.01
            if step == 5:
                rec = {k: v for k, v in rec.items() if not k.startswith("image/")}
            f.write(json.dumps(rec) + "\n")
    return path


def saved_figures(monkeypatch) -> list:
    """The matplotlib figures plots saves from now on, in order (each still written to its file)."""
    Figure = pytest.importorskip("matplotlib.figure").Figure
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, _save=Figure.savefig, **k: figures.append(self)
                        or _save(self, *a, **k))
    return figures


def test_curves_png_has_expected_size_and_content(tmp_path):
    pytest.importorskip("matplotlib")
    Image = pytest.importorskip("PIL.Image")
    out = plots.plot_curves(write_log(tmp_path / "log.jsonl"), tmp_path / "curves.png")
    assert out == tmp_path / "curves.png"
    with Image.open(out) as im:
        assert im.size == (3 * plots.PANEL_W, plots.PANEL_H)
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
    assert len(colours) > 10, "the picture is (nearly) one colour: nothing was drawn"
    # Both task colours appear: each task got its own line.
    present = {c for _, c in colours}
    assert plots.TASK_COLOURS["text"] in present and plots.TASK_COLOURS["image"] in present


def test_curves_draw_the_logged_values_and_their_trailing_mean(tmp_path, monkeypatch):
    """Read back from the figure: per panel and task, a faint line of the logged values (the NaN and the
    absent step left out) and a bold one of the trailing mean over window = steps // 10 = 3 values."""
    figures = saved_figures(monkeypatch)
    log = write_log(tmp_path / "log.jsonl")
    plots.plot_curves(log, tmp_path / "c.png")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    axes = figures[0].axes
    assert [ax.get_title(loc="left") for ax in axes] == ["reward", "KL to reference (k3)", "clip fraction"]
    for ax, metric in zip(axes, ("reward", "kl", "clipfrac")):
        lines = ax.get_lines()
        assert len(lines) == 4  # faint and bold, for text and image
        for (faint, bold), task in zip((lines[:2], lines[2:]), ("text", "image")):
            pts = [(r["step"], r[f"{task}/{metric}"]) for r in records
                   if f"{task}/{metric}" in r and math.isfinite(r[f"{task}/{metric}"])]
            ys = [y for _, y in pts]
            mean = [sum(ys[max(0, i - 2):i + 1]) / len(ys[max(0, i - 2):i + 1]) for i in range(len(ys))]
            assert list(faint.get_xdata()) == [x for x, _ in pts] and list(faint.get_ydata()) == ys
            assert list(bold.get_xdata()) == [x for x, _ in pts] and bold.get_ydata() == pytest.approx(mean)
            assert faint.get_alpha() == 0.3 and bold.get_label() == task
            assert faint.get_zorder() < 2 == bold.get_zorder()  # every raw line under every mean
            assert tuple(round(255 * c) for c in bold.get_color()) == plots.TASK_COLOURS[task]
        assert ax.get_xlim() == (0, 29)  # exactly the logged steps
    assert [t.get_text() for t in figures[0].legends[0].get_texts()] == ["text", "image", "bold: 3-step mean"]


def test_curves_skip_panels_whose_metric_is_missing(tmp_path):
    pytest.importorskip("matplotlib")
    Image = pytest.importorskip("PIL.Image")
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "text/reward": s / 10}) + "\n" for s in range(10)))
    with Image.open(plots.plot_curves(log, tmp_path / "c.png")) as im:
        assert im.size == (plots.PANEL_W, plots.PANEL_H)  # reward only: one panel


def test_curves_single_step_and_truncated_last_line(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"step": 0, "text/reward": 0.5, "text/kl": 0.0}) + '\n{"step": 1, "text/rew')
    assert plots.plot_curves(log, tmp_path / "c.png").is_file()


def test_empty_log_raises(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        plots.plot_curves(log, tmp_path / "c.png")
    with pytest.raises(FileNotFoundError, match="out_dir"):
        plots.plot_curves(tmp_path / "missing.jsonl", tmp_path / "c.png")


def test_log_without_known_metrics_raises(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"step": 0, "grad_norm": 1.0}) + "\n")
    with pytest.raises(ValueError, match="reward"):
        plots.plot_curves(log, tmp_path / "c.png")


def cell_pixel(im, ax, r: int, c: int) -> tuple:
    """The saved picture's pixel at the centre of cell (row r, column c) of ax's image: the axes' data
    coordinates are the cell indices, their display y runs up and the picture's rows down."""
    x, y = ax.transData.transform((c, r))
    return im.getpixel((int(x), im.height - 1 - int(y)))


def test_image_grid_cell_colours_and_captions(tmp_path, monkeypatch):
    """An axes per image in (row, prompt) order, the prompt over its column and the row's name beside it; the
    colour array handed to imshow and the saved pixel at each cell's centre are PALETTE[code], and a code outside
    the palette is drawn in no palette colour."""
    Image = pytest.importorskip("PIL.Image")
    figures = saved_figures(monkeypatch)
    width, prompts = 4, ["a red block", "two blue blocks", "a cyan block in the top row"]
    # Image (row i, column j) has code 1 + (i * 3 + j) % 7 at cell (1, 2), an invalid -1 at (3, 3), else 0.
    rows = []
    for i, name in enumerate(["before RL", "after RL"]):
        images = []
        for j in range(len(prompts)):
            codes = [0] * width * width
            codes[1 * width + 2] = 1 + (i * 3 + j) % 7
            codes[3 * width + 3] = -1
            images.append(codes)
        rows.append((name, images))
    out = plots.image_grid(rows, prompts, width, tmp_path / "grid.png")
    axes = figures[0].axes
    assert len(axes) == 6 and [ax.get_subplotspec().get_geometry() for ax in axes] == [(2, 3, k, k) for k in range(6)]
    assert [ax.get_title().replace("\n", " ") for ax in axes] == prompts + ["", "", ""]
    assert [axes[0].get_ylabel(), axes[3].get_ylabel()] == ["before RL", "after RL"]
    with Image.open(out) as im:
        im = im.convert("RGB")
        for i in range(2):
            for j in range(3):
                ax, colour = axes[3 * i + j], plots.PALETTE[1 + (i * 3 + j) % 7]
                shown = ax.images[0].get_array()
                assert shown.shape == (width, width, 3)
                assert tuple(shown[1][2]) == colour and tuple(shown[0][0]) == plots.PALETTE[0]
                assert tuple(shown[3][3]) not in plots.PALETTE
                assert cell_pixel(im, ax, 1, 2) == colour and cell_pixel(im, ax, 0, 0) == plots.PALETTE[0]
                assert cell_pixel(im, ax, 3, 3) not in plots.PALETTE  # invalid code: not a palette colour
                (x0, y0), (x1, y1) = ax.transData.transform([(0, 0), (width - 1, width - 1)])
                assert x0 < x1 and y0 > y1  # row-major: code 0 at the top left, as text_image prints it


def test_image_grid_rejects_bad_shapes(tmp_path):
    with pytest.raises(ValueError, match="one image per prompt"):
        plots.image_grid([("a", [[0] * 16])], ["p", "q"], 4, tmp_path / "g.png")
    with pytest.raises(ValueError, match="width\\*width = 16"):
        plots.image_grid([("a", [[0] * 15])], ["p"], 4, tmp_path / "g.png")


def test_without_the_extra_returns_none_and_prints_hint(tmp_path, monkeypatch, capsys):
    # None in sys.modules makes `import matplotlib` raise ImportError, as if the package were not installed:
    # the curves and the image grid both need it.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert plots.plot_curves(write_log(tmp_path / "log.jsonl"), tmp_path / "c.png") is None
    assert plots.image_grid([("a", [[0] * 16])], ["p"], 4, tmp_path / "g.png") is None
    out = capsys.readouterr().out
    assert out.count('pip install -e ".[plots]"') == 2 and len(out.splitlines()) == 2
    assert out.count("matplotlib is missing") == 2
    assert not (tmp_path / "c.png").exists() and not (tmp_path / "g.png").exists()


def _run(tmp_path, name, kls):
    d = tmp_path / name
    d.mkdir()
    (d / "log.jsonl").write_text("".join(json.dumps({"step": s, "text/kl": k, "text/reward": 0.5})
                                         + "\n" for s, k in enumerate(kls)))
    return d


def test_group_medians_take_runs_step_by_step(tmp_path):
    a, b = _run(tmp_path, "a", [1.0, 2.0, float("nan")]), _run(tmp_path, "b", [3.0, 4.0, 5.0])
    c = _run(tmp_path, "c", [1e7, 3.5, 6.0])  # one seed's KL spike at step 0 does not move the median
    medians = plots.group_medians({"x": [a, b], "y": [a], "z": [a, b, c]}, "text/kl")
    assert medians["x"] == [(0, 2.0), (1, 3.0), (2, 5.0)] and medians["y"] == [(0, 1.0), (1, 2.0)]
    assert medians["z"] == [(0, 3.0), (1, 3.5), (2, 5.5)]  # medians of {1, 3, 1e7}, {2, 4, 3.5}, {5, 6}
    assert plots.group_medians({"x": [a]}, "image/kl") == {}


def test_compare_runs_png(tmp_path):
    pytest.importorskip("matplotlib")
    Image = pytest.importorskip("PIL.Image")
    groups = {"d1": [_run(tmp_path, "a", [0.1, 0.3])], "MaskGRPO": [_run(tmp_path, "b", [0.2, 0.1])]}
    with Image.open(plots.compare_runs(groups, tmp_path / "kl.png")) as im:
        assert im.size == (2 * plots.PANEL_W, plots.PANEL_H)  # KL and reward panels
        present = {c for _, c in im.convert("RGB").getcolors(maxcolors=1 << 16)}
    assert plots.TASK_COLOURS["text"] in present and plots.TASK_COLOURS["image"] in present  # one line per label
    with pytest.raises(ValueError, match="no run logs"):
        plots.compare_runs(groups, tmp_path / "x.png", task="image")


def test_compare_seven_labels_wraps_the_legend(tmp_path, monkeypatch):
    """An ablation's seven rows get seven colours, and the legend wraps onto more lines above the panels
    instead of running past the picture's edge."""
    pytest.importorskip("matplotlib")
    Image = pytest.importorskip("PIL.Image")
    figures = saved_figures(monkeypatch)
    names = ["d1", "UniGRPO", "random", "MaskGRPO", "official", "trajectory", "gamma0"]
    groups = {n: [_run(tmp_path, n, [0.1 * k, 0.2])] for k, n in enumerate(names)}
    colours = [plots.TASK_COLOURS["text"], plots.TASK_COLOURS["image"]] + plots.OTHER_COLOURS
    with Image.open(plots.compare_runs(groups, tmp_path / "kl.png")) as im:
        assert im.size == (2 * plots.PANEL_W, plots.PANEL_H)
        assert set(colours) <= {c for _, c in im.convert("RGB").getcolors(maxcolors=1 << 16)}
    fig = figures[0]
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == names  # two steps: a window of 1, no mean to name
    assert [tuple(round(255 * c) for c in h.get_color()) for h in legend.legend_handles] == colours
    box, rows = legend.get_window_extent(), {round(t.get_window_extent().y0) for t in legend.get_texts()}
    assert 0 <= box.x0 and box.x1 <= 2 * plots.PANEL_W and len(rows) == 2  # four on a line, then three
    assert all(box.y0 >= ax.get_window_extent().y1 for ax in fig.axes)  # above the panels' plot areas
    with pytest.raises(ValueError, match="at most 7 labels"):
        plots.compare_runs({**groups, "eighth": groups["d1"]}, tmp_path / "x.png")


def test_cli_redraws_and_compares(tmp_path, capsys):
    """python -m infra.plots RUN_DIR redraws curves.png; --compare LABEL=DIR,DIR LABEL=DIR --png FILE
    --task image draws the image metric's picture; a --task no run logs is refused, naming it."""
    pytest.importorskip("matplotlib")
    runs = []
    for i in range(3):
        d = tmp_path / f"run{i}"
        d.mkdir()
        write_log(d / "log.jsonl", n=10)
        runs.append(str(d))
    assert plots.main([runs[0]]) == tmp_path / "run0" / "curves.png"
    assert (tmp_path / "run0" / "curves.png").is_file()
    png = tmp_path / "cmp.png"
    assert plots.main(["--compare", f"a={runs[0]},{runs[1]}", f"b={runs[2]}", "--png", str(png), "--task", "image"]) == png
    assert png.is_file() and f"wrote {png}" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no run logs sound/"):
        plots.main(["--compare", f"a={runs[0]}", "--png", str(png), "--task", "sound"])
    with pytest.raises(ValueError, match="labels must differ"):
        plots.main(["--compare", f"a={runs[0]}", f"a={runs[1]}", "--png", str(png)])


def test_compare_against_cumulative_seconds(tmp_path, monkeypatch):
    """--x=seconds / cpu_seconds: each step is placed at the median over a label's runs of its cumulative
    RL seconds from times.jsonl, the value at the median of the runs' values."""
    a, b = _run(tmp_path, "a", [1.0, 2.0, 3.0]), _run(tmp_path, "b", [3.0, 4.0, 5.0])
    for d, wall, cpu in ((a, [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]), (b, [4.0, 6.0, 8.0], [1.0, 3.0, 5.0])):
        (d / "times.jsonl").write_text("".join(json.dumps({"step": s, "seconds": w, "cpu_s": c}) + "\n"
                                               for s, (w, c) in enumerate(zip(wall, cpu))))
    # cumulative wall: a 2, 4, 6; b 4, 10, 18 -> medians 3, 7, 12. CPU: a 1, 2, 3; b 1, 4, 9 -> 1, 3, 6.
    assert plots.group_medians({"x": [a, b]}, "text/kl", "seconds") == {"x": [(3.0, 2.0), (7.0, 3.0), (12.0, 4.0)]}
    assert plots.group_medians({"x": [a, b]}, "text/kl", "cpu_seconds") == {"x": [(1.0, 2.0), (3.0, 3.0), (6.0, 4.0)]}
    pytest.importorskip("matplotlib")
    Image = pytest.importorskip("PIL.Image")
    monkeypatch.setattr(plots, "cli", cli, raising=False)  # main's command line parser, imported by __main__
    out = plots.main(["--compare", f"A={a}", f"B={b}", "--x=cpu_seconds", "--png", str(tmp_path / "s.png")])
    with Image.open(out) as im:
        assert im.size == (2 * plots.PANEL_W, plots.PANEL_H)
    (a / "times.jsonl").write_text(json.dumps({"step": 0, "seconds": 1.0}) + "\n")
    with pytest.raises(ValueError, match="no 'cpu_s'"):
        plots.group_medians({"x": [a]}, "text/kl", "cpu_seconds")
