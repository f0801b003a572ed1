"""What the batch grader grades: an exercise's function wherever the student last defined it
before its check cell, with the helpers it uses from earlier cells, and a `tampered` cell shown
as a diff that the instructor can accept.

A class of notebook 01 submissions (kernel exercises: a child each, fast), each built from the
student copy as a learner would edit it; each grades as the notebook's own check would judge
the function the notebook's kernel holds when the check cell runs.
"""

from __future__ import annotations

import json

import pytest
from test_grade_batch import NB01, course, submit

from zero_lab.grading import batch, submissions
from zero_lab.grading.student import student_notebook

BYTES_REF = '''def my_bytes_per_param(params: str, grads: str, master: str | None, states: str,
                       n_states: int) -> dict:
    size = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
    k = (size[master] if master else 0) + n_states * size[states]
    return {"params": size[params], "grads": size[grads], "optimizer": k,
            "total": size[params] + size[grads] + k}
'''
BYTES_BODY = BYTES_REF.split("-> dict:\n", 1)[1]
# my_per_rank_bytes through two helpers of an earlier cell, one using a constant of another
# cell; that earlier cell also holds a statement that must never run in the grader.
HELPERS = '''assert False, "a cell's other statements never run in the grader"
def ceil_div(a, b):
    return -(-a // b)
'''
WHOLE = '''KEPT = {0: lambda p, g, k: p + g + k, 1: lambda p, g, k: p + g, 2: lambda p, g, k: p,
        3: lambda p, g, k: 0}
def whole_bytes(recipe, stage):
    return KEPT[stage](recipe["params"], recipe["grads"], recipe["optimizer"])
print("nor this")
'''
PER_RANK_WITH_HELPERS = '''def my_per_rank_bytes(psi: int, stage: int, n_d: int,
                      recipe: dict) -> int:
    total = recipe["params"] + recipe["grads"] + recipe["optimizer"]
    whole = whole_bytes(recipe, stage)
    return whole * psi + (total - whole) * ceil_div(psi, n_d)
'''
LARGEST_WITH_NUMPY = '''def my_largest_model(gpu_bytes: float, n_d: int, stage: int, recipe: dict,
                     reserve: float = 0) -> float:
    p, g, k = recipe["params"], recipe["grads"], recipe["optimizer"]
    whole = {0: p + g + k, 1: p + g, 2: p, 3: 0}[stage]
    return float(np.divide(gpu_bytes - reserve, whole + (p + g + k - whole) / n_d))
'''
CHECK = "grading.check_{}(my_{})"


def _add_cell(nb: dict, source: str, before: str | None = None, after: str | None = None,
              cid: str = "") -> dict:
    cells = nb["cells"]
    mark = before or after
    i = next(i for i, c in enumerate(cells) if mark in "".join(c["source"]))
    cells.insert(i if before else i + 1, {
        "cell_type": "code", "id": cid or f"new-{len(cells)}", "metadata": {},
        "execution_count": None, "outputs": [], "source": source})
    return nb


def _edit(nb: dict, function: str, change) -> dict:
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "code" and f"def {function}(" in text:
            cell["source"] = change(text)
            return nb
    raise AssertionError(function)


def _stub() -> dict:
    return json.loads(json.dumps(STUB))


STUB = student_notebook(course(NB01))[0]
SIGNATURE_EDIT = ("n_states: int) -> dict:", "n_states: int = 2) -> dict:")


def _tampered() -> dict:
    def change(text):
        return text.replace(*SIGNATURE_EDIT).replace(
            '    raise NotImplementedError("exercise: replace this line with your solution")\n',
            BYTES_BODY)
    return _edit(_stub(), "my_bytes_per_param", change)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submitted")
    check = CHECK.format("bytes_per_param", "bytes_per_param")
    submit(folder, "new_cell", {NB01: _add_cell(_stub(), BYTES_REF, before=check)})
    submit(folder, "after_check", {NB01: _add_cell(_stub(), BYTES_REF, after=check)})
    helpers = _add_cell(_add_cell(_stub(), HELPERS, before="def my_bytes_per_param("),
                        WHOLE, before=check)
    submit(folder, "helpers", {NB01: _add_cell(
        helpers, PER_RANK_WITH_HELPERS, before=CHECK.format("per_rank_bytes", "per_rank_bytes"))})
    submit(folder, "numpy", {NB01: _add_cell(
        _add_cell(_stub(), "import numpy as np\n", before="def my_bytes_per_param("),
        LARGEST_WITH_NUMPY, before=CHECK.format("largest_model", "largest_model"))})
    comments = _edit(_stub(), "my_bytes_per_param", lambda text: "# my answer, second try\n"
                     + text.replace("states: str,\n", "states: str,  # as in the table\n")
                     .replace('    raise NotImplementedError("exercise: replace this line '
                              'with your solution")\n', BYTES_BODY))
    submit(folder, "comments", {NB01: comments})
    submit(folder, "tampered", {NB01: _tampered()})
    submit(folder, "accepted", {NB01: _tampered()})
    out = tmp_path_factory.mktemp("reports")
    done = batch.grade(folder, out, seed=5, jobs=2, only="01", progress=lambda line: None,
                       accept=["accepted/01_memory_accounting/check_bytes_per_param"])
    return {(g.student, g.exercise.check): g for g in done}, out


def verdict(graded, student, check):
    g = graded[0][(student, check)]
    return g.status, g.points == g.max_points, g.lines


def test_a_rewrite_in_a_new_cell_before_the_check_is_graded(graded):
    status, full, lines = verdict(graded, "new_cell", "check_bytes_per_param")
    assert status == "pass" and full, lines


