"""Interval arithmetic on time spans: the whole of the trace analysis rests on it.

An interval is a pair (start, end) with start <= end, in any unit (traces use microseconds).
Lists given to these functions may overlap, nest and come in any order; every result is a
*normalised* list: sorted, disjoint, with touching intervals merged. So nesting is handled
by construction: aten::linear and the aten::addmm inside it are one stretch of compute,
counted once, and two buckets in flight at the same time are one stretch of communication.
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def _normalised(intervals: Iterable[Interval], argument: str) -> list[Interval]:
    """`union`, refusing an interval that ends before it starts or is not a number (NaN
    compares false with everything, so it would otherwise cover nothing, silently); the
    message names the caller's `argument`. O(n log n): one sort, one pass."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if not start <= end:
            problem = ("an interval must not end before it starts" if end < start else
                       "an interval's ends must be numbers")
            raise ValueError(f"{argument}: {problem}: ({start}, {end})")
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        elif end > start:  # empty intervals cover nothing
            out.append([start, end])
    return [(s, e) for s, e in out]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The time covered by at least one interval, as sorted disjoint intervals."""
    return _normalised(intervals, "intervals")


def total(intervals: Iterable[Interval]) -> float:
    """How long the intervals cover (overlaps counted once)."""
    return sum(e - s for s, e in union(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time covered by both `a` and `b`: one sweep over both sorted lists."""
    return _intersect(_normalised(a, "a"), _normalised(b, "b"))


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time covered by `a` and not by `b`: one sweep over both sorted lists, so
    O(n log n) for the sorts (comparing every interval of `a` with every one of `b` made
    a step of 8,000 events take seconds)."""
    a, b = _normalised(a, "a"), _normalised(b, "b")
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:  # pieces of `b` that end before this one
            j += 1
        # Cut out every piece of `b` that starts inside [start, end). Only the last of them
        # can reach into the next interval of `a`, so `j` stays where it is.
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """The parts of `intervals` inside `window`."""
    return _intersect(_normalised(intervals, "intervals"), _normalised([window], "window"))
