"""`make run`'s runner: executes notebooks in order, names the notebook and cell that fail;
a run folder of its own; refuses what would fail (ranks the machine cannot hold, a device it
lacks) before any kernel starts; writes executed notebooks whole or not at all."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from zero_lab.course import preflight, runner
from zero_lab.launch import capacity
from zero_lab.launch.paths import REPO_ROOT


def _notebook(path, *sources):
    nb = new_notebook(cells=[new_code_cell("nproc = 2\nbackend = 'auto'\ndevice = 'auto'",
                                           metadata={"tags": ["parameters"]})])
    nb.cells += [new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)


@pytest.fixture
def course_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "NOTEBOOKS", tmp_path / "notebooks")
    monkeypatch.setattr(runner, "FIGURES", tmp_path / "committed_figures")
    monkeypatch.setenv("ZERO_LAB_RUNS_DIR", str(tmp_path / "runs"))
    (tmp_path / "notebooks").mkdir()
    return tmp_path


def test_runs_in_order_with_parameters(course_dirs, capfd):
    _notebook(course_dirs / "notebooks" / "01_b.ipynb", "assert nproc == 3, nproc",
              "print('-' * 111)")
    _notebook(course_dirs / "notebooks" / "00_a.ipynb", "print(backend)",
              "import os; print(os.environ['ZERO_LAB_FIGURES_DIR'])",
              "print(os.environ['ZERO_LAB_RUNS_DIR'])")
    (course_dirs / "notebooks" / "scratch.ipynb").write_text("not a course notebook")
    figures_before = os.environ["ZERO_LAB_FIGURES_DIR"]
    run_dir = runner.run({"nproc": 3, "backend": "gloo", "device": "cpu"})
    # a folder of this run's own, under $ZERO_LAB_RUNS_DIR/course/
    assert run_dir.parent == course_dirs / "runs" / "course"
    executed = run_dir / "executed"
    assert sorted(p.name for p in executed.iterdir()) == ["00_a.ipynb", "01_b.ipynb"]
    cells = nbformat.read(executed / "00_a.ipynb", as_version=4).cells
    # the kernels save figures, and notebooks their run folders, inside this run's folder
    assert [c.outputs[0]["text"] for c in cells[-3:]] == [
        "gloo\n", f"{run_dir / 'figures'}\n", f"{run_dir}\n"]
    assert os.environ["ZERO_LAB_FIGURES_DIR"] == figures_before  # put back after the run
    out, err = capfd.readouterr()  # the kernels' own stderr included
    assert "WARNING" not in err and "encryption" not in err, err
    # The end of the run: the total time and where its results are.
    lines = out.splitlines()
    assert "  1 printed lines over 110 characters, the first: -----" in out  # 01_b's
    assert re.fullmatch(r"2 notebooks executed in \d+(\.\d)? s", lines[-4]), out
    assert lines[-3] == f"run folder: {run_dir}"
    assert lines[-2] == f"executed notebooks: {executed}"
    assert lines[-1] == (f"figures: {run_dir / 'figures'} "
                         "(`make figures` copies them into committed_figures/)")


def test_wide_lines_are_what_a_learner_sees_as_text():
    out = [{"output_type": "stream", "name": "stdout", "text": "a" * 60},
           {"output_type": "stream", "name": "stdout", "text": "b" * 51 + "\nshort\n"},
           {"output_type": "stream", "name": "stderr", "text": "w" * 200},  # a warning
           {"output_type": "stream", "name": "stdout", "text": "x" * 200 + "\rdone\n"},
           {"output_type": "execute_result", "data": {"text/plain": "r" * 111}},
           {"output_type": "display_data",
            "data": {"text/plain": "<Figure " + "f" * 200, "image/png": "..."}}]
    assert runner.wide_lines(out) == ["r" * 111, "a" * 60 + "b" * 51]
    assert runner.wide_lines(out, width=111) == []


def test_nbval_fails_a_cell_that_prints_a_line_over_the_width(tmp_path):
    """The root conftest.py's hook, loaded as nbval meets the course's notebooks: a 111-
    character line fails its cell and names it; the 110-character line beside it passes."""
    nb = tmp_path / "wide.ipynb"
    nb.write_text(json.dumps({"cells": [
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": "print('=' * 110)"},
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": "print('#' * 111)"}],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                    "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5}))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "conftest", "-p",
         "no:cacheprovider", "-q", str(nb)], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
    assert "1 failed, 1 passed" in done.stdout, done.stdout[-2000:]
    assert "1 printed lines over 110 characters" in done.stdout and "#" * 111 in done.stdout


def test_two_runs_never_share_a_folder(course_dirs):
    _notebook(course_dirs / "notebooks" / "00_a.ipynb", "x = 1")
    first = runner.run({"nproc": 1, "backend": "gloo", "device": "cpu"})
    second = runner.run({"nproc": 1, "backend": "gloo", "device": "cpu"})
    assert first != second
    assert (first / "executed" / "00_a.ipynb").is_file()
    assert (second / "executed" / "00_a.ipynb").is_file()


def test_summary_counts_minutes_past_a_minute():
    text = runner.summary(8, 754.2, Path("runs/course/x"))
    assert text.splitlines()[0] == "8 notebooks executed in 12 min 34 s"
    assert runner.summary(1, 2.04, Path("r")).startswith("1 notebook executed in 2.0 s")


def test_a_dead_kernel_is_told_as_memory_with_fewer_ranks_to_try(tmp_path, monkeypatch, capsys):
    from nbclient.exceptions import DeadKernelError

    def dies(*_args):
        raise DeadKernelError("Kernel died")

    closed = []
    monkeypatch.setattr(runner, "execute", dies)
    with pytest.raises(SystemExit) as info:
        runner.execute_or_exit(Path("07_x.ipynb"), tmp_path / "07_x.ipynb", {"nproc": 4}, None,
                               type("Bar", (), {"close": lambda self: closed.append(1)})())
    assert info.value.code == 1 and closed == [1]
    assert capsys.readouterr().err == (
        "\nFAILED: 07_x.ipynb: its kernel died with nproc=4, most likely killed for running out "
        "of memory (the out-of-memory killer ends the largest process). Run it again with fewer "
        "ranks (make run NPROC=2 ONLY=07) or with less else running.\n")


def test_failure_names_notebook_and_cell(course_dirs, capsys):
    _notebook(course_dirs / "notebooks" / "00_ok.ipynb", "x = 1")
    _notebook(course_dirs / "notebooks" / "01_bad.ipynb", "y = 2", "1 / 0")
    with pytest.raises(SystemExit) as info:
        runner.run({"nproc": 2, "backend": "auto", "device": "auto"})
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "FAILED: 01_bad.ipynb, cell 3 (execution count 4), starting '1 / 0'" in err
    assert "ZeroDivisionError: division by zero" in err
    # the executed copy up to the failure, whole, at its name (and nothing else beside it)
    kept = re.search(r"The executed copy up to the failure is (\S+)", err).group(1)
    assert Path(kept).name == "01_bad.ipynb"
    assert nbformat.read(kept, as_version=4).cells[-1].outputs[0]["ename"] == "ZeroDivisionError"
    assert sorted(p.name for p in Path(kept).parent.iterdir()) == ["00_ok.ipynb", "01_bad.ipynb"]


def _papermill_that_writes_half_then(monkeypatch, error: BaseException) -> list:
    """papermill.execute_notebook replaced: it writes half a notebook at the output path, as
    a disk that fills mid-write leaves it, then raises `error`. Returns the paths it wrote."""
    import papermill

    written = []

    def execute_notebook(input_path, output_path, **kwargs):
        written.append(Path(output_path))
        text = json.dumps(nbformat.read(input_path, as_version=4))
        Path(output_path).write_text(text[: len(text) // 2])
        raise error

    monkeypatch.setattr(papermill, "execute_notebook", execute_notebook)
    return written


@pytest.mark.parametrize("code, cause, todo", [
    (errno.ENOSPC, "no space left", "free space"),
    (errno.EROFS, "read-only", "ZERO_LAB_RUNS_DIR"),
    (errno.EACCES, "permission denied", "ZERO_LAB_RUNS_DIR"),
])
def test_a_failed_write_leaves_no_half_notebook_and_says_why(course_dirs, monkeypatch, capsys,
                                                            code, cause, todo):
    # Failed before: a raw `OSError: [Errno 28]` traceback, and runs/executed/03_zero1.ipynb
    # left as truncated JSON at its final name.
    _notebook(course_dirs / "notebooks" / "03_zero1.ipynb", "x = 1")
    written = _papermill_that_writes_half_then(monkeypatch, OSError(code, os.strerror(code)))
    with pytest.raises(SystemExit) as info:
        runner.run({"nproc": 2, "backend": "gloo", "device": "cpu"})
    assert info.value.code not in (0, None)
    [run_dir] = (course_dirs / "runs" / "course").iterdir()
    final = run_dir / "executed" / "03_zero1.ipynb"
    assert written and written[0] != final and written[0].parent == final.parent  # same folder
    assert list(final.parent.iterdir()) == []  # neither the half file nor its temporary name
    err = capsys.readouterr().err
    assert "Traceback" not in err and "OSError" not in err, err
    line = err.strip().splitlines()[-1]  # one line (after the progress bar's)
    assert str(final) in line and cause in line.lower() and todo in line, err


def test_a_run_folder_that_cannot_be_made_says_why(course_dirs, monkeypatch, capsys):
    _notebook(course_dirs / "notebooks" / "00_a.ipynb", "x = 1")

    def read_only(kind):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(course_dirs / "runs" / kind))

    monkeypatch.setattr(runner, "new_run_dir", read_only)
    with pytest.raises(SystemExit) as info:
        runner.run({"nproc": 2, "backend": "gloo", "device": "cpu"})
    assert info.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(course_dirs / "runs" / "course") in err, err
    assert "read-only" in err and "ZERO_LAB_RUNS_DIR" in err and "Traceback" not in err, err


def test_a_dead_kernel_names_the_notebook_nproc_and_memory(course_dirs, monkeypatch, capsys):
    # Failed before: a raw `DeadKernelError: Kernel died` naming neither notebook nor nproc.
    from nbclient.exceptions import DeadKernelError

    _notebook(course_dirs / "notebooks" / "03_zero1.ipynb", "x = 1")
    _papermill_that_writes_half_then(monkeypatch, DeadKernelError("Kernel died"))
    with pytest.raises(SystemExit) as info:
        runner.run({"nproc": 4, "backend": "gloo", "device": "cpu"})
    assert info.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "03_zero1.ipynb" in err and "nproc=4" in err and "out of memory" in err, err
    assert "Traceback" not in err


def _no_kernel(monkeypatch) -> list:
    import papermill

    started = []
    monkeypatch.setattr(papermill, "execute_notebook", lambda *a, **k: started.append(a))
    return started


def test_too_many_ranks_are_refused_before_any_kernel(course_dirs, monkeypatch, capsys):
    # Failed before: `make run NPROC=64` on 2 cores ran until the out-of-memory killer.
    monkeypatch.setattr("zero_lab.launch.capacity.available_cores", lambda: 2)
    _notebook(course_dirs / "notebooks" / "00_a.ipynb", "x = 1")
    started = _no_kernel(monkeypatch)
    with pytest.raises(SystemExit) as info:
        runner.run({"nproc": 64, "backend": "auto", "device": "auto"})  # what `run` runs
    assert info.value.code not in (0, None)
    assert started == [] and not (course_dirs / "runs").exists()  # no kernel, no run folder
    err = capsys.readouterr().err
    assert "nproc=64 ranks on 2 cores: refused" in err and "Traceback" not in err, err


def test_more_ranks_than_memory_are_refused_before_any_kernel(course_dirs, monkeypatch, capsys):
    monkeypatch.setattr("zero_lab.launch.capacity.available_cores", lambda: 16)
    monkeypatch.setattr("zero_lab.launch.capacity.available_memory", lambda: 2**30)
    _notebook(course_dirs / "notebooks" / "00_a.ipynb", "x = 1")
    started = _no_kernel(monkeypatch)
    with pytest.raises(SystemExit):
        runner.run({"nproc": 16, "backend": "auto", "device": "auto"})
    assert started == []
    assert "nproc=16 ranks need about" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_a_device_the_machine_lacks_is_refused_before_any_kernel(course_dirs, monkeypatch,
                                                                 capsys):
    # Failed before: `--device cuda` with no GPU ran the course on gloo and returned 0.
    _notebook(course_dirs / "notebooks" / "00_a.ipynb", "x = 1")
    started = _no_kernel(monkeypatch)
    with pytest.raises(SystemExit) as info:
        runner.run({"nproc": 2, "backend": "auto", "device": "cuda"})
    assert info.value.code not in (0, None) and started == []
    assert "device='cuda'" in capsys.readouterr().err


def test_make_figures_copies_from_the_run_it_made(course_dirs, monkeypatch):
    _child_sees_this_test(course_dirs, monkeypatch)
    _notebook(course_dirs / "notebooks" / "00_a.ipynb",
              "from zero_lab.launch.paths import figures_dir\n"
              "(figures_dir() / 'made_here.png').write_bytes(b'png')")
    runner.main(["figures", "--nproc", "1", "--backend", "gloo"])
    assert sorted(p.name for p in (course_dirs / "committed_figures").iterdir()) == [
        "SOURCES.json", "made_here.png"]  # SOURCES.json: what drew each (figure_sources.py)


def test_only_that_matches_nothing_is_an_error(course_dirs):
    with pytest.raises(SystemExit, match="--only '99' matches no notebook"):
        runner.course_notebooks("99")


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


def test_a_figure_is_saved_whole_or_not_at_all(tmp_path, monkeypatch):
    # plots.save_figure writes a temporary name beside the figure and renames it: a disk that
    # fills mid-write leaves no half PNG under the figure's name (failed before: it did).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zero_lab.course.plots import save_figure

    monkeypatch.setenv("ZERO_LAB_FIGURES_DIR", str(tmp_path))
    fig = plt.figure()
    path = save_figure(fig, "whole")
    assert path == tmp_path / "whole.png" and path.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir()] == ["whole.png"]

    def half_then_full(target, **kwargs):
        Path(target).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fig, "savefig", half_then_full)
    with pytest.raises(OSError, match=r"saving figure 'cut'.*ZERO_LAB_FIGURES_DIR") as info:
        save_figure(fig, "cut")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "cut.png")
    assert [p.name for p in tmp_path.iterdir()] == ["whole.png"]
    plt.close(fig)


# ---- issue 47: shared teaching servers -----------------------------------------------------

def _child_sees_this_test(course_dirs, monkeypatch) -> None:
    """`main` runs the course in a child process: point that child at this test's notebooks
    and figures, as `course_dirs` points this process ($ZERO_LAB_RUNS_DIR it inherits)."""
    def command(argv, run_dir):
        code = ("import sys; from pathlib import Path; from zero_lab.course import runner; "
                f"runner.NOTEBOOKS = Path({str(course_dirs / 'notebooks')!r}); "
                f"runner.FIGURES = Path({str(course_dirs / 'committed_figures')!r}); "
                "runner.main(sys.argv[1:])")
        return [sys.executable, "-c", code, *argv, "--run-dir", str(run_dir)]

    monkeypatch.setattr(runner, "child_command", command)


def test_the_run_folder_says_which_notebooks_are_done_and_which_runs(course_dirs):
    # status.json, rewritten at each notebook: what a run that was killed leaves to read
    _notebook(course_dirs / "notebooks" / "00_a.ipynb", "x = 1")
    _notebook(course_dirs / "notebooks" / "01_b.ipynb",
              "import os\nprint(open(os.path.join(os.environ['ZERO_LAB_RUNS_DIR'], "
              "'status.json')).read())")
    run_dir = runner.run({"nproc": 1, "backend": "gloo", "device": "cpu"})
    cell = nbformat.read(run_dir / "executed" / "01_b.ipynb", as_version=4).cells[-1]
    during = json.loads(cell.outputs[0]["text"])
    assert (during["done"], during["running"], during["ended"]) == (
        ["00_a.ipynb"], "01_b.ipynb", None)
    after = json.loads((run_dir / "status.json").read_text())
    assert (after["done"], after["running"], after["ended"]) == (
        ["00_a.ipynb", "01_b.ipynb"], None, "finished")


def test_a_run_killed_by_sigkill_says_so_in_one_line_and_its_folder_what_is_partial(
        course_dirs, monkeypatch, capfd):
    # Failed before: the out-of-memory killer ended the runner itself: exit 137 and no word,
    # the notebook it ran left under a hidden temporary name, nothing saying what was done.
    # Here a cell kills its kernel's parent, the runner, as the OOM killer would.
    nb = course_dirs / "notebooks"
    _notebook(nb / "00_done.ipynb", "x = 1")
    _notebook(nb / "01_killed.ipynb", "print('before')",
              "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "print('after')")
    _notebook(nb / "02_never.ipynb", "x = 1")
    _child_sees_this_test(course_dirs, monkeypatch)
    monkeypatch.setattr(capacity, "oom_kills", lambda root=None: None)  # no counter to read
    with pytest.raises(SystemExit) as info:
        runner.main(["run", "--nproc", "4", "--backend", "gloo", "--device", "cpu"])
    assert info.value.code == 128 + signal.SIGKILL  # as a shell reports a killed command
    [run_dir] = (course_dirs / "runs" / "course").iterdir()
    executed = run_dir / "executed"
    err = capfd.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "make run: the run was killed (SIGKILL), most likely by the out-of-memory killer, "
        f"while running 01_killed.ipynb with nproc=4; {executed} holds 1 notebook complete "
        "(00) and 01_killed.ipynb partial; try NPROC=2"), err
    assert "Traceback" not in err
    assert sorted(p.name for p in executed.iterdir()) == ["00_done.ipynb", "01_killed.ipynb"]
    cells = nbformat.read(executed / "01_killed.ipynb", as_version=4).cells
    assert cells[2].outputs[0]["text"] == "before\n" and cells[-1].outputs == []  # up to it
    status = json.loads((run_dir / "status.json").read_text())
    assert status["done"] == ["00_done.ipynb"] and status["running"] == "01_killed.ipynb"
    assert status["ended"].startswith("killed (SIGKILL)")


def test_a_killed_run_says_the_oom_killer_as_a_fact_where_its_counter_rose(tmp_path):
    events = tmp_path / "memory.events"
    events.write_text("oom 1\noom_kill 1\n")
    before = capacity.OomKills(1, events)
    status = {"done": ["00_a.ipynb", "01_b.ipynb"], "running": "02_c.ipynb", "nproc": 2}
    said = runner.killed(signal.SIGKILL, status, tmp_path, before)
    assert said.startswith("the run was killed (SIGKILL), most likely by the out-of-memory")
    assert said.endswith("holds 2 notebooks complete (00, 01) and 02_c.ipynb partial; close "
                         "other kernels and programs or ask for more memory")  # nproc=2 already
    events.write_text("oom 2\noom_kill 3\n")
    said = runner.killed(signal.SIGKILL, status, tmp_path, before)
    assert said.startswith(f"the run was killed by the out-of-memory killer (oom_kill in "
                           f"{events} rose by 2) while running 02_c.ipynb with nproc=2;"), said


def _checked(path, rules: str = "", parameters: str = "") -> None:
    """A notebook whose cell after its parameters checks them, as the course's do."""
    nb = new_notebook(cells=[
        new_code_cell("nproc = 2\nbackend = 'auto'\ndevice = 'auto'\n" + parameters,
                      metadata={"tags": ["parameters"]}),
        new_code_cell("from zero_lab.course.parameters import check_parameters\n"
                      f"backend = check_parameters(nproc, backend, device, rank_bytes=None, "
                      f"{rules})"),
        new_code_cell("x = 1")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)


def test_each_notebooks_rules_are_checked_before_the_first_notebook(course_dirs, monkeypatch,
                                                                   capsys):
    # Failed before: NPROC=1 ran notebooks 00-01 (59 s) before 02 refused it, NPROC=3 ran
    # 00-02 (152 s) before 03 did.
    nb = course_dirs / "notebooks"
    _checked(nb / "00_any.ipynb")
    _checked(nb / "02_pairs.ipynb", "min_nproc=2")
    _checked(nb / "03_split.ipynb", 'divides={"batch": batch}', "batch = 16")
    started = _no_kernel(monkeypatch)
    for nproc, refused, rule in (
            (1, "02_pairs.ipynb", "TooFewRanks: parameter nproc=1: must be at least 2"),
            (3, "03_split.ipynb", "ValueError: parameter batch=16: must be divisible by nproc=3")):
        with pytest.raises(SystemExit) as info:
            runner.run({"nproc": nproc, "backend": "gloo", "device": "cpu"})
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"FAILED: {refused}, its check cell\n{rule}" in err, err  # as a failing cell
        assert "Use NPROC=2, 4 or 8 (each passes every notebook's check)" in err, err
    assert started == [] and not (course_dirs / "runs").exists()  # no kernel, no run folder


def test_only_the_selected_notebooks_rules_are_checked(course_dirs, monkeypatch):
    nb = course_dirs / "notebooks"
    _checked(nb / "00_any.ipynb")
    _checked(nb / "02_pairs.ipynb", "min_nproc=2")
    run_dir = runner.run({"nproc": 1, "backend": "gloo", "device": "cpu"}, only="00")
    assert [p.name for p in (run_dir / "executed").iterdir()] == ["00_any.ipynb"]


def test_the_command_refuses_before_any_notebook_and_leaves_no_run_folder(course_dirs,
                                                                           monkeypatch, capfd):
    nb = course_dirs / "notebooks"
    _checked(nb / "00_any.ipynb")
    _checked(nb / "02_pairs.ipynb", "min_nproc=2")
    _child_sees_this_test(course_dirs, monkeypatch)
    with pytest.raises(SystemExit) as info:
        runner.main(["run", "--nproc", "1", "--backend", "gloo", "--device", "cpu"])
    assert info.value.code == 2
    assert "FAILED: 02_pairs.ipynb, its check cell\nTooFewRanks: parameter nproc=1" in (
        capfd.readouterr().err)
    assert list((course_dirs / "runs" / "course").iterdir()) == []


def test_the_course_notebooks_refuse_nproc_1_and_3_by_their_own_checks(monkeypatch):
    # The real notebooks, through the cell after their parameters (the one place their rules
    # are written): every course notebook has one, and the runner reads each.
    monkeypatch.setattr(capacity, "available_cores", lambda: 16)
    monkeypatch.setattr(capacity, "available_memory", lambda: 64 * 2**30)
    notebooks = runner.course_notebooks()
    assert all(preflight.check_cell(nb) for nb in notebooks)
    cpu = {"backend": "gloo", "device": "cpu"}
    assert preflight.notebook_refusals(notebooks, {"nproc": 2, **cpu}) == {}
    one = preflight.notebook_refusals(notebooks, {"nproc": 1, **cpu})
    assert one["02_collectives.ipynb"].startswith(
        "TooFewRanks: parameter nproc=1: must be at least 2"), one
    three = preflight.notebook_refusals(notebooks, {"nproc": 3, **cpu})
    assert three["03_zero1.ipynb"].startswith(
        "ValueError: parameter batch=16: must be divisible by nproc=3"), three


def test_a_relative_runs_folder_is_the_folder_the_command_started_in(course_dirs, monkeypatch):
    # Failed before: ZERO_LAB_RUNS_DIR=myruns sent figures to notebooks/myruns/... (papermill
    # runs notebooks in notebooks/), and `make figures` copied none of them.
    monkeypatch.chdir(course_dirs)
    monkeypatch.setenv("ZERO_LAB_RUNS_DIR", "myruns")
    _notebook(course_dirs / "notebooks" / "00_a.ipynb",
              "from zero_lab.launch.paths import figures_dir, new_run_dir\n"
              "(figures_dir() / 'made.png').write_bytes(b'png')\nprint(new_run_dir('nb'))")
    run_dir = runner.run({"nproc": 1, "backend": "gloo", "device": "cpu"})
    assert run_dir.parent == course_dirs / "myruns" / "course"
    cell = nbformat.read(run_dir / "executed" / "00_a.ipynb", as_version=4).cells[-1]
    assert Path(cell.outputs[0]["text"].strip()).parent == run_dir / "nb"
    assert [p.name for p in runner.copy_figures(run_dir / "figures")] == ["made.png"]
    assert not (course_dirs / "notebooks" / "myruns").exists()


def test_make_figures_fails_in_one_line_when_there_is_no_figure_to_copy(course_dirs, capsys):
    # Failed before: "copied 0 figures" and exit status 0
    empty = course_dirs / "runs" / "figures"
    empty.mkdir(parents=True)
    with pytest.raises(SystemExit) as info:
        runner.copy_figures(empty)
    assert info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(empty) in err and "no figure" in err, err
