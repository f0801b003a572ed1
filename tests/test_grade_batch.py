"""The batch grader (zero_lab/grading/batch.py) on a folder of seeded submissions built from the
course's own notebooks and their student copies: full marks for the reference solutions, 0 for
the stubs, and each way to a false ✓ in a notebook worth nothing here.

Every submission is a notebook a learner could hand in: the course notebook (the reference
solutions), or its student copy, with one exercise cell's function body replaced.
"""

from __future__ import annotations

import csv
import json
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from zero_lab.grading import batch, submissions
from zero_lab.grading.student import student_notebook
from zero_lab.launch.paths import NOTEBOOKS

NB01 = "01_memory_accounting.ipynb"
NB03 = "03_zero1.ipynb"


def course(name: str) -> dict:
    return json.loads((NOTEBOOKS / name).read_text())


def with_body(nb: dict, function: str, body: str, extra: str = "") -> dict:
    """`nb` with `function`'s body in its exercise cell replaced by `body` (indented 4), and
    `extra` lines added to that cell after the function (outside it)."""
    nb = json.loads(json.dumps(nb))
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "code" and f"def {function}(" in text:
            lines = text.splitlines()
            start = next(i for i, ln in enumerate(lines) if ln.startswith(f"def {function}("))
            head = start
            while not lines[head].rstrip().endswith(":"):
                head += 1
            end = head + 1
            while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" ")):
                end += 1
            new = lines[:head + 1] + ["    " + ln for ln in body.splitlines()] + lines[end:]
            cell["source"] = "\n".join(new + ([extra] if extra else [])) + "\n"
            return nb
    raise AssertionError(f"no cell defines {function}")


def with_cell(nb: dict, source: str, before: str) -> dict:
    """`nb` with a code cell `source` inserted before the first cell containing `before`."""
    nb = json.loads(json.dumps(nb))
    i = next(i for i, c in enumerate(nb["cells"]) if before in "".join(c["source"]))
    nb["cells"].insert(i, {"cell_type": "code", "id": f"added{i}", "metadata": {},
                           "execution_count": None, "outputs": [], "source": source})
    return nb


def submit(folder: Path, student: str, books: dict[str, dict]) -> None:
    (folder / student).mkdir(parents=True)
    for name, nb in books.items():
        (folder / student / name).write_text(json.dumps(nb))


ALWAYS_EQUAL = '''class Yes(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
return {"params": Yes(1), "grads": Yes(1), "optimizer": Yes(1), "total": Yes(1)}'''

FAKE_CHECK = ('print("✓ check_bytes_per_param: 8/8 hidden cases pass")\n'
              "import zero_lab.grading as g\ng.check_bytes_per_param = lambda fn: None\n")


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submitted")
    ref, stub = course(NB01), student_notebook(course(NB01))[0]
    submit(folder, "reference", {NB01: ref})
    submit(folder, "stub", {NB01: stub})
    submit(folder, "wrong", {NB01: with_body(  # the master copy forgotten: a known mistake
        ref, "my_bytes_per_param", 'size = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}\n'
        "k = n_states * size[states]\n"
        'return {"params": size[params], "grads": size[grads], "optimizer": k,\n'
        '        "total": size[params] + size[grads] + k}')})
    submit(folder, "hang", {NB01: with_body(ref, "my_per_rank_bytes", "while True:\n    pass")})
    submit(folder, "exits", {NB01: with_body(ref, "my_largest_model",
                                             "import os\nos._exit(3)")})
    submit(folder, "raises_exit", {NB01: with_body(ref, "my_largest_model", "raise SystemExit")})
    submit(folder, "always_equal", {NB01: with_body(ref, "my_bytes_per_param", ALWAYS_EQUAL)})
    # A stub answered by a faked check cell, and grading's check replaced in an earlier cell:
    # in a notebook both print a ✓; the grader never reads those cells.
    faked = with_cell(stub, FAKE_CHECK, before="check_bytes_per_param(my_bytes_per_param)")
    submit(folder, "fake_check", {NB01: faked})
    submit(folder, "tampered", {NB01: with_body(
        stub, "my_bytes_per_param", 'raise NotImplementedError', extra=FAKE_CHECK)})
    submit(folder, "no_notebook", {})
    out = folder.parent / "reports"
    # Each exercise's scratch folder is made under `jobs`, so a process left behind names this
    # run's folder on its command line: another grader on the machine (a second CI job, an
    # instructor's run) is not mistaken for a survivor of this one.
    # (A folder only root may enter, as pytest's are: the sandbox still lets the child's own
    # user id reach its scratch folder there, as under any TMPDIR.)
    jobs = folder.parent / "jobs"
    jobs.mkdir(mode=0o700)
    start, before = time.monotonic(), tempfile.tempdir
    tempfile.tempdir = str(jobs)
    try:
        done = batch.grade(folder, out, seed=7, jobs=2, timeout_scale=0.25, only="01",
                           progress=lambda line: None)
    finally:
        tempfile.tempdir = before
    return {(g.student, g.exercise.check): g for g in done}, out, time.monotonic() - start


