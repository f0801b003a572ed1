"""Points into a gradebook (zero_lab/grading/gradebook.py): weights, totals, the wide CSV, runs
merged (a regraded student's rows replace theirs), missing exercises 0 and said, bad input named."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest

from zero_lab.grading import gradebook, reports

HEADER = "student,notebook,exercise,points,max,status,seconds\n"
CLASS = HEADER + """\
ann,01_memory_accounting.ipynb,check_bytes_per_param,8,8,pass,0.1
ann,03_zero1.ipynb,check_sharded_step,1,3,fail,9.0
bo,01_memory_accounting.ipynb,check_bytes_per_param,4,8,fail,0.1
bo,03_zero1.ipynb,check_sharded_step,0,3,tampered,0.0
"""
REGRADE = HEADER + """\
bo,03_zero1.ipynb,check_sharded_step,3,3,pass,8.0
cy,03_zero1.ipynb,check_sharded_step,3,3,pass,8.0
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def wide(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_without_weights_a_score_is_the_points_and_the_wide_csv_has_a_column_each(tmp_path):
    book = gradebook.gradebook([write(tmp_path, "grades.csv", CLASS)])
    assert book.exercises == ["check_bytes_per_param", "check_sharded_step"]  # course order
    assert book.total("ann") == (9, 11) and book.total("bo") == (4, 11)
    book.write(tmp_path / "gradebook.csv")
    rows = wide(tmp_path / "gradebook.csv")
    assert list(rows[0]) == ["student", "check_bytes_per_param", "check_sharded_step",
                             "total", "max", "notes"]
    assert rows[1] == {"student": "bo", "check_bytes_per_param": "4", "check_sharded_step": "0",
                       "total": "4", "max": "11", "notes": "check_sharded_step: tampered"}


def test_weights_make_a_score_weight_times_points_over_max(tmp_path):
    weights = write(tmp_path, "weights.csv", "# stage 1's step is worth more\n"
                    "exercise,weight\ncheck_sharded_step,10\n*,2\n")
    book = gradebook.gradebook([write(tmp_path, "grades.csv", CLASS)], weights)
    assert book.most == {"check_bytes_per_param": 2, "check_sharded_step": 10}
    assert book.scores["ann"]["check_sharded_step"] == pytest.approx(10 / 3)
    assert book.total("bo") == (pytest.approx(1.0), 12)
    book.write(tmp_path / "gradebook.csv")
    assert wide(tmp_path / "gradebook.csv")[0]["total"] == "5.333"


def test_a_later_run_replaces_a_students_rows_and_a_missing_one_is_zero_and_said(tmp_path):
    book = gradebook.gradebook([write(tmp_path, "class.csv", CLASS),
                                write(tmp_path, "regrade.csv", REGRADE)])
    assert book.scores["bo"] == {"check_bytes_per_param": 4, "check_sharded_step": 3}
    assert book.scores["ann"]["check_sharded_step"] == 1  # not in the regrade: kept
    assert book.scores["cy"]["check_bytes_per_param"] == 0
    assert book.notes["cy"] == ["check_bytes_per_param: no grade in any run (0)"]
    assert book.notes["bo"] == []  # the tampered verdict was replaced
    earlier_last = gradebook.gradebook([tmp_path / "regrade.csv", tmp_path / "class.csv"])
    assert earlier_last.scores["bo"]["check_sharded_step"] == 0  # the order given is the order


def test_it_reads_what_the_grader_writes(tmp_path):
    def graded(student, check, points, most, status):
        return SimpleNamespace(student=student, points=points, max_points=most, status=status,
                               seconds=0.5, lines=[], first_failing="",
                               exercise=SimpleNamespace(notebook="01_memory_accounting.ipynb",
                                                        check=check))
    reports.write_all([graded("ann", "check_bytes_per_param", 8, 8, "pass"),
                       graded("bo", "check_bytes_per_param", 2, 8, "fail")], tmp_path, seed=1)
    book = gradebook.gradebook([tmp_path / "grades.csv"])
    assert book.total("ann") == (8, 8) and book.total("bo") == (2, 8)


@pytest.mark.parametrize("weights, message", [
    ("exercise,weight\ncheck_nothing_such,3\n*,1\n",
     "row 1: unknown exercise 'check_nothing_such'"),
    ("exercise,weight\ncheck_sharded_step,-1\n*,1\n",
     "row 1: the weight of 'check_sharded_step' '-1' must be a number >= 0"),
    ("exercise,weight\ncheck_sharded_step,ten\n", "'ten' is not a number"),
    ("exercise,weight\ncheck_sharded_step,3\n", "no weight for 'check_bytes_per_param'"),
    ("exercise,points\ncheck_sharded_step,3\n", "no column.s. weight"),
    ("exercise,weight\ncheck_sharded_step,3\ncheck_sharded_step,4\n",
     "row 2: 'check_sharded_step' is weighted twice"),
])
def test_a_bad_weights_file_is_refused_naming_it(tmp_path, weights, message):
    path = write(tmp_path, "weights.csv", weights)
    with pytest.raises(ValueError, match=message) as info:
        gradebook.gradebook([write(tmp_path, "grades.csv", CLASS)], path)
    assert "weights.csv" in str(info.value)


@pytest.mark.parametrize("grades, message", [
    ("student,exercise,points\nann,check_x,1\n", "no column.s. notebook, max, status"),
    (HEADER + "ann,01.ipynb,check_x,nine,8,pass,0\n", "row 1: points 'nine' is not a number"),
    (HEADER + "ann,01.ipynb,check_x,9,8,pass,0\n", "row 1: points 9 above max 8"),
    (HEADER + "ann,01.ipynb,check_x,1,8,fail,0\nann,01.ipynb,check_x,2,8,fail,0\n",
     "row 2: ann's check_x again"),
])
def test_a_bad_grades_file_is_refused_naming_it(tmp_path, grades, message):
    with pytest.raises(ValueError, match=message) as info:
        gradebook.gradebook([write(tmp_path, "mine.csv", grades)])
    assert "mine.csv" in str(info.value)
    with pytest.raises(FileNotFoundError, match="absent.csv"):
        gradebook.gradebook([tmp_path / "absent.csv"])


def test_the_command_line(tmp_path, capsys):
    grades = write(tmp_path, "grades.csv", CLASS)
    assert gradebook.main([str(grades), "--out", str(tmp_path / "book.csv")]) == 0
    assert "bo: 4 of 11 (check_sharded_step: tampered)" in capsys.readouterr().out
    assert wide(tmp_path / "book.csv")[0]["total"] == "9"
    assert gradebook.main([str(grades), "--weights", str(tmp_path / "none.csv")]) == 2
    assert "gradebook: " in capsys.readouterr().err
