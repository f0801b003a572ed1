"""Running the learner's functions on N ranks: the grader's half of a graded launch.

Notebooks 02 to 05 grade code that only means something inside a process group. Each such
exercise is a `RankExercise`: the rank script in zero_lab/workers/ that runs it, its name
there, and the dummy arguments a stub is tried on. `run_on_ranks` reads each function's
source, fails a stub at once (starting no rank), writes the sources to one file, starts the
script on 3 gloo ranks and returns what every rank reported, per "exercise:fn[,fn]" key. A
learner's exception on any rank, or a hang, becomes an ExerciseFailed naming the case; a rank
that died (a signal, a native abort) is named with its signal and its last words on stderr.
A launch that failed only after every rank reported every key is judged on those reports.
The ranks report facts; each check's judge (in its notebook's module) turns them into a
verdict and a hint. The verdict quotes what the learner needs, so the launch's logs are
removed once it is given, unless it sends the learner to them.
"""

from __future__ import annotations

import inspect
import json
import shutil
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from zero_lab.grading import hang
from zero_lab.grading.framework import (
    NOT_IMPLEMENTED_HINT,
    ExerciseFailed,
    TooSlow,
    fail,
    time_limit,
)
from zero_lab.launch import LaunchError, LaunchTimeout, torchrun
from zero_lab.launch.capacity import CapacityWarning
from zero_lab.launch.paths import WORKERS

RANKS = 3  # enough for a middle rank, a remainder and a ring that wraps around
# What a timeout most often means; a check passes its own hint when it knows better.
HANG_HINT = ("a rank is waiting in a collective that another rank never called (every rank "
             "must issue the same collectives, in the same order, with the same sizes), or "
             "your function takes far longer than it should: the reference finishes every "
             "case in a few seconds")


START_S = 60.0  # 3 ranks importing torch and meeting, on a busy 2-core laptop
CASE_S = 10.0   # each case; the reference needs well under a second (as CASE_SECONDS in the kernel)
STACKS_BEFORE_S = 3.0  # the ranks write where they are this long before the limit (hang.py)


@dataclass(frozen=True)
class RankExercise:
    """An exercise graded on ranks: `script` in zero_lab/workers/ runs it under `name`.

    `probe()` returns fresh dummy arguments for one call outside any process group: a stub
    raises NotImplementedError on them at once, a real attempt fails at its first collective.
    `cases(seed)` lists the cases the script runs for a seed (zero_lab/course/rank_cases/):
    the launch's time limit is derived from their number.
    """

    script: str
    name: str
    probe: Callable[[], tuple]
    cases: Callable[[int | None], Sequence]

    def limit(self, seed: int | None = None) -> float:
        """Seconds a launch of this exercise gets: START_S, then CASE_S per case."""
        return START_S + CASE_S * len(self.cases(seed))


def exercise_key(exercise: RankExercise, fns: Sequence[Callable]) -> str:
    """The key a rank reports one run under: "exercise:function[,function]"."""
    return f"{exercise.name}:{','.join(fn.__name__ for fn in fns)}"


def function_source(check: str, fn: Callable) -> str:
    """The source of a function defined with `def` (in a notebook cell or a module)."""
    if not callable(fn):
        fail(check, f"expected a function, got {type(fn).__name__}", "pass the function itself")
    if getattr(fn, "__name__", "<lambda>") == "<lambda>":
        fail(check, "pass a function defined with `def`, not a lambda",
             "the ranks run your function from its source, so it needs a name")
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        fail(check, "cannot read the source of your function",
             "define it with `def` in a notebook cell (or a .py file) and pass it")
    raise AssertionError("unreachable")


PROBE_SECONDS = 5.0  # a dummy call outside any process group returns or fails at once


def is_stub(fn: Callable, args: tuple, check: str = "check") -> bool:
    """Does fn raise NotImplementedError at once? (A stub fails without starting any rank.)
    A call that does not return within PROBE_SECONDS, or ends the process, fails the check
    here, before any rank starts (it hung the kernel before, with no message)."""
    try:
        with time_limit(PROBE_SECONDS):
            fn(*args)
    except NotImplementedError:
        return True
    except TooSlow:
        fail(check, f"{fn.__name__}() did not return within {PROBE_SECONDS:.0f} s on a dummy "
                    "call outside any process group, where it should fail at its first "
                    "collective", "look for a loop that never ends before the first collective")
    except (SystemExit, KeyboardInterrupt) as exc:
        fail(check, f"{fn.__name__}() raised {type(exc).__name__} on a dummy call",
             "an exercise returns or raises; it never ends the process")
    except Exception:  # noqa: BLE001 - expected: no process group in this process
        return False
    return False


