"""`python -m zero_lab.grading grade SUBMISSIONS --out DIR`: grade a folder of submissions.

    make grade SUBMISSIONS=path/to/submitted [SEED=...] [JOBS=2]

Each exercise of each student runs in a fresh process of its own (sandbox.py), never in a
student's kernel, with only its `def`s from its cell (submissions.py) and the imports the
notebook gave it. Two kinds:

- Exercises in the kernel (input -> output; hidden.py): the inputs are drawn from `--seed`,
  so a notebook's printed outputs are worth nothing; this process computes every expected
  value with the course's reference and compares the child's answers, which come back as
  plain values of exact types. No learner code runs where a verdict is given. Points: one
  per hidden case.
- Exercises on ranks (notebooks 02-05's launches): the child starts the exercise's 3 ranks,
  which run the learner's function on cases drawn from the same seed and report what it
  produced (values, the collectives it issued, storage sizes); the child hands the reports
  back unjudged, and this process judges them with the notebook's judge, which computes the
  expected values with the course's reference here (zero_lab/course/rank_cases/). Points: one
  per case, each judged on its own.

Containment: no network where the machine allows it (offline.py: a network namespace of the
child's own, loopback only); a time limit per exercise (`--timeout` scales every exercise's
own), the child's whole session ended at it (no process left: the launch's ranks die with
their parent); an address-space and file-size limit (sandbox.py); the first 4 KB of what it
printed kept. Results: grades.csv, feedback/<student>.md, gradescope/<student>/results.json
and summary.md, in DIR.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from zero_lab.grading import sandbox
from zero_lab.grading.framework import ExerciseFailed, diagnose
from zero_lab.grading.hidden import HIDDEN, Hidden
from zero_lab.grading.offline import offline_prefix
from zero_lab.grading.remote import HANG_HINT
from zero_lab.grading.sandbox import ANSWERS, JOB
from zero_lab.grading.submissions import exercise_code
from zero_lab.launch.paths import NOTEBOOKS

PRINTED_BYTES = 4096  # of a child's output, kept for the feedback
RANK_PREAMBLE = "import math\nimport torch\nimport torch.distributed as dist\n"


@dataclass(frozen=True)
class OnRanks:
    """How an exercise on ranks is started and judged (its check's own pieces)."""

    exercise: str  # its RankExercise in the check's module, e.g. "SHARDED_STEP"
    judge: str     # judge_<x>(name, reports, seed=None, cases=None) in that module
    hang_hint: str = ""  # the check's own hint for a launch that hangs ("": the default)


@dataclass(frozen=True)
class Exercise:
    """One graded exercise, as the batch grader runs it."""

    check: str
    notebook: str
    functions: tuple[str, ...]
    preamble: str
    timeout_s: float | None  # a kernel exercise's limit (on ranks: from its cases, `limit`)
    hidden: Hidden | None = None  # a kernel exercise's cases
    module: str = ""  # an exercise on ranks: the module its check and judge are in
    ranks: OnRanks | None = None

    def limit(self, seed: int, scale: float = 1.0) -> tuple[float, float]:
        """(the child process's limit, its launch's) in seconds, for the cases of `seed`."""
        if self.ranks is None:
            return self.timeout_s * scale, 0.0
        rank_exercise = getattr(importlib.import_module(self.module), self.ranks.exercise)
        launch = rank_exercise.limit(seed) * scale
        return launch + CHILD_MARGIN_S, launch

    def case_count(self, seed: int) -> int:
        """Points on offer: one per case of `seed`."""
        if self.hidden is not None:
            return len(self.hidden.cases(random.Random(f"{seed}:{self.check}")))
        rank_exercise = getattr(importlib.import_module(self.module), self.ranks.exercise)
        return len(rank_exercise.cases(seed))


# Exercises whose check starts ranks (remote.py), with the names of their pieces.
ON_RANKS = (
    ("check_ring_reduce_scatter", "nb02_collectives", "02_collectives.ipynb",
     ("my_ring_reduce_scatter",),
     OnRanks("RING_REDUCE_SCATTER", "judge_ring_reduce_scatter", "RING_HANG_HINT")),
    ("check_owned_range", "nb03_zero1", "03_zero1.ipynb", ("owned_range",),
     OnRanks("OWNED_RANGE", "judge_owned_range")),
    ("check_sharded_step", "nb03_zero1", "03_zero1.ipynb", ("sharded_step",),
     OnRanks("SHARDED_STEP", "judge_sharded_step")),
    ("check_bucket_hook", "nb04_zero2", "04_zero2.ipynb", ("on_grad_ready",),
     OnRanks("BUCKET_HOOK", "judge_bucket_hook")),
    ("check_materialize_release", "nb05_zero3", "05_zero3.ipynb", ("materialize", "release"),
     OnRanks("MATERIALIZE_RELEASE", "judge_materialize_release")),
    ("check_post_backward", "nb05_zero3", "05_zero3.ipynb", ("post_backward",),
     OnRanks("POST_BACKWARD", "judge_post_backward")),
)
# The child's own limit, beyond its launch's: importing torch, the stub probe, the start-up.
CHILD_MARGIN_S = 60.0


def exercises() -> list[Exercise]:
    """Every graded exercise, in course order."""
    out = [Exercise(h.check, h.notebook, h.functions, h.preamble, h.timeout_s, h)
           for h in HIDDEN.values()]
    out += [Exercise(check, nb, fns, RANK_PREAMBLE, None,
                     module=f"zero_lab.grading.{mod}", ranks=on)
            for check, mod, nb, fns, on in ON_RANKS if check not in HIDDEN]
    return sorted(out, key=lambda e: e.notebook)


@dataclass
class Graded:
    """One exercise of one student: points, status and the feedback lines."""

    student: str
    exercise: Exercise
    points: int = 0
    max_points: int = 1
    status: str = "fail"  # pass, fail, timeout, crash, missing, tampered
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    first_failing: str = ""  # the label of the first case it failed (the summary counts them)


def run_child(job: dict, timeout_s: float) -> tuple[list[dict], str, str, float]:
    """Run sandbox.py on `job` in a new session; returns (answers, how it ended, printed, s).
    How it ended: "done", "timeout" or "crash: <why>". At the limit the whole session is
    killed, so nothing it started is left."""
    with tempfile.TemporaryDirectory(prefix="zero_lab_grade_") as tmp:
        folder = Path(tmp)
        (folder / JOB).write_bytes(pickle.dumps(job))
        printed = folder / "printed.txt"
        start = time.monotonic()
        with open(printed, "wb") as out:
            child = subprocess.Popen(
                [*offline_prefix()[0], sys.executable, sandbox.__file__, str(folder)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=folder, env=_child_env())
            try:
                code = child.wait(timeout=timeout_s)
                ended = "done" if code == 0 else f"crash: {_exit_reason(code)}"
            except subprocess.TimeoutExpired:
                ended = "timeout"
            finally:
                _kill_session(child)
        seconds = time.monotonic() - start
        try:
            answers = json.loads((folder / ANSWERS).read_text())
        except (OSError, json.JSONDecodeError):
            answers = []
        with open(printed, "rb") as f:
            text = f.read(PRINTED_BYTES).decode("utf-8", "replace")
    return answers, ended, text, seconds


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_LAB_", "MASTER_"))}
    root = str(NOTEBOOKS.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _kill_session(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def grade_one(student: str, exercise: Exercise, submission: dict | None, course: dict,
              seed: int, timeout_scale: float) -> Graded:
    """Grade one exercise of one student's notebook."""
    hidden, on = exercise.hidden, exercise.ranks
    cases = hidden.cases(random.Random(f"{seed}:{exercise.check}")) if hidden else []
    g = Graded(student, exercise, max_points=len(cases) if hidden else exercise.case_count(seed))
    if submission is None:
        g.status, g.lines = "missing", [f"no readable {exercise.notebook} in the submission"]
        return g
    found = exercise_code(submission, course, exercise.functions)
    if found.status in ("missing", "tampered"):
        g.status, g.lines = found.status, [found.detail]
        return g
    job = {"preamble": exercise.preamble, "source": found.source,
           "functions": list(exercise.functions)}
    limit, launch = exercise.limit(seed, timeout_scale)
    if hidden:
        job["calls"] = [pickle.dumps((c.args, c.kwargs)) for c in cases]
    else:
        module = importlib.import_module(exercise.module)
        hint = getattr(module, on.hang_hint) if on.hang_hint else HANG_HINT
        job["ranks"] = {"module": exercise.module, "exercise": on.exercise, "seed": seed,
                        "check": exercise.check, "timeout": launch,
                        "hang_hint": hint}
    answers, ended, printed, g.seconds = run_child(job, limit)
    if hidden:
        _judge_cases(g, cases, answers)
    else:
        _judge_reports(g, answers, seed)
    if ended == "timeout":
        g.status = "timeout"
        g.lines.append(f"stopped after {limit:.0f} s (the exercise's limit); every process "
                       "it started was ended")
    elif ended != "done":
        g.status = "crash"
        g.lines.append(f"the process grading it {ended.removeprefix('crash: ')}")
    if printed.strip() and g.status != "pass":
        g.lines.append("it printed (first lines): " + " | ".join(printed.splitlines()[:5]))
    return g


def _judge_cases(g: Graded, cases: list, answers: list[dict]) -> None:
    hidden = g.exercise.hidden
    if answers and "defined" in answers[0]:
        g.lines.append(f"the cell's functions could not be defined: {answers[0]['error']}")
        return
    for i, case in enumerate(cases):
        where = f"case {i + 1}/{len(cases)} {case.describe()}"
        if i >= len(answers):
            g.lines.append(f"{where}: no answer (the run ended before it)")
            g.first_failing = g.first_failing or case.describe()
            continue
        answer = answers[i]
        if answer.get("not_implemented"):
            problem = "not implemented yet"
        elif "not_plain" in answer:
            problem = answer["not_plain"]
        elif "error" in answer:
            problem = f"raised {answer['error']}"
        else:
            got = decode(answer["value"])
            problem = diagnose(case, got, hidden.compare, hidden.wrong_answers)
        if problem is None:
            g.points += 1
        else:
            g.lines.append(f"{where}:\n{problem}" if "\n" in problem else f"{where}: {problem}")
            g.first_failing = g.first_failing or case.describe()
    g.status = "pass" if g.points == g.max_points else "fail"


def _judge_reports(g: Graded, answers: list[dict], seed: int) -> None:
    """An exercise on ranks: its judge, here, on what the ranks reported; a point per case."""
    answer = answers[0] if answers else {}
    if "defined" in answer:
        g.lines.append(f"the cell's functions could not be defined: {answer['error']}")
        return
    if answer.get("not_implemented") or "not implemented yet" in answer.get("failed", ""):
        g.lines.append("not implemented yet")
        g.first_failing = "not implemented"
        return
    if "failed" in answer:  # the launch ended in the learner's error: a raise, a hang
        g.lines.append(answer["failed"])
        g.first_failing = answer["failed"].splitlines()[0][:80]
        return
    if "reports" not in answer:
        return  # the child ended before the launch did: run_child's status says how
    judge = getattr(importlib.import_module(g.exercise.module), g.exercise.ranks.judge)
    for case in range(1, g.max_points + 1):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its ✓ line: for notebooks
                judge(g.exercise.check, answer["reports"], seed=seed, cases=[case])
            g.points += 1
        except ExerciseFailed as exc:
            g.lines.append(str(exc))
            g.first_failing = g.first_failing or f"case {case}"
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # a malformed report
            g.lines.append(f"case {case}: the ranks' report could not be read "
                           f"({type(exc).__name__}: {exc})")
            g.first_failing = g.first_failing or f"case {case}"
    g.status = "pass" if g.points == g.max_points else "fail"


def decode(value):
    """The child's tagged JSON back to plain Python values of exactly those types."""
    (kind, data), = value.items()
    if kind in ("int", "str", "bool"):
        return {"int": int, "str": str, "bool": bool}[kind](data)
    if kind == "NoneType":
        return None
    if kind == "float":
        return float(data)
    if kind in ("list", "tuple"):
        items = [decode(v) for v in data]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {decode(k): decode(v) for k, v in data}
    if kind == "tensor":
        import torch

        return torch.tensor(data["values"], dtype=getattr(torch, data["dtype"])).reshape(
            data["shape"])
    raise ValueError(f"unknown answer kind {kind!r}")


def grade(folder: Path, out: Path, seed: int = 0, jobs: int = 2, timeout_scale: float = 1.0,
          only: str | None = None, course_dir: Path = NOTEBOOKS,
          progress: Callable[[str], None] = print) -> list[Graded]:
    """Grade every student in `folder` on every exercise; write the reports into `out`."""
    from zero_lab.grading import reports
    from zero_lab.grading.submissions import students

    if jobs < 1:
        raise ValueError(f"-j must be at least 1, got {jobs}")
    chosen = [e for e in exercises() if only is None or e.notebook.startswith(only)]
    if not chosen:
        raise ValueError(f"--only {only!r} names no notebook with graded exercises")
    courses = {e.notebook: json.loads((course_dir / e.notebook).read_text()) for e in chosen}
    work = [(s, e, books.get(e.notebook)) for s, books in students(folder).items()
            for e in chosen]
    progress(f"grading {len(work)} exercises ({len({w[0] for w in work})} students x "
             f"{len(chosen)} exercises), {jobs} at a time, seed {seed}")
    done = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(grade_one, s, e, nb, courses[e.notebook], seed, timeout_scale)
                   for s, e, nb in work]
        for future in futures:
            g = future.result()
            done.append(g)
            progress(f"  [{len(done)}/{len(work)}] {g.student} {g.exercise.check}: {g.status} "
                     f"{g.points}/{g.max_points} ({g.seconds:.1f} s)")
    reports.write_all(done, out, seed)
    return done
