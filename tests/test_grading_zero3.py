"""The graded stage-3 exercises of notebook 05 (zero_lab.grading, checked on 3 ranks).

Each check must accept the reference solution, reject the stub `make student` writes, and
reject plausible wrong answers with the hint that names the mistake, including the seed
blog's ZeRO-3 gradient bug. Every reference and wrong answer runs in ONE launch of
zero_lab/workers/zero3_exercises.py (the `graded` fixture); the tests apply each check's
verdict to its reports. One test per check runs the public check end to end.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zero_lab import grading
from zero_lab.grading import ExerciseFailed
from zero_lab.grading.nb05_zero3 import (
    MATERIALIZE_RELEASE,
    POST_BACKWARD,
    judge_materialize_release,
    judge_post_backward,
)
from zero_lab.grading.remote import exercise_key, run_on_ranks
from zero_lab.stages.partition import allocate_storage, free_storage

# ------------------------------------------------------------------ materialize / release


def materialize(unit):
    allocate_storage(unit.full)
    dist.all_gather_single(unit.full, unit.local)
    for p, view in zip(unit.params, unit.full_views, strict=True):
        p.data = view


def release(unit):
    for p, piece in zip(unit.params, unit.local_views, strict=True):
        p.data = piece
    free_storage(unit.full)


def materialize_stub(unit):
    raise NotImplementedError("exercise: replace this line with your solution")


def release_rebind_only(unit):
    # The seed blog's release: the parameters point at the slice again, nothing is freed.
    for p, piece in zip(unit.params, unit.local_views, strict=True):
        p.data = piece


def materialize_new_tensor(unit):
    # Right values, fresh memory: views autograd saved still point at the old storage.
    full = torch.empty(unit.group.padded_numel, dtype=unit.local.dtype)
    dist.all_gather_single(full, unit.local)
    for p, view in zip(unit.params, unit.group.views(full), strict=True):
        p.data = view


def materialize_per_parameter(unit):
    # One broadcast per rank instead of one all-gather.
    allocate_storage(unit.full)
    size = unit.local.numel()
    for r in range(dist.get_world_size()):
        piece = unit.full[r * size:(r + 1) * size]
        if r == dist.get_rank():
            piece.copy_(unit.local)
        dist.broadcast(piece, src=r)
    for p, view in zip(unit.params, unit.full_views, strict=True):
        p.data = view


# ------------------------------------------------------------------ post-backward


def post_backward(unit):
    unit.release()
    grad = torch.empty_like(unit.local)
    dist.reduce_scatter_single(grad, unit.full_grad, op=dist.ReduceOp.AVG)
    unit.grad = grad if unit.grad is None else unit.grad + grad
    unit.full_grad = None


def post_backward_stub(unit):
    raise NotImplementedError("exercise: replace this line with your solution")


def post_backward_blog(unit):
    # The seed blog: each rank all-reduces ITS OWN chunk of its own gradient.
    unit.release()
    mine = unit.group.shard(unit.full_grad).clone()
    dist.all_reduce(mine)
    mine /= dist.get_world_size()
    unit.grad = mine if unit.grad is None else unit.grad + mine
    unit.full_grad = None


def post_backward_all_reduce(unit):
    # Right values for 2Ψ: all-reduce the whole gradient, keep the owned slice.
    unit.release()
    dist.all_reduce(unit.full_grad, op=dist.ReduceOp.AVG)
    mine = unit.group.shard(unit.full_grad).clone()
    unit.grad = mine if unit.grad is None else unit.grad + mine
    unit.full_grad = None


def post_backward_overwrite(unit):
    unit.release()
    grad = torch.empty_like(unit.local)
    dist.reduce_scatter_single(grad, unit.full_grad, op=dist.ReduceOp.AVG)
    unit.grad = grad  # forgets the earlier backward calls
    unit.full_grad = None


def post_backward_keeps_params(unit):
    grad = torch.empty_like(unit.local)
    dist.reduce_scatter_single(grad, unit.full_grad, op=dist.ReduceOp.AVG)
    unit.grad = grad if unit.grad is None else unit.grad + grad
    unit.full_grad = None


RUNS = [
    ("materialize_release", [materialize, release]),
    ("materialize_release", [materialize, release_rebind_only]),
    ("materialize_release", [materialize_new_tensor, release]),
    ("materialize_release", [materialize_per_parameter, release]),
    ("post_backward", [post_backward]),
    ("post_backward", [post_backward_blog]),
    ("post_backward", [post_backward_all_reduce]),
    ("post_backward", [post_backward_overwrite]),
    ("post_backward", [post_backward_keeps_params]),
]
EXERCISES = {"materialize_release": (MATERIALIZE_RELEASE, "check_materialize_release",
                                     judge_materialize_release),
             "post_backward": (POST_BACKWARD, "check_post_backward", judge_post_backward)}


@pytest.fixture(scope="module")
def graded():
    """Every (exercise, functions) above, run on 3 ranks in a single launch."""
    return run_on_ranks("tests", [(EXERCISES[exercise][0], fns) for exercise, fns in RUNS])


@pytest.fixture
def judge(graded):
    def run(exercise, *fns):
        rank_exercise, name, verdict = EXERCISES[exercise]
        verdict(name, graded[exercise_key(rank_exercise, fns)])
    return run


def test_materialize_release_accepts_the_reference(judge, capsys):
    judge("materialize_release", materialize, release)
    assert "check_materialize_release: 3/3 units pass on 3 ranks" in capsys.readouterr().out


def test_materialize_release_end_to_end(capsys):
    grading.check_materialize_release(materialize, release)  # its own launch, as in the notebook
    assert "3/3 units pass on 3 ranks" in capsys.readouterr().out


def test_materialize_release_rejects_the_stub():
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        grading.check_materialize_release(materialize_stub, release)


def test_materialize_release_rejects_a_release_that_only_rebinds(judge):
    with pytest.raises(ExerciseFailed, match="still holds 336 bytes") as err:
        judge("materialize_release", materialize, release_rebind_only)
    assert "free_storage(unit.full)" in str(err.value)


def test_materialize_release_rejects_gathering_into_a_new_tensor(judge):
    with pytest.raises(ExerciseFailed, match="do not view unit.full's own storage"):
        judge("materialize_release", materialize_new_tensor, release)


def test_materialize_release_rejects_one_broadcast_per_rank(judge):
    with pytest.raises(ExerciseFailed, match="3 x broadcast|broadcast of 112 bytes") as err:
        judge("materialize_release", materialize_per_parameter, release)
    assert "one dist.all_gather_single" in str(err.value)


def test_post_backward_accepts_the_reference(judge, capsys):
    judge("post_backward", post_backward)
    assert "check_post_backward: 3/3 units x 2 backward calls pass on 3 ranks" in (
        capsys.readouterr().out)


def test_post_backward_end_to_end(capsys):
    grading.check_post_backward(post_backward)
    assert "3/3 units x 2 backward calls pass on 3 ranks" in capsys.readouterr().out


def test_post_backward_rejects_the_stub():
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        grading.check_post_backward(post_backward_stub)


def test_post_backward_rejects_the_blog_bug(judge):
    with pytest.raises(ExerciseFailed, match="ITS OWN chunk"):
        judge("post_backward", post_backward_blog)


def test_post_backward_rejects_all_reduce_then_slice(judge):
    with pytest.raises(ExerciseFailed, match="the values are right, but you sent"):
        judge("post_backward", post_backward_all_reduce)


def test_post_backward_rejects_overwriting_the_gradient(judge):
    with pytest.raises(ExerciseFailed, match="ADD the new slice") as err:
        judge("post_backward", post_backward_overwrite)
    assert "backward call 2" in str(err.value)


def test_post_backward_rejects_keeping_the_full_parameters(judge):
    with pytest.raises(ExerciseFailed, match="full parameters are still gathered"):
        judge("post_backward", post_backward_keeps_params)
