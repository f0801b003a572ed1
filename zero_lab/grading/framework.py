"""The grading framework: hidden cases, the comparison, and the learner-facing failure.

A check either prints two short lines, what passed and what the learner just showed

    ✓ check_<name>: 6/6 hidden cases pass
      You showed: you can price each collective in bytes one rank sends on a ring

or raises `ExerciseFailed`, whose message names the failing case, the expected and the received
value, and a hint. In Jupyter the failure shows as that message alone, never as a traceback.

How to write a check (for course authors; put it in the module of its notebook)
-------------------------------------------------------------------------------
    def check_ring_allreduce(fn: Callable) -> None:
        \"\"\"Notebook 02: the learner's ring all-reduce on lists of floats.\"\"\"
        run_cases("check_ring_allreduce", fn, [
            Case(args=([[1.0], [2.0]],), expected=[[3.0], [3.0]],
                 hint="every rank must end with the sum of all ranks' inputs"),
            ...
        ], shows="you can sum N ranks' tensors by passing chunks around a ring")

- `Case(args, kwargs, expected, hint, label)`: `expected` is computed by the reference
  implementation (import it from the package; never paste numbers), `hint` says what a
  learner who fails *this* case most likely got wrong.
- `run_cases` compares with `same()` (exact for ints and strings, relative 1e-6 for floats,
  key by key for dicts, element by element for lists, equal shapes then `allclose` for
  tensors); pass
  `compare=` for anything else, or `wrong_answers=` to recognise known mistakes by value.
- A check that needs more than input -> output (e.g. run the learner's code on several
  ranks, `remote.py`) builds its own logic and ends with `passed(name, detail, shows)` or
  `fail(...)`; a notebook's claim that each run's ledger is its formula, `check_ledger_matches`.
- `shows` is one line (a string literal: tests/test_grading.py reads them all) saying what the
  learner can now do that they could not before, not how many cases passed.
- Export it from `zero_lab/grading/__init__.py`. Tests call every `check_*` with the
  reference (must pass), a stub that raises NotImplementedError (must fail) and at least one
  plausible wrong answer.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# What a learner whose function is still the student copy's stub should do.
NOT_IMPLEMENTED_HINT = "replace the `raise NotImplementedError` line"
# The mistake every sharded exercise can make: N ranks' gradients added, never divided by N.
SUMMED_NOT_AVERAGED_HINT = ("the gradients were summed, not averaged: reduce with "
                            "op=dist.ReduceOp.AVG (or divide by the world size)")


class ExerciseFailed(AssertionError):
    """A check rejected the learner's function. The message says why and how to fix it."""

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing a traceback: the learner sees only the
        # message, which already names the case, expected vs got, and a hint.
        return ["\x1b[31m✗ " + str(self) + "\x1b[0m"]


