"""The batch grader soaked: the reference class graded again and again beside busy processes.

    python -m zero_lab.grading soak [--runs 20] [--load 2] [--students 2] [--only NB] [-j 2]

Why this exists. A grader must never fail a correct solution by chance (issue 49): a judge
that races another thread, a limit too tight on a busy machine, a seed whose cases a check
misreads. `make soak` holds the notebooks to that rule; this holds the grader to it. The
reference class is every course notebook as it is, solutions in, submitted by `--students`
students. Each run grades the whole class with `grade` (sandboxed, as an instructor runs it)
into a folder of its own, with a new seed every run, while `--load` processes spin on the CPU
beside it (`course.soak.busy_processes`). Per exercise it counts the runs in which every
reference copy scored every case. Nothing is retried: one exercise below runs/runs is a defect,
named with its run, student and first failing case, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

from zero_lab.course.runner import course_notebooks
from zero_lab.course.soak import busy_processes
from zero_lab.grading import batch
from zero_lab.launch.paths import new_run_dir


def reference_class(folder: Path, students: int, only: str | None = None) -> Path:
    """`students` students, each submitting every course notebook as it is (solutions in)."""
    for s in range(students):
        (folder / f"reference{s}").mkdir(parents=True, exist_ok=True)
        for notebook in course_notebooks(only):
            shutil.copyfile(notebook, folder / f"reference{s}" / notebook.name)
    return folder


def soak(out: Path, runs: int, load: int, students: int = 2, only: str | None = None,
         jobs: int = 2, say=print) -> dict[str, list[str]]:
    """Grade the reference class `runs` times beside `load` busy processes; returns, per
    exercise ("03_zero1.ipynb check_step"), what went wrong in each run it did not pass."""
    folder = reference_class(out / "submitted", students, only)
    failures: dict[str, list[str]] = defaultdict(list)
    exercises: set[str] = set()
    with busy_processes(load):
        for run in range(runs):
            start = time.monotonic()
            done = batch.grade(folder, out / f"run{run:02d}", seed=run, jobs=jobs, only=only,
                               progress=lambda line: None)
            for g in done:
                key = f"{g.exercise.notebook} {g.exercise.check}"
                exercises.add(key)
                if g.status != "pass" or g.points != g.max_points:
                    first = g.first_failing or (g.lines[0] if g.lines else "")
                    failures[key].append(f"run {run} (seed {run}), {g.student}: {g.status} "
                                         f"{g.points}/{g.max_points}, {first}"[:300])
            bad = sum(1 for k in failures if any(f.startswith(f"run {run} ") for f in
                                                 failures[k]))
            say(f"run {run + 1}/{runs}: {len(done)} exercises graded in "
                f"{time.monotonic() - start:.0f} s, {bad} exercise(s) not at full marks")
    return {key: failures.get(key, []) for key in sorted(exercises)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zero_lab.grading soak",
                                     description=__doc__.split("\n\n")[1])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", type=int, default=2, help="CPU-bound processes beside it")
    parser.add_argument("--students", type=int, default=2, help="reference copies a run")
    parser.add_argument("--only", default=None, help="notebooks whose name starts with this")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    for name in ("runs", "students", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if args.load < 0:
        parser.error(f"--load must be 0 or more, not {args.load}")
    out = new_run_dir("grade_soak")
    print(f"grade soak: {args.runs} runs of {args.students} reference student(s) beside "
          f"{args.load} busy process(es), into {out}")
    result = soak(out, args.runs, args.load, args.students, args.only, args.jobs,
                  say=lambda line: print(line, flush=True))  # a line a run, even into a file
    for key, failed in result.items():
        print(f"{key}: {args.runs - len({f.split(',')[0] for f in failed})}/{args.runs} runs "
              "at full marks")
        for line in failed:
            print(f"    {line}")
    return 1 if any(result.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
