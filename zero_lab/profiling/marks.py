"""The names zero_lab's stages give their work in a profiler trace, and how they set them.

A trace of `shard(model, stage)` reads like the lesson:

    forward / unit 3            stage 3: unit 3's forward (from its pre- to its post-hook)
    backward / unit 3           stage 3: unit 3's backward (first gradient in -> last out)
    all-gather / unit 3         issuing a collective (for an async one, only the posting)
    reduce-scatter / bucket 1   ... stages 1-2 name flat groups "bucket j", stage 3 "unit k"
    all-reduce / bucket 0
    wait / all-gather / unit 3  blocked until that collective is complete
    optimizer step              ShardedOptimizer.step(): the update and, at stages 1-2,
                                the all-gather of the updated slices
    zero_grad
    check / lockstep            the ranks compare where they are, once a step (lockstep.py),
                                and at stage 3 before each unit of the first forward
    check / buffers changed     ... and whether a buffer changed on any rank (buffers.py):
                                control, not data; not counted among the collectives

`mark(name)` is `torch.profiler.record_function(name)` when a profiler is recording and a
shared do-nothing context otherwise: a record_function costs ~5 us even when nobody listens,
the check ~0.05 us (measured in tests/test_profiling.py), so the stages can mark every
collective without slowing the benchmark.
"""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.profiler import record_function

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "broadcast")  # issue marks
WAIT = "wait / "  # prefix of the marks that wait for a collective issued earlier
OPTIMIZER_STEP = "optimizer step"
ZERO_GRAD = "zero_grad"
CONTROL = "check / "  # prefix of the marks of control messages (not data)
LOCKSTEP_CHECK = CONTROL + "lockstep"
BUFFERS_CHECK = CONTROL + "buffers changed"

_NOTHING = contextlib.nullcontext()


def profiling() -> bool:
    """Is a torch profiler recording on this process right now?"""
    return torch._C._autograd._profiler_enabled()


def mark(name: str) -> contextlib.AbstractContextManager:
    """`with mark("all-gather / unit 3"):` names the block in a trace; free when not profiling."""
    return record_function(name) if profiling() else _NOTHING


class UnitSpans:
    """Stage 3's marks of each unit's forward and backward (a listener of zero3.Zero3): a mark
    opened at "forward" (its pre-hook) and closed at "forward done" (its post-hook), and at
    "backward" (the first gradient reaching its outputs) and "backward done" (its last
    gradient in). Opens nothing unless a profiler is recording."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], record_function] = {}

    def __call__(self, what: str, u: int) -> None:
        phase, _, done = what.partition(" ")
        if phase not in ("forward", "backward"):
            return
        record = self._open.pop((phase, u), None)  # done, or left open by a step that raised
        if record is not None:
            record.__exit__(None, None, None)
        if not done and profiling():
            record = self._open[phase, u] = record_function(f"{phase} / unit {u}")
            record.__enter__()


class MarkedWork:
    """A collective's handle whose `wait()` shows in the trace as "wait / <its name>"."""

    def __init__(self, work, name: str) -> None:
        self._work, self.name = work, name

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> bool:
        with mark(WAIT + self.name):
            return self._work.wait()


def collective(name: str, issue, async_op: bool):
    """Run `issue()` (which starts a collective) under the mark `name`; an async handle comes
    back wrapped so that waiting on it is marked too (only while profiling)."""
    if not profiling():
        return issue()
    with record_function(name):
        work = issue()
    return MarkedWork(work, name) if async_op and work is not None else work
