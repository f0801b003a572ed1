"""The committed figures are what the current notebooks draw (issue 50, part 2): `make figures`
records what drew each (zero_lab/course/figure_sources.py); a figure whose notebook's code or
drawing module changed since is stale. Pure Python: hashes files, runs nothing."""

from __future__ import annotations

import json
import shutil

from zero_lab.course import figure_sources


def test_every_committed_figure_was_drawn_by_the_code_there_now():
    assert figure_sources.stale() == [], "run `make figures` and commit figures/"


def test_a_changed_code_cell_or_drawing_module_makes_a_figure_stale(tmp_path, monkeypatch):
    """Mutants: a code cell of notebook 03 changed; plots.py changed; a figure never recorded.
    A markdown edit leaves the figure fresh."""
    notebooks, course = tmp_path / "notebooks", tmp_path / "course"
    shutil.copytree(figure_sources.NOTEBOOKS, notebooks)
    shutil.copytree(figure_sources.COURSE, course)
    monkeypatch.setattr(figure_sources, "NOTEBOOKS", notebooks)
    monkeypatch.setattr(figure_sources, "COURSE", course)
    figures = tmp_path / "figures"
    figures.mkdir()
    for name in ("03_step_ddp.png", "03_zero1_who_owns_what.png"):
        (figures / name).write_bytes(b"png")
    figure_sources.record(sorted(figures.glob("*.png")))
    assert figure_sources.stale(figures) == []

    nb03 = next(notebooks.glob("03_*.ipynb"))
    nb = json.loads(nb03.read_text(encoding="utf-8"))
    prose = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    prose["source"].append("\nOne more sentence.")
    nb03.write_text(json.dumps(nb), encoding="utf-8")
    assert figure_sources.stale(figures) == []

    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    code["source"].append("\nwidth = 2048")
    nb03.write_text(json.dumps(nb), encoding="utf-8")
    assert figure_sources.stale(figures) == [
        "03_step_ddp.png (the code of 03_zero1.ipynb changed)",
        "03_zero1_who_owns_what.png (the code of 03_zero1.ipynb changed)"]

    figure_sources.record(sorted(figures.glob("*.png")))
    (course / "plots.py").write_text((course / "plots.py").read_text() + "\n# changed\n")
    assert len(figure_sources.stale(figures)) == 2
    figure_sources.record(sorted(figures.glob("*.png")))
    (figures / "03_new.png").write_bytes(b"png")
    assert figure_sources.stale(figures) == ["03_new.png (no record)"]
