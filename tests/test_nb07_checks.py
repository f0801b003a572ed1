"""Negative controls for notebook 07: every check its cells assert accepts what the notebook
measures and rejects a mutant, the mistake it is there to catch.

    cell                              check                               mutants that fail it
    1. held bytes (MLP, GPT)          check_held_is_formula_plus_padding  a leaked unit, bytes
                                                                          below the formula, the
                                                                          untied GPT's Ψ, a peak
                                                                          below what is held
    1. the peak's floor               check_peak_floor                    stage 3 without prefetch,
                                                                          a leaked unit
    1. activations measured           check_saved_equals_formula          the s² term dropped
    1. activations vs states          check_activations_outgrow_states    a stage 3 that does
                                                                          not fall with N
    2. collectives priced vs sent     check_projected_collectives         stage 3 gathering each
                                                                          unit once, the projection
                                                                          at DEFAULT_BUCKETS when
                                                                          the ledger counts 2
    2. bytes sent vs projection       check_projected_bytes               the ring factor dropped
    2. measured vs projected          same_launch_error (printed, not     a twin timed in other
       (the error, computed)          asserted: a timing)                 rounds than the stage
    3. overlap_step's saving          check_overlap_step_saving           overlap_step ignored (0
                                                                          saved), every reduction
                                                                          hidden under the step
    3. decision table                 check_decision_table                recommend() without its
                                                                          reserve, 79.2 of 80 GiB,
                                                                          "checkpoint activations"
                                                                          when they are
    +. resumed checkpoint             check_resumed_run                   a padding element leaked
                                                                          into a parameter, a
                                                                          parameter missing
    +. consolidated checkpoint        check_consolidated                  a value changed
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zero_lab import memory
from zero_lab.grading import nb07_scaling as checks
from zero_lab.predict import projection

GiB = 2**30
PSI = 3 * (10 * 10 + 10)  # the tiny MLP of test_memory_at_scale


def held_row(stage: int, n: int, pad: int = 0, psi: int = PSI, groups: int = 1) -> dict:
    """A memory_at_scale row as the worker reports it, `pad` bytes over the formula."""
    formula = memory.model_state_bytes(psi, stage, n, "fp32", "adam")["total"]
    return {"world_size": n, "stage": stage, "psi": psi, "groups": groups,
            "held": {"total": formula + pad}, "predicted": formula, "peak": formula + pad + 64}


# ------------------------------------------------------------------ section 1


def test_held_bytes_check_accepts_formula_plus_padding():
    rows = [held_row(s, n, pad=16 * (n - 1)) for n in (1, 3, 1024) for s in (1, 2, 3)]
    assert checks.check_held_is_formula_plus_padding(rows, psi=PSI) == 16 * 1023


@pytest.mark.parametrize("mutant", [
    # a leaked unit: one full Linear(4096, 4096) of the notebook's MLP kept after its release
    held_row(3, 1024, pad=4 * (4096 * 4096 + 4096), psi=6 * (4096 * 4096 + 4096), groups=6),
    held_row(2, 8, pad=-16),                 # fewer bytes than the formula: a unit mix-up
    held_row(1, 4, pad=16 * 4 * 1 + 16),     # more padding than N elements per group
])
def test_held_bytes_check_rejects_a_leak_or_a_padding_error(mutant):
    with pytest.raises(AssertionError):
        checks.check_held_is_formula_plus_padding([held_row(1, 1), mutant])


def test_held_bytes_check_rejects_the_untied_gpt_and_a_low_peak():
    tied, untied = 109_554_432, 134_130_432  # the worker before the re-tie: 76 tensors
    with pytest.raises(AssertionError, match="untied"):
        checks.check_held_is_formula_plus_padding([held_row(3, 64, psi=untied)], psi=tied)
    low = held_row(3, 64)
    low["peak"] = low["held"]["total"] - 1
    with pytest.raises(AssertionError):
        checks.check_held_is_formula_plus_padding([low])


def test_peak_floor_check():
    unit = 4 * (4096 * 4096 + 4096)
    measured = {s: u * unit for s, u in projection.FLOOR_UNITS.items()}
    assert checks.check_peak_floor(measured, unit) == projection.FLOOR_UNITS
    no_prefetch = {**measured, 3: measured[3] - unit}  # stage 3 gathering one unit fewer
    leaked = {**measured, 2: measured[2] + unit}
    for mutant in (no_prefetch, leaked):
        with pytest.raises(AssertionError, match="units above its states"):
            checks.check_peak_floor(mutant, unit)
    # the course MLP: a 4 MiB unit is one optimizer chunk, and stage 0 peaks at Adam's two
    # temporaries of a chunk, two units; a check that forgot them, or a leak, fails
    from zero_lab.stages.sharded_optimizer import OPTIMIZER_CHUNK

    unit, chunks = 4 * (1024 * 1024 + 1024), 2 * 4 * OPTIMIZER_CHUNK
    measured = {**{s: u * unit for s, u in projection.FLOOR_UNITS.items()}, 0: chunks}
    assert checks.check_peak_floor(measured, unit, optimizer_bytes=chunks)[0] == chunks / unit
    with pytest.raises(AssertionError, match="stage 0"):
        checks.check_peak_floor(measured, unit)
    with pytest.raises(AssertionError, match="Adam chunk temporaries"):
        checks.check_peak_floor({**measured, 0: chunks + unit}, unit, optimizer_bytes=chunks)


def test_activations_checks():
    s, b, h, a = 1024, 1, 768, 12
    formula = memory.activation_bytes_saved_by_torch(s, b, h, a)
    checks.check_saved_equals_formula(formula, formula)
    no_s2 = formula - 5 * a * s * s * b  # a measurement that lost the attention scores
    with pytest.raises(AssertionError, match="formula"):
        checks.check_saved_equals_formula(no_s2, formula)
    stage3 = {1: 16 * 109_554_432, 64: 16 * 109_554_432 // 64}
    checks.check_activations_outgrow_states(stage3, 12 * formula)
    flat = {1: stage3[1], 64: stage3[1]}  # a stage 3 whose states do not fall with N
    with pytest.raises(AssertionError, match="N = 64"):
        checks.check_activations_outgrow_states(flat, 12 * formula)


# ------------------------------------------------------------------ section 2


def ring_bytes(psi: int, stage: int, n: int) -> float:
    return projection.project_step(psi, stage, n, "pcie4", 0.01, 4, buckets=6)["bytes_sent"]


def test_projected_bytes_check_accepts_the_ring_formula():
    psi = 1_575_936  # the bench model of notebook 07
    ledger = {(n, s): int(ring_bytes(psi, s, n)) for n in (2, 4) for s in range(4)}
    projected = {k: ring_bytes(psi, k[1], k[0]) for k in ledger}
    assert checks.check_projected_bytes(projected, ledger) < 1e-6


def test_projected_bytes_check_rejects_a_projection_without_the_ring_factor():
    psi = 1_575_936
    ledger = {(n, s): int(ring_bytes(psi, s, n)) for n in (2, 4) for s in range(4)}
    # the whole message per collective, no (N-1)/N: what the ZeRO paper's volume counts
    dropped = {(n, s): ring_bytes(psi, s, n) * n / (n - 1) for n, s in ledger}
    with pytest.raises(AssertionError, match="projected"):
        checks.check_projected_bytes(dropped, ledger)


def test_projected_collectives_check_accepts_what_the_ledger_counts():
    # the bench model's ledger (runs/scaling: 2 buckets at stages 0-2, 6 units at stage 3)
    ledger = {(n, 0): {"all_reduce": 2} for n in (1, 2, 4)}
    ledger.update({(n, s): {"reduce_scatter": 2, "all_gather": 2} for n in (1, 2, 4)
                   for s in (1, 2)})
    ledger.update({(n, 3): {"all_gather": 12, "reduce_scatter": 6} for n in (1, 2, 4)})
    buckets = {0: 2, 1: 2, 2: 2, 3: 6}
    projected = {(n, s): projection.project_step(1_575_936, s, n, "pcie4", 0.01, 4,
                                                 buckets=buckets[s])["calls"]
                 for n, s in ledger}
    checks.check_projected_collectives(projected, ledger)


def test_projected_collectives_check_rejects_a_wrong_count():
    ledger = {(2, 3): {"all_gather": 12, "reduce_scatter": 6}, (2, 1): {"reduce_scatter": 2,
                                                                        "all_gather": 2}}
    once = {(2, 3): {"all_gather": 6, "reduce_scatter": 6}, (2, 1): ledger[2, 1]}  # no re-gather
    default = {k: projection.project_step(1_575_936, k[1], 2, "pcie4", 0.01, 4)["calls"]
               for k in ledger}  # DEFAULT_BUCKETS (32) where the stages send 2 and 6
    for mutant in (once, default):
        with pytest.raises(AssertionError, match="projected"):
            checks.check_projected_collectives(mutant, ledger)


def test_same_launch_error_pairs_each_round_of_the_stage_with_its_twins():
    # a machine whose load doubles in round 2: the stage and its twin both slow down, and the
    # projection (twin + 10 ms of collectives) still explains each round exactly
    twin = [0.040, 0.080, 0.041]
    stage = [t + 0.010 for t in twin]
    best, (lo, hi) = checks.same_launch_error(stage, twin, 0.010)
    assert best == pytest.approx(0.0) and lo == pytest.approx(0.0) and hi == pytest.approx(0.0)
    # the best rounds: each side's fastest, whichever round it fell in; the band: round by round
    best, (lo, hi) = checks.same_launch_error([0.050, 0.060], [0.045, 0.036], 0.010)
    assert best == pytest.approx(0.046 / 0.050 - 1)
    assert (lo, hi) == (pytest.approx(0.046 / 0.060 - 1), pytest.approx(0.055 / 0.050 - 1))


def test_same_launch_error_rejects_a_twin_timed_in_other_rounds():
    # the mutant: the compute taken from another launch (one rank alone, 3 rounds) set
    # beside the stage's 8 rounds
    with pytest.raises(AssertionError, match="same rounds"):
        checks.same_launch_error([0.05] * 8, [0.03] * 3, 0.01)


# ------------------------------------------------------------------ section 3


def scenario(n_params, gpus, reserve_fraction=projection.RESERVE_FRACTION,
             activations_checkpointed=True, extra_acts=0.0):
    shape = memory.gpt_shape(n_params)
    acts = memory.activation_bytes(shape["n_layers"], 4096, 4, shape["hidden"], shape["heads"],
                                   "full", attention="fused") + extra_acts
    return projection.recommend(n_params, 80 * GiB, gpus, "dgx_h100",
                                projection.compute_time(n_params, 4 * 4096, 0.4 * 989e12),
                                activation_bytes=acts, buckets=shape["n_layers"],
                                reserve_fraction=reserve_fraction,
                                activations_checkpointed=activations_checkpointed)


def _stage2_steps(n_params: float, saved_by_mutant=None) -> tuple[float, float]:
    """Notebook 07's stage-2 step at 64 DGX GPUs without and with overlap_step."""
    compute = projection.compute_time(n_params, 4 * 4096, 0.4 * 989e12)
    adam = projection.optimizer_time(n_params, 2, 64, 0.6 * 3.35e12)
    plain, stepped = (projection.project_step(n_params, 2, 64, "dgx_h100", compute,
                                              optimizer_s=adam, overlap_step=on)
                      for on in (False, True))
    if saved_by_mutant is not None:
        return plain["step_s"], plain["step_s"] - saved_by_mutant(plain)
    return plain["step_s"], stepped["step_s"]


