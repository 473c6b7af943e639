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


def test_image_grid_draws_scores_and_notes(tmp_path):
    pytest.importorskip("PIL")  # Pillow is a declared extra; tests/test_plots.py requires it the same way
    from PIL import Image

    plain = plots.image_grid([("a", [[1, 0, 0, 0]])], ["p"], 2, tmp_path / "plain.png")
    scored = plots.image_grid([("a", [[1, 0, 0, 0]])], ["p"], 2, tmp_path / "scored.png", scores=[[1.0]],
                              notes=("legend",))
    w0, h0 = Image.open(plain).size
    w1, h1 = Image.open(scored).size
    assert w1 == w0 and h1 == h0 + 2 * (plots.FONT_SIZE + 3)  # one score line for the row, one note line


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
