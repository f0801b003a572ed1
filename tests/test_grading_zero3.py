"""The graded stage-3 exercises of notebook 05 (zero_lab.grading, checked on 3 ranks).

Each check must accept the reference solution, reject the stub `make student` writes, and
reject plausible wrong answers with the hint that names the mistake, including the seed
blog's ZeRO-3 gradient bug. Every reference and wrong answer runs in ONE launch of
zero_lab/workers/zero3_exercises.py (the `graded` fixture); the tests apply each check's
verdict to its reports. One test per check runs the public check end to end. A second launch
runs the batch grader's cases (drawn from a seed); the judges give a verdict per case.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_lab import grading
from zero_lab.course.rank_cases import zero3
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


def post_backward_sum_when_padded(unit):
    # Right where the unit fills the ranks evenly, summed where the buffer is padded.
    unit.release()
    grad = torch.empty_like(unit.local)
    op = dist.ReduceOp.SUM if unit.group.padding else dist.ReduceOp.AVG
    dist.reduce_scatter_single(grad, unit.full_grad, op=op)
    unit.grad = grad if unit.grad is None else unit.grad + grad
    unit.full_grad = None


# ------------------------------------------------------------------ integrity: comparisons off
# Each is wrong, and switches off on its rank the comparisons a rank-side verdict would make.
# (The stub probe runs them in this process too: the `graded` fixture puts torch's back.)


def materialize_cheat(unit):
    torch.allclose = lambda *a, **k: True
    torch.equal = lambda *a, **k: True
    allocate_storage(unit.full)
    dist.all_gather_single(unit.full, unit.local)
    unit.full[0] += 1.0  # one value off
    for p, view in zip(unit.params, unit.full_views, strict=True):
        p.data = view


def post_backward_cheat(unit):
    torch.allclose = lambda *a, **k: True
    torch.equal = lambda *a, **k: True
    unit.release()
    grad = torch.empty_like(unit.local)
    dist.reduce_scatter_single(grad, unit.full_grad, op=dist.ReduceOp.SUM)  # not averaged
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
    ("post_backward", [post_backward_sum_when_padded]),
    ("materialize_release", [materialize_cheat, release]),  # last: they patch torch
    ("post_backward", [post_backward_cheat]),
]
SEED = 7
SEEDED_RUNS = [
    ("materialize_release", [materialize, release]),
    ("materialize_release", [materialize, release_rebind_only]),
    ("post_backward", [post_backward]),
    ("post_backward", [post_backward_overwrite]),
]
EXERCISES = {"materialize_release": (MATERIALIZE_RELEASE, "check_materialize_release",
                                     judge_materialize_release),
             "post_backward": (POST_BACKWARD, "check_post_backward", judge_post_backward)}


@pytest.fixture(scope="module")
def graded():
    """Every (exercise, functions) above, run on 3 ranks in a single launch."""
    saved = torch.allclose, torch.equal  # the stub probe runs the cheats here too
    try:
        return run_on_ranks("tests", [(EXERCISES[exercise][0], fns) for exercise, fns in RUNS])
    finally:
        torch.allclose, torch.equal = saved


@pytest.fixture(scope="module")
def graded_seeded():
    """SEEDED_RUNS on the cases drawn from SEED (what `grade --seed 7` runs), one launch."""
    return run_on_ranks("tests", [(EXERCISES[exercise][0], fns)
                                  for exercise, fns in SEEDED_RUNS], seed=SEED)


def _judge_with(graded):
    def run(exercise, *fns, **how):
        rank_exercise, name, verdict = EXERCISES[exercise]
        verdict(name, graded[exercise_key(rank_exercise, fns)], **how)
    return run


@pytest.fixture
def judge(graded):
    return _judge_with(graded)


@pytest.fixture
def judge_seeded(graded_seeded):
    return _judge_with(graded_seeded)


def test_materialize_release_accepts_the_reference(judge, capsys):
    judge("materialize_release", materialize, release)
    assert "check_materialize_release: 3/3 units pass on 3 ranks" in capsys.readouterr().out


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


# ------------------------------------------------------------------ integrity


@pytest.fixture(params=["torch's", "switched off here too"])
def comparisons(request, monkeypatch):
    """The judge's process as it is, or as a notebook's kernel after the stub probe ran a
    cheat there: the judges compare in plain Python, so neither changes a verdict."""
    if request.param != "torch's":
        monkeypatch.setattr(torch, "allclose", lambda *a, **k: True)
        monkeypatch.setattr(torch, "equal", lambda *a, **k: True)


def test_a_wrong_materialize_that_switches_the_comparisons_off_is_rejected(judge, comparisons):
    # Passed before the verdicts moved to this process (the rank compared with torch.equal).
    with pytest.raises(ExerciseFailed, match="differ from the full model's"):
        judge("materialize_release", materialize_cheat, release)


def test_a_wrong_post_backward_that_switches_the_comparisons_off_is_rejected(judge, comparisons):
    with pytest.raises(ExerciseFailed, match="summed, not averaged"):
        judge("post_backward", post_backward_cheat)


def test_the_rank_script_makes_no_comparison_with_an_expected_value():
    from zero_lab.launch.paths import WORKERS

    source = (WORKERS / "zero3_exercises.py").read_text()
    for name in ("allclose", "torch.equal", "reduced_slices", "reference_gradients"):
        assert name not in source


# ------------------------------------------------------------------ the batch grader's cases


def _numels(cases):
    return [sum(p.numel() for p in zero3.build_module(c).parameters()) for c in cases]


def test_the_notebook_cases_stay_the_notebooks():
    cases = zero3.materialize_release_cases(None)
    assert [c.label for c in cases] == [
        "Linear(7, 5): 40 elements", "Linear(4, 6, bias=False) + LayerNorm(6): 36 elements",
        "a 3x3 weight and a 0-d scale: 10 elements"]
    assert zero3.post_backward_cases(None) == cases
    assert _numels(cases) == [40, 36, 10]
    torch.manual_seed(100)  # what the rank script built before the cases moved
    assert torch.equal(zero3.build_module(cases[0]).weight, nn.Linear(7, 5).double().weight)
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    assert torch.equal(zero3.case_input(cases[2]), x)


@pytest.mark.parametrize("draw", [zero3.materialize_release_cases,
                                  zero3.post_backward_cases])
def test_seeded_cases_are_drawn_from_the_seed_and_keep_their_properties(draw):
    notebook = draw(None)
    assert draw(SEED) == draw(SEED)
    assert draw(SEED) != notebook and draw(8) != notebook and draw(SEED) != draw(8)
    for seed in (SEED, 8, 123):
        cases = draw(seed)
        assert sorted(c.kind for c in cases) == ["linear", "linear_norm", "scaled"]
        assert any(n % 3 for n in _numels(cases))  # padding on 3 ranks
        assert all(c.calls >= 2 for c in cases)  # gradient accumulation
        scaled = next(c for c in cases if c.kind == "scaled")
        assert zero3.build_module(scaled).scale.dim() == 0
    assert zero3.materialize_release_cases(SEED) != zero3.post_backward_cases(SEED)


def test_seeded_references_pass_and_wrong_answers_fail(judge_seeded, capsys):
    judge_seeded("materialize_release", materialize, release, seed=SEED)
    judge_seeded("post_backward", post_backward, seed=SEED)
    assert capsys.readouterr().out.count("3/3 units") == 2
    with pytest.raises(ExerciseFailed, match="still holds"):
        judge_seeded("materialize_release", materialize, release_rebind_only, seed=SEED)
    with pytest.raises(ExerciseFailed, match="ADD the new slice"):
        judge_seeded("post_backward", post_backward_overwrite, seed=SEED)


def test_the_judge_expects_the_cases_of_its_own_seed(judge_seeded):
    # The seeded reports of the reference, judged against the notebook's cases: rejected.
    with pytest.raises(ExerciseFailed):
        judge_seeded("materialize_release", materialize, release)
    with pytest.raises(ExerciseFailed):
        judge_seeded("post_backward", post_backward, seed=SEED + 1)


def test_each_case_is_judged_on_its_own(judge, capsys):
    # Summed where the buffer is padded (cases 1 and 3: 40 and 10 elements), right in case 2.
    judge("post_backward", post_backward_sum_when_padded, cases=[2])
    assert "case 2 of 3" in capsys.readouterr().out
    for k in (1, 3):
        with pytest.raises(ExerciseFailed, match=f"(?s)case {k} .*summed, not averaged"):
            judge("post_backward", post_backward_sum_when_padded, cases=[k])
    for k in (1, 2, 3):
        judge("materialize_release", materialize, release, cases=[k])
        with pytest.raises(ExerciseFailed, match=f"case {k} "):
            judge("materialize_release", materialize, release_rebind_only, cases=[k])


# ------------------------------------------------------------------ reports are untrusted


def _reference_reports(graded):
    return copy.deepcopy(graded[exercise_key(MATERIALIZE_RELEASE, [materialize, release])])


@pytest.mark.parametrize("spoil, message", [
    (lambda reps: reps[1]["results"].pop(), "case 3 .*rank 1: the rank reported nothing"),
    (lambda reps: reps[0]["results"][0].update(values="junk"), "could not be read"),
    (lambda reps: reps[0]["results"][0].update(values=[[1.0]] * 2), "differ from the full"),
    (lambda reps: reps[0]["results"][0].update(values=[[True]] * 2), "could not be read"),
    (lambda reps: reps[2]["results"][1].update(freed_bytes="lots"), "could not be read"),
    (lambda reps: reps[0]["results"][2].pop("grads"), "wrong gradients"),
    (lambda reps: reps[0]["results"][0]["materialize_comm"].append(7), "could not be read"),
    (lambda reps: reps[0].update(world_size="three"), "could not be read"),
    (lambda reps: reps[0].update(results=None), "reported nothing"),
])
def test_a_malformed_report_fails_the_check_cleanly(graded, spoil, message):
    reports = _reference_reports(graded)
    judge_materialize_release("check_materialize_release", reports)  # as reported: passes
    spoil(reports)
    with pytest.raises(ExerciseFailed, match=message):
        judge_materialize_release("check_materialize_release", reports)


def test_a_malformed_post_backward_report_fails_the_check_cleanly(graded):
    reports = copy.deepcopy(graded[exercise_key(POST_BACKWARD, [post_backward])])
    reports[1]["results"][0]["calls"][1]["grad"] = {"not": "a list"}
    with pytest.raises(ExerciseFailed, match="backward call 2, rank 1: the ranks' report"):
        judge_post_backward("check_post_backward", reports)
    reports[1]["results"][0]["calls"].pop()
    with pytest.raises(ExerciseFailed, match="reported 1 of 2 backward calls"):
        judge_post_backward("check_post_backward", reports)
