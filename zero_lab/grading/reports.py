"""What the batch grader writes (batch.py): one table for the gradebook, one feedback file per
student, Gradescope's results.json per student, and a summary per exercise.

    grades.csv                       student, notebook, exercise, points, max, status, seconds
    feedback/<student>.md            per exercise: the status, then each failing case as the
                                     in-notebook check shows it (expected, got, hint)
    gradescope/<student>/results.json  Gradescope's format: a test per exercise, its score and
                                     max_score, the feedback as its output
    summary.md                       per exercise: how many passed, the mean points, and the
                                     case most students failed first; then each tampered
                                     exercise cell's diff (stub -> submitted, outside bodies)
"""

from __future__ import annotations

import collections
import csv
import json
from pathlib import Path

STATUSES = ("pass", "fail", "timeout", "crash", "missing", "tampered")


def write_all(graded: list, out: Path, seed: int, note: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    graded = sorted(graded, key=lambda g: (g.student, g.exercise.notebook, g.exercise.check))
    with open(out / "grades.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", "notebook", "exercise", "points", "max", "status", "seconds"])
        for g in graded:
            w.writerow([g.student, g.exercise.notebook, g.exercise.check, g.points,
                        g.max_points, g.status, f"{g.seconds:.1f}"])
    by_student = collections.defaultdict(list)
    for g in graded:
        by_student[g.student].append(g)
    for student, mine in by_student.items():
        (out / "feedback").mkdir(exist_ok=True)
        (out / "feedback" / f"{student}.md").write_text(feedback(student, mine))
        folder = out / "gradescope" / student
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps(gradescope(mine), indent=1))
    (out / "summary.md").write_text(summary(graded, seed, note))


def _lines(g) -> str:
    return "\n".join(g.lines)


def fenced(text: str) -> list[str]:
    """`text` in a code fence longer than any run of backticks in it: nothing the learner's
    code printed or raised can close the fence and write a heading of its own."""
    longest = run = 0
    for c in text:
        run = run + 1 if c == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return [fence, text, fence]


def feedback(student: str, graded: list, seed: int | None = None) -> str:
    """A student's feedback. The seed is never in it (`seed` is ignored): with the seed, the
    hidden cases of a rerun under it are known in advance."""
    total, most = sum(g.points for g in graded), sum(g.max_points for g in graded)
    parts = [f"# Feedback for {student}", "", f"{total} of {most} points (hidden cases).", ""]
    for g in graded:
        parts += [f"## {g.exercise.notebook}: {g.exercise.check}", "",
                  f"**{g.status}**: {g.points}/{g.max_points}", ""]
        if g.lines:
            parts += [*fenced(_lines(g)), ""]
    return "\n".join(parts)


def gradescope(graded: list) -> dict:
    tests = [{"name": f"{g.exercise.notebook}: {g.exercise.check}", "score": g.points,
              "max_score": g.max_points, "status": "passed" if g.status == "pass" else "failed",
              "output": f"{g.status}\n{_lines(g)}".strip(), "visibility": "visible"}
             for g in graded]
    return {"score": sum(g.points for g in graded), "tests": tests}


def summary(graded: list, seed: int, note: str = "") -> str:
    rows = collections.defaultdict(list)
    for g in graded:
        rows[(g.exercise.notebook, g.exercise.check)].append(g)
    parts = [f"# Summary (seed {seed})", "", note, "",
             "| notebook | exercise | passed | mean points | statuses | most common first "
             "failing case |", "| --- | --- | --- | --- | --- | --- |"]
    for (notebook, check), gs in sorted(rows.items()):
        count = collections.Counter(g.status for g in gs)
        statuses = ", ".join(f"{s} {count[s]}" for s in STATUSES if count[s])
        failing = collections.Counter(g.first_failing for g in gs if g.first_failing)
        common = (f"{_cell(failing.most_common(1)[0][0])} ({failing.most_common(1)[0][1]})"
                  if failing else "")
        mean = sum(g.points for g in gs) / len(gs)
        parts.append(f"| {notebook} | {check} | {count['pass']}/{len(gs)} | "
                     f"{mean:.1f}/{gs[0].max_points} | {statuses} | {common} |")
    tampered = [g for g in graded if g.status == "tampered"]
    if tampered:  # each with its diff, to accept or not (grade --accept)
        parts += ["", "## Tampered exercise cells", ""]
        for g in tampered:
            parts += [f"### {_cell(g.student)}: {g.exercise.notebook}, {g.exercise.check}", "",
                      *fenced(_lines(g)), ""]
    return "\n".join(parts) + "\n"


def _cell(text: str) -> str:
    """Learner text in a table cell: one line, no column break."""
    return " ".join(text.split()).replace("|", "\\|")[:80]
