"""`make soak`: notebooks run under nbval again and again beside busy processes, passes counted."""

from __future__ import annotations

import contextlib
import json

import nbformat
import pytest

from zero_lab.course import soak


def _notebook(path, *cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, path)
    return path


def test_soak_counts_passes_names_the_failing_cell_and_leaves_no_load(tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.setenv("ZERO_LAB_RUNS_DIR", str(tmp_path))  # new_run_dir's root
    # A sleeping stand-in for the spinning load: what is held here is the bookkeeping (started
    # before each run, alive through it, gone after); a real spinner would take a core from the
    # rest of `make test` (pytest beside nbval on two cores) for the whole test.
    monkeypatch.setattr(soak, "SPIN", "import time; time.sleep(600)")
    good = _notebook(tmp_path / "good.ipynb", "x = 1")
    bad = _notebook(tmp_path / "bad.ipynb", "x = 1", "assert x == 2, ('stage0', x)", "print(y)")
    spinners, seen_load = [], []
    real_busy, real_run_once = soak.busy_processes, soak.run_once

    @contextlib.contextmanager
    def watched_busy(count):
        with real_busy(count) as started:
            spinners.extend(started)
            yield started

    def watched_run_once(nb):
        seen_load.append(sum(p.poll() is None for p in spinners))
        return real_run_once(nb)

    monkeypatch.setattr(soak, "busy_processes", watched_busy)
    monkeypatch.setattr(soak, "run_once", watched_run_once)

    assert soak.main([str(bad), str(good), "--runs", "1", "--load", "1"]) == 1

    out = capsys.readouterr().out
    assert "bad.ipynb: 0/1 passed" in out and "good.ipynb: 1/1 passed" in out
    assert "cell 1: AssertionError: ('stage0', 1)" in out
    assert "cell 2: NameError: name 'y' is not defined" in out
    assert seen_load == [1, 1]                           # the load ran beside every run ...
    assert all(p.poll() is not None for p in spinners)  # ... and is gone after the soak
    (folder,) = (tmp_path / "soak").iterdir()  # the soak's own folder, named in its output
    assert str(folder / "summary.json") in out
    summary = json.loads((folder / "summary.json").read_text())
    assert [(n["notebook"], n["passed"], n["runs"]) for n in summary["notebooks"]] == \
        [("bad.ipynb", 0, 1), ("good.ipynb", 1, 1)]


def test_soak_refuses_nonsense_counts():
    with pytest.raises(SystemExit):
        soak.main(["--runs", "0"])


@pytest.mark.parametrize("fill", ["______", "_"])  # a long notebook path leaves one underscore
def test_failed_cells_are_read_from_nbval_reports_whatever_the_path_length(fill):
    report = (f"{fill} ../pytest-of-root/pytest-15/test_soak_0/bad.ipynb::Cell 1 {fill}\n"
              "\x1b[31mAssertionError\x1b[39m                  Traceback (most recent call last)\n"
              "\x1b[31mAssertionError\x1b[39m: ('stage0', 1)\n\n"
              f"{fill} ../pytest-of-root/pytest-15/test_soak_0/bad.ipynb::Cell 2 {fill}\n"
              "NameError: name 'y' is not defined\n")
    assert soak.failed_cells(report) == ["cell 1: AssertionError: ('stage0', 1)",
                                         "cell 2: NameError: name 'y' is not defined"]
