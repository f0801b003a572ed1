"""Gradient accumulation without waste (model.no_sync(), grad_accumulation) and stage 3's
reshard_after_forward, checked against one process and against predict/knobs.py.

The multi-rank numbers come from tests/workers/accumulation_cases.py, a part of the launch per
world size (N = 2, 3) that tests/workers/world_cases.py shares: 8 configurations (stages 0,
1; stage 2 in both accumulation modes; stage 3 in both modes x reshard_after_forward True and
False) at k = 1 and 4 micro-batches, each trained 3 steps + 1 under the ledger from
rank-dependent initialisations. The notebook-08 checks (zero_lab/grading/
nb08_knobs_accumulation.py) are fed a recorded report and its mutants at the end.
"""

from __future__ import annotations

import copy

import pytest
import torch
from common import case_reports

from zero_lab.grading import nb08_knobs_accumulation as nb08
from zero_lab.predict.knobs import accumulation_messages, accumulation_volume
from zero_lab.stages.accumulation import check_accumulation_arguments

FP32_ATOL = 1e-6  # fp32 weights ~0.1-1 after 4 Adam steps; measured worst 3e-8
WORLDS = (2, 3)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"N={n}")
def ranks(request) -> tuple[int, tuple[dict, ...]]:
    n = request.param
    return n, case_reports("accumulation", n)


# ------------------------------------------------------------------ equivalence


def test_every_configuration_trains_to_one_process_on_the_global_batch(ranks):
    n, reports = ranks
    assert len(reports) == n
    names = [c["name"] for c in reports[0]["cases"]]
    assert len(names) == len(set(names)) == 16
    for rep in reports:
        for c in rep["cases"]:
            assert c["max_abs_diff"] <= FP32_ATOL, (c["name"], c["max_abs_diff"])


def test_losses_averaged_over_ranks_match_the_global_batch_loss(ranks):
    n, reports = ranks
    for i, c in enumerate(reports[0]["cases"]):
        mean = torch.tensor([rep["cases"][i]["losses"] for rep in reports]).mean(0)
        torch.testing.assert_close(mean, torch.tensor(reports[0]["ref_losses"]), rtol=1e-5,
                                   atol=0, msg=c["name"])


# ------------------------------------------------------------------ bytes


def test_bytes_per_optimizer_step_equal_the_formula_exactly(ranks):
    """Every rank's ledger of one optimizer step, op by op (count, message bytes, ring bytes
    sent, ZeRO volume), equals accumulation_messages."""
    n, reports = ranks
    for rep in reports:
        for c in rep["cases"]:
            expected = accumulation_messages(c["stage"], c["psi_bytes"], c["k"], n,
                                             n_groups=c["n_groups"],
                                             grad_accumulation=c["mode"],
                                             reshard_after_forward=c["reshard"])
            assert c["ledger"] == expected, c["name"]


def test_no_sync_sends_once_per_optimizer_step_where_the_stage_can():
    """The formula's teaching rows at k = 8 (volume in Ψ): stages 0 and 1, and stages 2-3
    "unsharded", send 2Ψ whatever k (stage 3: with reshard_after_forward=False); stage 2
    "sharded" sends (k + 1)Ψ: its memory saving costs k times the gradient bytes."""
    k = 8
    assert accumulation_volume(0, k) == accumulation_volume(1, k) == 2
    assert accumulation_volume(0, k, no_sync=False) == 2 * k
    assert accumulation_volume(2, k, grad_accumulation="unsharded") == 2
    assert accumulation_volume(2, k) == k + 1
    assert accumulation_volume(3, k) == 3 * k
    assert accumulation_volume(3, 1, reshard_after_forward=False) == 2
    assert accumulation_volume(3, k, grad_accumulation="unsharded",
                               reshard_after_forward=False) == 2


# ------------------------------------------------------------------ memory


def test_states_held_between_micro_batches(ranks):
    """After k - 1 backwards under no_sync: full gradients (Ψ) at stages 0-1 and with
    "unsharded", the slice with "sharded"; stage 3 keeps Ψ of gathered units more when
    reshard_after_forward=False. The notebook's check, on every rank's report."""
    n, reports = ranks
    for rep in reports:
        nb08.check_held_between(_as_demo_report(rep["cases"], n))


