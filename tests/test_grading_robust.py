"""The in-notebook checks hold against a learner's function that changes its inputs or ends the
process (issue 37): each call gets its own copy of the case's inputs, and SystemExit or
KeyboardInterrupt become the check's one-line message, not a traceback; what it prints and
what it returns are cut to a readable size; a launch stopped at its limit names the ranks still
running."""

from __future__ import annotations

import json

import pytest

import zero_lab.grading as grading
from zero_lab.grading import remote
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


def test_a_function_that_prints_without_end_is_cut_and_the_cut_is_said(capsys):
    def chatty(params, grads, master, states, n_states):
        for _ in range(100_000):
            print("debugging " * 10)
        raise NotImplementedError

    with pytest.raises(ExerciseFailed, match="not implemented"):
        grading.check_bytes_per_param(chatty)
    shown = capsys.readouterr().out
    assert len(shown) < 3000 and "more characters printed, not shown" in shown


def test_a_huge_wrong_value_is_shown_cut():
    def huge(params, grads, master, states, n_states):
        return {"params": "x" * 1_000_000, "grads": 0, "optimizer": 0, "total": 0}

    with pytest.raises(ExerciseFailed) as failed:
        grading.check_bytes_per_param(huge)
    assert len(str(failed.value)) < 3000 and "characters)..." in str(failed.value)


def test_a_timeout_names_the_ranks_still_running(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps({"x:f": {}}))
    (tmp_path / "rank2.json").write_text(json.dumps({"x:f": {}}))
    assert remote.late_ranks(tmp_path, 3, ["x:f"]) == [1]
    assert remote.late_ranks(tmp_path / "none", 3, ["x:f"]) == [0, 1, 2]


@pytest.mark.parametrize("body", ["while True:\n        pass",
                                  "while True:\n        try:\n            pass\n"
                                  "        except BaseException:\n            pass"])
def test_a_kernel_exercise_that_never_returns_is_the_checks_message(body, monkeypatch):
    from zero_lab.grading import framework

    monkeypatch.setattr(framework, "CASE_SECONDS", 0.5)
    namespace: dict = {}
    exec(f"def spin(xs):\n    {body}\n", namespace)
    with pytest.raises(ExerciseFailed, match="did not return within"):
        run_cases("check_total", namespace["spin"], cases(), shows="-")