def test_a_definition_after_the_check_cell_is_not(graded):
    status, full, lines = verdict(graded, "after_check", "check_bytes_per_param")
    assert status == "fail" and lines == [
        line for line in lines if "not implemented" in line] and lines, lines


def test_helpers_and_their_constants_from_earlier_cells_are_carried(graded):
    status, full, lines = verdict(graded, "helpers", "check_per_rank_bytes")
    assert status == "pass" and full, lines


def test_numpy_imported_in_an_earlier_cell_is_carried(graded):
    status, full, lines = verdict(graded, "numpy", "check_largest_model")
    assert status == "pass" and full, lines


def test_comments_outside_the_body_are_no_tampering(graded):
    status, full, lines = verdict(graded, "comments", "check_bytes_per_param")
    assert status == "pass" and full, lines


def test_a_tampered_cell_shows_its_diff(graded):
    status, full, lines = verdict(graded, "tampered", "check_bytes_per_param")
    text = "\n".join(lines)
    assert status == "tampered", lines
    assert "-                       n_states: int) -> dict:" in text, text
    assert "+                       n_states: int = 2) -> dict:" in text, text
    assert "--accept tampered/01_memory_accounting/check_bytes_per_param" in text, text
    assert "size = {" not in text  # the diff is of the text outside the bodies
    feedback = (graded[1] / "feedback" / "tampered.md").read_text()
    summary = (graded[1] / "summary.md").read_text()
    for report in (feedback, summary):
        assert "+                       n_states: int = 2) -> dict:" in report, report


def test_an_accepted_cell_is_graded_from_the_student_s_definitions(graded):
    status, full, lines = verdict(graded, "accepted", "check_bytes_per_param")
    assert status == "pass" and full, lines


def test_a_run_again_into_the_same_folder_with_the_accept_regrades_it(tmp_path):
    # The instructor's loop: grade, read the diff in summary.md, grade again with --accept.
    submit(tmp_path / "in", "tampered", {NB01: _tampered()})
    for accept, want in (([], "tampered"), (["tampered/01_memory_accounting.ipynb/"
                                              "my_bytes_per_param"], "pass")):
        done = batch.grade(tmp_path / "in", tmp_path / "out", seed=5, only="01",
                           progress=lambda line: None, accept=accept)
        got = {g.exercise.check: g.status for g in done}
        assert len(done) == 3 and got["check_bytes_per_param"] == want, got
    rows = (tmp_path / "out" / "grades.csv").read_text().splitlines()
    assert len(rows) == 4 and any("check_bytes_per_param,8,8,pass" in r for r in rows), rows


def test_accepts_are_read_from_options_and_files(tmp_path):
    listed = tmp_path / "accept.txt"
    listed.write_text("# reviewed by hand\nbob/03_zero1.ipynb/owned_range\n\n")
    got = submissions.read_accepts(["ann/01_memory_accounting/check_bytes_per_param"], [listed])
    assert got == {("ann", "01_memory_accounting", "check_bytes_per_param"),
                   ("bob", "03_zero1", "owned_range")}
    with pytest.raises(ValueError, match="student/notebook/exercise"):
        submissions.read_accepts(["ann/check_bytes_per_param"], [])


def test_comment_lines_and_trailing_comments_leave_the_digest_alone():
    stub = "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError\n"
    edited = "# mine\ndef f(x):  # returns x\n    return x  # done\n# end\n"
    assert submissions.outside_bodies(edited, ("f",)) == submissions.outside_bodies(stub, ("f",))
    assert submissions.outside_bodies("def f(x, y):\n    pass\n", ("f",)) != (
        submissions.outside_bodies(stub, ("f",)))


def test_the_class_s_functions_pass_the_notebook_s_own_checks(capsys):
    # What a kernel that ran those cells holds, judged by the notebook's check cells: the
    # verdicts the grader must give (the other statements of the cells left out here too).
    from zero_lab import grading

    kernel: dict = {}
    helpers = HELPERS.replace('assert False, "a cell\'s other statements never run in the '
                              'grader"\n', "")
    exec(helpers + WHOLE.replace('print("nor this")\n', "") + PER_RANK_WITH_HELPERS, kernel)
    exec("import numpy as np\n" + LARGEST_WITH_NUMPY, kernel)
    exec(BYTES_REF, kernel)
    grading.check_bytes_per_param(kernel["my_bytes_per_param"])
    grading.check_per_rank_bytes(kernel["my_per_rank_bytes"])
    grading.check_largest_model(kernel["my_largest_model"])
    tampered = {}
    exec(BYTES_REF.replace(*SIGNATURE_EDIT), tampered)
    grading.check_bytes_per_param(tampered["my_bytes_per_param"])
    assert capsys.readouterr().out.count("✓") == 4


def test_the_ast_work_of_concurrent_exercises_runs_one_at_a_time(tmp_path, monkeypatch):
    """The grader grades exercises in threads; CPython 3.11's ast module keeps one recursion
    count for the interpreter, so two threads converting ASTs at once can fail with
    "SystemError: AST constructor recursion depth mismatch" (a CI run graded a correct
    reference `crash` so). Reading submissions is held to one thread at a time."""
    import threading
    import time

    inside, most, lock = [0], [0], threading.Lock()
    parse = submissions.ast.parse

    def slow_parse(*args, **kwargs):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.002)  # long enough for another grading thread to arrive
        try:
            return parse(*args, **kwargs)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(submissions.ast, "parse", slow_parse)
    for name in ("a", "b", "c"):
        submit(tmp_path / "in", name, {NB01: course(NB01)})
    done = batch.grade(tmp_path / "in", tmp_path / "out", only="01", jobs=3,
                       progress=lambda line: None)
    assert all(g.status == "pass" for g in done), [(g.status, g.lines) for g in done]
    assert most[0] == 1, f"{most[0]} threads read submissions' ASTs at once"
