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


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The time covered by at least one interval, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"an interval must not end before it starts: ({start}, {end})")
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        elif end > start:  # empty intervals cover nothing
            out.append([start, end])
    return [(s, e) for s, e in out]


def total(intervals: Iterable[Interval]) -> float:
    """How long the intervals cover (overlaps counted once)."""
    return sum(e - s for s, e in union(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The time covered by both `a` and `b`."""
    a, b = union(a), union(b)
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
    """The time covered by `a` and not by `b`."""
    out, b = [], union(b)
    for start, end in union(a):
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
        if start < end:
            out.append((start, end))
    return out


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """The parts of `intervals` inside `window`."""
    return intersect(intervals, [window])
