"""What a run's pictures show: images.png gives each toy image its verifier score, a legend and the
held-out gain it illustrates; curves.png gives the held-out before/after and a KL axis one spike cannot
flatten. (Pixels are not compared: the arguments the drawing functions receive are.)

    OMP_NUM_THREADS=1 python -m pytest tests/test_pictures.py -q
"""
import json

import pytest

from infra import plots

SPEC = {"width": 2, "counts": {"red": 1}, "relation": None, "place": None}  # "a red block" on a 2 x 2 grid


def test_image_panel_scores_every_image_and_explains_itself(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(plots, "image_grid", lambda grid, prompts, width, png, **kw: seen.update(kw, prompts=prompts))
    grid = [("before RL", [[0, 0, 0, 0], [1, 1, 0, 0]]), ("after RL", [[1, 0, 0, 0], [1, 0, 0, 0]])]
    exs = [{"prompt": "a red block", "spec": SPEC}] * 2
    summary = {"image": {"before": 0.25, "after": 0.5, "gain_se": 0.05}}
    plots.toy_image_panel(grid, exs, 2, tmp_path / "images.png", summary)
    # By hand (rewards.image_reward's checks: the count of red, no other colour): empty 0; two reds 1/2
    # (count wrong, colours right); one red 1.
    assert seen["scores"] == [[0.0, 0.5], [1.0, 1.0]]
    notes = " ".join(seen["notes"])
    assert "dark grey: empty cell" in notes and "same prompts and sampling seeds before and after" in notes
    assert "held-out mean image reward (summary.json): 0.250 -> 0.500 (+0.250 ± 0.050)" in notes


def test_image_grid_draws_scores_and_notes(tmp_path, monkeypatch):
    """A score under each image and the notes under the whole grid, read back from the saved figure."""
    Figure = pytest.importorskip("matplotlib.figure").Figure
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, _save=Figure.savefig, **k: figures.append(self)
                        or _save(self, *a, **k))
    plots.image_grid([("a", [[1, 0, 0, 0]])], ["p"], 2, tmp_path / "plain.png")
    plots.image_grid([("a", [[1, 0, 0, 0], [0] * 4])], ["p", "q"], 2, tmp_path / "scored.png", scores=[[1.0, 0.25]],
                     notes=("legend", "second line"))
    (plain,), scored = figures[0].axes, figures[1].axes
    assert plain.get_xlabel() == "" and [t.get_text() for t in figures[0].texts] == [""]
    assert [ax.get_xlabel() for ax in scored] == ["score 1.00", "score 0.25"]
    notes = figures[1].texts[0]
    assert notes.get_text() == "legend\nsecond line"
    for ax in scored:  # the score under its image, the notes under the scores
        image, score = ax.get_window_extent(), ax.xaxis.label.get_window_extent()
        assert score.y1 <= image.y0 and image.x0 <= (score.x0 + score.x1) / 2 <= image.x1
        assert notes.get_window_extent().y1 <= score.y0


def write_log(path, kl):
    path.write_text("".join(json.dumps({"step": i, "text/reward": 0.5, "text/kl": v}) + "\n" for i, v in enumerate(kl)))


def test_curves_cut_a_kl_spike_and_show_the_held_out_gain(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(plots, "_save_panels", lambda panels, colours, steps, png, held=None:
                        seen.update(panels=dict(panels), held=held))
    kl = [0.01] * 19 + [1.0]
    write_log(tmp_path / "log.jsonl", kl)
    (tmp_path / "summary.json").write_text(json.dumps({"text": {"before": 0.4, "after": 0.55, "gain_se": 0.02},
                                                       "seconds": {"sft": 1, "rl": 2}}))
    plots.plot_curves(tmp_path / "log.jsonl", tmp_path / "curves.png")
    # 90th percentile 0.01: the axis is cut at twice it, and the spike drawn at the cut
    assert [y for _, y in seen["panels"]["KL k3 (axis cut at 0.02)"]["text"]] == [0.01] * 19 + [0.02]
    assert seen["held"] == [("text", "0.400 -> 0.550 (+0.150 ± 0.020)")]
    write_log(tmp_path / "log.jsonl", [0.01 * (i + 1) for i in range(20)])  # a steady rise: not cut
    plots.plot_curves(tmp_path / "log.jsonl", tmp_path / "curves.png")
    assert "KL to reference (k3)" in seen["panels"]