@pytest.mark.parametrize("n_params", [7e9, 70e9])
def test_overlap_step_check_accepts_the_projection(n_params):
    assert 0 < checks.check_overlap_step_saving(*_stage2_steps(n_params)) < 0.001


@pytest.mark.parametrize("mutant", [
    lambda step: 0.0,                                   # overlap_step ignored
    lambda step: step["comm_s"]["reduce_scatter"],      # every reduction hidden under the step
])
def test_overlap_step_check_rejects_nothing_saved_or_every_reduction_hidden(mutant):
    with pytest.raises(AssertionError, match="overlap_step saves"):
        checks.check_overlap_step_saving(*_stage2_steps(7e9, mutant))


def test_decision_table_check_accepts_the_notebooks_table():
    table = {(n, g): scenario(n, g) for n in (1.3e9, 7e9, 13e9, 70e9) for g in (8, 64)}
    checks.check_decision_table(table, 80 * GiB)
    assert [table[n, 64].stage for n in (1.3e9, 7e9, 13e9, 70e9)] == [0, 2, 2, 3]
    assert not table[70e9, 8].fits


def test_decision_table_check_rejects_a_recommend_without_its_reserve():
    # 7B on one node with activations that leave stage 2 only 5 GiB: the reserve says stage 3
    rows = projection.candidates(7e9, 80 * GiB, 8, "dgx_h100", 1.7, buckets=32)
    extra = rows[2]["headroom_bytes"] - 5 * GiB - scenario(7e9, 8).per_rank_bytes + rows[2][
        "per_rank_bytes"]
    assert scenario(7e9, 8, extra_acts=extra).stage == 3
    no_reserve = scenario(7e9, 8, reserve_fraction=0.0, extra_acts=extra)
    assert no_reserve.stage == 2 and no_reserve.fits
    with pytest.raises(AssertionError, match="GiB free"):
        checks.check_decision_table({(7e9, 8): no_reserve}, 80 * GiB)
    # the old table's "fits on 32 ranks" at 79.2 of 80 GiB
    old = dataclasses.replace(scenario(70e9, 64), headroom_bytes=0.8 * GiB)
    with pytest.raises(AssertionError, match="0.8 GiB free"):
        checks.check_decision_table({(70e9, 32): old}, 80 * GiB)


