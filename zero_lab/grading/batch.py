"""`python -m zero_lab.grading grade SUBMISSIONS --out DIR`: grade a folder of submissions.

    make grade SUBMISSIONS=path/to/submitted [SEED=...] [JOBS=2]

Each exercise of each student runs in a fresh process of its own (sandbox.py), never in a
student's kernel, with its `def`s as last defined above its check cell and the imports,
helpers and constants of earlier cells they use (submissions.py; a tampered exercise cell is
graded once `accept`ed), after the imports the notebook gave it. Two kinds:

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

Containment (jail.py, child.py): each child in a bubblewrap sandbox of its own (the course
read-only, only its scratch folder writable, its own PID namespace, loopback only, a user id
and a cgroup of its own where the machine allows); without one the grader refuses unless
`--unsafe-no-sandbox`. The bytes the ranks sent on that loopback, counted by the kernel
(wire.py), must back their reports, else none of their cases is judged. The instructor's
seed never goes there: the kernel exercises get drawn inputs, the ranks a seed hashed from it
per exercise (`case_seed`). A time limit per exercise (`--timeout` scales each one's). Each
result written as it ends (results_log.py; `--resume`), then grades.csv, feedback/, Gradescope's
results.json and summary.md, in DIR.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import pickle
import random
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from zero_lab.grading import jail, results_log, wire
from zero_lab.grading.child import allow_children, run_child, stop_children
from zero_lab.grading.framework import ExerciseFailed, diagnose
from zero_lab.grading.hidden import HIDDEN, Hidden
from zero_lab.grading.remote import HANG_HINT
from zero_lab.grading.submissions import accept_key, accepted_for, exercise_code, read_accepts
from zero_lab.launch.paths import NOTEBOOKS

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
        launch = rank_exercise.limit(case_seed(seed, self.check)) * scale
        return launch + CHILD_MARGIN_S, launch

    def case_count(self, seed: int) -> int:
        """Points on offer: one per case of `seed`."""
        if self.hidden is not None:
            return len(self.hidden.cases(random.Random(f"{seed}:{self.check}")))
        rank_exercise = getattr(importlib.import_module(self.module), self.ranks.exercise)
        return len(rank_exercise.cases(case_seed(seed, self.check)))


def case_seed(seed: int, check: str) -> int:
    """The seed an exercise on ranks draws its cases from: the instructor's seed never goes
    where learner code runs (a rank's command line is in /proc). This one, hashed from it,
    gives only this exercise's cases, which its ranks are handed anyway."""
    digest = hashlib.sha256(f"zero_lab grading:{seed}:{check}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


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


def grade_one(student: str, exercise: Exercise, submission: dict | None, course: dict,
              seed: int, timeout_scale: float, sandboxed: bool = True,
              accepted: bool = False) -> Graded:
    """Grade one exercise of one student's notebook. Whatever the answers are, this returns:
    one that cannot be judged (an int too large for a float, an answers file the learner's
    code wrote itself) fails its exercise with the reason, never the run."""
    try:
        return _grade_one(student, exercise, submission, course, seed, timeout_scale,
                          sandboxed, accepted)
    except Exception as exc:  # noqa: BLE001 - the run goes on; the message says why
        g = Graded(student, exercise, max_points=0, status="crash")
        g.lines = [f"the grader could not judge this exercise's answers ({type(exc).__name__}: "
                   f"{str(exc)[:200]})"]
        with contextlib.suppress(Exception):
            g.max_points = exercise.case_count(seed)
        return g


def _grade_one(student: str, exercise: Exercise, submission: dict | None, course: dict,
               seed: int, timeout_scale: float, sandboxed: bool, accepted: bool) -> Graded:
    hidden, on = exercise.hidden, exercise.ranks
    cases = hidden.cases(random.Random(f"{seed}:{exercise.check}")) if hidden else []
    g = Graded(student, exercise, max_points=len(cases) if hidden else exercise.case_count(seed))
    if submission is None:
        g.status, g.lines = "missing", [f"no readable {exercise.notebook} in the submission"]
        return g
    found = exercise_code(submission, course, exercise.functions, exercise.check, accepted)
    if found.status in ("missing", "tampered"):
        g.status, g.lines = found.status, [found.detail]
        if found.status == "tampered":
            g.lines.append(f"(the instructor may accept it: grade --accept "
                           f"{accept_key(student, exercise)})")
        return g
    job = {"preamble": exercise.preamble, "source": found.source,
           "functions": list(exercise.functions)}
    limit, launch = exercise.limit(seed, timeout_scale)
    if hidden:
        job["calls"] = [pickle.dumps((c.args, c.kwargs)) for c in cases]
    else:
        module = importlib.import_module(exercise.module)
        hint = getattr(module, on.hang_hint) if on.hang_hint else HANG_HINT
        job["ranks"] = {"module": exercise.module, "exercise": on.exercise,
                        "seed": case_seed(seed, exercise.check),
                        "check": exercise.check, "timeout": launch,
                        "hang_hint": hint}
    answers, ended, printed, g.seconds, sent = run_child(job, limit, sandboxed)
    if hidden:
        _judge_cases(g, cases, answers)
    else:
        _judge_reports(g, answers, case_seed(seed, exercise.check), sent, sandboxed)
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
        if i >= len(answers) or not isinstance(answers[i], dict):
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
            try:
                got = decode(answer["value"])
                problem = diagnose(case, got, hidden.compare, hidden.wrong_answers)
            except (TypeError, ValueError, KeyError, AttributeError, OverflowError,
                    RecursionError) as exc:
                problem = (f"the answer could not be compared ({type(exc).__name__}: "
                           f"{str(exc)[:120]})")
        if problem is None:
            g.points += 1
        else:
            g.lines.append(f"{where}:\n{problem}" if "\n" in problem else f"{where}: {problem}")
            g.first_failing = g.first_failing or case.describe()
    g.status = "pass" if g.points == g.max_points else "fail"


def _judge_reports(g: Graded, answers: list[dict], seed: int, sent: int | None = None,
                   sandboxed: bool = False) -> None:
    """Its judge, here, on what the ranks reported, a point per case, once `sent` backs them."""
    answer = answers[0] if answers and isinstance(answers[0], dict) else {}
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
    if problem := wire.gate(g.exercise.check, answer["reports"], sent, sandboxed):
        g.lines, g.first_failing = [*g.lines, problem], "bytes on the wire"  # none judged
        return
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


class NoSandbox(RuntimeError):
    """This machine cannot sandbox learner code, and the grader was not told to go on."""


def grade(folder: Path | None, out: Path, seed: int = 0, jobs: int = 2,
          timeout_scale: float = 1.0, only: str | None = None, course_dir: Path = NOTEBOOKS,
          progress: Callable[[str], None] = print, unsafe: bool = False,
          resume: bool = False, accept: Iterable[str] = ()) -> list[Graded]:
    """Grade every student in `folder` on every exercise; write the reports into `out`.

    Each graded exercise is written to `out/results/` as it ends (results_log.py); `resume`
    takes the run's submissions, seed and notebooks from `out` and grades only what is not
    there yet. `accept`: "student/notebook/exercise" keys (read_accepts) whose tampered
    exercise cell the instructor accepted: graded from the student's definitions. Without a
    sandbox (jail.py) this refuses (NoSandbox) unless `unsafe`."""
    from zero_lab.grading import reports
    from zero_lab.grading.submissions import students

    if resume:
        run = results_log.params(out)
        # The cases and who is graded are the run's; the time limits may be set anew.
        folder, seed, only = Path(run["submissions"]), run["seed"], run["only"]
    accepted = read_accepts(accept, [])
    if jobs < 1:
        raise ValueError(f"-j must be at least 1, got {jobs}")
    sandboxed, why = jail.available()
    if not sandboxed and not unsafe:
        raise NoSandbox(f"no sandbox for learner code on this machine: {why}. Install "
                        f"bubblewrap (apt-get install bubblewrap), or pass {jail.UNSAFE_FLAG} "
                        "to grade with learner code able to reach this user's files, "
                        "processes and network")
    note = f"{jail.note(unsafe)} {wire.note(sandboxed)}"
    chosen = [e for e in exercises() if only is None or e.notebook.startswith(only)]
    if not chosen:
        raise ValueError(f"--only {only!r} names no notebook with graded exercises")
    courses = {e.notebook: json.loads((course_dir / e.notebook).read_text()) for e in chosen}
    work = [(s, e, books.get(e.notebook)) for s, books in students(folder).items()
            for e in chosen]
    if not resume:  # a new run into a folder replaces its results (an --accept is regraded)
        for old in (out / results_log.FOLDER).glob("*.jsonl"):
            old.unlink()
        results_log.start(out, {"submissions": str(Path(folder).absolute()), "seed": seed,
                                "only": only, "timeout_scale": timeout_scale})
    unknown = sorted("/".join(key) for key in accepted
                     if not any(accepted_for({key}, s, e) for s, e, _ in work))
    if unknown:
        progress(f"--accept names no exercise of this run (ignored): {', '.join(unknown)}")
    by_check = {e.check: e for e in chosen}
    done = [_from_record(r, by_check) for r in results_log.read(out) if r["check"] in by_check]
    finished = {(g.student, g.exercise.check) for g in done}
    todo = [w for w in work if (w[0], w[1].check) not in finished]
    progress(f"{note.split(':')[0]}\ngrading {len(todo)} exercises "
             f"({len({w[0] for w in work})} students x {len(chosen)} exercises), "
             f"{jobs} at a time" + (f"; {len(finished)} exercises already graded" if resume
                                    else ""))
    allow_children()
    with _interrupts_stop_children(), ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(grade_one, s, e, nb, courses[e.notebook], seed, timeout_scale,
                               sandboxed, accepted_for(accepted, s, e)) for s, e, nb in todo]
        try:
            for future in futures:
                g = future.result()
                results_log.append(out, g)
                done.append(g)
                progress(f"  [{len(done)}/{len(work)}] {g.student} {g.exercise.check}: "
                         f"{g.status} {g.points}/{g.max_points} ({g.seconds:.1f} s)")
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            stop_children()
            raise
    reports.write_all(done, out, seed, note)
    return done


def _from_record(record: dict, by_check: dict) -> Graded:
    return Graded(str(record["student"]), by_check[record["check"]], int(record["points"]),
                  int(record["max"]), str(record["status"]), list(record.get("lines", [])),
                  float(record.get("seconds", 0.0)), str(record.get("first_failing", "")))


@contextlib.contextmanager
def _interrupts_stop_children():
    """SIGTERM becomes KeyboardInterrupt while grading (the main thread only can set it), so
    both end every child at once instead of leaving them to their limits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
