"""`make run`'s runner: executes notebooks in order, names the notebook and cell that fail."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from zero_lab import course
from zero_lab.paths import REPO_ROOT


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
    monkeypatch.setenv("ZERO_LAB_FIGURES_DIR", str(tmp_path / "figures"))
    (tmp_path / "notebooks").mkdir()
    return tmp_path


def test_runs_in_order_with_parameters(course_dirs, capfd):
    _notebook(course_dirs / "notebooks" / "01_b.ipynb", "assert nproc == 3, nproc")
    _notebook(course_dirs / "notebooks" / "00_a.ipynb", "print(backend)")
    (course_dirs / "notebooks" / "scratch.ipynb").write_text("not a course notebook")
    outputs = course.run({"nproc": 3, "backend": "gloo", "device": "cpu"})
    assert [p.name for p in outputs] == ["00_a.ipynb", "01_b.ipynb"]
    executed = nbformat.read(outputs[0], as_version=4)
    assert executed.cells[-1].outputs[0]["text"] == "gloo\n"
    out, err = capfd.readouterr()  # the kernels' own stderr included
    assert "WARNING" not in err and "encryption" not in err, err
    # The end of the run: the total time and where its results are.
    lines = out.splitlines()
    assert re.fullmatch(r"2 notebooks executed in \d+(\.\d)? s", lines[-3]), out
    assert lines[-2] == f"executed notebooks: {course_dirs / 'executed'}"
    assert lines[-1] == (f"figures: {course_dirs / 'figures'} "
                         "(`make figures` copies them into figures/)")


def test_summary_counts_minutes_past_a_minute():
    text = course.summary(8, 754.2, Path("runs/executed"), Path("runs/figures"))
    assert text.splitlines()[0] == "8 notebooks executed in 12 min 34 s"
    assert course.summary(1, 2.04, Path("e"), Path("f")).startswith("1 notebook executed in 2.0 s")


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


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("uid, flag", [("0", True), ("1000", False)])
def test_make_lab_allows_root_only_as_root(tmp_path, uid, flag):
    # Jupyter refuses to run as root without --allow-root (GPU containers often run as root).
    # A fake `id` says who we are; `make -n` prints the command without running it.
    fake = tmp_path / "id"
    fake.write_text(f"#!/bin/sh\necho {uid}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["make", "-n", "lab"], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    lab = [ln for ln in out.splitlines() if "jupyter lab" in ln]
    assert len(lab) == 1 and lab[0].endswith("--allow-root") == flag, out
