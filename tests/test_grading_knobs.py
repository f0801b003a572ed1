"""Notebook 08's graded exercises: the notebook's solutions pass, the stubs fail, and each
typical wrong answer is rejected with its own explanation; the references are the formulas
the live runs are held to."""

from __future__ import annotations

import pytest
from test_grading import _exercises, assert_check_grades

from zero_lab.grading import ExerciseFailed
from zero_lab.grading import nb08_knobs as nb08
from zero_lab.launch.paths import NOTEBOOKS
from zero_lab.predict.knobs import accumulation_messages
from zero_lab.predict.projection import hybrid_bytes_per_step

NB08 = NOTEBOOKS / "08_knobs.ipynb"
EXERCISES = _exercises(NB08)


def _k_times_at_stage1(stage, psi_bytes, k, grad_accumulation="sharded"):
    """The mistake the brief names: stage 1 sending k times (no no_sync)."""
    out = nb08.reference_accumulation_bytes(stage, psi_bytes, k, grad_accumulation)
    if stage == 1:
        out["reduce_scatter"] = k * psi_bytes
    return out


def _extra_op(stage, psi_bytes, k, grad_accumulation="sharded"):
    """Right bytes, plus an all-reduce no stage 1-3 sends."""
    return {**nb08.reference_accumulation_bytes(stage, psi_bytes, k, grad_accumulation),
            "all_reduce": psi_bytes}


WRONG = {
    "check_accumulation_bytes": [
        (_k_times_at_stage1, "that is the loop without no_sync"),
        (nb08._sends_every_backward, "that is the loop without no_sync"),
        (nb08._stage2_sends_once_anyway, "stage 2 'sharded' cannot wait"),
        (nb08._stage3_gathers_once, "two all-gathers per micro-batch"),
        (nb08._stage3_gathers_once_per_step, "that is reshard_after_forward=False"),
        (nb08._stage1_all_gathers_every_micro_batch, "once per optimizer step"),
        (_extra_op, "check_accumulation_bytes: case"),
    ],
    "check_hsdp_bytes": [
        (nb08._full_gradient_across, "the whole gradient all-reduced across groups"),
        (nb08._one_gather_per_unit, "one all-gather per unit"),
        (nb08._padded_to_world, "padded to a multiple of N"),
        (nb08._not_padded, "not padded"),
        (nb08._flat_stage3, "that is flat stage 3"),
    ],
}


def test_notebook08_has_the_two_exercises():
    assert [e[1] for e in EXERCISES] == ["check_accumulation_bytes", "check_hsdp_bytes"]


@pytest.mark.parametrize("source, check, fn_name", EXERCISES, ids=[e[1] for e in EXERCISES])
def test_notebook08_checks_accept_reference_reject_stub_and_mistakes(source, check, fn_name,
                                                                     capsys):
    assert_check_grades(check, source, fn_name, WRONG[check], capsys)


def test_references_are_the_formulas_the_live_runs_meet():
    """The exercises' expected values come from predict/knobs.py and projection, the functions
    notebook 08's launches are checked against byte for byte."""
    for stage, psi, k, mode in nb08.ACCUMULATION_CASES:
        messages = accumulation_messages(stage, psi, k, 2, grad_accumulation=mode)
        assert nb08.reference_accumulation_bytes(stage, psi, k, mode) == {
            op: m["nbytes"] for op, m in messages.items()}
    # the numbers notebook 08's text states: stage 2 "sharded" at k = 8 sends 9Ψ of volume
    sharded = nb08.reference_accumulation_bytes(2, 1, 8, "sharded")
    assert sharded == {"reduce_scatter": 8, "all_gather": 1}
    assert nb08.reference_accumulation_bytes(1, 1, 8) == {"reduce_scatter": 1, "all_gather": 1}
    assert nb08.reference_hsdp_bytes([65_792] * 4, 2, 2) == hybrid_bytes_per_step(
        [65_792] * 4, 3, 2, 2, 4) == {"shard": {"all_gather": 2_105_344,
                                                "reduce_scatter": 1_052_672},
                                      "replicate": {"all_reduce": 526_336}}


def test_every_mistake_breaks_at_least_one_case():
    """A mistake that gave the right answer on every hidden case would be a check that cannot
    fail it: each must differ from the reference somewhere."""
    for mistake, _ in WRONG["check_accumulation_bytes"]:
        assert any(not nb08.nonzero_ops_equal(nb08.reference_accumulation_bytes(*c), mistake(*c))
                   for c in nb08.ACCUMULATION_CASES), mistake.__name__
    for mistake, _ in WRONG["check_hsdp_bytes"]:
        assert any(mistake(*c) != nb08.reference_hsdp_bytes(*c) for c in nb08.HSDP_CASES), (
            mistake.__name__)


def test_zero_byte_ops_are_absent_ops_but_other_extras_are_not():
    assert nb08.nonzero_ops_equal({"all_reduce": 8}, {"all_reduce": 8, "all_gather": 0})
    assert not nb08.nonzero_ops_equal({"all_reduce": 8}, {"all_reduce": 8, "all_gather": 8})
    assert not nb08.nonzero_ops_equal({"all_reduce": 8}, [("all_reduce", 8)])
    with pytest.raises(ExerciseFailed, match="expected"):
        nb08.check_hsdp_bytes(lambda units, r, s, b=4: {"shard": {}, "replicate": {}})
