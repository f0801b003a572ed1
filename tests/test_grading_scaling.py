"""Notebook 07's graded exercise: the notebook's solution passes, the stub fails, each
known mistake is rejected with its explanation, and any valid choice is accepted."""

from __future__ import annotations

import pytest
from test_grading import _exercises, assert_check_grades

from zero_lab.grading import nb07_scaling as nb07
from zero_lab.paths import NOTEBOOKS

NB07 = NOTEBOOKS / "07_choosing_a_stage.ipynb"
WRONG = [
    (nb07._forgets_activations, "the activations need memory too"),
    (nb07._ignores_time, "over the bound"),
    (nb07._stage0_reflex, "stage 0 replicates everything"),
]


def test_notebook07_has_the_exercise():
    assert [e[1] for e in _exercises(NB07)] == ["check_stage_choice"]


@pytest.mark.parametrize("source, check, fn_name", _exercises(NB07),
                         ids=[e[1] for e in _exercises(NB07)])
def test_notebook07_check_accepts_reference_rejects_stub_and_mistakes(source, check, fn_name,
                                                                     capsys):
    source = "from zero_lab import projection\n" + source
    assert_check_grades(check, source, fn_name, WRONG, capsys)


def test_any_choice_that_meets_the_constraints_is_accepted():
    kw = nb07.CASES[1]  # 7B on 80 GiB GPUs over 100 GbE, N in {4, 8, 16}
    valid = nb07.AnyValidChoice(kw)
    assert nb07.reference_choice(**kw) == (2, 8)
    assert valid.accepts((2, 8)) and valid.accepts((1, 16))  # more ranks: fine too
    assert not valid.accepts((3, 4))       # fits, but its projected step is over the bound
    assert not valid.accepts((2, 32))      # not a world size on offer
    assert not valid.accepts("stage 3")    # not a (stage, world size) pair
    assert "any (stage, world_size)" in repr(valid)


def test_every_mistake_breaks_at_least_one_case():
    for mistake, _ in WRONG:
        assert any(not nb07.AnyValidChoice(kw).accepts(mistake(**kw)) for kw in nb07.CASES)
