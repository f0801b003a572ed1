"""Notebook 02's graded ring reduce-scatter (zero_lab.grading, checked on 3 ranks).

The check must accept the reference ring, reject the stub and plausible wrong rings with the
hint that names the mistake, and reject a wrong ring that switches off the comparisons on its
rank (the verdict is the judge's, in this process). The references and wrong rings run in ONE
launch of zero_lab/workers/ring_exercise.py (the `graded` fixture); a second launch runs the
batch grader's cases, drawn from a seed. One test runs the public check end to end.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from zero_lab import grading
from zero_lab.course.rank_cases.ring import (
    DTYPES,
    RingCase,
    rank_inputs,
    ring_reduce_scatter_cases,
)
from zero_lab.grading import ExerciseFailed
from zero_lab.grading.nb02_collectives import RING_REDUCE_SCATTER, judge_ring_reduce_scatter
from zero_lab.grading.remote import exercise_key, run_on_ranks

NAME = "check_ring_reduce_scatter"

# The learner functions below are run from their source on 3 fresh ranks, so each uses only
# torch and dist (which the rank script provides).


def reference_ring_reduce_scatter(output, input):
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = input.reshape(-1).clone().split(output.numel())
    for step in range(n - 1):
        send, recv = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[recv])
        requests = [dist.isend(chunks[send], dst=right), dist.irecv(incoming, src=left)]
        for request in requests:
            request.wait()
        chunks[recv].add_(incoming)
    output.copy_(chunks[rank].view(output.shape))


def stub_ring_reduce_scatter(output, input):
    raise NotImplementedError("exercise: replace this line with your solution")


def torch_ring_reduce_scatter(output, input):  # right values, but not built from send/recv
    dist.reduce_scatter_single(output, input)


def no_sum_ring_reduce_scatter(output, input):  # keeps its own chunk, never adds
    rank = dist.get_rank()
    output.copy_(input.reshape(-1).split(output.numel())[rank].view(output.shape))


def in_place_ring_reduce_scatter(output, input):  # right values, summed into `input` itself
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = input.reshape(-1).split(output.numel())
    for step in range(n - 1):
        send, recv = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[recv])
        requests = [dist.isend(chunks[send], dst=right), dist.irecv(incoming, src=left)]
        for request in requests:
            request.wait()
        chunks[recv].add_(incoming)
    output.copy_(chunks[rank].view(output.shape))


def unwritten_ring_reduce_scatter(output, input):  # sums, then returns the chunk instead
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = input.reshape(-1).clone().split(output.numel())
    for step in range(n - 1):
        send, recv = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[recv])
        requests = [dist.isend(chunks[send], dst=right), dist.irecv(incoming, src=left)]
        for request in requests:
            request.wait()
        chunks[recv].add_(incoming)
    return chunks[rank]


def float32_ring_reduce_scatter(output, input):
    # Right on int64 and float32, wrong on float64: the sum goes through torch.zeros' float32.
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = input.reshape(-1).clone().split(output.numel())
    for step in range(n - 1):
        send, recv = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[recv])
        requests = [dist.isend(chunks[send], dst=right), dist.irecv(incoming, src=left)]
        for request in requests:
            request.wait()
        chunks[recv].add_(incoming)
    result = torch.zeros(output.numel())
    result += chunks[rank]
    output.copy_(result.view(output.shape))


def cheat_ring_reduce_scatter(output, input):
    # Wrong by one everywhere, and switches off the comparisons a rank-side verdict made.
    torch.allclose = lambda *a, **k: True
    torch.equal = lambda *a, **k: True
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = input.reshape(-1).clone().split(output.numel())
    for step in range(n - 1):
        send, recv = (rank - step - 1) % n, (rank - step - 2) % n
        incoming = torch.empty_like(chunks[recv])
        requests = [dist.isend(chunks[send], dst=right), dist.irecv(incoming, src=left)]
        for request in requests:
            request.wait()
        chunks[recv].add_(incoming)
    output.copy_(chunks[rank].view(output.shape) + 1)


RUNS = [reference_ring_reduce_scatter, torch_ring_reduce_scatter, no_sum_ring_reduce_scatter,
        in_place_ring_reduce_scatter, unwritten_ring_reduce_scatter,
        float32_ring_reduce_scatter,
        cheat_ring_reduce_scatter]  # last: it patches torch on its ranks
SEED = 7
SEEDED_RUNS = [reference_ring_reduce_scatter, no_sum_ring_reduce_scatter]


@pytest.fixture(scope="module")
def graded():
    """Every function of RUNS, run on 3 ranks in a single launch."""
    saved = torch.allclose, torch.equal  # the stub probe runs the cheat here too
    try:
        return run_on_ranks("tests", [(RING_REDUCE_SCATTER, [fn]) for fn in RUNS])
    finally:
        torch.allclose, torch.equal = saved


@pytest.fixture(scope="module")
def graded_seeded():
    """SEEDED_RUNS on the cases drawn from SEED (what `grade --seed 7` runs), one launch."""
    return run_on_ranks("tests", [(RING_REDUCE_SCATTER, [fn]) for fn in SEEDED_RUNS],
                        seed=SEED)


def reports(graded, fn):
    return graded[exercise_key(RING_REDUCE_SCATTER, [fn])]


# ------------------------------------------------------------------ the public check


def test_check_ring_reduce_scatter_rejects_the_stub_without_a_launch():
    with pytest.raises(ExerciseFailed) as failed:
        grading.check_ring_reduce_scatter(stub_ring_reduce_scatter)
    assert "not implemented yet" in str(failed.value)
    assert "replace the `raise NotImplementedError`" in str(failed.value)


# ---------------------------------------------------------- the judge on the notebook's cases


def test_the_judge_accepts_the_reference(graded, capsys):
    judge_ring_reduce_scatter(NAME, reports(graded, reference_ring_reduce_scatter))
    assert "✓ check_ring_reduce_scatter: 5/5 cases pass on 3 ranks" in capsys.readouterr().out


@pytest.mark.parametrize("fn, message, hint", [
    (torch_ring_reduce_scatter, "your function called reduce_scatter", "isend / dist.irecv"),
    (no_sum_ring_reduce_scatter, "case 1/5 (output (1,) int64, input (3,)), rank 0",
     "kept its own chunk r without the other ranks' contributions"),
    (in_place_ring_reduce_scatter, "`input` was modified", "input.clone()"),
    (unwritten_ring_reduce_scatter, "got:                     [-7]",
     "output was never written"),
], ids=["calls-torch", "no-sum", "in-place", "unwritten"])
def test_the_judge_rejects_wrong_answers(graded, fn, message, hint):
    with pytest.raises(ExerciseFailed) as failed:
        judge_ring_reduce_scatter(NAME, reports(graded, fn))
    assert message in str(failed.value) and hint in str(failed.value)


def test_a_wrong_ring_that_switches_the_comparisons_off_is_rejected(graded):
    # Passed before the verdict moved to this process (the ranks compared with torch.allclose).
    with pytest.raises(ExerciseFailed, match=r"case 1/5 .*, rank 0\n  expected") as failed:
        judge_ring_reduce_scatter(NAME, reports(graded, cheat_ring_reduce_scatter))
    assert "step s: send chunk" in str(failed.value)


def test_each_case_is_judged_on_its_own_for_partial_credit(graded, capsys):
    # float32_ring is right on the int64 and float32 cases (1, 2, 4), not on float64 (3, 5).
    got = reports(graded, float32_ring_reduce_scatter)
    for k in (1, 2, 4):
        judge_ring_reduce_scatter(NAME, got, cases=[k])
        assert f"case {k} of 5 pass on 3 ranks" in capsys.readouterr().out
    for k in (3, 5):
        with pytest.raises(ExerciseFailed, match=rf"case {k}/5 \(.* float64, .*\), rank 0"):
            judge_ring_reduce_scatter(NAME, got, cases=[k])
    with pytest.raises(ExerciseFailed, match="case 3/5"):
        judge_ring_reduce_scatter(NAME, got)
    with pytest.raises(ExerciseFailed, match="there is no case 6"):
        judge_ring_reduce_scatter(NAME, got, cases=[6])


# ------------------------------------------------------------------ untrusted reports


@pytest.mark.parametrize("corrupt, message", [
    (lambda r: r[1]["results"].pop(2), r"case 3/5 \(output \(7,\) float64, input \(21,\)\), "
                                       "rank 1: the rank reported nothing for this case"),
    (lambda r: r[0]["results"][0].update(output="17"), "case 1/5 .*could not be read"),
    (lambda r: r[0]["results"][0].update(output=[None]), "case 1/5 .*could not be read"),
    (lambda r: r[0]["results"][0].update(output=[True]), "case 1/5 .*could not be read"),
    (lambda r: r[2]["results"][3].pop("sent_bytes"), "case 4/5 .*could not be read"),
    (lambda r: r[0]["results"][0].update(ops=7), "case 1/5 .*could not be read"),
    (lambda r: r[0].update(world_size="many"), "the launch: the ranks' report could not"),
    (lambda r: r.pop(), "the launch: the ranks' report could not be read"),
    (lambda r: r[0]["results"][1].update(output=[float("nan")] * 5), "(?s)case 2/5 .*expected"),
], ids=["missing-case", "str", "none", "bool", "no-bytes", "ops", "world", "a-rank-short", "nan"])
def test_a_malformed_report_fails_the_check_cleanly(graded, corrupt, message):
    bad = copy.deepcopy(reports(graded, reference_ring_reduce_scatter))
    corrupt(bad)
    with pytest.raises(ExerciseFailed, match=message):
        judge_ring_reduce_scatter(NAME, bad)


# ------------------------------------------------------------------ the batch grader's cases


def test_the_notebook_cases_and_inputs_are_unchanged():
    cases = ring_reduce_scatter_cases(None)
    assert [(c.shape, c.dtype) for c in cases] == [
        ((1,), "int64"), ((5,), "int64"), ((7,), "float64"), ((1001,), "float32"),
        ((4, 3), "float64")]
    assert cases[4].label(3) == "output (4, 3) float64, input (12, 3)"
    for rank in range(3):  # as the rank script drew them before the cases moved
        gen = torch.Generator().manual_seed(100 + rank)
        for case, got in zip(cases, rank_inputs(cases, rank, 3), strict=True):
            shape, dtype = case.input_shape(3), DTYPES[case.dtype]
            if dtype.is_floating_point:
                old = torch.randn(shape, generator=gen, dtype=dtype)
            else:
                old = torch.randint(-50, 50, shape, generator=gen, dtype=dtype)
            assert torch.equal(got, old)


def is_prime(p: int) -> bool:
    return p > 1 and all(p % d for d in range(2, p))


@pytest.mark.parametrize("seed", range(12))
def test_seeded_cases_are_drawn_from_the_seed_and_keep_their_properties(seed):
    cases = ring_reduce_scatter_cases(seed)
    assert cases == ring_reduce_scatter_cases(seed)  # deterministic
    assert cases != ring_reduce_scatter_cases(None)
    assert cases != ring_reduce_scatter_cases(seed + 1)
    assert all(isinstance(c, RingCase) for c in cases) and len(cases) == 5
    sizes = [c.shape[0] for c in cases if len(c.shape) == 1]
    assert sizes[0] == 1 and sizes[1] % 2 == 1 and is_prime(sizes[2]) and sizes[3] % 2 == 1
    assert sizes[3] > 500  # a large chunk, as 1001
    assert any(len(c.shape) == 2 for c in cases)
    assert {c.dtype for c in cases} == set(DTYPES)
    # Each rank's input draws from the seed: not the notebook's generator.
    assert len({c.gen_seed for c in cases}) == 5 and 100 not in {c.gen_seed for c in cases}


def test_seeded_shapes_vary_across_seeds():
    drawn = {tuple((c.shape, c.dtype) for c in ring_reduce_scatter_cases(s)) for s in range(12)}
    assert len(drawn) == 12


def test_the_judge_accepts_the_reference_on_seeded_cases(graded_seeded, capsys):
    judge_ring_reduce_scatter(NAME, reports(graded_seeded, reference_ring_reduce_scatter),
                              seed=SEED)
    assert "5/5 cases pass on 3 ranks" in capsys.readouterr().out
    labels = [r["label"] for r in reports(graded_seeded, reference_ring_reduce_scatter)[0][
        "results"]]
    assert labels == [c.label(3) for c in ring_reduce_scatter_cases(SEED)]
    assert labels != [c.label(3) for c in ring_reduce_scatter_cases(None)]


def test_the_judge_rejects_a_wrong_ring_on_seeded_cases(graded_seeded):
    got = reports(graded_seeded, no_sum_ring_reduce_scatter)
    for k in range(1, 6):
        with pytest.raises(ExerciseFailed, match=f"(?s)case {k}/5 .*kept its own chunk"):
            judge_ring_reduce_scatter(NAME, got, seed=SEED, cases=[k])
    # The notebook's cases are not the seed's: judged against them, the reports do not fit.
    with pytest.raises(ExerciseFailed):
        judge_ring_reduce_scatter(NAME, reports(graded_seeded, reference_ring_reduce_scatter))
