"""The in-notebook checks hold against a learner's function that changes its inputs or ends the
process (issue 37): each call gets its own copy of the case's inputs, and SystemExit or
KeyboardInterrupt become the check's one-line message, not a traceback."""

from __future__ import annotations

import pytest

from zero_lab.grading.framework import Case, ExerciseFailed, run_cases


def total(xs: list) -> int:
    return sum(xs)


def cases() -> list[Case]:
    return [Case(args=([1, 2, 3],), expected=6), Case(args=([4, 5],), expected=9)]


def test_a_function_that_empties_its_input_corrupts_no_case():
    shared = cases()

    def sums_then_empties(xs):
        answer = sum(xs)
        xs.clear()
        return answer

    run_cases("check_total", sums_then_empties, shared, shows="you can add")
    run_cases("check_total", total, shared, shows="you can add")  # the cases are intact
    assert shared[0].args == ([1, 2, 3],)


@pytest.mark.parametrize("ending", [SystemExit, KeyboardInterrupt])
def test_an_exit_is_the_checks_message(ending):
    def ends(xs):
        raise ending("bye")

    with pytest.raises(ExerciseFailed, match=f"raised {ending.__name__}: bye"):
        run_cases("check_total", ends, cases(), shows="you can add")
