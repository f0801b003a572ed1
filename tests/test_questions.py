"""Predict-then-observe questions (zero_lab/course/questions.py): the verdict's arithmetic, the
widget's commit (clicked here through ipywidgets' own click, no browser), and bad input named.

Mutants: `verdict` calling every number right (the 3x-off case fails), Commit not locking the
answer (the second click's change shows), a choice outside the list accepted."""

from __future__ import annotations

import pytest

from zero_lab.course.questions import CLOSE, WIDTH, Question, ask, verdict


def test_a_choice_is_right_or_not_and_says_why():
    assert verdict("the same", "the same", "one all-reduce")[0].endswith("· right")
    lines = verdict("less", "the same", "one all-reduce")
    assert lines == ["your prediction: less · measured: the same · not this time",
                     "why: one all-reduce"]


def test_a_number_is_right_within_a_quarter_and_otherwise_says_how_far_off():
    assert verdict(110.0, 100.0, "w", number=True)[0].endswith("right (within 25%)")
    assert verdict(100 * (1 + CLOSE) + 1, 100.0, "w", number=True)[0].endswith("off by 1.26x")
    assert verdict(300.0, 100.0, "w", number=True)[0].endswith("off by 3x")


def test_no_commit_still_shows_the_measured_answer():
    assert verdict(None, 2.5e6, "w", number=True)[0] == \
        "measured: 2.5e+06 (no prediction committed)"
    assert verdict(None, "more", "w")[0] == "measured: more (no prediction committed)"


def test_long_lines_wrap_within_the_printed_width():
    lines = verdict("a", "a", "because " * 60)
    assert len(lines) > 2 and all(len(line) <= WIDTH for line in lines)


def test_the_commit_button_locks_the_first_answer(capsys):
    q = Question("which?", ["less", "the same", "more"])
    box = q.widget()
    choices, (button, status) = box.children[1], box.children[2].children
    button.click()  # nothing picked: nothing committed
    assert q.committed is None and "pick one first" in status.value
    choices.value = "more"
    button.click()
    assert q.committed == "more" and choices.disabled and button.disabled
    choices.value = "less"  # the measured answer seen, an answer changed: too late
    q.commit("less")
    assert q.committed == "more"
    q.reveal("the same", "a reduce-scatter and an all-gather")
    out = capsys.readouterr().out
    assert "your prediction: more · measured: the same · not this time" in out


def test_a_number_box_commits_a_number():
    q = Question("how many MiB?", number=True)
    box = q.widget()
    box.children[1].value = 42.0
    box.children[2].children[0].click()
    assert q.committed == 42.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="either choices or number=True"):
        Question("x")
    with pytest.raises(ValueError, match="either choices or number=True"):
        Question("x", ["a"], number=True)
    with pytest.raises(ValueError, match="repeat"):
        Question("x", ["a", "a"])
    q = Question("x", ["a", "b"])
    with pytest.raises(ValueError, match="'c' is not one of the choices"):
        q.commit("c")
    with pytest.raises(ValueError, match="measured answer 'c' is not one of the choices"):
        q.reveal("c", "w")
    with pytest.raises(ValueError, match="finite"):
        Question("x", number=True).commit(float("nan"))


def test_outside_a_notebook_the_question_is_printed(capsys):
    q = ask("Stage 3 holds what share of stage 0's states at N = 8?", ["1/8", "1/4", "all"])
    assert q.choices == ["1/8", "1/4", "all"]
    assert capsys.readouterr().out.startswith("Predict: Stage 3 holds")
