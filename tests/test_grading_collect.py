"""Collecting an LMS download (zero_lab/grading/collect.py): Moodle's folders, Canvas's flat
renamed files, per-student zips with a zip inside, a wrapper folder, the newest of two
candidates, junk ignored with its reason, another course version flagged, and the result read
by the grader as SUBMISSIONS/<student>/<notebook>.ipynb."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest

from zero_lab.grading import collect, submissions
from zero_lab.grading.student import student_notebook
from zero_lab.launch.paths import NOTEBOOKS

NB01, NB03 = "01_memory_accounting.ipynb", "03_zero1.ipynb"


def course(name: str) -> dict:
    return json.loads((NOTEBOOKS / name).read_text())


def other_version(nb: dict) -> dict:
    """The notebook as an earlier course version had it: its cells rewritten and renumbered."""
    nb = json.loads(json.dumps(nb))
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"old{i}"
        if cell["cell_type"] == "code" and i % 4:
            cell["source"] = ["# the 2025 edition\n", *cell["source"]]
    return nb


def learners_edits(nb: dict) -> dict:
    """What a learner does to this version: a cell of their own, two cells tried otherwise."""
    nb = json.loads(json.dumps(nb))
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "SOLUTION" not in
            "".join(c["source"])]
    for cell in code[2:4]:
        cell["source"] = [*cell["source"], "\nprint('trying this')\n"]
    nb["cells"].insert(3, {**code[0], "id": "mine1", "source": ["x = 1\n"]})
    return nb


def write(path: Path, nb: dict | bytes, mtime: float = 1_700_000_000) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(nb if isinstance(nb, bytes) else json.dumps(nb).encode())
    os.utime(path, (mtime, mtime))


def zipped(files: dict[str, bytes]) -> bytes:
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


@pytest.fixture(scope="module")
def download(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("download") / "submissions"  # a wrapper folder, looked into
    ref01, ref03 = course(NB01), course(NB03)
    stub03 = json.dumps(student_notebook(ref03)[0]).encode()
    write(root / "Jane Doe_12345_assignsubmission_file_" / NB03, learners_edits(ref03))
    write(root / "smithjohn_67890_111_03_zero1-1.ipynb", stub03, 1_700_000_000)  # Canvas
    write(root / "smithjohn_LATE_67890_222_03_zero1.ipynb", ref03, 1_700_000_900)  # newer
    inner = zipped({"01_memory_accounting.ipynb": json.dumps(ref01).encode()})
    write(root / "bob.zip", zipped({"bob/03_zero1 (1).ipynb": json.dumps(ref03).encode(),
                                    "bob/notes.txt": b"hi",
                                    "bob/deeper.zip": zipped({"x.zip": inner}),
                                    "__MACOSX/bob/._03_zero1 (1).ipynb": b"\0"}))
    write(root / "carol" / "work.zip", zipped({"01_memory_accounting_late.ipynb":
                                               json.dumps(ref01).encode()}))
    write(root / "carol" / ".ipynb_checkpoints" / "03_zero1-checkpoint.ipynb", ref03)
    write(root / "dave" / NB03, other_version(ref03))
    write(root / "erin" / "03_zero1-1.ipynb", stub03)   # same time: the higher copy wins
    write(root / "erin" / "03_zero1 (2).ipynb", ref03)  # (though its name sorts first)
    write(root / "erin" / "103_zero1x.ipynb", ref03)    # not 03_zero1: the name stands alone
    write(root / "erin" / "03-zero1 (3).ipynb", b"{not json")
    return root.parent


@pytest.fixture(scope="module")
def collected(download, tmp_path_factory):
    out = tmp_path_factory.mktemp("collected") / "class"
    return collect.collect(download, out), out


def taken(result) -> dict[tuple[str, str], collect.Taken]:
    return {(t.student, t.notebook): t for t in result.taken}


def test_each_lms_layout_gives_a_student_folder_the_grader_reads(collected):
    result, out = collected
    assert set(taken(result)) == {
        ("Jane_Doe_12345", NB03), ("smithjohn_67890", NB03), ("bob", NB03),
        ("carol", NB01), ("dave", NB03), ("erin", NB03)}
    books = submissions.students(out)
    assert books["bob"][NB03] == course(NB03)  # `03_zero1 (1).ipynb` from a student's zip
    assert books["carol"][NB01] == course(NB01)  # a zip inside a student's folder, opened
    assert (out / collect.REPORT).read_text().count("| ") > 6


def test_of_two_candidates_the_newest_is_taken_and_the_rule_said(collected):
    result, out = collected
    smith = taken(result)[("smithjohn_67890", NB03)]
    assert smith.source.endswith("LATE_67890_222_03_zero1.ipynb")  # the later upload
    erin = taken(result)[("erin", NB03)]
    assert erin.source.endswith("03_zero1 (2).ipynb")  # a tie: the higher copy number
    assert json.loads((out / "erin" / NB03).read_text()) == course(NB03)
    older = dict(result.ignored)
    assert "older candidate" in older["erin/03_zero1-1.ipynb"]
    assert collect.RULE in older["erin/03_zero1-1.ipynb"]
    assert "not a readable notebook" in older["erin/03-zero1 (3).ipynb"]


def test_what_is_not_a_submission_is_ignored_with_its_reason(collected):
    ignored = dict(collected[0].ignored)
    assert "nested more than 1" in ignored["bob.zip/bob/deeper.zip"]
    assert "not a notebook" in ignored["bob.zip/bob/notes.txt"]
    assert ".ipynb_checkpoints" in ignored["carol/.ipynb_checkpoints/03_zero1-checkpoint.ipynb"]
    assert "no course notebook" in ignored["erin/103_zero1x.ipynb"]
    assert any(where.startswith("bob.zip/__MACOSX") for where in ignored)


def test_another_course_version_is_collected_and_flagged(collected):
    result, out = collected
    versions = {t.student: t.version for t in result.taken}
    assert "unchanged" in versions["dave"] and (out / "dave" / NB03).exists()
    assert versions["Jane_Doe_12345"] == ""  # a learner's own cell and two edits: this one
    assert versions["erin"] == versions["carol"] == ""
    assert versions["smithjohn_67890"] == ""  # the solution written in: still this version
    assert "FROM ANOTHER VERSION" in (out / collect.REPORT).read_text()


def test_a_zipped_download_collects_the_same(download, collected, tmp_path):
    files = {str(p.relative_to(download)): p.read_bytes()
             for p in sorted(download.rglob("*")) if p.is_file()}
    archive = tmp_path / "download.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2023, 11, 14, 22, 13, 20))
            if "LATE" in name:
                info.date_time = (2023, 11, 14, 22, 28, 20)
            z.writestr(info, data)
        z.writestr("../escape.ipynb", b"{}")
    result = collect.collect(archive, tmp_path / "out")
    assert ({(t.student, t.notebook, t.source.split("/")[-1]) for t in result.taken} ==
            {(t.student, t.notebook, t.source.split("/")[-1]) for t in collected[0].taken})
    assert {w for w, _ in result.ignored} - {"../escape.ipynb"} == {
        w for w, _ in collected[0].ignored}
    assert "climbs out" in dict(result.ignored)["../escape.ipynb"]
    assert not (tmp_path / "escape.ipynb").exists()


def test_names_as_lmss_and_browsers_rename_them():
    names = collect.course_notebooks()
    for renamed in ("03_zero1-1.ipynb", "03_zero1 (1).ipynb", "03_zero1_late.ipynb",
                    "smithjohn_67890_111_03_zero1.ipynb", "03-zero1.ipynb", "03_ZERO1.ipynb"):
        assert collect.match_notebook(renamed, names)[0] == NB03, renamed
    for other in ("03_zero10.ipynb", "zero1.ipynb", "03_zero1.py", "103_zero1.ipynb"):
        assert collect.match_notebook(other, names)[0] is None, other


def test_bad_input_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder nor a .zip"):
        collect.collect(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="full exists and is not an empty folder"):
        collect.collect(tmp_path, tmp_path / "full")


def test_the_collected_class_grades(collected, tmp_path):
    """The grader reads the collected folder as it is: carol's zipped, renamed notebook 01
    (the reference) scores every case; the others handed in no notebook 01."""
    from zero_lab.grading import batch

    graded = batch.grade(collected[1], tmp_path / "grades", seed=5, jobs=1, only="01",
                         progress=lambda line: None)
    points = {}
    for g in graded:
        got, most = points.get(g.student, (0, 0))
        points[g.student] = (got + g.points, most + g.max_points)
    assert points["carol"] == (24, 24)
    assert {g.status for g in graded if g.student != "carol"} == {"missing"}


def test_the_command_line(download, tmp_path, capsys):
    assert collect.main([str(download), "--out", str(tmp_path / "class")]) == 0
    assert "6 students, 6 notebooks" in capsys.readouterr().out
    assert collect.main([str(download), "--out", str(tmp_path / "class")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
