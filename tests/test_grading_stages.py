"""The graded exercises of notebooks 03 and 04 (zero_lab.grading, checked on 3 ranks).

Each check must accept the reference solution, reject the stub `make student` writes, and
reject plausible wrong answers with the hint that names the mistake. A check is a launch of
zero_lab/workers/zero1_zero2_exercises.py on 3 gloo ranks followed by a verdict on what the
ranks report; to keep this file fast, every reference and wrong answer runs in ONE launch (the
`graded` fixture) and the tests apply each check's verdict to its reports. One test runs a
public check end to end; stubs are recognised before any launch.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from zero_lab import grading
from zero_lab.grading import ExerciseFailed
from zero_lab.grading.nb03_zero1 import (
    OWNED_RANGE,
    SHARDED_STEP,
    judge_owned_range,
    judge_sharded_step,
)
from zero_lab.grading.nb04_zero2 import BUCKET_HOOK, judge_bucket_hook
from zero_lab.grading.remote import run_on_ranks

# ------------------------------------------------------------------ owned slice ranges


def owned_range(numel, world_size, rank):
    shard = -(-numel // world_size)  # S = ceil(numel / N); the buffer is padded to N·S
    return rank * shard, (rank + 1) * shard


def owned_range_stub(numel, world_size, rank):
    raise NotImplementedError("exercise: replace this line with your solution")


def owned_range_remainder_to_last(numel, world_size, rank):
    # A common learner mistake: floor-sized slices, the last rank takes what is left.
    shard = numel // world_size
    end = numel if rank == world_size - 1 else (rank + 1) * shard
    return rank * shard, end


def test_owned_range_accepts_the_reference_end_to_end(capsys):
    grading.check_owned_range(owned_range)  # its own launch, as in the notebook
    assert "check_owned_range: 9/9 buffer sizes pass on 3 ranks" in capsys.readouterr().out


def test_owned_range_rejects_the_stub():
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        grading.check_owned_range(owned_range_stub)


def test_owned_range_rejects_the_remainder_on_the_last_rank(judge):
    with pytest.raises(ExerciseFailed, match="the same number of elements") as err:
        judge("owned_range", owned_range_remainder_to_last)
    assert "numel=1, world_size=3" in str(err.value)  # the first case already differs


# ------------------------------------------------------------------ sharded optimizer step


def sharded_step(flat_param, flat_grad, shard_param, optimizer):
    grad = torch.empty_like(shard_param)
    dist.reduce_scatter_single(grad, flat_grad, op=dist.ReduceOp.AVG)
    shard_param.grad = grad
    optimizer.step()
    dist.all_gather_single(flat_param, shard_param.detach())


def sharded_step_stub(flat_param, flat_grad, shard_param, optimizer):
    raise NotImplementedError("exercise: replace this line with your solution")


def sharded_step_all_reduce(flat_param, flat_grad, shard_param, optimizer):
    # The seed notes' stage 1: all-reduce everything, keep the owned slice (3Ψ per step).
    rank, shard = dist.get_rank(), shard_param.numel()
    dist.all_reduce(flat_grad, op=dist.ReduceOp.AVG)
    shard_param.grad = flat_grad[rank * shard:(rank + 1) * shard].clone()
    optimizer.step()
    dist.all_gather_single(flat_param, shard_param.detach())


def sharded_step_summed(flat_param, flat_grad, shard_param, optimizer):
    grad = torch.empty_like(shard_param)
    dist.reduce_scatter_single(grad, flat_grad)  # SUM: N times the average gradient
    shard_param.grad = grad
    optimizer.step()
    dist.all_gather_single(flat_param, shard_param.detach())


def test_sharded_step_accepts_the_reference(judge, capsys):
    judge("sharded_step", sharded_step)
    assert "3/3 cases pass on 3 ranks" in capsys.readouterr().out


def test_sharded_step_rejects_the_stub():
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        grading.check_sharded_step(sharded_step_stub)


def test_sharded_step_rejects_summed_gradients_where_the_difference_shows(judge):
    with pytest.raises(ExerciseFailed, match="summed, not averaged") as err:
        judge("sharded_step", sharded_step_summed)
    # Adam divides by the gradient's size, so a sum moves it by ~1e-10 only: the message must
    # show the case where summing is visible (SGD), and say by how much the values differ.
    text = str(err.value)
    assert "sgd_momentum" in text, text
    relative = float(re.search(r"largest difference [^(]*\(relative ([0-9.e+-]+)\)", text)[1])
    assert relative > 0.01, text


def test_sharded_step_rejects_all_reduce_then_slice(judge):
    with pytest.raises(ExerciseFailed, match="the values are right") as err:
        judge("sharded_step", sharded_step_all_reduce)
    assert "3Ψ per step" in str(err.value)


# ------------------------------------------------------------------ bucketed gradient hook


def on_grad_ready(param, bucket):
    if bucket.full is None:
        bucket.full = bucket.group.new_full()
    bucket.group.views(bucket.full)[bucket.index(param)].copy_(param.grad)
    param.grad = None
    bucket.arrived += 1
    if bucket.arrived == len(bucket.group.params):
        owned = bucket.group.new_shard()
        dist.reduce_scatter_single(owned, bucket.full, op=dist.ReduceOp.AVG)
        bucket.owned_grad += owned
        bucket.full = None
        bucket.arrived = 0


def on_grad_ready_stub(param, bucket):
    raise NotImplementedError("exercise: replace this line with your solution")


def on_grad_ready_n_copies(param, bucket):
    # The seed blog's "reduce-scatter": N copies of the gradient concatenated as input.
    if bucket.full is None:
        bucket.full = bucket.group.new_full()
    bucket.group.views(bucket.full)[bucket.index(param)].copy_(param.grad)
    param.grad = None
    bucket.arrived += 1
    if bucket.arrived == len(bucket.group.params):
        n = dist.get_world_size()
        averaged = torch.empty_like(bucket.full)
        dist.reduce_scatter_single(averaged, torch.cat([bucket.full] * n),
                                   op=dist.ReduceOp.AVG)
        bucket.owned_grad += bucket.group.shard(averaged)
        bucket.full = None
        bucket.arrived = 0


def on_grad_ready_returns_none(param, bucket):
    # Right values, but "discards" the full gradient by returning None, which keeps it.
    if bucket.full is None:
        bucket.full = bucket.group.new_full()
    bucket.group.views(bucket.full)[bucket.index(param)].copy_(param.grad)
    bucket.arrived += 1
    if bucket.arrived == len(bucket.group.params):
        owned = bucket.group.new_shard()
        dist.reduce_scatter_single(owned, bucket.full, op=dist.ReduceOp.AVG)
        bucket.owned_grad += owned
        bucket.full = None
        bucket.arrived = 0
    return None


def test_bucket_hook_accepts_the_reference(judge, capsys):
    judge("bucket_hook", on_grad_ready)
    assert "2/2 layouts pass on 3 ranks" in capsys.readouterr().out


def test_bucket_hook_rejects_the_stub():
    with pytest.raises(ExerciseFailed, match="not implemented yet"):
        grading.check_bucket_hook(on_grad_ready_stub)


def test_bucket_hook_rejects_n_concatenated_copies(judge):
    with pytest.raises(ExerciseFailed, match="3 times the bucket") as err:
        judge("bucket_hook", on_grad_ready_n_copies)
    assert "concatenated N copies" in str(err.value)


def test_bucket_hook_rejects_returning_none_to_discard(judge):
    with pytest.raises(ExerciseFailed, match="still hold a full .grad") as err:
        judge("bucket_hook", on_grad_ready_returns_none)
    assert "Returning None from a hook discards nothing" in str(err.value)


def test_checks_refuse_a_lambda():
    with pytest.raises(ExerciseFailed, match="not a lambda"):
        grading.check_owned_range(lambda numel, world_size, rank: (0, numel))


# ------------------------------------------------------------------ one launch for all

RUNS = [
    ("owned_range", owned_range_remainder_to_last),
    ("sharded_step", sharded_step),
    ("sharded_step", sharded_step_all_reduce),
    ("sharded_step", sharded_step_summed),
    ("bucket_hook", on_grad_ready),
    ("bucket_hook", on_grad_ready_n_copies),
    ("bucket_hook", on_grad_ready_returns_none),
]
EXERCISES = {"owned_range": (OWNED_RANGE, "check_owned_range", judge_owned_range),
             "sharded_step": (SHARDED_STEP, "check_sharded_step", judge_sharded_step),
             "bucket_hook": (BUCKET_HOOK, "check_bucket_hook", judge_bucket_hook)}


@pytest.fixture(scope="module")
def graded():
    """Every (exercise, function) above, run on 3 ranks in a single launch."""
    return run_on_ranks("tests", [(EXERCISES[exercise][0], [fn]) for exercise, fn in RUNS])


@pytest.fixture
def judge(graded):
    def run(exercise, fn):
        _, name, verdict = EXERCISES[exercise]
        verdict(name, graded[f"{exercise}:{fn.__name__}"])
    return run
