"""Notebook 02's ring figure is drawn from what the ranks recorded (issue 50, part 2): each
rank starts with 2^rank in every chunk, so the bits of a chunk's value name whose
contributions it holds. Pure Python: the records here are what a correct run reports."""

from __future__ import annotations

import pytest

from zero_lab.course.plots import recorded_ring_states, scheduled_ring_states


def records_of_a_run(n: int, skip_step: int | None = None) -> list[dict]:
    """Each rank's `ring_steps` as collectives_demo.py reports them, built from the schedule;
    `skip_step`: a run whose step of that index moved nothing (the mutant)."""
    ranks = [{"ring_steps": []} for _ in range(n)]
    previous = None
    for i, (title, state, _) in enumerate(scheduled_ring_states(n)):
        if skip_step is not None and i == skip_step:
            state = previous
        phase, step = ("start", 0) if i == 0 else (title.rsplit(" step ", 1)[0],
                                                     int(title.rsplit(" ", 1)[1]))
        for r in range(n):
            chunks = [float(sum(2**b for b in state[r][c])) for c in range(n)]
            ranks[r]["ring_steps"].append({"phase": phase, "step": step, "chunks": chunks})
        previous = state
    return ranks


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_recorded_values_decode_to_the_schedules_states(n):
    assert list(recorded_ring_states(records_of_a_run(n))) == list(scheduled_ring_states(n))


def test_a_run_that_skips_a_step_differs_from_the_schedule():
    """Mutant: step 2 of the reduce-scatter moved nothing; the notebook's assert fails it."""
    assert list(recorded_ring_states(records_of_a_run(4, skip_step=2))) != list(
        scheduled_ring_states(4))