def run_on_ranks(check: str, runs: Sequence[tuple[RankExercise, Sequence[Callable]]],
                 timeout: float | None = None, hang_hint: str = HANG_HINT,
                 nproc: int = RANKS, seed: int | None = None) -> dict[str, list[dict]]:
    """Run each (exercise, functions), all in one launch of their script on `nproc` ranks.

    Returns {exercise_key: [the report of rank 0, rank 1, ...]}. Several runs share a launch
    (the tests grade a reference and its wrong answers together); they must share a script.
    `seed` picks the cases: None, the notebook's; an int, the batch grader's (rank_cases/).
    `timeout` (seconds) defaults to the sum of the exercises' limits for those cases.
    """
    scripts = {exercise.script for exercise, _ in runs}
    if len(scripts) != 1:
        raise ValueError(f"one launch runs one script, got {sorted(scripts)}")
    sources = {}
    for exercise, fns in runs:
        for fn in fns:
            sources[fn.__name__] = function_source(check, fn)
            if is_stub(fn, exercise.probe(), check):
                fail(check, "not implemented yet", NOT_IMPLEMENTED_HINT)
    keys = [exercise_key(exercise, fns) for exercise, fns in runs]
    if timeout is None:
        cases = sum(len(exercise.cases(seed)) for exercise, _ in runs)
        timeout = sum(exercise.limit(seed) for exercise, _ in runs)
        limit = (f"{timeout:.0f} s ({START_S:.0f} s to start, {CASE_S:.0f} s for each of its "
                 f"{cases} cases)")
    else:
        limit = f"{timeout:.0f} s"

    # The ranks take seconds to start and run the cases: say so, or the cell looks stuck.
    names = " and ".join(f"{fn.__name__}()" for _, fns in runs for fn in fns)
    print(f"{check}: checking your {names} on {nproc} ranks (5-10 s)...", flush=True)
    with tempfile.TemporaryDirectory(prefix=f"zero_lab-{check}-") as folder:
        learner = Path(folder) / "learner.py"
        learner.write_text("\n\n".join(sources.values()), encoding="utf-8")
        stacks_at = ["--stacks-at", f"{time.time() + max(timeout - STACKS_BEFORE_S, 1.0):.1f}"]
        try:
            with warnings.catch_warnings():  # the checks time nothing: 3 ranks on 2 cores do
                warnings.simplefilter("ignore", CapacityWarning)
                result = torchrun(WORKERS / scripts.pop(), nproc=nproc, timeout=timeout,
                                  backend="gloo", stream=False,
                                  args=[str(learner), *seed_args(seed), *stacks_at, *keys])
        except LaunchError as exc:
            reports = judge_failed_launch(check, exc, nproc, keys, limit, hang_hint,
                                          learner.read_text(encoding="utf-8"))
        else:
            reports = result.ranks
    return {key: [rank_report[key] for rank_report in reports] for key in keys}


def judge_failed_launch(check: str, exc: LaunchError, nproc: int, keys: Sequence[str],
                        limit: str, hang_hint: str, learner_source: str = "") -> list[dict]:
    """The reports of a launch that failed after its work was done, or the learner's verdict.

    Either way the launch's logs are removed, unless the verdict sends the learner to them.
    """
    keep = False
    try:
        if isinstance(exc, LaunchTimeout):
            timed_out(check, exc.run_dir, nproc, keys, limit, hang_hint, learner_source)
        reports = complete_reports(exc.run_dir, nproc, keys)
        if reports is None:
            explain_rank_error(check, exc, nproc)  # raises ExerciseFailed
        return reports
    except ExerciseFailed as verdict:
        keep = exc.run_dir is not None and str(exc.run_dir) in str(verdict)
        raise
    finally:
        if exc.run_dir is not None and not keep:
            shutil.rmtree(exc.run_dir, ignore_errors=True)


def timed_out(check: str, run_dir: Path | None, nproc: int, keys: Sequence[str], limit: str,
              hang_hint: str, learner_source: str) -> None:
    """The verdict on a launch stopped at its limit: which ranks were still running, where each
    was (hang.py), and the advice that fits: a collective mismatch only when every rank that
    said where it was waited in a collective."""
    late = late_ranks(run_dir, nproc, keys)
    found = hang.places(run_dir, late, learner_source)
    if not late:
        who = ""
    elif len(late) == nproc:
        who = " (every rank was still running)"
    else:
        who = f" (still running: rank {', '.join(map(str, late))}; the others had finished)"
    where = "".join(f"\n  {place.says()}" for place in found)
    hint = hang_hint if not found or hang.all_waiting(found) else hang.running_hint(found)
    fail(check, f"the {nproc} ranks did not finish within {limit}{who}{where}", hint)


