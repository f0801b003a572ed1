"""Notebook 07's graded exercise (from how many GPUs each stage fits): the notebook's solution
passes, the stub fails, each known mistake is rejected with its explanation, and the
reference agrees with the package's own memory formula at every turning point."""

from __future__ import annotations

import pytest
from test_grading import _exercises, assert_check_grades

from zero_lab import memory
from zero_lab.grading import nb07_scaling as nb07
from zero_lab.launch.paths import NOTEBOOKS

NB07 = NOTEBOOKS / "07_choosing_a_stage.ipynb"
WRONG = [
    (nb07._no_reserve, "keep the reserve free"),
    (nb07._no_activations, "the activations take room on every rank"),
    (nb07._all_sharded, "only stage 3 divides all 16 bytes by N"),
    (nb07._rounded_down, "rounded up"),
]


def test_notebook07_has_the_exercise():
    assert [e[1] for e in _exercises(NB07)] == ["check_stage_choice"]


@pytest.mark.parametrize("source, check, fn_name", _exercises(NB07),
                         ids=[e[1] for e in _exercises(NB07)])
def test_notebook07_check_accepts_reference_rejects_stub_and_mistakes(source, check, fn_name,
                                                                     capsys):
    source = "import math\n" + source
    assert_check_grades(check, source, fn_name, WRONG, capsys)


@pytest.mark.parametrize("kw", nb07.CASES, ids=lambda kw: f"{kw['n_params'] / 1e9:g}B")
def test_the_reference_is_the_first_n_the_memory_formula_fits(kw):
    """At each answer N the states + activations fit in 90% of the GPU, at N - 1 they do not
    (memory.model_state_bytes, not the reference's own closed form)."""
    room = 0.9 * kw["gpu_bytes"] - kw["activation_bytes"]
    for stage, n in nb07.reference_fewest_gpus(**kw).items():
        def held(world, stage=stage):
            return memory.model_state_bytes(kw["n_params"], stage, world)["total"]

        if n is None:
            assert held(10**6) > room, (stage, kw)  # not even on a million GPUs
        else:
            assert held(n) <= room and (n == 1 or held(n - 1) > room), (stage, n, kw)


def test_every_mistake_breaks_the_first_case():
    """run_cases stops at the first case it fails: the first must tell every mistake apart."""
    first = nb07.CASES[0]
    answers = [nb07.reference_fewest_gpus(**first)] + [m(**first) for m, _ in WRONG]
    assert len({tuple(a.items()) for a in answers}) == len(answers), answers
