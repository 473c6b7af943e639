"""Image-grid captions sit over their own column (infra/plots.image_grid): the column geometry is measured
from the picture itself (the dark cells and lines of each image of the first row), not from the figure's
layout, and the ink of each caption must be centred over its column's images.

    python -m pytest tests/test_grid_captions.py -q
"""
import pytest

from infra import plots


def runs(flags):
    """[(first, last)] of the runs of True in a list."""
    out, start = [], None
    for i, f in enumerate(list(flags) + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i - 1))
            start = None
    return out


@pytest.mark.parametrize("n_prompts", [1, 3, 4])
def test_each_caption_is_centred_over_its_column(tmp_path, n_prompts):
    pytest.importorskip("matplotlib")
    Image = pytest.importorskip("PIL.Image")
    width = 4
    prompts = ["red", "yellowish", "mm", "cyan block"][:n_prompts]
    rows = [(name, [[0] * width * width for _ in prompts]) for name in ("before RL", "after RL")]
    with Image.open(plots.image_grid(rows, prompts, width, tmp_path / "grid.png")) as im:
        im = im.convert("RGB")
        W, H = im.size
        # The first row's images: background cells (PALETTE[0]) and the dark lines, scanned from the top down
        # for a run of dark pixels longer than any letter.
        dark = lambda p: max(p) <= max(plots.PALETTE[0])
        wide = lambda y: [(a, b) for a, b in runs(dark(im.getpixel((x, y))) for x in range(W)) if b - a > 20]
        y_img = min(y for y in range(H) if wide(y))
        columns = wide(y_img + 10)
        assert len(columns) == n_prompts
        # The captions: every non-white pixel above the images, grouped by x (words are single runs).
        ink = [any(im.getpixel((x, y)) != (255, 255, 255) for y in range(0, y_img - 2)) for x in range(W)]
        groups = []
        for a, b in runs(ink):
            if groups and a - groups[-1][1] <= 8:  # letters of one word
                groups[-1] = (groups[-1][0], b)
            else:
                groups.append((a, b))
    assert len(groups) == n_prompts, groups
    for (ia, ib), (ca, cb) in zip(columns, groups):
        assert abs((ia + ib) / 2 - (ca + cb) / 2) <= 3, (columns, groups)
