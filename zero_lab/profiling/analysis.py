"""What a trace says: time per category per step, overlap, collectives, top ops, memory.

    trace = load_trace("runs/profiles/stage3/rank0.json")
    breakdown(trace.events, trace.steps[0])   # one step of one rank, in microseconds
    collectives(trace)                        # every collective, its op, label and elements
    blocking_time(trace.events)               # which collective held the training thread

How a step's time is divided (`breakdown`), with C the compute, O the optimizer regions, B
the training thread busy with communication and F every collective in flight (plus B):

    compute          |C - B - O|      ops of forward and backward (an op inside a wait, e.g.
                                      the sum of a reduce-scatter, is communication: B wins)
    optimizer        |(C - B) ∩ O|
    exposed comm     |F - (C - B)|    communication nothing else was hiding: on the critical
                                      path of this rank
    idle             |W - (C - B) - F| no op running, nothing in flight: Python, hooks, the
                                      framework, the profiler's own cost
    overlapped comm  |F ∩ (C - B)|    communication hidden behind compute (not a part of the
                                      step's sum: it runs *under* compute)

compute + optimizer + exposed + idle = the step window W. Each set is a union of intervals
(intervals.py), so nested and overlapping events count once.

Exposed communication is the time the step waited for its collectives with no compute to
do. Measured, it bounds what communication costs a step neither from below nor from above.
Hidden (overlapped) communication is not free: on shared CPU cores gloo's threads that move
the bytes take the cores the compute needs; on GPUs NCCL's kernels take SMs and memory
bandwidth; so removing the communication can save more than the exposed time. And exposed time
includes waiting for the slowest rank, which removing the communication does not save, so it
can exceed the saving (the course's stage 3 A/B: 197.9 ms exposed, 161.2 ms saved). The
projection at ideal overlap (`zero_lab.predict.projection`) is a lower bound; a measured
exposed time is not.

On a CPU (gloo) trace the figures themselves can run high. A collective is "in flight" while
gloo's threads work on it and, for the direct exchange's isend/irecv, from its posting to its
wait (gloo does not report when the bytes arrived, so a message that landed early still counts
until the wait). And only torch ops are compute: while the training thread runs Python between
ops (hooks, the optimizer's loop, the autograd engine) with gloo work in flight, that time
counts as exposed communication, though the thread was not waiting. Notebook 06 sets both
effects against each other: the exposed time beside what removing the communication saves
(`checks.check_exposed_matches_removal`). On a GPU trace F comes from NCCL's kernels: their
real time on the device.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections import defaultdict, deque
from collections.abc import Callable, Iterable

from zero_lab.profiling import intervals as iv
from zero_lab.profiling.capture import STEP
from zero_lab.profiling.marks import CONTROL, WAIT
from zero_lab.profiling.trace import Event, Trace, is_collective_mark

CATEGORIES = ("compute", "optimizer", "exposed_comm", "idle")  # they sum to the step


def recorded_steps(trace: Trace) -> list[iv.Interval]:
    """The trace's step windows; a trace without any (a profile taken without a schedule
    or "train step" marks) is refused by name rather than read as having no collectives."""
    if not trace.steps:
        where = trace.path if trace.path is not None else f"rank {trace.rank}'s trace"
        raise ValueError(f"{where}: no recorded step (no '{STEP}' or 'ProfilerStep#' mark): "
                         f"capture with zero_lab.profiling.capture, or give torch.profiler "
                         f"a schedule")
    return trace.steps


def _spans(events: Iterable[Event], kind: str, window: iv.Interval) -> list[iv.Interval]:
    """The spans of `kind` that reach into `window` (written so that a NaN end is kept, and
    refused by the interval arithmetic, rather than dropped here)."""
    lo, hi = window
    return [(e.start, e.end) for e in events
            if e.kind == kind and not (e.end <= lo or e.start >= hi)]


def categorize(events: Iterable[Event], window: iv.Interval) -> dict[str, list[iv.Interval]]:
    """The intervals of each category inside `window` (see the module docstring): compute,
    optimizer, exposed_comm, idle, and overlapped_comm (which lies under compute).
    O(n log n): a sort per category, then sweeps (intervals.py)."""
    events = list(events)
    blocked = iv.clip(_spans(events, "comm", window), window)
    busy = iv.subtract(iv.clip(_spans(events, "compute", window), window), blocked)
    optimizer = iv.clip(_spans(events, "optimizer", window), window)
    in_flight = iv.union(iv.clip(_spans(events, "in_flight", window), window) + blocked)
    return {
        "compute": iv.subtract(busy, optimizer),
        "optimizer": iv.intersect(busy, optimizer),
        "exposed_comm": iv.subtract(in_flight, busy),
        "idle": iv.subtract([window], busy + in_flight),
        "overlapped_comm": iv.intersect(in_flight, busy),
    }


def breakdown(events: Iterable[Event], window: iv.Interval) -> dict[str, float]:
    """Time in each category (microseconds) inside `window`; see the module docstring.

    Returns compute, optimizer, exposed_comm, idle (summing to the window), and
    overlapped_comm, comm (= exposed + overlapped), step (the window's length).
    """
    out = {name: iv.total(spans) for name, spans in categorize(events, window).items()}
    out["step"] = window[1] - window[0]
    out["comm"] = out["exposed_comm"] + out["overlapped_comm"]
    return out


def step_breakdowns(trace: Trace) -> list[dict[str, float]]:
    """`breakdown` of every recorded step of one rank."""
    return [breakdown(trace.events, window) for window in recorded_steps(trace)]


def mean_breakdown(traces: list[Trace]) -> dict[str, float]:
    """Every category averaged over the steps of every rank; "critical_comm_share" is the
    exposed communication's share of the step: what communication costs on the critical
    path (the rest of it was hidden under compute)."""
    rows = [b for t in traces for b in step_breakdowns(t)]
    if not rows:
        raise ValueError("no recorded step in these traces")
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    mean["critical_comm_share"] = mean["exposed_comm"] / mean["step"]
    mean["overlap"] = mean["overlapped_comm"] / mean["comm"] if mean["comm"] else 0.0
    return mean


def typical_breakdown(traces: list[Trace], pick: str = "median") -> dict[str, float]:
    """Like `mean_breakdown`, but each rank contributes one step, its median (by length) or,
    with pick="fastest", its shortest; the categories are averaged over ranks. A step slowed
    by something outside the program (another process, the machine) does not pull the
    figures; the fastest step is the closest to the program's own cost."""
    if pick not in ("median", "fastest"):
        raise ValueError(f"pick must be 'median' or 'fastest', got {pick!r}")
    picked = []
    for trace in traces:
        rows = sorted(step_breakdowns(trace), key=lambda b: b["step"])
        picked.append(rows[(len(rows) - 1) // 2] if pick == "median" else rows[0])
    out = {k: sum(r[k] for r in picked) / len(picked) for k in picked[0]}
    out["critical_comm_share"] = out["exposed_comm"] / out["step"]
    out["overlap"] = out["overlapped_comm"] / out["comm"] if out["comm"] else 0.0
    return out


# ------------------------------------------------------------------------- collectives
# torch's dispatcher ops -> the ledger's op names (zero_lab.collectives.CommLedger)
_TORCH_OPS = {
    "c10d::allreduce_": "all_reduce", "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::_reduce_scatter_base_": "reduce_scatter", "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::_allgather_base_": "all_gather", "c10d::allgather_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather", "c10d::broadcast_": "broadcast",
    "c10d::send": "send", "c10d::recv_": "recv",
}
# Which argument of each op holds the full message (as the ledger counts it)
_FULL_ARG = {"all_gather": 0, "reduce_scatter": 1}


def _outermost(events: list[Event]) -> list[Event]:
    """`events` without those that lie inside another of them on the same track (of two
    with the same span, the first is kept), in (start, -end) order. One sort, one pass:
    sorted so, an event is inside an earlier one exactly when an earlier one on its track
    ends no sooner."""
    kept, reach = [], {}  # reach: per track, the latest end of the events kept so far
    for e in sorted(events, key=lambda e: (e.start, -e.end)):
        if e.track in reach and e.end <= reach[e.track]:
            continue
        reach[e.track] = e.end
        kept.append(e)
    return kept


def _containers(events: list[Event], outers: list[Event]) -> list[list[Event]]:
    """For each of `events`, the `outers` that contain it (same track, start no later, end
    no sooner). One sort, then a sweep with a stack of open outers per track: a thread's
    marks and ops nest like its calls, so the stack holds the few that enclose the current
    time, not all of them (comparing every event with every outer made collectives()
    quadratic)."""
    found: list[list[Event]] = [[] for _ in events]
    # At the same (start, -end) an outer comes first: it contains an event with its span.
    order = sorted([(o.start, -o.end, 0, i) for i, o in enumerate(outers)]
                   + [(e.start, -e.end, 1, i) for i, e in enumerate(events)])
    open_outers: dict[str, list[Event]] = defaultdict(list)
    for start, _, is_event, i in order:
        item = events[i] if is_event else outers[i]
        stack = open_outers[item.track]
        while stack and stack[-1].end < start:  # ended before this begins
            stack.pop()
        if is_event:
            found[i] = [o for o in stack if o.end >= item.end and o is not item]
        else:
            stack.append(item)
    return found


def _step_finder(windows: list[iv.Interval]) -> Callable[[float], int | None]:
    """A function from a time to the index of the step window holding it (None outside
    them): a binary search over the (disjoint) windows."""
    order = sorted(range(len(windows)), key=lambda k: windows[k])
    starts = [windows[k][0] for k in order]

    def step_of(t: float) -> int | None:
        i = bisect_right(starts, t) - 1
        return order[i] if i >= 0 and t < windows[order[i]][1] else None
    return step_of


def _numel(dims) -> int | None:
    """Elements of a profiler "Input Dims" entry: a tensor's dims or a list of them (None
    when the trace was captured without shapes)."""
    if dims is None:
        return None
    if not dims:
        return 0
    if isinstance(dims[0], list):
        return sum(_numel(d) for d in dims)
    n = 1
    for d in dims:
        n *= d
    return n


def collectives(trace: Trace) -> list[dict]:
    """Every collective issued inside a recorded step, in order: {"op" (the ledger's name),
    "label" (zero_lab's "unit 3" / "bucket 1", or the torch op), "numel" (the full message,
    as the ledger counts it; None if the trace was captured without record_shapes),
    "start", "step"}.

    zero_lab's marks are read first; torch ops inside them are the same collective (the
    direct exchange's isend/irecv, or torch's collective) and are not counted again. Control
    messages ("check / lockstep", 24 bytes a rank; "check / buffers changed", 1 byte) are
    not data: left out, as the CommLedger leaves them out of its records. O(n log n)
    (`_containers`).
    """
    step_of = _step_finder(recorded_steps(trace))
    events = sorted(trace.events, key=lambda e: (e.start, -e.end))
    marks = [e for e in events if is_collective_mark(e.name)]
    checks = [e for e in events if e.name.startswith(CONTROL)]  # control, not data: skipped
    ops = [e for e in events if e.name in _TORCH_OPS]
    ops = [e for e, held in zip(ops, _containers(ops, checks), strict=True) if not held]
    # A torch op inside another is the same call seen twice (a dispatch mode such as the
    # CommLedger re-dispatches it): keep the outer one.
    ops = _outermost(ops)
    inner: dict[int, list[Event]] = {id(m): [] for m in marks}  # each mark's torch ops
    alone = []  # torch collectives issued without a zero_lab mark around them
    for e, held in zip(ops, _containers(ops, marks), strict=True):
        for m in held:
            inner[id(m)].append(e)
        if not held:
            alone.append(e)
    issued = []
    for m in marks:
        if (k := step_of(m.start)) is not None:
            op = m.name.split(" / ")[0].replace("-", "_")
            issued.append({"op": op, "label": m.name.split(" / ", 1)[1], "start": m.start,
                           "step": k, "numel": _mark_numel(op, inner[id(m)], trace.world_size)})
    for e in alone:
        if (k := step_of(e.start)) is not None:
            op = _TORCH_OPS[e.name]
            issued.append({"op": op, "label": e.name, "start": e.start, "step": k,
                           "numel": _op_numel(e, op)})
    return sorted(issued, key=lambda c: (c["start"], c["step"]))


def _mark_numel(op: str, inner: list[Event], world_size: int) -> int:
    """The full message of a zero_lab collective, from the torch ops that sent it: torch's
    own collective, or the direct exchange's N-1 sends of one chunk each (x N/(N-1))."""
    for e in inner:
        if _TORCH_OPS[e.name] == op:
            return _op_numel(e, op)
    sends = [_op_numel(e, "send") for e in inner if e.name == "c10d::send"]
    if any(n is None for n in sends):
        return None
    return sum(sends) * world_size // (world_size - 1) if world_size > 1 else 0


def _op_numel(e: Event, op: str) -> int | None:
    """The full message of one torch collective call (None without recorded shapes)."""
    dims = e.args.get("Input Dims")
    if dims is None:
        return None
    arg = _FULL_ARG.get(op, 0)
    return _numel(dims[arg] if arg < len(dims) else [])


def collective_counts(trace: Trace, step: int | None = None) -> dict[str, int]:
    """How many collectives of each op (in one step, or all recorded steps)."""
    counts: dict[str, int] = defaultdict(int)
    for c in collectives(trace):
        if step is None or c["step"] == step:
            counts[c["op"]] += 1
    return dict(counts)


def blocking_time(events: Iterable[Event], window: iv.Interval | None = None
                  ) -> dict[str, float]:
    """Per collective ("all-gather / unit 3"), the time the training thread spent on it:
    issuing it (its mark; gloo's isend may write the bytes right there) and waiting for it
    (its "wait / ..." marks). The collective with the most is the one to hide first.
    Reads zero_lab's marks. torch's FSDP2 marks its own phases under other names
    ("FSDP::all_gather (k)", "FSDP::post_backward_reduce", "FSDP::post_backward_rs_wait",
    "FSDP::pre_forward (k)", ...: see `fsdp_marks`); torch's DDP marks none."""
    out: dict[str, float] = defaultdict(float)
    for e in events:
        if window is not None and not window[0] <= e.start < window[1]:
            continue
        if e.name.startswith(WAIT):
            out[e.name[len(WAIT):]] += e.duration
        elif is_collective_mark(e.name):
            out[e.name] += e.duration
    return dict(out)


def fsdp_marks(trace: Trace, window: iv.Interval | None = None) -> dict[str, int]:
    """The phases torch's FSDP2 names in a trace ("FSDP::all_gather", "FSDP::pre_forward",
    "FSDP::post_backward_reduce", ...; the unit's number dropped), with how often each
    occurs: FSDP2 marks its all-gathers, reduce-scatters and their waits as zero_lab does."""
    out: dict[str, int] = defaultdict(int)
    for e in trace.events:
        if e.name.startswith("FSDP::") and (window is None or window[0] <= e.start < window[1]):
            out[re.sub(r" \(\d+\)$| for \d+$", "", e.name)] += 1
    return dict(out)


def collective_spans(trace: Trace, window: iv.Interval) -> list[tuple[str, str, float, float]]:
    """(op, label, start, end) of every collective in `window`, from issue to completion as
    far as the trace can tell: zero_lab's collectives from their mark to the end of their
    wait (marks and waits of one name pair up in order); others from gloo's spans or the
    NCCL kernels. For timelines."""
    lo, hi = window
    events = sorted((e for e in trace.events if lo <= e.start < hi), key=lambda e: e.start)
    waits: dict[str, deque[Event]] = defaultdict(deque)
    for e in events:
        if e.name.startswith(WAIT):
            waits[e.name[len(WAIT):]].append(e)
    spans = []
    for e in events:
        if is_collective_mark(e.name) and e.track == "main":
            end = waits[e.name].popleft().end if waits[e.name] else e.end
            op, label = e.name.split(" / ", 1)
            spans.append((op.replace("-", "_"), label, e.start, end))
    if spans:
        return spans
    for e in events:  # torch's collectives: gloo's worker-thread spans, or NCCL kernels
        name = e.name.lower()
        if e.kind == "in_flight" and (e.name.startswith("gloo:") or "nccl" in name):
            op = next((o for o in ("all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                   "send", "recv", "barrier")
                       if o in name.replace("allgather", "all_gather")
                       .replace("reducescatter", "reduce_scatter")
                       .replace("allreduce", "all_reduce")), "other")
            spans.append((op, "", e.start, e.end))
    return spans


# ------------------------------------------------------------------------- ops, memory
def top_ops(trace: Trace, n: int = 10, window: iv.Interval | None = None
            ) -> list[tuple[str, float, int]]:
    """The `n` ops with the most *self* time (their time minus their children's) on the
    step's timeline: [(name, microseconds, calls)]."""
    self_time: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    by_track: dict[str, list[Event]] = defaultdict(list)
    for e in trace.events:
        if e.kind in ("compute", "comm", "in_flight") and (
                window is None or window[0] <= e.start < window[1]):
            by_track[e.track].append(e)
    for track_events in by_track.values():
        stack: list[Event] = []
        for e in sorted(track_events, key=lambda e: (e.start, -e.end)):
            while stack and stack[-1].end <= e.start:
                stack.pop()
            if stack and e.end <= stack[-1].end:  # nested: not the parent's own time
                self_time[stack[-1].name] -= e.duration
            self_time[e.name] += e.duration
            calls[e.name] += 1
            stack.append(e)
    ranked = sorted(self_time.items(), key=lambda kv: -kv[1])[:n]
    return [(name, t, calls[name]) for name, t in ranked]


def memory_over_step(trace: Trace, step: int = 0) -> list[tuple[float, int]]:
    """(microseconds since the step began, bytes allocated minus at the step's start) for
    every allocator event inside the step: how the step's memory rises and falls."""
    lo, hi = recorded_steps(trace)[step]
    before = [b for t, b in trace.memory if t < lo]
    base = before[-1] if before else (trace.memory[0][1] if trace.memory else 0)
    return [(t - lo, b - base) for t, b in trace.memory if lo <= t <= hi]


def unit_of(name: str) -> str | None:
    """"all-gather / unit 3" -> "unit 3" (None for a name without one)."""
    found = re.search(r"(unit|bucket) \d+", name)
    return found.group(0) if found else None