def test_decision_table_check_rejects_advice_to_checkpoint_checkpointed_activations():
    told = scenario(70e9, 8, activations_checkpointed=False)
    with pytest.raises(AssertionError, match="checkpointing"):
        checks.check_decision_table({(70e9, 8): told}, 80 * GiB)


# ------------------------------------------------------------------ section 4


def test_resumed_run_check():
    final = {"0.weight": [0.25, -1.5, 3.0], "0.bias": [0.1]}
    assert checks.check_resumed_run(final, {k: list(v) for k, v in final.items()}) == 0
    leaked = {**final, "0.weight": [0.25, -1.5, 3.001]}  # a padding element loaded as a value
    with pytest.raises(AssertionError, match="differs"):
        checks.check_resumed_run(final, leaked)
    with pytest.raises(AssertionError):
        checks.check_resumed_run(final, {"0.weight": final["0.weight"]})


def test_consolidated_check():
    at_save = {"0.weight": [[0.5, 1.0], [2.0, 3.0]], "0.bias": [0.1, 0.2]}
    weights = {k: torch.tensor(v) for k, v in at_save.items()}
    flat = {k: torch.tensor(v).flatten().tolist() for k, v in at_save.items()}
    checks.check_consolidated(weights, flat)
    changed = {**weights, "0.bias": torch.tensor([0.1, 0.0])}
    with pytest.raises(AssertionError, match="0.bias"):
        checks.check_consolidated(changed, flat)


def test_resume_with_extras_check():
    run = {"w": [1.0, 2.0], "b": [0.5]}
    same = checks.check_resume_with_extras(dict(run), {"w": [1.0, 2.5], "b": [0.5]}, run)
    assert same == {"with": True, "without": False}
    with pytest.raises(AssertionError, match="resumed with its extras"):  # one value off
        checks.check_resume_with_extras({"w": [1.0, 2.0000001], "b": [0.5]}, {"w": [0.0],
                                        "b": [0.0]}, run)
    with pytest.raises(AssertionError, match="without its extras"):  # extras change nothing
        checks.check_resume_with_extras(dict(run), dict(run), run)


def test_killed_resume_check():
    checks.check_killed_resume(2, 2)
    with pytest.raises(AssertionError, match="not step 2"):  # the kill lost a published save
        checks.check_killed_resume(1, 1)
    with pytest.raises(AssertionError, match="not step 2"):  # published before it was complete
        checks.check_killed_resume(3, 3)
    with pytest.raises(AssertionError):  # resumed from another step than the one published
        checks.check_killed_resume(2, 0)
