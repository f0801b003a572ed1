"""What a grading run has decided, written as each exercise ends: a crash, a kill or a
hostile submission loses at most the exercise it was grading, and `grade --resume OUT`
continues from here. The reports (reports.py) are rebuilt from these files.

    OUT/run.json                 the run's submissions folder, seed, notebooks and time scale
    OUT/results/<student>.jsonl  one line per graded exercise, appended, flushed to disk

Only the grader writes here: the sandboxes (jail.py) never see OUT.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RUN = "run.json"
FOLDER = "results"


def start(out: Path, params: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / FOLDER).mkdir(exist_ok=True)
    (out / RUN).write_text(json.dumps(params, indent=1))


def params(out: Path) -> dict:
    """The parameters the run in `out` was started with (FileNotFoundError: no run there)."""
    path = out / RUN
    if not path.is_file():
        raise FileNotFoundError(f"{out} holds no grading run to resume (no {RUN})")
    return json.loads(path.read_text())


def append(out: Path, g) -> None:
    """One graded exercise (batch.Graded), on its student's line-per-exercise file."""
    record = {"student": g.student, "notebook": g.exercise.notebook, "check": g.exercise.check,
              "points": g.points, "max": g.max_points, "status": g.status,
              "lines": g.lines, "seconds": round(g.seconds, 2), "first_failing": g.first_failing}
    line = json.dumps(record, ensure_ascii=True) + "\n"
    path = out / FOLDER / f"{_file_name(g.student)}.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read(out: Path) -> list[dict]:
    """Every record written so far; a line cut short by a kill is skipped (regraded)."""
    records = []
    for path in sorted((out / FOLDER).glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and {"student", "check", "status"} <= set(record):
                records.append(record)
    return records


def _file_name(student: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in student) or "_"
