"""Hybrid sharding (HSDP, zero_lab/stages/hybrid.py) on 4 gloo ranks as 2 x 2.

Every multi-rank number comes from tests/workers/hsdp_cases.py, a part of world_cases.py's
launch at N = 4 (`case_reports("hsdp", 4)`): stages 0-3 on mesh=(2, 2) against one process
on the global batch, what a step sent per level against `projection.hybrid_bytes_per_step`,
torch's FSDP2 on a 2-D DeviceMesh against ours, and a mutant that never averages across the
groups, which the same checks must catch. Notebook 08's checks (grading/nb08_knobs_hsdp.py)
are held to their mutants here too, on a recorded report of workers/knob_hsdp.py's shape.
"""

from __future__ import annotations

import copy

import pytest
import torch
from common import case_reports

from zero_lab.grading.nb08_knobs_hsdp import (
    check_bytes_per_level,
    check_flat_bytes,
    check_held,
    check_knob_hsdp,
)
from zero_lab.predict.projection import hybrid_bytes_per_step

N, MESH = 4, (2, 2)
TOLERANCE = 1e-5  # fp32, three Adam steps: the reductions run in another order


@pytest.fixture(scope="module")
def reports():
    return case_reports("hsdp", N)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hsdp_trains_equal_to_one_process_on_the_global_batch(reports, stage):
    for rep in reports:
        case = rep["stages"][str(stage)]
        assert case["max_abs_diff"] < TOLERANCE, (stage, case["max_abs_diff"])
    mean = torch.tensor([rep["stages"][str(stage)]["losses"] for rep in reports]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(reports[0]["ref_losses"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_level_are_the_formula_exactly(reports, stage):
    """Inside a group: stage 3 all-gathers every unit twice and reduce-scatters it once
    (stages 0-2: one of each per bucket); across the groups: one all-reduce of the 1/S slice."""
    for rep in reports:
        case = rep["stages"][str(stage)]
        assert case["group_world"] == MESH[1]  # sharded over the 2 ranks of a group
        check_bytes_per_level(case["by_level"], case["group_numels"], *MESH, stage=stage)
        # the lockstep check goes over the whole world, apart from the data
        assert case["levels_of_control"] == ["world"]


def test_a_torch_device_mesh_gives_the_same_layout(reports):
    """shard(model, 3, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate",
    "shard"))): its groups, the same bytes per level, equal to one process."""
    for rep in reports:
        case = rep["device_mesh"]
        assert case["max_abs_diff"] < TOLERANCE
        check_bytes_per_level(case["by_level"], case["group_numels"], *MESH)
        assert case["by_level"] == rep["stages"]["3"]["by_level"]


@pytest.mark.parametrize("stage", [2, 3])
def test_the_global_gradient_norm_counts_each_slice_once(reports, stage):
    """opt.clip_grad_norm_ on a mesh: every group holds every slice, so the norm's sum runs
    over one group only (over the world it would count each slice R times: sqrt(2) too
    large here). Clipped training equals one process clipping its global gradient."""
    for rep in reports:
        case = rep[f"clipped_stage{stage}"]
        assert case["max_abs_diff"] < TOLERANCE, case["max_abs_diff"]
        assert min(case["norms"]) > 0.05  # clipping was active every step
        assert case["norms"] == reports[0][f"clipped_stage{stage}"]["norms"]


def test_mixed_precision_on_a_mesh_stays_within_what_bf16_moves(reports):
    """bf16 parameters and gradients (and collectives, 2 bytes an element): the weights end
    within twice the gap between fp32 and bf16 training of one process; bytes per level are
    the formula's at 2 bytes."""
    for rep in reports:
        case = rep["mixed"]
        assert 0 < case["precision_gap"] < 0.1
        assert case["max_abs_diff"] <= 2 * case["precision_gap"], case
        check_bytes_per_level(case["by_level"], case["group_numels"], *MESH, element_size=2)


def test_find_unused_parameters_is_refused_on_a_mesh(reports):
    for rep in reports:
        assert rep["unused_error"].startswith(
            "ValueError: find_unused_parameters=True is not supported with a mesh yet")


def test_checkpoints_of_a_mesh_are_refused_by_name(reports):
    """Not yet supported: save and load say so on every rank (was: save failed with "two
    pieces hold elements 0.. of '0.weight'", which does not point at the mesh)."""
    for rep in reports:
        for message in rep["checkpoint_errors"]:
            assert message.startswith("CheckpointError: this model is sharded on a mesh "
                                      "(hybrid sharding, 2 x 2)"), message
            assert "full_state_dict(model)" in message


def test_the_formula_by_hand():
    """Units of 600 elements on 2 x 2 (fp32): 2 x 3 x 600 x 4 gathered inside, 3 x 600 x 4
    reduce-scattered inside, 3 x 300 x 4 all-reduced across; 7 elements pad to 8."""
    assert hybrid_bytes_per_step([600] * 3, 3, 2, 2) == {
        "shard": {"all_gather": 14400, "reduce_scatter": 7200},
        "replicate": {"all_reduce": 3600}}
    assert hybrid_bytes_per_step([7], 1, 2, 2, 2) == {
        "shard": {"all_gather": 16, "reduce_scatter": 16}, "replicate": {"all_reduce": 8}}


def test_torch_fsdp2_on_a_2d_mesh_gives_our_weights(reports):
    case = reports[0]["stages"]["3"]
    assert case["fsdp2_keys_match"]
    for name, theirs in case["fsdp2_weights"].items():
        torch.testing.assert_close(torch.tensor(case["weights"][name]), torch.tensor(theirs),
                                   msg=name)
    assert all(rep["stages"]["3"]["fsdp2_max_abs_diff"] < TOLERANCE for rep in reports)


def test_a_layout_that_never_averages_across_groups_is_caught(reports):
    """Negative control: the across-groups all-reduce removed (each group trains on its half
    of the batch). The equivalence and the byte checks above must both fail on it."""
    for rep in reports:
        mutant = rep["mutant_nothing_across"]
        assert mutant["max_abs_diff"] > 100 * TOLERANCE, mutant["max_abs_diff"]
        with pytest.raises(AssertionError, match="the formula says"):
            check_bytes_per_level(mutant["by_level"], mutant["group_numels"], *MESH)


def test_lockstep_and_agreement_still_hold_on_a_mesh(reports):
    for rep in reports:
        # rank 3 stepped once more: every rank stops at the next forward, naming it
        assert rep["lockstep_error"].startswith("RuntimeError: the ranks left lockstep")
        assert "rank 3 ended a forward (2 optimizer steps taken" in rep["lockstep_error"]
        # rank 1 asked for another layout: refused on every rank before a group is made
        assert rep["agreement_error"].startswith("ValueError: the ranks called shard() "
                                                 "differently: rank 1 has mesh[0] = 4")
        assert rep["bad_mesh_error"] == ("ValueError: mesh=(3, 2) lays out 3 x 2 = 6 ranks; "
                                         "the world has 4")


# ---------------------------------------------------------------- notebook 08's checks

UNITS = [65792] * 4  # deep_mlp(256, 4): Linear(256, 256) units
PSI = sum(UNITS)


def knob_report() -> dict:
    """One rank's report of workers/knob_hsdp.py (mesh 2 x 2, deep_mlp(256, 4), fp32 Adam) as
    the formulas give it: what a correct run reports (the live run is notebook 08's)."""
    hsdp = hybrid_bytes_per_step(UNITS, 3, 2, 2)
    return {
        "mesh": [2, 2], "world_size": 4, "element_size": 4, "psi": PSI,
        "hsdp": {"by_level": hsdp, "unit_numels": UNITS, "held_bytes": 16 * PSI // 2,
                 "peak_bytes": 3 * PSI * 4, "step_s": [0.1, 0.1]},
        "zero3": {"by_level": {"world": hybrid_bytes_per_step(UNITS, 3, 1, 4)["shard"]},
                  "unit_numels": UNITS, "held_bytes": 16 * PSI // 4, "peak_bytes": 2 * PSI * 4,
                  "step_s": [0.1, 0.1]},
        "fsdp2": {"same_names": True, "max_abs_diff": 0.0},
    }


def test_knob_checks_accept_a_correct_report():
    summary = check_knob_hsdp([knob_report()] * 4)
    assert summary["across"] == {"all_reduce": PSI * 4 // 2}
    assert summary["held"] == {"hsdp": 8 * PSI, "zero3": 4 * PSI}


def _mutant(edit):
    rep = copy.deepcopy(knob_report())
    edit(rep)
    return rep


MUTANTS = {
    # the whole gradient all-reduced across groups, not its 1/S slice
    "full gradient across": lambda r: r["hsdp"]["by_level"]["replicate"].update(
        all_reduce=PSI * 4),
    # parameters gathered across the groups too (flat stage 3's all-gathers)
    "gathers across": lambda r: r["hsdp"]["by_level"].setdefault("replicate", {}).update(
        all_gather=PSI * 4),
    # one all-gather per unit instead of two (no re-gather for backward)
    "one gather": lambda r: r["hsdp"]["by_level"]["shard"].update(all_gather=PSI * 4),
    # flat stage 3 that sent across a second level
    "flat with levels": lambda r: r["zero3"].update(by_level=hybrid_bytes_per_step(UNITS, 3, 2, 2)),
    # HSDP holding flat stage 3's memory (sharded over all N)
    "hsdp held as flat": lambda r: r["hsdp"].update(held_bytes=16 * PSI // 4),
    # FSDP2 ending elsewhere
    "fsdp2 differs": lambda r: r["fsdp2"].update(max_abs_diff=1e-3),
    "fsdp2 other names": lambda r: r["fsdp2"].update(same_names=False),
    # a mesh that is not the world
    "mesh not the world": lambda r: r.update(mesh=[2, 3]),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_knob_checks_reject_each_mutant(name):
    with pytest.raises(AssertionError):
        check_knob_hsdp([knob_report(), _mutant(MUTANTS[name])])


def test_each_knob_check_alone_rejects_its_mutant():
    rep = knob_report()
    with pytest.raises(AssertionError, match="the formula says"):
        check_bytes_per_level(hybrid_bytes_per_step(UNITS, 3, 1, 4), UNITS, 2, 2)
    with pytest.raises(AssertionError, match="flat stage 3 sent"):
        check_flat_bytes(rep["hsdp"]["by_level"], UNITS, 4)
    with pytest.raises(AssertionError, match="the formula for stage 3 over 2 ranks"):
        check_held(16 * PSI // 4, PSI, 2, len(UNITS))
    assert check_held(16 * PSI // 2 + 16, PSI, 2, len(UNITS)) == 16  # padding accepted
