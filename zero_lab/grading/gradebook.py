"""Points into a gradebook: weights per exercise, totals per student, runs merged.

    gradebook(GRADES.csv [GRADES.csv ...], weights=WEIGHTS.csv) -> Gradebook
    Gradebook.write(OUT.csv)     one row a student, one column an exercise, total, max, notes

The grader's grades.csv (reports.py) is long: student, notebook, exercise, points, max, status,
a point per hidden case, so an exercise's worth is however many cases it draws. A weights file
says what each is worth instead:

    exercise,weight            # weights.csv; `#` starts a comment line
    check_sharded_step,10      # an exercise's score = weight x points / max
    check_bytes_per_param,2
    *,1                        # any exercise not listed (without this row, each must be)

Without one, an exercise's score is its points. Several runs merge in the order given: a later
run's row for a student's exercise replaces the earlier one's (regrade one student with
`grade --only`, or a folder holding just them, then merge it into the class's run). An exercise
a student has no row for counts 0 and is said in the `notes` column, as are the grader's
`missing`, `tampered`, `crash` and `timeout` verdicts. Bad input is refused, naming the file and
line: a CSV without the columns, a number that is not one, an unknown exercise, a weight < 0.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

COLUMNS = ("student", "notebook", "exercise", "points", "max", "status")
NOTED = ("missing", "tampered", "crash", "timeout")  # verdicts an instructor looks at
DEFAULT = "*"


@dataclasses.dataclass(frozen=True)
class Row:
    student: str
    notebook: str
    exercise: str
    points: float
    max: float
    status: str
    where: str  # file:line, for the messages


def _number(text: str, what: str, where: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {what} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {what} {text!r} must be a number >= 0")
    return value


def _rows(path: Path, need: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(file:line, row) of a CSV, refused when a column in `need` is absent."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, newline="", encoding="utf-8") as f:
        lines = [line for line in f if not line.lstrip().startswith("#")]
    reader = csv.DictReader(lines)
    absent = [c for c in need if c not in (reader.fieldnames or [])]
    if absent:
        raise ValueError(f"{path}: no column(s) {', '.join(absent)} (its header: "
                         f"{', '.join(reader.fieldnames or []) or 'none'}; wanted "
                         f"{', '.join(need)})")
    # Line numbers as an editor shows them only when no comment precedes: said as row numbers.
    return [(f"{path} row {i}", row) for i, row in enumerate(reader, start=1)]


def read_grades(path: Path) -> list[Row]:
    """One run's grades.csv (reports.py's long table), every number checked."""
    out, seen = [], {}
    for where, row in _rows(path, COLUMNS):
        student, exercise = (row["student"] or "").strip(), (row["exercise"] or "").strip()
        if not student or not exercise:
            raise ValueError(f"{where}: a row without a student or an exercise")
        points = _number(row["points"], "points", where)
        top = _number(row["max"], "max", where)
        if points > top:
            raise ValueError(f"{where}: points {row['points']} above max {row['max']}")
        if (student, exercise) in seen:
            raise ValueError(f"{where}: {student}'s {exercise} again (first at "
                             f"{seen[student, exercise]}); one run grades it once")
        seen[student, exercise] = where
        out.append(Row(student, row["notebook"].strip(), exercise, points, top,
                       (row["status"] or "").strip(), where))
    return out


def merge(runs: list[list[Row]]) -> dict[tuple[str, str], Row]:
    """{(student, exercise): row}, a later run's row replacing an earlier one's."""
    merged: dict[tuple[str, str], Row] = {}
    for rows in runs:
        for row in rows:
            merged[row.student, row.exercise] = row
    return merged


def read_weights(path: Path, exercises: set[str]) -> dict[str, float]:
    """{exercise or "*": weight} from a weights CSV; an exercise must be in `exercises` (the
    grades') or one of the course's graded exercises."""
    weights: dict[str, float] = {}
    course = None
    for where, row in _rows(path, ("exercise", "weight")):
        name = (row["exercise"] or "").strip()
        if name in weights:
            raise ValueError(f"{where}: {name!r} is weighted twice")
        if name != DEFAULT and name not in exercises:
            course = course if course is not None else _course_exercises()
            if name not in course:
                raise ValueError(f"{where}: unknown exercise {name!r} (not in the grades, nor "
                                 f"one of the course's: {', '.join(sorted(course))})")
        try:
            weights[name] = _number(row["weight"], f"the weight of {name!r}", where)
        except ValueError as exc:
            raise ValueError(f"{exc} (a weight is a number >= 0)") from None
    return weights


def _course_exercises() -> set[str]:
    from zero_lab.grading.batch import exercises  # only when a name is not in the grades

    return {e.check for e in exercises()}


@dataclasses.dataclass
class Gradebook:
    exercises: list[str]                       # columns, in course order (notebook, name)
    scores: dict[str, dict[str, float]]        # student -> exercise -> score
    most: dict[str, float]                     # exercise -> what it is worth
    notes: dict[str, list[str]]                # student -> what was missing or odd

    def total(self, student: str) -> tuple[float, float]:
        """(the student's total, the most it could be)."""
        return (sum(self.scores[student].values()), sum(self.most.values()))

    def write(self, path: Path) -> None:
        """The wide CSV: student, one column an exercise, total, max, notes."""
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["student", *self.exercises, "total", "max", "notes"])
            for student in sorted(self.scores):
                total, most = self.total(student)
                w.writerow([student, *(_fmt(self.scores[student][e]) for e in self.exercises),
                            _fmt(total), _fmt(most), "; ".join(self.notes[student])])


def _fmt(x: float) -> str:
    return f"{round(x, 3):g}"


def gradebook(grades: list[Path], weights: Path | None = None) -> Gradebook:
    """Merge the runs' grades.csv (later over earlier) and weigh them."""
    if not grades:
        raise ValueError("gradebook: no grades.csv given")
    merged = merge([read_grades(Path(p)) for p in grades])
    order = sorted({(r.notebook, r.exercise) for r in merged.values()})
    exercises = [e for _, e in order]
    if len(set(exercises)) != len(exercises):
        raise ValueError("gradebook: one exercise under two notebooks in the grades: "
                         f"{sorted(e for e in exercises if exercises.count(e) > 1)}")
    weight = read_weights(Path(weights), set(exercises)) if weights else None
    most = {}
    for e in exercises:
        if weight is None:  # a point per case: the most any run offered for it
            most[e] = max(r.max for r in merged.values() if r.exercise == e)
        elif e in weight or DEFAULT in weight:
            most[e] = weight.get(e, weight.get(DEFAULT))
        else:
            raise ValueError(f"{weights}: no weight for {e!r} (add a row for it, or "
                             f"`{DEFAULT},1` for every exercise not listed)")
    students = sorted({r.student for r in merged.values()})
    scores = {s: {} for s in students}
    notes = {s: [] for s in students}
    for s in students:
        for e in exercises:
            row = merged.get((s, e))
            if row is None:
                scores[s][e] = 0.0
                notes[s].append(f"{e}: no grade in any run (0)")
                continue
            if weight is None:
                scores[s][e] = row.points
            else:  # a crash can leave max 0 (its cases could not be counted): worth 0 then
                scores[s][e] = most[e] * row.points / row.max if row.max else 0.0
            if row.status in NOTED:
                notes[s].append(f"{e}: {row.status}")
    return Gradebook(exercises, scores, most, notes)


def main(argv: list[str] | None = None) -> int:
    """`python -m zero_lab.grading gradebook GRADES.csv... [--weights W] --out OUT.csv`."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m zero_lab.grading gradebook")
    parser.add_argument("grades", type=Path, nargs="+",
                        help="runs' grades.csv, earliest first: a later run's rows win")
    parser.add_argument("--weights", type=Path, default=None, help="CSV: exercise,weight")
    parser.add_argument("--out", type=Path, default=Path("gradebook.csv"))
    args = parser.parse_args(argv)
    try:
        book = gradebook(args.grades, args.weights)
    except (FileNotFoundError, ValueError) as exc:
        print(f"gradebook: {exc}", file=sys.stderr)
        return 2
    book.write(args.out)
    for student in sorted(book.scores):
        total, most = book.total(student)
        print(f"{student}: {_fmt(total)} of {_fmt(most)}"
              + (f" ({'; '.join(book.notes[student])})" if book.notes[student] else ""))
    print(f"wrote {args.out}: a row a student, a column an exercise, total, max, notes")
    return 0
