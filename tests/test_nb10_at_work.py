"""Notebook 10's checks, each run on what its launch measured and on a mutant it must catch.

The checks are the notebook's own cells, read from the .ipynb and run here over the reports of
one launch of zero_lab/workers/at_work.py (4 gloo ranks), then over a mutant: a wrong formula,
the flight recorder's dumps without the mismatch, torch's loss-scaler agreement taken away
(tests/workers/nb10_scaler_mutants.py), a worker that does not make the mistake."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import pickle
import warnings

import pytest

from zero_lab.launch import torchrun
from zero_lab.launch.capacity import CapacityWarning
from zero_lab.launch.paths import NOTEBOOKS, REPO_ROOT, WORKERS
from zero_lab.predict import tensor_parallel

CELLS = {c["id"]: "".join(c["source"])
         for c in json.loads((NOTEBOOKS / "10_at_work.ipynb").read_text())["cells"]}
PRELUDE = """
import json, subprocess, sys, textwrap
from zero_lab import memory
from zero_lab.course.formatting import table
from zero_lab.launch import LaunchError, torchrun
from zero_lab.predict import tensor_parallel as tp
"""
FR = {"TORCH_FR_BUFFER_SIZE": "64"}
READS = {"a10c0016": ("a10c0014",)}  # its `report`, `t` and `d`


def run_cell(cell_id: str, **names) -> str:
    """Run one of the notebook's cells with `names` as the kernel's variables (and the cells
    it reads first, as the kernel ran them); its output."""
    scope: dict = {}
    exec(PRELUDE, scope)
    scope.update(names)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for before in READS.get(cell_id, ()):
            exec(CELLS[before], scope)
        exec(CELLS[cell_id], scope)
    return out.getvalue()


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("at_work")
    with warnings.catch_warnings():  # 4 ranks on 2 cores: CapacityWarning, expected
        warnings.simplefilter("ignore", CapacityWarning)
        result = torchrun(WORKERS / "at_work.py", nproc=4, backend="gloo", timeout=600,
                          stream=False, env=FR, args=["--part", "all", "--folder", folder])
    return result.ranks, folder


@pytest.mark.parametrize("cell_id", ["a10c0008", "a10c0010", "a10c0014", "a10c0016",
                                     "a10c0018", "a10c0020", "a10c0023"])
def test_each_check_holds_on_the_launch(launch, cell_id):
    ranks, folder = launch
    run_cell(cell_id, ranks=ranks, folder=folder)


def test_debug_mode_off_is_caught(launch):
    """Mutant: the group made without DETAIL: a plain gloo group, which just times out."""
    ranks = copy.deepcopy(launch[0])
    for r, plain in zip(ranks, launch[0], strict=True):
        r["detail"] = {"backend": "ProcessGroupGloo", "error": plain["flight"]["error"]}
    with pytest.raises(AssertionError):
        run_cell("a10c0008", ranks=ranks)


def test_the_analyzer_finds_nothing_where_the_ranks_agree(launch, tmp_path):
    """Mutant: rank 1's dump rewritten as if it had all-reduced too: torchfrtrace then
    reports no culprit, and the notebook's check fails."""
    ranks, folder = launch
    (tmp_path / "flight").mkdir()
    for rank in (0, 1):
        dump = pickle.loads((folder / "flight" / f"rank_{rank}").read_bytes())
        for entry in dump["entries"]:
            entry["profiling_name"] = "gloo:all_reduce"
        (tmp_path / "flight" / f"rank_{rank}").write_bytes(pickle.dumps(dump))
    with pytest.raises(AssertionError, match="tabulate|Collective"):  # the analyzer's words
        run_cell("a10c0010", ranks=ranks, folder=tmp_path)


@pytest.mark.parametrize("mutant", ["held", "backward all-reduces"])
def test_a_wrong_tp_formula_is_caught(launch, monkeypatch, mutant):
    if mutant == "held":  # TP forgotten: each rank holding Ψ/d
        monkeypatch.setattr(tensor_parallel, "held_elements", lambda psi, t, d: psi / d)
        cell = "a10c0014"
    else:  # one backward all-reduce a block, the first block's data input forgotten
        real = tensor_parallel.step_messages
        monkeypatch.setattr(tensor_parallel, "step_messages", lambda *a, **k: real(
            *a, **{**k, "input_requires_grad": True}))
        cell = "a10c0016"
    with pytest.raises(AssertionError):
        run_cell(cell, ranks=launch[0])


@pytest.fixture(scope="module")
def scaler_mutants():
    return torchrun(REPO_ROOT / "tests" / "workers" / "nb10_scaler_mutants.py", nproc=2,
                    backend="gloo", timeout=600, stream=False, env=FR).ranks


@pytest.mark.parametrize("mutant, kind", [("no DTensor reduce", "GradScaler"),
                                          ("no scaler all-reduce", "ShardedGradScaler")])
def test_a_scaler_without_its_agreement_is_caught(launch, scaler_mutants, mutant, kind):
    """Mutants of torch itself: GradScaler on DTensors without DTensor's reduction of the
    flag (rank 0 steps, rank 1 skips); ShardedGradScaler without its all-reduce (the ranks
    still agree, through DTensor, but the 4 bytes the notebook counts are gone)."""
    ranks = [copy.deepcopy(r) for r in launch[0][:2]]
    for r, m in zip(ranks, scaler_mutants, strict=True):
        r["scaler"][kind] = m[mutant]
    run_cell("a10c0023", ranks=launch[0][:2])  # the real reports, on 2 ranks: they pass
    with pytest.raises(AssertionError):
        run_cell("a10c0023", ranks=ranks)


def test_the_launcher_check_needs_the_mistake(tmp_path):
    """The notebook's failing launch, run as the notebook runs it; then a worker without the
    mistake, which the cell must refuse ("the launch should have failed")."""
    run_cell("a10c0006", script=WORKERS / "at_work.py", folder=tmp_path, nproc=2)
    fine = tmp_path / "fine.py"
    fine.write_text("from zero_lab.launch import init_worker\ninit_worker()\n")
    with pytest.raises(AssertionError, match="should have failed"):
        run_cell("a10c0006", script=fine, folder=tmp_path, nproc=2)
