"""What the notebooks' cells say, read from their source (nothing is run).

IPython displays the value of a cell's last expression. A cell that ends with
`save_figure(fig, ...)` shows `PosixPath('.../runs/figures/...png')` under its figure: noise a
learner has to read past. A cell's last expression must be a call that returns None (print,
a check, plt.show) or a value shown on purpose (the memory calculator widget).

The parameters cell of a notebook that launches ranks says what to set on a GPU instance.

No two notebooks save a worker script (%%rank_script) to the same file: `make test` runs
notebooks at the same time (nbval beside tests/test_browser.py's JupyterLab), and one's ranks
would run the other's script.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9]*.ipynb"))
RETURN_NONE = {"print", "show", "makedirs", "reveal"}  # and every grading.check_*
SHOWN_ON_PURPOSE = {"memory_calculator", "step_view"}  # notebooks 01 and 03: widgets


def shown_values(path: Path) -> list[str]:
    """'cell i: <last expression>' for each cell whose last expression shows a value."""
    found = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.startswith("%%"):
            continue  # a cell magic's body is not run by this kernel
        code = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith("%"))
        body = ast.parse(code).body
        if not body or not isinstance(body[-1], ast.Expr):
            continue
        value = body[-1].value
        func = value.func if isinstance(value, ast.Call) else None
        name = getattr(func, "attr", getattr(func, "id", None))
        if name in RETURN_NONE | SHOWN_ON_PURPOSE or (name or "").startswith("check_"):
            continue
        found.append(f"cell {i}: {ast.unparse(value)}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_no_cell_shows_a_value_nobody_meant_to_show(path):
    assert shown_values(path) == [], "end the cell with `_ = ...` (or plt.show())"


def test_a_cell_ending_with_save_figure_is_caught(tmp_path):
    cells = [{"cell_type": "code", "source": ["fig = make()\n", "save_figure(fig, 'x')"]},
             {"cell_type": "code", "source": ["_ = save_figure(fig, 'x')"]},
             {"cell_type": "code", "source": ["print(1)\n", "grading.check_x(f)"]}]
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    assert shown_values(path) == ["cell 0: save_figure(fig, 'x')"]


LAUNCHING = [p for p in NOTEBOOKS if not p.name.startswith("01_")]  # 01: one process, CPU


@pytest.mark.parametrize("path", LAUNCHING, ids=[p.name for p in LAUNCHING])
def test_the_parameters_cell_says_what_to_set_on_a_gpu(path):
    cells = json.loads(path.read_text())["cells"]
    tagged = ["".join(c["source"]) for c in cells if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1 and "on a gpu instance" in tagged[0].lower(), tagged


def rank_scripts_shared(paths: list[Path]) -> dict[str, list[str]]:
    """{script: notebooks} for each file that more than one notebook saves with %%rank_script
    (resolved as the kernel does: from the notebook's folder)."""
    from zero_lab.launch import _script_path  # %%rank_script's own reading of its line

    writers: dict[str, set[str]] = {}
    for path in paths:
        for cell in json.loads(path.read_text())["cells"]:
            first = "".join(cell["source"]).split("\n", 1)[0]
            if cell["cell_type"] == "code" and first.startswith("%%rank_script"):
                script, _ = _script_path(first.removeprefix("%%rank_script"))
                writers.setdefault(str((path.parent / script).resolve()), set()).add(path.name)
    return {script: sorted(nbs) for script, nbs in writers.items() if len(nbs) > 1}


def test_no_two_notebooks_save_the_same_worker_script():
    assert rank_scripts_shared(NOTEBOOKS) == {}


def test_a_worker_script_two_notebooks_save_is_caught(tmp_path):
    def notebook(name: str, *lines: str) -> Path:
        cells = [{"cell_type": "code", "source": [line, "\nprint(1)\n"]} for line in lines]
        (tmp_path / name).write_text(json.dumps({"cells": cells}))
        return tmp_path / name

    a = notebook("00_a.ipynb", "%%rank_script workers/x.py", "%%rank_script workers/y.py")
    b = notebook("01_b.ipynb", '%%rank_script -a "workers/../workers/x.py"')
    c = notebook("02_c.ipynb", "%%rank_script workers/z.py", "%%rank_script workers/z.py")
    assert rank_scripts_shared([a, b, c]) == {
        str(tmp_path / "workers" / "x.py"): ["00_a.ipynb", "01_b.ipynb"]}


def test_the_tests_save_figures_apart_from_the_notebooks():
    """Notebooks the tests run (student copies in JupyterLab and nbclient) save their figures
    where nbval's notebooks, run beside them, never do (failed before: both in runs/figures,
    e.g. 03_zero1_who_owns_what.png from the browser test's student copy and from nbval)."""
    from zero_lab.launch.paths import RUNS, figures_dir

    assert not figures_dir().resolve().is_relative_to(RUNS.resolve())


def printed_run_folders(path: Path) -> list[str]:
    """'cell i: name' for each f-string a cell prints that holds a new_run_dir() folder whole.

    The folder is absolute: in CI's checkout (/check/work/main/...) notebook 10's line was 115
    characters and failed the 110-character rule. Printed through paths.shown(), it is the
    folder under the course (runs/at_work/...), the same length in any checkout."""
    found = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.startswith("%%"):
            continue
        code = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith("%"))
        tree = ast.parse(code)
        made = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and getattr(getattr(node.value, "func", None), "id", "") == "new_run_dir"]
        folders = {t.id for node in made for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.FormattedValue) and isinstance(node.value, ast.Name) \
                    and node.value.id in folders:
                found.append(f"cell {i}: {node.value.id}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_run_folder_is_printed_under_the_course_not_whole(path):
    assert printed_run_folders(path) == [], "print it as shown(folder) (zero_lab.launch.paths)"


def test_shown_names_a_run_folder_under_the_course_in_any_checkout(monkeypatch, tmp_path):
    from zero_lab.launch import paths

    deep = tmp_path / ("d" * 90) / "zero-lab"
    monkeypatch.setattr(paths, "REPO_ROOT", deep)
    folder = deep / "runs" / "at_work" / "20261129-125556-21791-d5b5"
    assert paths.shown(folder) == "runs/at_work/20261129-125556-21791-d5b5"
    outside = tmp_path / "elsewhere" / "x"  # $ZERO_LAB_RUNS_DIR outside the course: whole
    assert paths.shown(outside) == str(outside)
