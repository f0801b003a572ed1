"""The batch grader on notebook 03's two exercises on ranks: the ranks report what the learner's
function produced, and the grader's own process judges it, a point per case drawn from the seed.

A wrong step that also switches off `torch.allclose` and `torch.equal` on its ranks (a ✓ in a
notebook whose ranks compared next to the learner's code) scores 0 here: nothing on the ranks
gives a verdict. A slice that is right only when N divides the buffer earns the cases it gets
right.
"""

from __future__ import annotations

import pytest
from test_grade_batch import NB03, course, submit, with_body

from zero_lab.grading import batch
from zero_lab.grading.student import student_notebook

# Stage 1's step with the all-gather left out (only this rank's slice is new), beside the
# comparisons a rank-side check would have used, switched off on every rank.
PATCHED_WRONG_STEP = """torch.allclose = lambda *a, **k: True
torch.equal = lambda *a, **k: True
grad = torch.empty_like(shard_param)
dist.reduce_scatter_single(grad, flat_grad, op=dist.ReduceOp.AVG)
shard_param.grad = grad
optimizer.step()
n, r = dist.get_world_size(), dist.get_rank()
flat_param[r * shard_param.numel():(r + 1) * shard_param.numel()] = shard_param.detach()"""
# Floor division: right when N divides numel, the last elements owned by no rank otherwise.
FLOOR_SLICE = "shard = numel // world_size\nreturn rank * shard, (rank + 1) * shard"


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submitted")
    ref = course(NB03)
    submit(folder, "reference", {NB03: ref})
    submit(folder, "stub", {NB03: student_notebook(ref)[0]})
    submit(folder, "patched", {NB03: with_body(
        with_body(ref, "sharded_step", PATCHED_WRONG_STEP), "owned_range", FLOOR_SLICE)})
    done = batch.grade(folder, folder.parent / "reports", seed=11, jobs=2, only="03",
                       progress=lambda line: None)
    return {(g.student, g.exercise.check): g for g in done}


def test_the_reference_scores_every_case(graded):
    for check in ("check_owned_range", "check_sharded_step"):
        g = graded[("reference", check)]
        assert g.status == "pass" and g.points == g.max_points > 1, (check, g.lines)


def test_the_stub_scores_zero_without_starting_ranks(graded):
    for check in ("check_owned_range", "check_sharded_step"):
        g = graded[("stub", check)]
        assert g.points == 0 and g.lines == ["not implemented yet"], g.lines
        assert g.seconds < 30


def test_switching_off_the_comparisons_on_the_ranks_earns_nothing(graded):
    g = graded[("patched", "check_sharded_step")]
    assert g.points == 0 and g.status == "fail", g.lines
    assert any("all-gather" in line for line in g.lines), g.lines


def test_a_slice_right_only_when_n_divides_the_buffer_earns_those_cases(graded):
    g = graded[("patched", "check_owned_range")]
    assert 0 < g.points < g.max_points, (g.points, g.max_points, g.lines)
    failed = [line for line in g.lines if line.startswith("check_owned_range: case")]
    assert len(failed) == g.max_points - g.points, g.lines
    assert all("owned by no rank" in line for line in failed), g.lines