@dataclass
class Case:
    """One hidden test case: call fn(*args, **kwargs) and compare with `expected`."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    expected: Any = None
    hint: str = ""
    label: str = ""

    def describe(self) -> str:
        if self.label:
            return self.label
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"({', '.join(parts)})"


def same(expected: Any, got: Any, rel: float = 1e-6) -> bool:
    """True when `got` equals `expected`: exact ints/strings, floats to `rel`, recursively."""
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and set(expected) <= set(got)
            and all(same(v, got[k], rel) for k, v in expected.items())
        )
    if isinstance(expected, (list, tuple)):
        return (
            isinstance(got, (list, tuple))
            and len(got) == len(expected)
            and all(same(e, g, rel) for e, g in zip(expected, got, strict=True))
        )
    if hasattr(expected, "shape") and hasattr(expected, "dtype"):  # a tensor or an array
        return _same_tensor(expected, got, rel)
    if isinstance(expected, bool) or isinstance(expected, str):
        return got == expected
    if isinstance(expected, (int, float)):
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            # accept numpy / torch scalars, which carry .item()
            if not hasattr(got, "item"):
                return False
            got = got.item()
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        return math.isclose(float(got), float(expected), rel_tol=rel, abs_tol=0.0)
    return got == expected


def _same_tensor(expected: Any, got: Any, rel: float) -> bool:
    """Same shape, then the values: exact for integers and bools, allclose (rtol=rel) else.

    Shapes first because torch.allclose broadcasts: a (1,) or (3, 1) answer full of the
    right value would pass for a (3,) one. Integer and float answers compare by value, as
    numbers do in `same`; a bool tensor is not a count. Lists and arrays become tensors.
    """
    import torch

    try:
        want, have = torch.as_tensor(expected), torch.as_tensor(got)
        if want.shape != have.shape or (want.dtype == torch.bool) != (have.dtype == torch.bool):
            return False
        common = torch.promote_types(want.dtype, have.dtype)
        want, have = want.to(common), have.to(device=want.device, dtype=common)
        if common.is_floating_point or common.is_complex:
            return torch.allclose(have, want, rtol=rel)
        return torch.equal(have, want)
    except (TypeError, RuntimeError, ValueError):
        return False


def largest_difference(expected: Any, got: Any) -> tuple[float, float] | None:
    """(absolute, relative) largest difference between two numbers or two equal-length lists of
    numbers, or None when they are not that. Relative is to |expected| (where it is not 0)."""
    def numbers(x: Any) -> list[float] | None:
        items = x if isinstance(x, (list, tuple)) else [x]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items):
            return None
        return [float(v) for v in items]

    want, have = numbers(expected), numbers(got)
    if not want or have is None or len(want) != len(have):
        return None
    gaps = [abs(w - h) for w, h in zip(want, have, strict=True)]
    relative = [g / abs(w) for g, w in zip(gaps, want, strict=True) if w != 0]
    return max(gaps), max(relative, default=math.inf if max(gaps) else 0.0)


def describe_difference(expected: Any, got: Any) -> str:
    """'0.12 (relative 0.2)', so that 1.53099610836 vs 1.53099610828 reads as what it is."""
    gap = largest_difference(expected, got)
    return "" if gap is None else f"{gap[0]:.2g} (relative {gap[1]:.2g})"


def first_values_differ(expected: list, got: list) -> str:
    """The lines a rank check shows under a wrong value: the first values expected and got,
    and the largest difference among them (so 1.53099610836 vs 1.53099610828 reads as what
    it is)."""
    text = f"\n  expected (first values): {expected}\n  got:                     {got}"
    gap = describe_difference(expected, got)
    return text + (f"\n  largest difference in these values: {gap}" if gap else "")


def fail(name: str, message: str, hint: str = "") -> None:
    """Stop the check with a learner-facing message (raises ExerciseFailed, no chained cause)."""
    text = f"{name}: {message}"
    if hint:
        text += f"\n  hint: {hint}"
    raise ExerciseFailed(text) from None


SHOWED = "  You showed: "  # the second line's start, under the check's name


def passed(name: str, detail: str, shows: str) -> None:
    """Print what every passing check ends with: what passed, then what the learner showed."""
    print(f"✓ {name}: {detail}\n{SHOWED}{shows}")


def run_cases(
    name: str,
    fn: Callable,
    cases: Sequence[Case],
    compare: Callable[[Any, Any], bool] = same,
    wrong_answers: Sequence[tuple[Callable[..., Any], str]] = (),
    *,
    shows: str,
) -> None:
    """Run `fn` on every hidden case; print a pass line or raise ExerciseFailed on the first miss.

    `shows` is the line printed under the pass line: what the learner just showed.
    `wrong_answers` lists (mistaken_function, explanation) pairs: when the learner's value
    equals what a known mistake would return on that case, its explanation replaces the
    case's hint (all of them, if several mistakes give the same value).
    An `fn` wrapped in `typed` that returns an answer of the wrong type fails with what its
    type check says, instead of comparing values.
    """
    if not callable(fn):
        fail(name, f"expected a function, got {type(fn).__name__}", "pass the function itself")
    for i, case in enumerate(cases, start=1):
        where = f"case {i}/{len(cases)} {case.describe()}"
        # A copy of the inputs for each call: a function that changes its arguments (empties
        # a list) changes nothing the next case, the next check or the reference sees.
        args, kwargs = copy.deepcopy((case.args, case.kwargs))
        try:
            with capped_output(), time_limit(CASE_SECONDS):
                got = fn(*args, **kwargs)
        except NotImplementedError:
            fail(name, "not implemented yet", NOT_IMPLEMENTED_HINT)
        except WrongType as wrong:
            fail(name, f"your function {wrong.args[0]}", wrong.args[1])
        except TooSlow:
            fail(name, f"{where} did not return within {CASE_SECONDS:.0f} s",
                 "the reference takes milliseconds: look for a loop that never ends")
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # one line, no traceback
            fail(name, f"{where} raised {type(exc).__name__}: {exc}", case.hint)
        problem = diagnose(case, got, compare, wrong_answers)
        if problem is not None:
            detail, _, diagnosis = problem.partition("\n  hint: ")
            fail(name, f"{where}\n{detail}", diagnosis)
    passed(name, f"{len(cases)}/{len(cases)} hidden cases pass", shows)


class WrongType(BaseException):
    """(what is wrong, hint): the learner's answer is not of the type the exercise returns.
    Not an Exception, so that a learner's `except Exception:` lets it through (as TooSlow)."""


