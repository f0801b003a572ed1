"""`make gpu-check` (zero_lab/course/gpu_check.py) where there is no GPU: every row that needs one
is skipped with the reason and it exits 0; a failed test or notebook is a failed row and exit 1.
On one GPU (faked): one rank, and a notebook that needs two is a skip, not a failure."""

from __future__ import annotations

import os
import shutil
import subprocess

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


@pytest.fixture
def one_gpu(monkeypatch):
    """This process sees one CUDA GPU (machine_row reads its name, memory and NCCL)."""
    props = type("Props", (), {"name": "Fake GPU", "total_memory": 80 * 2**30})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))


def test_on_one_gpu_a_notebook_that_needs_two_ranks_is_a_skip(tmp_path, monkeypatch, capsys,
                                                              one_gpu):
    """`make gpu-check` on one GPU: one rank (gpu_check's own choice), and notebook 02, whose
    parameters cell asks for at least 2 (TooFewRanks), is a skip that says so, not a failure.
    It runs the notebook for real, to that cell; the child processes see one GPU through a
    sitecustomize on PYTHONPATH. Mutant: the default nproc 2 (what the Makefile passed): on one
    GPU no notebook runs, 02 has no row of its own."""
    fake = tmp_path / "one_gpu"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(
        "import torch\ntorch.cuda.is_available = lambda: True\n"
        "torch.cuda.device_count = lambda: 1\n")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    monkeypatch.setenv("ZERO_LAB_RUNS_DIR", str(tmp_path / "runs"))
    assert gpu_check.main(["--no-tests", "--only", "02"]) == 0
    text = capsys.readouterr().out
    row = [ln for ln in text.splitlines() if ln.startswith("| 02_collectives.ipynb |")]
    assert row and "| skip |" in row[0], text
    assert "parameter nproc=1: must be at least 2" in row[0], text


def test_more_ranks_than_gpus_skip_the_notebooks_saying_what_to_do(tmp_path, monkeypatch,
                                                                 capsys, one_gpu):
    """`make gpu-check NPROC=2` on one GPU: no notebook can start (the runner refuses NCCL
    without a GPU per rank), so none is launched and one row says why and what to run instead,
    as where there is no GPU at all. Mutant: the check of --nproc against the GPUs removed
    (every notebook launched and failed, exit 1)."""
    launched = []

    def refused(cmd, **kw):  # what the runner does with nproc=2 on one GPU: exit 2
        launched.append(cmd)
        return type("Done", (), {"returncode": 2})()

    monkeypatch.setattr(gpu_check.subprocess, "run", refused)
    monkeypatch.setenv("ZERO_LAB_RUNS_DIR", str(tmp_path))
    assert gpu_check.main(["--no-tests", "--nproc", "2", "--only", "02"]) == 0
    text = capsys.readouterr().out
    assert launched == []
    row = [ln for ln in text.splitlines() if ln.startswith("| notebooks |")]
    assert row and "| skip |" in row[0], text
    assert "--nproc 2 needs one GPU per rank and this machine has 1" in row[0], text
    assert "without NPROC" in row[0] and "--nproc 1" in row[0], text  # what to run instead


def _make_gpu_check(**given: str) -> str:
    """The command `make -n gpu-check` prints: given={"cli": ..., "env": ...} sets NPROC on
    make's command line or in its environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "NPROC")}  # a make of its own
    if "env" in given:
        env["NPROC"] = given["env"]
    extra = [f"NPROC={given['cli']}"] if "cli" in given else []
    # -o: setup's .installed is taken as current, so only gpu-check's own line prints
    out = subprocess.run(["make", "-n", "-o", ".venv/.installed", "gpu-check", *extra],
                         cwd=gpu_check.ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout
    lines = [ln for ln in out.splitlines() if "zero_lab.course.gpu_check" in ln]
    assert lines, f"make -n gpu-check printed no gpu_check command:\n{out}"
    return lines[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_passes_nproc_only_when_it_is_given():
    """NPROC's `?= 2` is for make run; gpu-check leaves the count to gpu_check (one rank per
    GPU, at most 2) unless NPROC is on the command line or in the environment. Mutant:
    `$(if $(NPROC),...)` (always true: every notebook failed on one GPU) or only `command line`
    accepted (the environment's NPROC ignored)."""
    assert "--nproc" not in _make_gpu_check()
    assert _make_gpu_check(cli="1").endswith("--nproc 1")
    assert _make_gpu_check(env="3").endswith("--nproc 3")