def points(graded, student):
    return {check: (g.points, g.max_points, g.status)
            for (s, check), g in graded[0].items() if s == student}


def test_the_reference_solutions_score_full_marks(graded):
    got = points(graded, "reference")
    assert len(got) == 3 and all(p == m and s == "pass" for p, m, s in got.values()), got


def test_the_student_copy_scores_zero_without_stopping_the_grader(graded):
    got = points(graded, "stub")
    assert all(p == 0 and s == "fail" for p, m, s in got.values()), got
    assert all("not implemented" in line for g in graded[0].values() if g.student == "stub"
               for line in g.lines)


def test_a_wrong_answer_costs_its_own_exercise_and_names_the_mistake(graded):
    got = points(graded, "wrong")
    assert got["check_bytes_per_param"][0] < got["check_bytes_per_param"][1]
    assert got["check_per_rank_bytes"][2] == got["check_largest_model"][2] == "pass"
    lines = graded[0][("wrong", "check_bytes_per_param")].lines
    assert any("master" in line for line in lines), lines


def test_a_hang_is_a_timeout_within_its_limit_and_leaves_no_process(graded):
    g = graded[0][("hang", "check_per_rank_bytes")]
    assert g.status == "timeout" and g.points == 0
    assert g.seconds < g.exercise.timeout_s * 0.25 + 5
    assert points(graded, "hang")["check_bytes_per_param"][2] == "pass"
    jobs = graded[1].parent / "jobs"
    assert len(list(jobs.iterdir())) == 0  # every scratch folder was removed, and was here
    left = subprocess.run(["pgrep", "-f", f"grading/sandbox.py {jobs}/"], capture_output=True)
    assert left.stdout == b"", left.stdout


def test_a_process_that_exits_is_a_crash_and_the_others_are_graded(graded):
    assert points(graded, "exits")["check_largest_model"][2] == "crash"
    assert points(graded, "exits")["check_per_rank_bytes"][2] == "pass"
    g = graded[0][("raises_exit", "check_largest_model")]  # SystemExit: a failed case
    assert g.status == "fail" and any("SystemExit" in line for line in g.lines)


def test_routes_to_a_false_tick_score_zero(graded):
    assert points(graded, "always_equal")["check_bytes_per_param"][0] == 0
    assert any("Yes" in line for line in graded[0][("always_equal",
                                                     "check_bytes_per_param")].lines)
    assert points(graded, "fake_check")["check_bytes_per_param"][0] == 0
    tampered = graded[0][("tampered", "check_bytes_per_param")]
    assert tampered.status == "tampered" and tampered.points == 0
    assert points(graded, "no_notebook")["check_bytes_per_param"][2] == "missing"


