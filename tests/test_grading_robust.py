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


def test_a_rank_exercise_that_never_returns_fails_before_any_rank_starts():
    """It hung the kernel in the stub probe before any launch, with no message."""
    import time

    from zero_lab.grading import check_owned_range

    def owned_range(numel, world_size, rank):
        while True:
            pass

    start = time.monotonic()
    with pytest.raises(ExerciseFailed, match="did not return within 5 s"):
        check_owned_range(owned_range)
    assert time.monotonic() - start < 30


def test_a_rank_exercise_that_exits_is_the_checks_message():
    from zero_lab.grading import check_owned_range

    def owned_range(numel, world_size, rank):
        raise SystemExit(0)

    with pytest.raises(ExerciseFailed, match="raised SystemExit on a dummy call"):
        check_owned_range(owned_range)
