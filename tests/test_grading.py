"""zero_lab.grading: checks accept the reference, reject stubs and known mistakes;
the student-copy generator stubs every solution and clears every output."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zero_lab import grading, memory
from zero_lab.grading import Case, ExerciseFailed
from zero_lab.grading import nb01_memory as nb01

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
NB01 = REPO / "notebooks" / "01_memory_accounting.ipynb"
# grading.check_<name>(fn) or, for a pair of functions, grading.check_<name>(fn1, fn2)
CHECK_CALL = re.compile(r"grading\.(check_\w+)\((\w+)(?:,\s*\w+)*\)")


def _cells(path: Path) -> list[dict]:
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if isinstance(cell["source"], list):
            cell["source"] = "".join(cell["source"])
    return nb["cells"]


def _exercises(path: Path) -> list[tuple[str, str, str]]:
    """(solution cell source, check name, function name) for each exercise of a notebook."""
    cells = _cells(path)
    found = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code" and grading.BEGIN_MARK in cell["source"]:
            following = [c for c in cells[i + 1 :] if c["cell_type"] == "code"][:1]
            match = CHECK_CALL.search(following[0]["source"]) if following else None
            assert match, f"{path.name} cell {i}: the next code cell must call grading.check_*"
            found.append((cell["source"], match.group(1), match.group(2)))
    return found


def _define(source: str, name: str):
    namespace: dict = {}
    exec(compile(source, "<exercise>", "exec"), namespace)
    return namespace[name]


# ------------------------------------------------------------------------- framework


def test_same_compares_by_kind():
    assert grading.same({"a": 1, "b": 2.0}, {"a": 1, "b": 2.0000001, "extra": 0})
    assert not grading.same({"a": 1}, {"b": 1})
    assert grading.same([1, 2.5], (1, 2.5))
    assert not grading.same([1, 2], [1, 2, 3])
    assert not grading.same(1, True)  # a bool is not a count
    assert not grading.same(16, None)
    assert grading.same(7.5e9, 7_500_000_001)
    assert not grading.same(7.5e9, 7.6e9)


def test_same_tensors_need_equal_shapes_not_broadcastable_ones():
    import torch

    expected = torch.tensor([2.0, 2.0, 2.0])
    assert grading.same(expected, torch.tensor([2.0, 2.0, 2.0]))
    assert grading.same(expected, expected * (1 + 1e-8))  # within rel
    assert grading.same(expected, [2.0, 2.0, 2.0])  # a list of the right shape is an answer
    assert not grading.same(expected, torch.tensor([2.0, 2.0, 2.1]))
    wrong_shapes = [torch.tensor([2.0]), torch.full((3, 1), 2.0), torch.full((1, 3), 2.0),
                    torch.tensor(2.0), 2.0, [[2.0]] * 3, torch.full((2, 3), 2.0)]
    for got in wrong_shapes:  # torch.allclose would broadcast each of these and agree
        assert not grading.same(expected, got), got
    assert not grading.same(torch.tensor(2.0), torch.tensor([2.0]))  # 0-d is not (1,)
    assert grading.same(torch.tensor(2.0), 2.0)  # a 0-d tensor and a number
    assert not grading.same(expected, None) and not grading.same(expected, "2, 2, 2")


def test_same_tensors_compare_ints_and_floats_by_value_but_not_bools():
    import numpy as np
    import torch

    # like numbers (same(16, 16.0)), int and float tensors of equal values agree
    assert grading.same(torch.tensor([1.0, 2.0]), torch.tensor([1, 2]))
    assert grading.same(torch.tensor([1, 2]), torch.tensor([1.0, 2.0]))
    assert grading.same(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert grading.same(np.array([1.0, 2.0]), torch.tensor([1, 2]))
    assert not grading.same(np.array([1.0, 2.0]), np.array([[1.0, 2.0]]))
    # integers are exact, as same(3, 3) is: no relative tolerance
    assert not grading.same(torch.tensor([1, 2**40]), torch.tensor([1, 2**40 + 1]))
    # a bool is not a count (same(1, True) is False)
    assert not grading.same(torch.tensor([1, 0]), torch.tensor([True, False]))
    assert not grading.same(torch.tensor([True, False]), torch.tensor([1.0, 0.0]))
    assert grading.same(torch.tensor([True, False]), torch.tensor([True, False]))


def test_run_cases_pass_lines_say_what_passed_and_what_the_learner_showed(capsys):
    grading.run_cases("check_double", lambda x: 2 * x, [Case(args=(2,), expected=4)] * 3,
                      shows="you can double a number")
    assert capsys.readouterr().out == ("✓ check_double: 3/3 hidden cases pass\n"
                                       "  You showed: you can double a number\n")


def _shows_arguments() -> list[tuple[str, int, object]]:
    """(module, line, the `shows` argument's AST node or None) of every run_cases/passed call
    in zero_lab/grading: the line a passing check prints under its pass line."""
    found = []
    for path in sorted((REPO / "zero_lab" / "grading").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in {"run_cases",
                                                                              "passed"}:
                if path.name == "framework.py":
                    continue  # the definitions' own forwarding call
                arg = {k.arg: k.value for k in node.keywords}.get("shows")
                if arg is None and getattr(node.func, "id", "") == "passed" and len(node.args) > 2:
                    arg = node.args[2]
                found.append((path.name, node.lineno, arg))
    return found


def test_every_check_says_what_the_learner_showed_in_one_short_line():
    from zero_lab.grading.framework import SHOWED

    calls = _shows_arguments()
    assert len(calls) >= 15, calls  # every notebook's checks, 01 to 08
    for module, line, arg in calls:
        where = f"{module}:{line}"
        assert arg is not None, f"{where}: a passing check must say what the learner showed"
        assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), (
            f"{where}: `shows` must be a string literal (this test reads it)")
        text = arg.value
        assert text.startswith("you "), f"{where}: say what the learner can now do: {text!r}"
        assert not re.search(r"\d+/\d+|\bpass", text), f"{where}: not a count of cases: {text!r}"
        assert len(SHOWED + text) <= 110, f"{where}: {len(SHOWED + text)} characters"


def test_failure_names_case_expected_got_and_hint():
    with pytest.raises(ExerciseFailed) as info:
        grading.run_cases("check_double", lambda x: x + 2,
                          [Case(args=(2,), expected=4), Case(args=(5,), expected=10, hint="x2")],
                          shows="you x")
    text = str(info.value)
    assert "case 2/2 (5)" in text and "expected: 10" in text and "got:      7" in text
    assert "hint: x2" in text
    assert info.value.__suppress_context__  # no chained traceback from the learner's error


def test_a_float_failure_shows_how_far_off_it_is():
    # 1.5309961083596662 vs 1.5309961082825843 look alike; the difference says they are not.
    with pytest.raises(ExerciseFailed) as info:
        grading.run_cases("check_x", lambda x: x * (1 + 4e-6), [Case(args=(1.5,), expected=1.5)],
                          shows="you x")
    assert "difference: 6e-06 (relative 4e-06)" in str(info.value)
    with pytest.raises(ExerciseFailed) as info:  # ints compare exactly: nothing to add
        grading.run_cases("check_x", lambda x: x + 1, [Case(args=(1,), expected=1)], shows="you x")
    assert "difference" not in str(info.value)


def test_largest_difference_of_numbers_and_lists():
    from zero_lab.grading.framework import describe_difference, largest_difference

    assert largest_difference([1.0, -2.0, 4.0], [1.0, -2.5, 4.0]) == (0.5, 0.25)
    assert largest_difference(2.0, 2.0) == (0.0, 0.0)
    assert largest_difference([1.0], [1.0, 2.0]) is None  # not comparable element-wise
    assert largest_difference("a", "b") is None
    assert describe_difference([0.2, 0.3], [0.1, 0.3]) == "0.1 (relative 0.5)"


def test_known_mistake_gets_its_own_explanation():
    with pytest.raises(ExerciseFailed, match="you added"):
        grading.run_cases("check_double", lambda x: x + x + 1, [Case(args=(3,), expected=6)],
                          wrong_answers=[(lambda x: 2 * x + 1, "you added one")], shows="you x")


def test_learner_exception_is_reported_in_one_line():
    def broken(x):
        return {}[x]

    with pytest.raises(ExerciseFailed, match=r"case 1/1 \('k'\) raised KeyError: 'k'"):
        grading.run_cases("check_x", broken, [Case(args=("k",), expected=1)], shows="you x")
    with pytest.raises(ExerciseFailed, match="expected a function, got int"):
        grading.run_cases("check_x", 3, [Case(args=(), expected=1)], shows="you x")


def test_ipython_shows_the_message_not_a_traceback(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        result = shell.run_cell(
            "from zero_lab import grading\n"
            "def stub(params, grads, master, states, n_states):\n"
            "    raise NotImplementedError\n"
            "grading.check_bytes_per_param(stub)\n"
        )
    finally:
        InteractiveShell.clear_instance()  # leave no global shell behind for other tests
    out = capsys.readouterr().out
    assert isinstance(result.error_in_exec, ExerciseFailed)
    assert "check_bytes_per_param: not implemented yet" in out
    assert "Traceback" not in out and "grading.py" not in out


# ------------------------------------------------- notebook 01's checks, both directions


def _wrong_bytes_per_param(params, grads, master, states, n_states):  # K without the master
    return nb01.recipe_bytes(params, grads, None, states, n_states)


def _wrong_states_fp32(params, grads, master, states, n_states):  # 8-bit Adam priced as fp32
    return nb01.recipe_bytes(params, grads, master, "fp32", n_states)


def _wrong_one_state(params, grads, master, states, n_states):  # Adam's v forgotten
    return nb01.recipe_bytes(params, grads, master, states, min(n_states, 1))


def _wrong_stage2_like_stage1(psi, stage, n_d, r):
    return nb01.per_rank_bytes(psi, 1 if stage == 2 else stage, n_d, r)


def _wrong_stage1_shards_grads(psi, stage, n_d, r):
    return nb01.per_rank_bytes(psi, 2 if stage == 1 else stage, n_d, r)


def _wrong_no_padding(psi, stage, n_d, r):  # Ψ/N_d elements, no padded partition
    whole = {0: r["total"], 1: r["params"] + r["grads"], 2: r["params"], 3: 0}[stage]
    return whole * psi + (r["total"] - whole) * psi / n_d


def _wrong_largest_ignores_stage(gpu, n_d, stage, r, reserve=0):
    return (gpu - reserve) / r["total"]


def _wrong_largest_all_sharded(gpu, n_d, stage, r, reserve=0):
    return (gpu - reserve) * n_d / r["total"]


def _wrong_largest_no_reserve(gpu, n_d, stage, r, reserve=0):
    return nb01.largest_model(gpu, n_d, stage, r)


def _wrong_largest_in_gib(gpu, n_d, stage, r, reserve=0):  # a byte budget read as GiB
    return nb01.largest_model(gpu, n_d, stage, r, reserve) / 2**30 * 1e9


WRONG = {
    "check_bytes_per_param": [
        (_wrong_bytes_per_param, "fp32 master copy is part of K"),
        (_wrong_states_fp32, "size of their own dtype"),
        (_wrong_one_state, "n_states counts the state tensors"),
    ],
    "check_per_rank_bytes": [
        (_wrong_stage2_like_stage1, "sharded one state too few"),
        (_wrong_stage1_shards_grads, "sharded one state too many"),
        (_wrong_no_padding, "ceil(Ψ/N_d)"),
    ],
    "check_largest_model": [
        (_wrong_largest_ignores_stage, "plain data parallelism's limit"),
        (_wrong_largest_all_sharded, "only stage 3 divides every byte"),
        (_wrong_largest_no_reserve, "the reserve (activations, buffers) comes off"),
        (_wrong_largest_in_gib, "solve per-rank bytes + reserve"),
    ],
}


def test_notebook01_references_agree_with_the_memory_calculators():
    """The checks' own references (any recipe) give what `memory` gives for the recipes it
    names: bytes per parameter, per-rank bytes (padded partitions), the largest model."""
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
              "int8": torch.int8}
    assert {k: dtypes[k].itemsize for k in nb01.DTYPE_BYTES} == nb01.DTYPE_BYTES
    named = {"fp32 Adam": ("fp32", "adam", None),
             "mixed-precision Adam, the paper's": ("mixed", "adam", None),
             "Megatron-LM's fp32 main grads, Adam": ("mixed", "adam", 4),
             "fp16 momentum SGD, fp32 master": ("mixed", "sgd_momentum", None),
             "fp32 SGD": ("fp32", "sgd", None)}
    for name, (precision, optimizer, grad_bytes) in named.items():
        b = memory.bytes_per_param(precision, optimizer, grad_bytes)
        assert nb01.recipe(name) == {k: b[k] for k in ("params", "grads", "optimizer", "total")}
        for psi, n in ((126, 4), (1001, 8), (7_000_000_001, 64), (10, 16)):
            for stage in memory.STAGES:
                assert nb01.per_rank_bytes(psi, stage, n, nb01.recipe(name)) == (
                    memory.model_state_bytes(psi, stage, n, precision, optimizer,
                                             grad_bytes=grad_bytes)["total"]), (name, psi, n)
                exact = memory.largest_model(80 * 2**30, n, stage, precision, optimizer,
                                             grad_bytes=grad_bytes)
                assert 0 <= nb01.largest_model(80 * 2**30, n, stage, nb01.recipe(name)) - exact < n


@pytest.mark.parametrize("source, check, fn_name", _exercises(NB01),
                         ids=[e[1] for e in _exercises(NB01)])
def test_notebook01_check_accepts_reference_rejects_stub_and_mistakes(source, check, fn_name,
                                                                     capsys):
    assert_check_grades(check, source, fn_name, WRONG[check], capsys)


def assert_check_grades(check: str, source: str, fn_name: str, wrong: list, capsys) -> None:
    """The check passes the notebook's own solution (`source`), fails its student stub, and
    rejects each (mistake, words of its explanation) in `wrong` with that explanation."""
    check_fn = getattr(grading, check)
    check_fn(_define(source, fn_name))  # the notebook's own reference solution
    out = capsys.readouterr().out
    assert out.startswith(f"✓ {check}:") and "\n  You showed: you " in out, out

    stub = _define(grading.stub_solutions(source), fn_name)
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        check_fn(stub)

    for mistake, explanation in wrong:
        with pytest.raises(ExerciseFailed, match=re.escape(explanation)):
            check_fn(mistake)


def test_notebook01_has_the_three_exercises():
    assert [e[1] for e in _exercises(NB01)] == [
        "check_bytes_per_param", "check_per_rank_bytes", "check_largest_model"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_exercise_calls_an_existing_check(path):
    for _, check, _ in _exercises(path):
        assert callable(getattr(grading, check, None)), f"{path.name}: no grading.{check}"


# ------------------------------------------------------------------- student copies


def test_stub_keeps_indentation_and_code_around_it():
    source = (
        "def f(x):\n"
        "    y = 1\n"
        "    ### BEGIN SOLUTION\n"
        "    return x + y\n"
        "    ### END SOLUTION\n"
        "\n"
        "print('after')\n"
    )
    stubbed = grading.stub_solutions(source)
    assert stubbed == (
        "def f(x):\n"
        "    y = 1\n"
        "    # YOUR CODE HERE\n"
        '    raise NotImplementedError("exercise: replace this line with your solution")\n'
        "\n"
        "print('after')\n"
    )
    namespace: dict = {}
    exec(stubbed.replace("print('after')", ""), namespace)
    with pytest.raises(NotImplementedError):
        namespace["f"](1)


@pytest.mark.parametrize("bad, message", [
    ("### BEGIN SOLUTION\nx = 1\n", "without '### END SOLUTION'"),
    ("x = 1\n### END SOLUTION\n", "without '### BEGIN SOLUTION'"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "nested"),
])
def test_unbalanced_markers_are_refused(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        grading.stub_solutions(bad, "nb.ipynb cell 3")


def _toy_notebook() -> dict:
    return {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3"}, "papermill": {"duration": 1.0}},
        "cells": [
            {"cell_type": "markdown", "id": "a", "metadata": {}, "source": "# Title"},
            {"cell_type": "code", "id": "b", "metadata": {"execution": {"x": 1}},
             "execution_count": 3,
             "outputs": [{"output_type": "stream", "name": "stdout", "text": "42\n"}],
             "source": ["def f():\n", "    ### BEGIN SOLUTION\n", "    return 42\n",
                        "    ### END SOLUTION\n"]},
            {"cell_type": "code", "id": "c", "metadata": {}, "execution_count": 4,
             "outputs": [{"output_type": "stream", "name": "stdout", "text": "ok\n"}],
             "source": "grading.check_f(f)"},
        ],
    }


def test_student_notebook_stubs_and_clears_outputs():
    nb = _toy_notebook()
    student, n = grading.student_notebook(nb)
    assert n == 1
    code = [c for c in student["cells"] if c["cell_type"] == "code"]
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    assert "execution" not in code[0]["metadata"] and "papermill" not in student["metadata"]
    assert "return 42" not in "".join(code[0]["source"])
    assert "raise NotImplementedError" in "".join(code[0]["source"])
    assert student["cells"][0]["source"] == ["# Title"]
    assert nb["cells"][1]["outputs"]  # the original is untouched


def test_cli_writes_student_copies_of_every_notebook(tmp_path):
    nb_dir = tmp_path / "notebooks"
    nb_dir.mkdir()
    (nb_dir / "09_toy.ipynb").write_text(json.dumps(_toy_notebook()))
    out = tmp_path / "build" / "student"
    result = subprocess.run(
        [sys.executable, "-m", "zero_lab.grading", "student", "--notebooks", str(nb_dir),
         "--out", str(out)],
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    assert "09_toy.ipynb: 1 solution(s) replaced by stubs" in result.stdout
    written = json.loads((out / "09_toy.ipynb").read_text())
    assert "### BEGIN SOLUTION" not in json.dumps(written)


def test_real_notebooks_produce_compilable_stubs(tmp_path):
    written = grading.write_student_copies(REPO / "notebooks", tmp_path)
    assert written["01_memory_accounting.ipynb"] == 3
    for name in written:
        for i, cell in enumerate(_cells(tmp_path / name)):
            if cell["cell_type"] != "code":
                continue
            assert cell["outputs"] == [] and cell["execution_count"] is None
            assert grading.BEGIN_MARK not in cell["source"]
            # IPython magics and shell escapes are not Python; everything else must compile
            python = "\n".join(
                line for line in cell["source"].splitlines()
                if not line.lstrip().startswith(("%", "!"))
            )
            compile(python, f"{name} cell {i}", "exec")


def test_student_copy_of_notebook01_runs_and_fails_only_at_the_checks(tmp_path):
    """Execute the stubbed notebook: every check cell (and nothing else) stops the learner."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    grading.write_student_copies(REPO / "notebooks", tmp_path)
    nb = nbformat.read(tmp_path / NB01.name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    errors = [(c.source, o) for c in nb.cells if c.cell_type == "code"
              for o in c.outputs if o.output_type == "error"]
    assert [src for src, _ in errors] == [
        f"grading.{check}({fn})" for _, check, fn in _exercises(NB01)
    ]
    for _, output in errors:
        assert output.ename == "ExerciseFailed"
        shown = "\n".join(output.traceback)
        assert "not implemented yet" in shown and "Traceback" not in shown