# ------------------------------------------------------------------ lockstep and refusals


def test_ranks_accumulating_different_numbers_of_micro_batches_fail_together(ranks):
    """Rank 0 runs 3 micro-batches, the others 2: every rank raises, naming the counts."""
    n, reports = ranks
    for rep in reports:
        for name, message in rep["mismatch"].items():
            assert "different numbers of backwards (micro-batches)" in message, (name, message)
            assert "rank 0 " in message and f"rank {n - 1} " in message, (name, message)
            assert "2 backward(s) since its last step" in message or "stage3" in name, message
    stage3 = reports[0]["mismatch"]["stage3-unsharded"]
    assert "under no_sync" in stage3 and "ended a forward" in stage3


def test_step_after_an_unsynced_backward_is_refused(ranks):
    n, reports = ranks
    for rep in reports:
        assert rep["unsynced_step"].startswith("opt.step() after a backward under "
                                               "model.no_sync()"), rep["unsynced_step"]


def test_reshard_after_forward_false_keeps_the_stage_3_habits(ranks):
    """check_order=True and prefetch=False train equal to one process; between steps a read
    of a piece is refused (at_rest.py); a checkpoint loads into a fresh model and both go on
    identically."""
    n, reports = ranks
    for rep in reports:
        kept = rep["keep_gathered"]
        assert kept["check_order_diff"] <= FP32_ATOL, kept
        assert "is read outside its unit's call" in kept["guard"], kept["guard"]
        assert kept["checkpoint_diff"] == 0.0 and kept["after_resume_diff"] == 0.0, kept


def test_shard_refuses_settings_that_make_no_sense():
    refusals = case_reports("accumulation", 2)[0]["refusals"]
    assert "grad_accumulation applies to stages 2 and 3 only, not stage 1" in \
        refusals["mode_at_stage_1"]
    assert "grad_accumulation must be one of ('sharded', 'unsharded')" in \
        refusals["mode_unknown"]
    assert "reshard_after_forward applies to stage 3 only, not stage 2" in \
        refusals["reshard_at_stage_2"]
    assert refusals["reshard_int"].startswith(  # at N = 2: no group between 1 and N
        "ValueError: reshard_after_forward=2 must divide the world size 2 and lie strictly "
        "between 1 and 2")
    for key, setting in (("ranks_disagree", "grad_accumulation"),
                         ("ranks_disagree_reshard", "reshard_after_forward")):
        assert f"the ranks called shard() differently: rank 1 has {setting}" in refusals[key]


@pytest.mark.parametrize("stage, options, words", [
    (0, {"grad_accumulation": "unsharded"}, "stages 2 and 3 only"),
    (3, {"grad_accumulation": "sum"}, "must be one of"),
    (1, {"reshard_after_forward": False}, "stage 3 only"),
    (3, {"reshard_after_forward": 0}, "at least 2"),
    (3, {"reshard_after_forward": "2"}, "True, False or an int"),
    (2, {"reshard_after_forward": 2}, "stage 3 only"),
])
def test_accumulation_arguments_are_checked_before_any_collective(stage, options, words):
    settings = {"grad_accumulation": "sharded", "reshard_after_forward": True, **options}
    with pytest.raises((ValueError, TypeError), match=words):
        check_accumulation_arguments(stage, **settings)
    check_accumulation_arguments(3, "unsharded", False)  # the valid combination passes


# ------------------------------------------------------------------ notebook 08's checks


def _as_demo_report(cases: list[dict], n: int) -> dict:
    """The test part's cases in the shape zero_lab/workers/knob_accumulation.py reports."""
    labels = {(0, "sharded", True): "stage 0", (1, "sharded", True): "stage 1",
              (2, "sharded", True): "stage 2 sharded", (2, "unsharded", True): "stage 2 unsharded"}
    runs = []
    for c in cases:
        label = labels.get((c["stage"], c["mode"], c["reshard"]),
                           f"stage 3 {c['mode']}, {'reshard' if c['reshard'] else 'keep'}")
        runs.append({"label": label, "stage": c["stage"], "grad_accumulation": c["mode"],
                     "reshard_after_forward": c["reshard"], "k": c["k"], "comm": c["ledger"],
                     "psi_bytes": c["psi_bytes"], "shard_bytes": c["shard_bytes"],
                     "n_groups": c["n_groups"], "held_between": c["held_between"],
                     "peak_bytes": c["peak_bytes"], "step_times": c["step_times"],
                     "max_abs_diff": c["max_abs_diff"]})
    return {"runs": runs, "world_size": n}