def late_ranks(run_dir: Path | None, nproc: int, keys: Sequence[str]) -> list[int]:
    """The ranks that had not reported every key when the launch was stopped."""
    if run_dir is None:
        return []
    late = []
    for rank in range(nproc):
        path = run_dir / f"rank{rank}.json"
        try:
            done = all(key in json.loads(path.read_text()) for key in keys)
        except (OSError, ValueError):
            done = False
        if not done:
            late.append(rank)
    return late


def complete_reports(run_dir: Path | None, nproc: int, keys: Sequence[str]) -> list[dict] | None:
    """Every rank's report if each of the `nproc` ranks reported every key and none raised.

    A launch can fail after its work is done: a rank killed on its way out, once its report
    was on disk. Such reports are whole, so the check judges them instead of failing the
    learner. None when any rank raised (it left `rank{r}.error.json`) or misses a key.
    """
    if run_dir is None:
        return None
    reports = []
    for rank in range(nproc):
        path = run_dir / f"rank{rank}.json"
        if (run_dir / f"rank{rank}.error.json").exists() or not path.exists():
            return None
        data = json.loads(path.read_text())
        if not all(key in data for key in keys):
            return None
        reports.append(data)
    return reports


def seed_args(seed: int | None) -> list[str]:
    """The rank script's arguments that pick the cases (zero_lab.course.exercises)."""
    return [] if seed is None else ["--seed", str(int(seed))]


def run_exercise(check: str, exercise: RankExercise, fns: Sequence[Callable],
                 timeout: float | None = None, hang_hint: str = HANG_HINT,
                 seed: int | None = None) -> list[dict]:
    """The per-rank reports of one exercise, in a launch of its own (what a check does)."""
    runs = run_on_ranks(check, [(exercise, fns)], timeout, hang_hint, seed=seed)
    return runs[exercise_key(exercise, fns)]


def explain_rank_error(check: str, exc: LaunchError, nproc: int) -> None:
    """Turn a failed launch into the learner's own error, with the case it failed on.

    Reads the ranks' reports: records with an "error" (a `zero_lab.course.exercises.learner_error`)
    under "results", at the top level or under any key, or a top-level "error" record.
    """
    for rank in range(nproc):
        path = Path(exc.run_dir or ".") / f"rank{rank}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        blocks = [data] + [v for v in data.values() if isinstance(v, dict)]
        records = [r for b in blocks for r in b.get("results", []) if isinstance(r, dict)]
        if isinstance(data.get("error"), dict):
            records.append({**data["error"], "error": data["error"]})
        for record in records:
            error = record.get("error")
            if not error:
                continue
            if error["type"] == "NotImplementedError":
                fail(check, "not implemented yet", NOT_IMPLEMENTED_HINT)
            hint = ("your function runs on its own on each rank: use only its arguments, "
                    "torch, dist, nn and math (import anything else inside it)"
                    if error["type"] == "NameError" else "")
            during = f" in {error['during']}" if error.get("during") else ""
            where = "\n".join(error.get("where", "").strip().splitlines()[-6:])
            fail(check, f"case {record.get('case', '?')} ({record.get('label', '')}) raised"
                        f"{during} on rank {rank}: {error['type']}: {error['message']}"
                        + (f"\n{where}" if where else ""), hint)
    if "NotImplementedError" in str(exc):
        fail(check, "not implemented yet", NOT_IMPLEMENTED_HINT)
    if exc.rank is not None:  # the launcher knows which rank failed first, and how
        tail = [ln for ln in exc.tail.splitlines() if ln.strip()][-6:]
        fail(check, exc.cause,
             "its last lines:\n" + "\n".join(f"    {ln}" for ln in tail) if tail
             else f"rank {exc.rank} wrote nothing to its stderr")
    # No rank recorded an error and torchrun named none that died: torchrun itself failed
    # (a rendezvous that timed out, ...). Its last words, not the listing of every log.
    log = Path(exc.run_dir or ".") / "launcher.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    said = [ln.strip() for ln in lines if ln.strip("=- \t")]  # not its rules (=====)
    fail(check, f"the launch failed, and no rank recorded an error: {exc.cause}"
                + (f"\n  torchrun's last words: {said[-1]}" if said else ""),
         f"nothing points at your function; run the check again. torchrun's log: {log}")


def comm_summary(comm: list[dict]) -> str:
    """What a rank sent, for a message: "reduce_scatter of 96 bytes, all_gather of 96 bytes"."""
    if not comm:
        return "no collectives"
    return ", ".join(f"{c['op']} of {c['nbytes']} bytes" for c in comm)
