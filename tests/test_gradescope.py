"""Gradescope's autograder zip (zero_lab/grading/gradescope.py): built from the course, then its
own run_autograder run against a notebook 01 submission in a folder laid out as Gradescope lays
one out (root/source, root/submission, root/submission_metadata.json, root/results), and the
results.json it writes checked: scores, totals, the hidden cases only after publication, a seed
per student from the instructor's secret, the secret gone before student code runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from zero_lab.grading import gradescope
from zero_lab.launch.paths import NOTEBOOKS

NB01 = "01_memory_accounting.ipynb"
SECRET = "the-instructors-secret-4f1c"


def submission(secret: Path) -> dict:
    """Notebook 01 with two exercises' references and one wrong: it reads `secret`."""
    nb = json.loads((NOTEBOOKS / NB01).read_text())
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "code" and "def my_per_rank_bytes(" in text:
            body = re.search(r"    ### BEGIN SOLUTION\n(.*?)    ### END SOLUTION", text, re.DOTALL)
            cell["source"] = text.replace(body.group(1), (
                f"    print(open({str(secret)!r}).read())\n"
                "    return 0\n"))
    return nb


@pytest.fixture(scope="module")
def autograder(tmp_path_factory) -> Path:
    return gradescope.build(tmp_path_factory.mktemp("zip") / "autograder.zip", ["01"],
                            secret=SECRET, jobs=1)


def lay_out(zip_path: Path, root: Path, user: str) -> Path:
    """A folder as Gradescope has it when run_autograder starts."""
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(root / "source")
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    (root / "submission").mkdir()
    (root / "submission" / "01_memory_accounting (2).ipynb").write_text(json.dumps(
        submission(root / "source" / "gradescope_secret")))
    (root / "submission_metadata.json").write_text(json.dumps(
        {"id": 99, "users": [{"id": user, "email": f"{user}@uni.example", "name": "A B"}]}))
    (root / "results").mkdir()
    return root


@pytest.fixture(scope="module")
def two_runs(autograder, tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """The zip's run_autograder for two students, at once (they are independent runs)."""
    roots = {u: lay_out(autograder, tmp_path_factory.mktemp(f"gs{u}"), u) for u in ("41", "42")}
    runs = {u: subprocess.Popen(
        ["bash", str(r / "run_autograder")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, "AUTOGRADER_ROOT": str(r),
                        "AUTOGRADER_PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
        for u, r in roots.items()}
    out = {}
    for u, proc in runs.items():
        printed = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, printed
        results = roots[u] / "results" / "results.json"
        out[u] = json.loads(results.read_text()), roots[u]
    return out


def test_the_zip_holds_the_course_pinned_and_gradescopes_two_scripts(autograder):
    with zipfile.ZipFile(autograder) as z:
        names = set(z.namelist())
        setup = z.read("setup.sh").decode()
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
    assert {"setup.sh", "run_autograder", "gradescope.json", "gradescope_secret",
            "course/pyproject.toml", "course/README.md", "course/zero_lab/grading/batch.py",
            f"course/notebooks/{NB01}"} <= names
    assert not any("__pycache__" in n for n in names)
    assert modes["setup.sh"] & 0o111 and modes["run_autograder"] & 0o111
    assert ('--index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"' in setup
            and "numpy==2.4.6" in setup and 'install -e "$SRC/course"' in setup)
    assert subprocess.run(["bash", "-n", "-c", setup]).returncode == 0


def test_run_autograder_writes_gradescopes_results(two_runs):
    results, _ = two_runs["41"]
    visible = [t for t in results["tests"] if t["visibility"] == "visible"]
    assert [(t["name"], t["score"], t["max_score"]) for t in visible] == [
        ("01_memory_accounting: check_bytes_per_param", 8, 8),
        ("01_memory_accounting: check_per_rank_bytes", 0, 8),
        ("01_memory_accounting: check_largest_model", 8, 8)]
    assert results["score"] == 16 == sum(t.get("score", 0) for t in results["tests"])
    assert "01_memory_accounting.ipynb from 01_memory_accounting (2).ipynb" in results["output"]
    assert results["stdout_visibility"] == "hidden"


def test_the_hidden_cases_are_shown_only_after_publication(two_runs):
    results, _ = two_runs["41"]
    later = [t for t in results["tests"] if t["visibility"] == "after_published"]
    assert [t["name"] for t in later] == [
        "01_memory_accounting: check_per_rank_bytes: the hidden cases"]
    assert "case 1/8" in later[0]["output"] and "score" not in later[0]
    shown = json.dumps([t for t in results["tests"] if t["visibility"] != "after_published"])
    assert "case 1/8" not in shown and "expected" not in shown


def test_each_student_draws_cases_from_the_secret_and_never_sees_it(two_runs):
    cases = {}
    for user, (results, root) in two_runs.items():
        cases[user] = next(t["output"] for t in results["tests"]  # the cases, not the paths
                           if t["visibility"] == "after_published").replace(str(root), "ROOT")
        assert not (root / "source" / "gradescope_secret").exists()  # removed before grading
        text = (root / "results" / "results.json").read_text()
        assert SECRET not in text
        assert str(gradescope.seed_for(SECRET, [user])) not in text
    assert cases["41"] != cases["42"]  # another student, other inputs
    assert gradescope.seed_for(SECRET, ["41"]) == gradescope.seed_for(SECRET, ["41"])
    assert gradescope.seed_for(SECRET, ["41"]) != gradescope.seed_for("other", ["41"])


def test_bad_input_is_named(tmp_path):
    with pytest.raises(ValueError, match="'03' names 1 course notebooks .03_zero1.ipynb.; the "
                                         "graded ones|'99' names 0"):
        gradescope.build(tmp_path / "a.zip", ["99"])
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = ["numpy==1"]\n')
    with pytest.raises(ValueError, match="pyproject.toml: no torch==X pin"):
        gradescope.pins(tmp_path / "pyproject.toml")


def test_without_a_sandbox_the_secret_is_gone_before_student_code_runs(autograder, tmp_path,
                                                                       monkeypatch):
    """Where the container cannot start bubblewrap (Docker's default seccomp), the student's
    code runs unsandboxed in run_autograder's container: the secret must be off the disk."""
    from zero_lab.grading import jail

    root = lay_out(autograder, tmp_path, "41")
    monkeypatch.setattr(jail, "available", lambda: (False, "no namespaces in this test"))
    results = gradescope.run(root)
    text = json.dumps(results)
    assert "no sandbox in this container (no namespaces in this test)" in results["output"]
    assert "No such file or directory" in text and SECRET not in text
    assert results["score"] == 16


def test_the_command_line(tmp_path, capsys):
    assert gradescope.main(["build", "01", "--out", str(tmp_path / "ag.zip"), "-j", "1"]) == 0
    assert "upload it as the assignment's autograder" in capsys.readouterr().out
    with zipfile.ZipFile(tmp_path / "ag.zip") as z:
        assert json.loads(z.read("gradescope.json"))["notebooks"] == [NB01]
        assert len(z.read("gradescope_secret")) == 64  # a new random secret
    assert gradescope.main(["build", "99", "--out", str(tmp_path / "x.zip")]) == 2
    assert "gradescope: '99' names 0 course notebooks" in capsys.readouterr().err