def typed(fn: Callable, problem_of: Callable[[Any], tuple[str, str] | None]) -> Callable:
    """`fn`, raising WrongType when `problem_of(its answer)` says what is wrong with it."""
    if not callable(fn):
        return fn  # run_cases says what it got

    def call(*args, **kwargs):
        got = fn(*args, **kwargs)
        problem = problem_of(got)
        if problem is not None:
            raise WrongType(*problem)
        return got

    return call


def check_ledger_matches(runs: Sequence, measured: Callable[[Any], Any],
                         expected: Callable[[Any], Any], name: Callable[[Any], str]) -> int:
    """A notebook's claim that each run's ledger is its formula: `measured(run)` equals
    `expected(run)` exactly, or AssertionError names the run (`name(run)`), what the ledger
    counted and what the formula gives. Returns how many runs were checked."""
    for run in runs:
        got, want = measured(run), expected(run)
        assert got == want, f"{name(run)}: the ledger counted {got}, the formula gives {want}"
    return len(runs)


CASE_SECONDS = 10.0  # a case of an exercise in the kernel: the references take milliseconds


class TooSlow(BaseException):
    """A learner's call ran past its `time_limit`. Not an Exception, so that a learner's
    `except Exception:` does not swallow it; the timer fires again every second anyway."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise TooSlow in this (main) thread after `seconds` (a `while True` hung the kernel with
    no message); in another thread, where no signal can reach it, no limit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TooSlow

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


PRINTED_CHARS = 2000  # what a learner's function may print per call, in the notebook


class _Capped(io.TextIOBase):
    """A stream that passes the first `limit` characters on to `to` and counts the rest."""

    def __init__(self, to, limit: int) -> None:
        self.to, self.left, self.dropped = to, limit, 0

    def write(self, text: str) -> int:
        shown = text[:max(self.left, 0)]
        if shown:
            self.to.write(shown)
        self.left -= len(shown)
        self.dropped += len(text) - len(shown)
        return len(text)

    def flush(self) -> None:
        self.to.flush()


@contextlib.contextmanager
def capped_output(limit: int = PRINTED_CHARS):
    """What the learner's function prints, cut after `limit` characters (stdout and stderr
    together): a debugging print in a loop made an 80 MB notebook. The cut is said."""
    out = sys.stdout
    capped = _Capped(out, limit)
    with contextlib.redirect_stdout(capped), contextlib.redirect_stderr(capped):
        try:
            yield
        finally:
            if capped.dropped:
                out.write(f"\n... ({capped.dropped:,} more characters printed, not shown)\n")


def short_repr(value: Any, limit: int = 600) -> str:
    """repr(value), cut in the middle past `limit` characters (a message stays readable)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]} ...({len(text) - limit:,} characters)... {text[-limit // 2:]}"


def diagnose(case: Case, got: Any, compare: Callable[[Any, Any], bool] = same,
             wrong_answers: Sequence[tuple[Callable[..., Any], str]] = ()) -> str | None:
    """None when `got` is right for `case`; else what a learner reads: expected, got, the
    difference, and a hint (a known mistake's explanation when `got` is what it gives)."""
    if compare(case.expected, got):
        return None
    known = []  # every known mistake that produces exactly this wrong value
    for mistake, explanation in wrong_answers:
        try:
            if compare(mistake(*case.args, **case.kwargs), got):
                known.append(explanation)
        except Exception:  # a mistake model that does not apply to this case
            continue
    diagnosis = "\n  or: ".join(known) if known else case.hint
    detail = f"  expected: {short_repr(case.expected)}\n  got:      {short_repr(got)}"
    if isinstance(case.expected, float) or isinstance(got, float):
        gap = describe_difference(case.expected, got)
        detail += f"\n  difference: {gap}" if gap else ""
    return f"{detail}\n  hint: {diagnosis}" if diagnosis else detail
