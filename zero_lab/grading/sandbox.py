"""The child process the batch grader runs one learner's exercise in: call, encode, nothing else.

    python zero_lab/grading/sandbox.py JOB_DIR

(Run by its path, not with -m: importing the package `zero_lab.grading` would load every
check, and torch, into each child before the learner's code even starts; this file imports
only the standard library.)

JOB_DIR/job.pickle, written by the grader (batch.py), holds the exercise's preamble (the
imports the notebook gave the function), the learner's function definitions (taken from the
submission with the AST: only the `def`s, never the rest of the cell), and either the calls
to make (a kernel exercise: one pickled (args, kwargs) per hidden case) or the exercise to
start on ranks (its ranks report what the learner's function produced; this process passes
the reports back unjudged, and the grader's parent judges them). The grader pickles; this
process never pickles anything back: it writes JOB_DIR/answers.json, one entry per call,
rewritten after every call, so a case that hangs or kills the process still leaves the
cases before it graded.

What the learner's code can reach here, it can change; so nothing here decides a verdict.
Each answer is the returned value encoded with exact types (`encode`: an int subclass whose
`__eq__` always says True is refused, not compared), and the grader's parent process
compares it with the expected value it computed itself, where no learner code runs. Each
call gets its own unpickled arguments, so a function that empties its input list changes
nothing for the next case. Limits (set before the learner's code is defined): address space,
file size (what it prints goes to files the grader reads only the start of), CPU time; in its
bubblewrap sandbox (jail.py) it first becomes a user id of its own (a root grader's children)
and caps its tasks, and removes the job file, so nothing of the job is left to read.
"""

from __future__ import annotations

import json
import pickle
import resource
import sys
import traceback
from pathlib import Path

ANSWERS = "answers.json"
JOB = "job.pickle"
MEMORY_BYTES = 4 * 2**30  # address space: a runaway allocation fails here, not on the host
FILE_BYTES = 16 * 2**20  # any file it writes, its printed output included
PLAIN = (int, float, str, bool, type(None))
INT_BITS = 4096  # ~1233 digits: far beyond any answer, well within what json writes


class NotPlain(TypeError):
    """The learner's function returned something the grader does not compare."""


def encode(value, depth: int = 0):
    """`value` as JSON with its exact type: {"int": 3}, {"tuple": [...]}, {"dict": [[k, v], ...]},
    {"tensor": {"dtype", "shape", "values"}}. Subclasses are refused (NotPlain)."""
    if depth > 20:
        raise NotPlain("a value nested more than 20 deep")
    kind = type(value)
    if kind in PLAIN:
        if kind is float and value != value:
            return {"float": "nan"}
        if kind is float and value in (float("inf"), float("-inf")):
            return {"float": "inf" if value > 0 else "-inf"}
        if kind is int and value.bit_length() > INT_BITS:  # json refuses 4300+ digits
            raise NotPlain(f"returned an int of {value.bit_length()} bits; no answer here "
                           f"needs more than {INT_BITS}")
        return {kind.__name__: value}
    if kind in (list, tuple):
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    torch = sys.modules.get("torch")
    if torch is not None and kind in (torch.Tensor, torch.nn.Parameter):
        t = value.detach().cpu()
        return {"tensor": {"dtype": str(t.dtype).removeprefix("torch."),
                           "shape": list(t.shape), "values": t.reshape(-1).tolist()}}
    raise NotPlain(f"returned a {kind.__module__}.{kind.__qualname__}; the exercise returns "
                   "plain numbers, strings, lists, tuples, dicts or tensors")


def _drop(job: dict) -> None:
    """In a sandbox (jail.py): become the child's own user id, which drops every capability,
    and cap its tasks (RLIMIT_NPROC counts that id's alone, never root's)."""
    import os

    uid = job.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if job.get("tasks"):
        resource.setrlimit(resource.RLIMIT_NPROC, (job["tasks"], job["tasks"]))


def _limit() -> None:
    for which, amount in ((resource.RLIMIT_AS, MEMORY_BYTES),
                          (resource.RLIMIT_FSIZE, FILE_BYTES)):
        soft, hard = resource.getrlimit(which)
        cap = amount if hard == resource.RLIM_INFINITY else min(amount, hard)
        resource.setrlimit(which, (cap, hard))


def _define(job: dict, folder: Path) -> dict:
    """The preamble, then the learner's `def`s, in a fresh namespace. The defs are compiled
    from a file of their own, so `inspect.getsource` finds them (an exercise on ranks sends
    its functions' source to the ranks)."""
    namespace: dict = {"__name__": "__exercise__"}
    exec(compile(job["preamble"], "<preamble>", "exec"), namespace)
    cell = folder / "exercise_cell.py"
    cell.write_text(job["source"])
    exec(compile(job["source"], str(cell), "exec"), namespace)
    return namespace


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _on_ranks(spec: dict, functions: list) -> dict:
    """Start the exercise's ranks (remote.run_exercise) and return their reports, unjudged:
    {"reports": [rank 0's, ...]}. A launch that ends in the learner's error (a raise on a rank,
    a hang, a stub) is {"failed": the message the notebook's check shows}."""
    import importlib

    from zero_lab.grading import remote  # torch and the launcher: only for these exercises
    from zero_lab.grading.framework import ExerciseFailed

    exercise = getattr(importlib.import_module(spec["module"]), spec["exercise"])
    try:
        reports = remote.run_exercise(spec["check"], exercise, functions, spec["timeout"],
                                      spec["hang_hint"], seed=spec["seed"])
    except ExerciseFailed as exc:
        return {"failed": str(exc)[:4000]}
    except NotImplementedError:
        return {"not_implemented": True}
    return {"reports": reports}


def main(job_dir: str) -> int:
    folder = Path(job_dir)
    job = pickle.loads((folder / JOB).read_bytes())
    out = folder / ANSWERS
    answers: list[dict] = []

    def save() -> None:
        out.write_text(json.dumps(answers))

    _drop(job)
    (folder / JOB).unlink()  # nothing of the job's is left for the learner's code to read
    _limit()
    try:
        namespace = _define(job, folder)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt too: the cell does not run
        answers.append({"defined": False, "error": _one_line(exc)})
        save()
        return 0
    functions = [namespace.get(name) for name in job["functions"]]
    missing = [n for n, f in zip(job["functions"], functions, strict=True) if not callable(f)]
    if missing:
        answers.append({"defined": False, "error": f"no function {', '.join(missing)}"})
        save()
        return 0
    if job.get("ranks"):  # an exercise on ranks: launch them, bring back what they report
        answers.append(_on_ranks(job["ranks"], functions))
        save()
        return 0
    for blob in job["calls"]:
        args, kwargs = pickle.loads(blob)  # fresh inputs for every call
        try:
            answers.append({"value": encode(functions[0](*args, **kwargs))})
        except NotImplementedError:
            answers.append({"not_implemented": True})
        except NotPlain as exc:
            answers.append({"not_plain": str(exc)})
        except BaseException as exc:  # SystemExit, KeyboardInterrupt: this case failed
            answers.append({"error": _one_line(exc),
                            "where": traceback.format_exc(limit=-1).splitlines()[-3:]})
        save()
    return 0


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # run by path: the grading folder is not a place to import from
    raise SystemExit(main(sys.argv[1]))