@pytest.fixture(scope="module")
def demo() -> dict:
    return _as_demo_report(case_reports("accumulation", 2)[0]["cases"], 2)


def _run(report: dict, label: str, k: int) -> dict:
    return next(r for r in report["runs"] if r["label"] == label and r["k"] == k)


def test_notebook_checks_accept_what_the_stages_do(demo):
    assert nb08.check_bytes_match_formula(demo) == 16
    nb08.check_held_between(demo)
    assert nb08.check_zero2_pays_k_times(demo) == {1: 1.0, 4: 2.5}
    assert nb08.check_equal_to_one_process(demo) <= FP32_ATOL
    rows = nb08.accumulation_rows(demo)
    assert len(rows) == 16 and {r["volume Ψ"] for r in rows} >= {2.0, 3.0, 5.0, 12.0}


def test_bytes_check_rejects_a_stage_that_sends_every_micro_batch(demo):
    """Mutant: stage 1 ignoring no_sync (a reduce-scatter per micro-batch)."""
    bad = copy.deepcopy(demo)
    rs = _run(bad, "stage 1", 4)["comm"]["reduce_scatter"]
    rs["count"], rs["nbytes"], rs["volume"] = 4 * rs["count"], 4 * rs["nbytes"], 4 * rs["volume"]
    rs["sent_bytes"] *= 4
    with pytest.raises(AssertionError, match=r"stage 1 \(k = 4\)"):
        nb08.check_bytes_match_formula(bad)


def test_bytes_check_rejects_stage_3_regathering_in_backward_when_kept(demo):
    """Mutant: reshard_after_forward=False that still gathers each unit for its backward."""
    bad = copy.deepcopy(demo)
    ag = _run(bad, "stage 3 sharded, keep", 1)["comm"]["all_gather"]
    for key in ag:
        ag[key] *= 2
    with pytest.raises(AssertionError, match="stage 3 sharded, keep"):
        nb08.check_bytes_match_formula(bad)


def test_held_check_rejects_unsharded_accumulation_that_keeps_only_the_slice(demo):
    """Mutant: "unsharded" at stage 2 holding the slice (it would be "sharded" in disguise)."""
    bad = copy.deepcopy(demo)
    run = _run(bad, "stage 2 unsharded", 4)
    run["held_between"]["grads"] = run["shard_bytes"]
    with pytest.raises(AssertionError, match="gradients held between micro-batches"):
        nb08.check_held_between(bad)


def test_held_check_rejects_kept_units_that_were_released(demo):
    """Mutant: stage 3 with reshard_after_forward=False holding only its slices."""
    bad = copy.deepcopy(demo)
    run = _run(bad, "stage 3 unsharded, keep", 4)
    run["held_between"]["params"] = run["shard_bytes"]
    with pytest.raises(AssertionError, match="parameters held"):
        nb08.check_held_between(bad)


def test_zero2_check_rejects_a_stage_2_that_sends_like_stage_1(demo):
    """Mutant: stage 2 "sharded" with stage 1's bytes (the teaching point would be false)."""
    bad = copy.deepcopy(demo)
    _run(bad, "stage 2 sharded", 4)["comm"] = _run(bad, "stage 1", 4)["comm"]
    with pytest.raises(AssertionError, match="ratio"):
        nb08.check_zero2_pays_k_times(bad)


def test_equivalence_check_rejects_weights_apart_from_one_process(demo):
    """Mutant: a run whose weights ended 1e-3 from one process (a micro-batch averaged
    twice would do that)."""
    bad = copy.deepcopy(demo)
    _run(bad, "stage 2 unsharded", 4)["max_abs_diff"] = 1e-3
    with pytest.raises(AssertionError, match="from one process"):
        nb08.check_equal_to_one_process(bad)
