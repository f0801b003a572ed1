"""Stage 3, a parameter read outside its unit's call (issue 21, point 4): between its unit's
forward and backward a parameter holds only this rank's 1-D piece, so a read of it elsewhere
(a parent's forward, an L2 term over model.parameters(), a logged weight norm) is refused at
the read, naming the parameter and its unit; what worked keeps training as one process
(tests/workers/stage3_reads.py, one launch per world size).
"""

from __future__ import annotations

import pytest
from common import worker_reports

from zero_lab.paths import REPO_ROOT

WORKER = REPO_ROOT / "tests" / "workers" / "stage3_reads.py"
FP32_ATOL = 1e-6  # fp32 weights after a few Adam steps (the contract tests measure ~2e-7)
BF16_ATOL = 1e-2  # bf16 keeps 8 significant bits; ranks round in another order than one process


@pytest.fixture(params=[2, 3], scope="module", ids=lambda n: f"N={n}")
def ranks(request):
    return request.param, worker_reports(WORKER, request.param)


def refusal(name: str, unit: str, op: str) -> str:
    """The start every refusal of a read outside the unit has."""
    return (f"RuntimeError: {name} is read outside its unit's call ({op}): at stage 3 it holds "
            f"only this rank's 1-D piece of itself outside the forward and backward of its "
            f"unit '{unit}'")


def assert_refused(message, name: str, unit: str, op: str) -> None:
    assert isinstance(message, str), message  # not numbers: the read was not refused
    assert message.startswith(refusal(name, unit, op)), message
    for advice in ("unit_classes", "opt.clip_grad_norm_", "weight_decay",
                   "full_state_dict(model)", ".data"):
        assert advice in message, (advice, message)


def test_a_parent_reading_a_childs_weight_while_training_is_refused(ranks):
    """Was autograd's "PowBackward0 returned an invalid gradient" in backward."""
    for rep in ranks[1]:
        assert_refused(rep["parent_reads_grad"], "fc.weight", "fc", "norm")


def test_a_parent_reading_a_childs_weight_under_no_grad_is_refused(ranks):
    """Was silently this rank's piece: the evaluated loss 4e-3 off one process."""
    for rep in ranks[1]:
        assert_refused(rep["parent_reads_no_grad"], "fc.weight", "fc", "norm")


def test_an_l2_term_over_model_parameters_is_refused(ranks):
    for rep in ranks[1]:
        assert_refused(rep["l2_term"], "0.weight", "0", "pow")


def test_a_weight_norm_logged_under_no_grad_is_refused(ranks):
    """Was each rank's part of the norm, a different number on every rank."""
    for rep in ranks[1]:
        assert_refused(rep["logged_norm"], "0.weight", "0", "norm")


def test_the_child_inside_the_parents_unit_trains_as_one_process(ranks):
    for rank, rep in enumerate(ranks[1]):
        found = rep["parent_unit"]
        assert "error" not in found, (rank, found)
        assert found["max_abs_diff"] <= FP32_ATOL, (rank, found)
        assert found["loss_diff"] <= FP32_ATOL, (rank, found)


def test_a_parametrized_weight_norm_trains_as_one_process(ranks):
    for rank, rep in enumerate(ranks[1]):
        found = rep["parametrized"]
        assert "error" not in found, (rank, found)
        assert found["max_abs_diff"] <= FP32_ATOL, (rank, found)


def test_an_optimizer_of_ones_own_on_the_local_pieces_trains_as_one_process(ranks):
    for rank, rep in enumerate(ranks[1]):
        found = rep["own_optimizer"]
        assert "error" not in found, (rank, found)
        assert found["max_abs_diff"] <= FP32_ATOL, (rank, found)


def test_tied_checkpointed_clipped_loaded_and_saved_as_before(ranks):
    for rank, rep in enumerate(ranks[1]):
        found = rep["habits"]
        assert [r["precision"] for r in found] == ["fp32", "bf16"], found
        for r in found:
            assert "error" not in r, (rank, r)
            assert r["after_load"] == 0.0, (rank, r)
            assert r["after_checkpoint"] == 0.0, (rank, r)
            bound = FP32_ATOL if r["precision"] == "fp32" else BF16_ATOL
            assert r["max_abs_diff"] <= bound, (rank, r)