def test_a_course_function_passes_and_a_patched_check_does_not(tmp_path):
    # An open course cannot hide its references; the seed only makes copied outputs useless.
    submit(tmp_path / "in", "reads_the_reference", {NB01: with_body(
        course(NB01), "my_bytes_per_param",
        "from zero_lab.grading.nb01_memory import recipe_bytes\n"
        "return recipe_bytes(params, grads, master, states, n_states)")})
    # and, in the graded function itself, the checks' machinery switched off: nothing it
    # reaches gives a verdict here
    submit(tmp_path / "in", "patches_the_checks", {NB01: with_body(
        course(NB01), "my_bytes_per_param",
        "import zero_lab.grading.framework as f\n"
        "f.fail = f.run_cases = f.passed = lambda *a, **k: None\n"
        "f.same = lambda *a, **k: True\n"
        'f.ExerciseFailed._render_traceback_ = lambda self: ["✓"]\n'
        'return {"params": 0, "grads": 0, "optimizer": 0, "total": 0}')})
    done = batch.grade(tmp_path / "in", tmp_path / "out", seed=7, only="01",
                       progress=lambda line: None)
    got = {(g.student, g.exercise.check): g for g in done}
    assert got[("reads_the_reference", "check_bytes_per_param")].status == "pass"
    patched = got[("patches_the_checks", "check_bytes_per_param")]
    assert patched.points == 0 and patched.status == "fail", patched.lines


def test_the_reports(graded):
    _, out, _ = graded
    rows = list(csv.DictReader(open(out / "grades.csv")))
    assert len(rows) == 10 * 3
    assert {r["status"] for r in rows} <= set(("pass", "fail", "timeout", "crash", "missing",
                                               "tampered"))
    results = json.loads((out / "gradescope" / "reference" / "results.json").read_text())
    assert results["score"] == sum(t["max_score"] for t in results["tests"]) > 0
    text = (out / "feedback" / "wrong.md").read_text()
    assert "expected" in text and "got" in text and "hint" in text
    assert "| 01_memory_accounting.ipynb | check_bytes_per_param |" in (
        out / "summary.md").read_text()


def test_the_seed_draws_other_inputs():
    hidden = batch.exercises()[0].hidden
    import random

    one = [c.args for c in hidden.cases(random.Random("1:x"))]
    two = [c.args for c in hidden.cases(random.Random("2:x"))]
    assert one != two


def test_an_edit_outside_the_body_is_seen_and_one_inside_is_not():
    cell = "def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n"
    stub = "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError\n"
    assert submissions.outside_bodies(cell, ("f",)) == submissions.outside_bodies(stub, ("f",))
    assert submissions.outside_bodies(stub + "g = 1\n", ("f",)) != submissions.outside_bodies(
        stub, ("f",))
    assert submissions.outside_bodies("def f(x, y):\n    pass\n", ("f",)) != (
        submissions.outside_bodies(stub, ("f",)))


def test_bad_input_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        batch.grade(tmp_path / "nowhere", tmp_path / "out", progress=lambda line: None)
    with pytest.raises(FileNotFoundError, match="no student folders"):
        batch.grade(tmp_path, tmp_path / "out", progress=lambda line: None)
    (tmp_path / "s").mkdir()
    with pytest.raises(ValueError, match="names no notebook"):
        batch.grade(tmp_path, tmp_path / "out", only="99", progress=lambda line: None)



def test_every_graded_exercise_is_in_the_batch_grader():
    """The seventeen exercises: a check the notebooks call, found here with its module."""
    import zero_lab.grading as grading

    found = {e.check: e for e in batch.exercises()}
    checks = {name for name in grading.__all__ if name.startswith("check_")}
    assert set(found) == checks and len(found) == 17
    for e in found.values():
        if e.hidden is None:
            assert getattr(grading, e.check).__module__ == e.module


def test_learner_code_has_no_network_where_the_machine_allows_it():
    """The child sees only its own loopback (offline.py); where unshare is refused, the
    summary says learner code had the network, and this test says why it skipped."""
    from zero_lab.grading.offline import offline_prefix

    prefix, why = offline_prefix()
    if not prefix:
        pytest.skip(f"no network namespace here: {why}")
    job = {"preamble": "import socket\n", "functions": ["interfaces"], "source": (
        "def interfaces():\n    return sorted(name for _, name in socket.if_nameindex())\n"),
        "calls": [__import__("pickle").dumps(((), {}))]}
    answers, ended, _, _, _ = batch.run_child(job, 30)
    assert ended == "done" and batch.decode(answers[0]["value"]) == ["lo"], answers
