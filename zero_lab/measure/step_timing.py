"""How the course times training steps: back to back, as training runs them.

A step of a stage that hides its communication returns with work still in flight:
`overlap_param_gather` (stages 1-2) leaves the all-gathers of the updated parameters for the
next forward to wait for. Whatever runs between two timed steps lets that work progress
untimed. Until stop 31 `make bench` put a barrier before every timed step, and the barrier
is where the overlapped stages' all-gathers went. Measured on 2 gloo ranks, 6 x
Linear(1024), best of 6 rounds: stage 2 took 59.6 ms a step with a barrier between steps
and 64.4 ms back to back; the plain stage (gathering inside `opt.step()`) 63.5 and 63.4.
The 8% "gain" of overlapping was the barrier's.

So a block of steps is timed like this: the ranks start together once (`start_together`, a
barrier); the steps then run back to back, each timed from its start to the next one's
start; the last step also waits for what it left in flight (`settle`), inside its time.
The block as a whole pays for all its communication and leaves nothing to run under
whatever is timed next. A step in the middle of the block is a steady-state step: it
inherits the previous step's work in flight and leaves its own to the next. The first step
inherits nothing and the last pays for its own, so a block's mean step is the steady state
too (for a median, use blocks of three steps or more).

`CpuMeter` counts the CPU work a block costs this process, every thread of it: the
compute, and gloo's threads moving the bytes. On a CPU machine that is what hiding cannot
hide: R ranks on C cores keep at most C cores busy, so a step takes at least (the ranks'
CPU seconds per step, summed) / C, however well its communication overlaps its compute
(`make bench` reports this floor beside every time).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def time_back_to_back(
    steps: int,
    run_step: Callable[[int, Callable[[], None]], None],
    *,
    start_together: Callable[[], None],
    settle: Callable[[], None],
    now: Callable[[], float] = time.perf_counter,
) -> list[list[float]]:
    """Run `steps` steps back to back; per step [total, phase 1, phase 2, ...] in seconds.

    `run_step(i, lap)` runs step i and calls `lap()` at the end of each of its phases
    (forward, backward, ...). `settle()` finishes whatever the last step left in flight
    (e.g. `model.wait_for_params`); its time counts in the last phase of the last step.
    `now` is the clock (on a GPU, one that synchronizes first).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rows: list[list[float]] = []
    start_together()
    marks = [now()]  # this step's start, then the end of each of its phases

    def lap() -> None:
        marks.append(now())

    for i in range(steps):
        run_step(i, lap)
        if i == steps - 1:
            settle()
            marks[-1] = now()
        phases = [b - a for a, b in zip(marks, marks[1:], strict=False)]
        rows.append([marks[-1] - marks[0], *phases])
        del marks[:-1]  # the next step starts where this one ended: nothing between
    return rows


class CpuMeter:
    """CPU seconds this process spends inside a `with` block, all its threads together.

    Waiting costs none (a gloo barrier or receive sleeps; measured: a rank waiting 1 s for
    its peer used 3 ms of CPU), so on a CPU machine a step's CPU time is its work: the
    compute and the communication's copies, whichever thread ran them."""

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.clock = clock
        self.seconds = 0.0

    def __enter__(self) -> CpuMeter:
        self._start = self.clock()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = self.clock() - self._start


def training_step(loss_of: Callable[[int], object], optimizer) -> Callable:
    """`run_step` for `time_back_to_back`: step i computes `loss_of(i)` (the forward), then
    backward, `optimizer.step()` and `optimizer.zero_grad()`, a lap after each."""
    def run_step(i: int, lap: Callable[[], None]) -> None:
        loss = loss_of(i)
        lap()
        loss.backward()
        lap()
        optimizer.step()
        lap()
        optimizer.zero_grad()
        lap()
    return run_step


def settle_in_flight(model) -> None:
    """Finish the communication a step of `model` may leave in flight: a zero_lab stage's
    overlapped all-gathers (`model.wait_for_params`). Systems without it have none."""
    getattr(model, "wait_for_params", lambda: None)()
