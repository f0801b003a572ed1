"""The loops people write in real training code, at every stage, against one process
(tests/workers/contract_habits.py, one launch per world size): each is made right, or refused
at the first moment it can be detected with a message that says what to do instead.
"""

from __future__ import annotations

from functools import cache

import pytest

from zero_lab.launch import torchrun
from zero_lab.paths import REPO_ROOT

WORKER = REPO_ROOT / "tests" / "workers" / "contract_habits.py"
FP32_ATOL = 1e-6  # fp32 weights after a few Adam steps (the contract tests measure ~2e-7)


@cache
def reports(nproc: int) -> tuple[dict, ...]:
    return tuple(torchrun(WORKER, nproc=nproc, timeout=600, stream=False,
                          backend="gloo").ranks)


@pytest.fixture(params=[2, 3], scope="module", ids=lambda n: f"N={n}")
def ranks(request):
    return request.param, reports(request.param)


def runs(ranks, case: str) -> list[tuple[int, dict]]:
    _, reps = ranks
    out = []
    for rank, rep in enumerate(reps):
        found = rep[case]
        assert isinstance(found, list), (case, rank, found)  # the case itself did not crash
        out += [(rank, r) for r in found]
    return out


def test_training_goes_on_after_an_exception_caught_in_backward(ranks):
    """An OOM-skip loop: the second step's backward raises on every rank, the loop zeroes the
    gradients and goes on; three more steps train as in one process."""
    found = runs(ranks, "backward_raises")
    assert sorted({r["stage"] for _, r in found}) == [0, 1, 2, 3]
    for rank, r in found:
        assert "error" not in r, (rank, r)
        assert r["max_abs_diff"] <= FP32_ATOL, (rank, r)


def test_torch_clip_grad_norm_on_all_parameters_is_the_global_norm(ranks):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), c): each rank alone would see only
    its slices (stage 1: the norm of its slice, stage 2: 0.0, no gradients on the
    parameters; stage 3: its pieces); shard() routes it to opt.clip_grad_norm_, the global
    norm, at every stage."""
    found = runs(ranks, "torch_clip")
    assert sorted({r["stage"] for _, r in found}) == [0, 1, 2, 3]
    for rank, r in found:
        assert "error" not in r, (rank, r)
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), (rank, r)
        assert min(r["ref_norms"]) > 0.05  # every step clipped
        assert r["max_abs_diff"] <= FP32_ATOL, (rank, r)


def test_torch_clip_grad_norm_on_some_parameters_is_refused(ranks):
    _, reps = ranks
    for rep in reps:
        for stage, message in rep["torch_clip_subset"].items():
            assert message.startswith(
                f"RuntimeError: torch.nn.utils.clip_grad_norm_ was given 2 of the 6 trainable "
                f"parameters of a model sharded at stage {stage}"), message
            assert "opt.clip_grad_norm_(max_norm)" in message

