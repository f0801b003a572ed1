"""Notebook 06's graded exercises: the notebook's own solutions pass, the student stubs fail,
and every known mistake is rejected with its explanation."""

from __future__ import annotations

import pytest
from test_grading import _exercises, assert_check_grades

from zero_lab.grading import nb06_profiler as nb06
from zero_lab.launch.paths import NOTEBOOKS

NB06 = NOTEBOOKS / "06_profiler_analysis.ipynb"

WRONG = {
    "check_exposed_communication": [
        (nb06._summed_durations, "you added durations"),
        (nb06._no_window, "inside the step's window"),
        (nb06._all_comm, "that is all the communication"),
        (nb06._step_minus_compute, "idle time included"),
    ],
    "check_most_exposed_unit": [
        (nb06._longest_single_wait, "single longest wait"),
        (nb06._waits_only, "issuing the all-gather holds the thread too"),
        (nb06._longest_in_flight, "time in flight"),
        (nb06._any_collective, "count the all-gathers only"),
    ],
}


def test_notebook06_has_the_two_exercises():
    assert [e[1] for e in _exercises(NB06)] == ["check_exposed_communication",
                                                "check_most_exposed_unit"]


@pytest.mark.parametrize("source, check, fn_name", _exercises(NB06),
                         ids=[e[1] for e in _exercises(NB06)])
def test_notebook06_check_accepts_reference_rejects_stub_and_mistakes(source, check, fn_name,
                                                                     capsys):
    # the notebook's imports the solutions use
    source = ("from zero_lab.profiling import intervals as iv\n"
              "from zero_lab.profiling.analysis import unit_of\n" + source)
    assert_check_grades(check, source, fn_name, WRONG[check], capsys)


def test_every_case_tells_the_mistakes_apart_from_the_answer():
    """A case where a mistake gives the reference's value could not catch it."""
    for seed in range(5):
        events, window = nb06._exposed_case(seed)
        answer = nb06.reference_exposed(events, window)
        for mistake, _ in WRONG["check_exposed_communication"]:
            assert abs(mistake(events, window) - answer) > 1e-3, (seed, mistake.__name__)
    for seed in range(6):
        events = nb06._unit_case(seed)
        answer = nb06.reference_most_exposed_unit(events)
        for mistake, _ in WRONG["check_most_exposed_unit"]:
            assert mistake(events) != answer, (seed, mistake.__name__)
