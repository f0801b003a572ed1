"""Reading what the ranks of a graded exercise reported, as the judges of notebooks 02-05 do.

A report comes from a process where the learner's code ran, so it is untrusted data: each
reader either returns a value of the type and size the judge expects or fails the check with
the case and the rank it came from, never crashes the judge (the batch grader judges one case
at a time from the same reports: `chosen_cases`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from zero_lab.grading.framework import NOT_IMPLEMENTED_HINT, fail


def chosen_cases(name: str, all_cases: list, cases: Sequence[int] | None) -> list[tuple]:
    """(number, case) for the 1-based case numbers asked for (None: every case)."""
    numbers = range(1, len(all_cases) + 1) if cases is None else cases
    chosen = []
    for k in numbers:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(all_cases):
            fail(name, f"there is no case {k!r}: the cases are 1 to {len(all_cases)}")
        chosen.append((k, all_cases[k - 1]))
    return chosen


def passed_cases(all_cases: list, chosen: list, noun: str = "cases") -> str:
    """"5/5 cases" when every case was judged, else "case 2 of 5"."""
    if len(chosen) == len(all_cases):
        return f"{len(chosen)}/{len(all_cases)} {noun}"
    return f"case {', '.join(str(k) for k, _ in chosen)} of {len(all_cases)}"


def unreadable(name: str, where: str, what: str) -> None:
    fail(name, f"{where}: the ranks' report could not be read ({what})",
         "the function must leave the objects it receives usable (the right types and sizes)")


@contextlib.contextmanager
def readable(name: str, where: str):
    """A report that is not what the rank script writes fails the check, with its place."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError,
            RecursionError) as exc:
        fail(name, f"{where}: the ranks' report could not be read ({type(exc).__name__}: "
                   f"{str(exc)[:80]})",
             "run the check again; if it repeats, the report was changed on its way here")


def world_size(name: str, reports: list, least: int = 1) -> int:
    """The launch's world size: one report per rank, each saying the same."""
    with readable(name, "the launch"):
        n = int(reports[0]["world_size"])
        if n < least or len(reports) != n:
            raise ValueError(f"{len(reports)} reports for {n} ranks")
    return n


def case_record(name: str, reports: list, rank: int, k: int, where: str) -> dict:
    """Rank `rank`'s record of case k (`where` names the case); a missing one fails, as does
    one with the error the function raised."""
    report = reports[rank] if rank < len(reports) else None
    results = report.get("results") if isinstance(report, dict) else None
    found = [r for r in results if isinstance(r, dict) and r.get("case") == k] \
        if isinstance(results, list) else []
    if len(found) != 1:
        fail(name, f"{where}, rank {rank}: the rank reported nothing for this case",
             "the ranks stopped before this case: look for an error or an early exit")
    record = found[0]
    if record.get("error"):
        error = record["error"]
        text = (f"{error.get('type')}: {error.get('message')}" if isinstance(error, dict)
                else str(error))
        if text.startswith("NotImplementedError"):
            fail(name, "not implemented yet", NOT_IMPLEMENTED_HINT)
        fail(name, f"{where}, rank {rank}: raised {text[:300]}")
    return record


def as_floats(name: str, where: str, value: Any, length: int, what: str) -> torch.Tensor:
    """A reported list of `length` numbers, as float64 (fails on anything else)."""
    if not isinstance(value, list) or len(value) != length or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        unreadable(name, where, f"{what}: expected {length} numbers")
    return torch.tensor(value, dtype=torch.float64)


def close(got: Any, expected: Any, rtol: float, atol: float) -> bool:
    """Every value within atol + rtol * |expected| of its expected one, NaN never, compared in
    plain Python: no torch.allclose that code run in this process could have replaced."""
    got, expected = numbers(got), numbers(expected)
    return len(got) == len(expected) and all(
        abs(g - e) <= atol + rtol * abs(e) for g, e in zip(got, expected, strict=True))


def same(got: Any, expected: Any) -> bool:
    """Exactly the same values, compared in plain Python (see `close`)."""
    return numbers(got) == numbers(expected)


def numbers(value: Any) -> list[float]:
    """A reported number, (nested) list of numbers or tensor, flat, as floats; ValueError for
    anything else (a bool is not a number)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().reshape(-1).tolist()
    if isinstance(value, list | tuple):
        return [x for v in value for x in numbers(v)]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"not a number: {str(value)[:40]!r}")
    return [float(value)]


def ints(value: Any) -> list[int]:
    """A reported shape (a list of ints); ValueError otherwise."""
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                          for v in value):
        raise ValueError(f"not a list of ints: {str(value)[:40]!r}")
    return list(value)


def as_count(name: str, where: str, value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        unreadable(name, where, f"{what}: expected a count, got {str(value)[:40]}")
    return value


def as_comm(name: str, where: str, value: Any) -> list[dict]:
    """The collectives a rank's ledger saw: [{"op", "nbytes", "in_backward"}, ...]."""
    if not isinstance(value, list):
        unreadable(name, where, "the collectives issued")
    comm = []
    for c in value:
        if not (isinstance(c, dict) and isinstance(c.get("op"), str)
                and isinstance(c.get("nbytes"), int) and isinstance(c.get("in_backward"), bool)):
            unreadable(name, where, "the collectives issued")
        comm.append({"op": c["op"], "nbytes": c["nbytes"], "in_backward": c["in_backward"]})
    return comm
