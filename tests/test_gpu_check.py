"""`make gpu-check` (zero_lab/course/gpu_check.py) where there is no GPU: every row that needs one
is skipped with the reason and it exits 0; a failed test or notebook is a failed row and exit 1."""

from __future__ import annotations

import pytest
import torch

from zero_lab.course import gpu_check

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_cuda" name="test_a" time="1.5"/>
<testcase classname="tests.test_cuda" name="test_b" time="2.0">
  <failure message="AssertionError: peak 3 MiB over the formula">trace</failure></testcase>
<testcase classname="tests.test_cuda" name="test_c" time="0.0">
  <skipped message="no CUDA GPU here"/></testcase>
</testsuite></testsuites>"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run make gpu-check")
def test_without_a_gpu_every_cuda_row_is_skipped_and_it_passes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZERO_LAB_RUNS_DIR", str(tmp_path))
    assert gpu_check.main([]) == 0
    text = capsys.readouterr().out
    assert "| machine | skip |" in text and "| notebooks | skip |" in text
    assert "| test_stages_train_to_the_one_process_result_on_gpus | skip |" in text
    assert "| pass |" not in text.split("| machine |")[1]  # nothing ran that needs CUDA
    assert list(tmp_path.glob("gpu-check/*/table.md"))


def test_a_failed_test_is_a_failed_row_with_its_message(tmp_path):
    (tmp_path / "x.xml").write_text(JUNIT)
    rows = gpu_check.test_rows(tmp_path / "x.xml", 4.0, 1, tmp_path / "log")
    assert [(r.check, r.status) for r in rows] == [("test_a", "pass"), ("test_b", "fail"),
                                                  ("test_c", "skip")]
    assert "over the formula" in rows[1].detail
    missing = gpu_check.test_rows(tmp_path / "none.xml", 4.0, 2, tmp_path / "log")
    assert missing[0].status == "fail" and "exited 2" in missing[0].detail


def test_a_failed_notebook_names_its_cell(tmp_path):
    log = tmp_path / "05.log"
    log.write_text("course: 0/1\n\nFAILED: 05_zero3.ipynb, cell 15 (execution count 9), "
                   "starting 'unit = max(...)'\nAssertionError: rise over the bound\n")
    row = gpu_check.notebook_row("05_zero3.ipynb", 1, 46.0, log)
    assert row.status == "fail"
    assert row.detail == ("FAILED: 05_zero3.ipynb, cell 15 (execution count 9) "
                          "AssertionError: rise over the bound")
    assert gpu_check.notebook_row("00.ipynb", 0, 3.0, log).status == "pass"
    log.write_text("FAILED: 02_collectives.ipynb, cell 3 (execution count 2), starting 'x'\n"
                   "TooFewRanks: parameter nproc=1: must be at least 2: this notebook ...\n")
    row = gpu_check.notebook_row("02_collectives.ipynb", 1, 5.0, log)  # one GPU: not a failure
    assert (row.status, row.detail) == ("skip", "parameter nproc=1: must be at least 2: this "
                                                "notebook ...")
    log.write_text("FAILED: 08_knobs.ipynb, cell 2 (execution count 2), starting 'x'\n"
                   "TooFewGPUs: parameter math.prod(hsdp_mesh)=4 (backend='auto', device='cuda', "
                   "4 ranks): device='cuda' needs one CUDA device per rank\n")
    row = gpu_check.notebook_row("08_knobs.ipynb", 1, 5.0, log)  # HSDP on one GPU: a skip
    assert row.status == "skip" and row.detail.startswith("parameter math.prod(hsdp_mesh)=4")
    assert "stopped after" in gpu_check.notebook_row("03.ipynb", None, 180.0, log).detail


def test_the_notebooks_import_this_checkout(tmp_path, monkeypatch):
    """The kernels start in notebooks/: a relative PYTHONPATH entry ("." as the device README
    has it) named notebooks/ there, and on an H100 every notebook failed at its first import
    ("No module named 'zero_lab'"). The children get this checkout first and every entry
    made absolute. Mutant: env not passed (the child inherits PYTHONPATH=".")."""
    seen = []

    def fake_run(cmd, **kw):
        seen.append(kw.get("env"))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setenv("PYTHONPATH", ".")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gpu_check.subprocess, "run", fake_run)
    rows = gpu_check.run_notebooks(tmp_path, 1, "01")
    assert [r.status for r in rows] == ["pass"]
    assert seen[0]["PYTHONPATH"].split(":") == [str(gpu_check.ROOT), str(tmp_path)]
