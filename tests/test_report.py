"""docs/results.md and its figures are what `python -m tools.report` writes from docs/data/.

The tables between the `<!-- table: NAME -->` markers must equal the tables the report builds from the kept
run data, and the figures it draws (infra/plots.py, from the kept per-step points) must have the pixels of
the committed PNGs, so the docs cannot drift from the data. The kept data stays compact."""
import json
import shutil

import pytest
from PIL import Image

from tools import report

RESULTS = report.DOCS / "results.md"


def test_committed_tables_are_what_the_report_prints(capsys):
    committed = report.marked(RESULTS.read_text())
    assert report.main(["--print"]) == 0
    printed = report.marked(capsys.readouterr().out)
    assert set(committed) == set(printed) == set(report.TABLES)
    for name in printed:
        assert committed[name] == printed[name], f"docs/results.md table {name!r} differs: run python -m tools.report"


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory):
    """`python -m tools.report` run once on a copy of results.md: (the copy, the folder of its figures)."""
    pytest.importorskip("matplotlib")  # the plots extra, in the dev extra, as tests/test_plots.py requires it
    d = tmp_path_factory.mktemp("report")
    (d / "results.md").write_text(RESULTS.read_text())
    report.main(["--results", str(d / "results.md"), "--figures", str(d / "fig")])
    return d / "results.md", d / "fig"


def test_rewriting_the_results_changes_nothing(rewritten):
    assert rewritten[0].read_text() == RESULTS.read_text()


def test_figures_have_the_committed_pixels(rewritten):
    written = list(rewritten[1].iterdir())
    names = {p.name for p in written}
    text = RESULTS.read_text()
    # every picture results.md shows is one the report draws, and every committed docs/*.png is shown somewhere
    shown = {n for n in (p.name for p in report.DOCS.glob("*.png")) if f"]({n})" in text}
    assert names == shown == {p.name for p in report.DOCS.glob("*.png")}
    for p in written:
        with Image.open(p) as new, Image.open(report.DOCS / p.name) as old:
            assert new.size == old.size and new.convert("RGB").tobytes() == old.convert("RGB").tobytes(), p.name


def test_a_changed_run_changes_its_table(tmp_path, monkeypatch):
    # The check above can fail: one run's held-out score moved by 0.01 changes the printed seed table.
    data = tmp_path / "data"
    shutil.copytree(report.DATA, data)
    seeds = json.loads((data / "toy_seeds.json").read_text())
    seeds["runs"][2]["summary"]["text"]["after"] += 0.01
    (data / "toy_seeds.json").write_text(json.dumps(seeds))
    before = report.t_toy_seeds()
    monkeypatch.setattr(report, "DATA", data)
    after = report.t_toy_seeds()
    assert before != after and "0.316 -> 0.414" in after and "0.316 -> 0.404" in before


def test_a_marker_without_a_table_is_an_error():
    with pytest.raises(ValueError, match="no_such_table"):
        report.fill("<!-- table: no_such_table -->\n<!-- /table -->\n", {"toy_seeds": "x"})


def test_kept_data_is_compact():
    files = [p for p in report.DATA.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 30 and sum(p.stat().st_size for p in files) <= 1_000_000
