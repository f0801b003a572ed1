"""`make run`'s runner: executes notebooks in order, names the notebook and cell that fail."""

from __future__ import annotations

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from zero_lab import course


def _notebook(path, *sources):
    nb = new_notebook(cells=[new_code_cell("nproc = 2\nbackend = 'auto'\ndevice = 'auto'",
                                           metadata={"tags": ["parameters"]})])
    nb.cells += [new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)


@pytest.fixture
def course_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(course, "NOTEBOOKS", tmp_path / "notebooks")
    monkeypatch.setattr(course, "EXECUTED", tmp_path / "executed")
    (tmp_path / "notebooks").mkdir()
    return tmp_path


def test_runs_in_order_with_parameters(course_dirs):
    _notebook(course_dirs / "notebooks" / "01_b.ipynb", "assert nproc == 3, nproc")
    _notebook(course_dirs / "notebooks" / "00_a.ipynb", "print(backend)")
    (course_dirs / "notebooks" / "scratch.ipynb").write_text("not a course notebook")
    outputs = course.run({"nproc": 3, "backend": "gloo", "device": "cpu"})
    assert [p.name for p in outputs] == ["00_a.ipynb", "01_b.ipynb"]
    executed = nbformat.read(outputs[0], as_version=4)
    assert executed.cells[-1].outputs[0]["text"] == "gloo\n"


def test_failure_names_notebook_and_cell(course_dirs, capsys):
    _notebook(course_dirs / "notebooks" / "00_ok.ipynb", "x = 1")
    _notebook(course_dirs / "notebooks" / "01_bad.ipynb", "y = 2", "1 / 0")
    with pytest.raises(SystemExit) as info:
        course.run({"nproc": 2, "backend": "auto", "device": "auto"})
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "FAILED: 01_bad.ipynb, cell 3 (execution count 4), starting '1 / 0'" in err
    assert "ZeroDivisionError: division by zero" in err


def test_only_that_matches_nothing_is_an_error(course_dirs):
    with pytest.raises(SystemExit, match="--only '99' matches no notebook"):
        course.course_notebooks("99")
