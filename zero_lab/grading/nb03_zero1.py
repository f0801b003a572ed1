"""Notebook 03's checks: ZeRO stage 1's owned slice and sharded step, on 3 ranks.

The learner's function runs inside a real process group: its source is written to a file
and zero_lab/workers/zero1_zero2_exercises.py runs it on every rank (gloo, CPU). The ranks
report what it produced (values, the collectives issued and their bytes); the judges here
rebuild the same cases (zero_lab/course/rank_cases/zero1_zero2.py), compute the expected
values with the reference in this process, and decide the verdict and the hint. Nothing on
the ranks compares: the learner's code runs there and could change what compares.

A judge takes the cases' `seed` (None: the notebook's) and `cases`, the 1-based numbers of
the cases to judge (None: all; the batch grader judges one case at a time, a point each).
What a rank reported is read as untrusted data: a malformed report fails the check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zero_lab.course.rank_cases.zero1_zero2 import (
    GATHERED_REPORTED,
    one_process_steps,
    owned_range,
    owned_range_cases,
    sharded_step_cases,
)
from zero_lab.grading.framework import (
    SUMMED_NOT_AVERAGED_HINT,
    fail,
    first_values_differ,
    largest_difference,
    passed,
)
from zero_lab.grading.rank_reports import (
    as_comm,
    as_count,
    as_floats,
    case_record,
    chosen_cases,
    close,
    same,
    unreadable,
)
from zero_lab.grading.remote import RankExercise, comm_summary, run_exercise

RTOL, ATOL = 1e-9, 1e-12  # float64 throughout: a sharded step differs in rounding only


def _sharded_step_probe() -> tuple:
    import torch
    from torch import nn

    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.zeros(2)
    return torch.zeros(6), torch.zeros(6), param, torch.optim.SGD([param], lr=0.1)


OWNED_RANGE = RankExercise("zero1_zero2_exercises.py", "owned_range", lambda: (10, 3, 0),
                           owned_range_cases)
SHARDED_STEP = RankExercise("zero1_zero2_exercises.py", "sharded_step", _sharded_step_probe,
                            sharded_step_cases)


# --------------------------------------------------------------------------- owned range


def check_owned_range(fn: Callable) -> None:
    """Notebook 03: fn(numel, world_size, rank) -> (start, end) of the slice `rank` owns.

    The flat buffer of `numel` elements is padded at the end to N·S, S = ceil(numel / N);
    rank r owns [r·S, (r+1)·S). Each of 3 ranks asks for its own slice; the slices are then
    used in a real all-gather that must rebuild the buffer.
    """
    name = "check_owned_range"
    judge_owned_range(name, run_exercise(name, OWNED_RANGE, [fn]))


def _owned_answer(name: str, where: str, rank: int, value: Any) -> list[int]:
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        unreadable(name, where, f"rank {rank}'s (start, end)")
    return value


def judge_owned_range(name: str, reports: list[dict], seed: int | None = None,
                      cases: Sequence[int] | None = None) -> None:
    """The verdict on every rank's slice: equal, contiguous, covering; then the all-gather."""
    n = len(reports)
    all_cases = owned_range_cases(seed)
    for k, case in chosen_cases(name, all_cases, cases):
        numel = case.numel
        where = f"case {k}/{len(all_cases)} ({case.label(n)})"
        records = [case_record(name, reports, rank, k, where) for rank in range(n)]
        size = -(-numel // n)
        expected = [list(owned_range(numel, n, r)) for r in range(n)]
        got = [_owned_answer(name, where, rank, r.get("got")) for rank, r in enumerate(records)]
        if got == expected:
            data = [float(i) for i in range(1, numel + 1)]
            if numel <= GATHERED_REPORTED and any(r.get("gathered") != data for r in records):
                fail(name, f"{where}: the all-gather of the owned slices did not rebuild "
                           "the buffer", "each rank must send exactly its own elements")
            continue
        sizes = [hi - lo for lo, hi in got]
        detail = (f"{where}\n  expected (start, end) per rank: {expected}"
                  f"\n  got:                            {got}")
        if len(set(sizes)) > 1:
            hint = ("every rank must own the same number of elements, S = ceil(numel / N): "
                    "reduce-scatter and all-gather cut the buffer into N equal chunks. Pad the "
                    "end of the buffer rather than giving one rank the remainder (or clipping "
                    "the last slice at numel)")
        elif sizes[0] * n < numel:
            hint = (f"{numel - sizes[0] * n} element(s) at the end are owned by no rank: round "
                    "the slice size up, S = ceil(numel / N); the padding fills the last slice")
        elif sizes[0] > size:
            hint = ("the slices are larger than needed: S = ceil(numel / N), so the padding "
                    "is less than N elements")
        else:
            hint = "rank r's slice starts at r·S: the slices are contiguous and in rank order"
        fail(name, detail, hint)
    if cases is None:
        passed(name, f"{len(all_cases)}/{len(all_cases)} buffer sizes pass on {n} ranks",
               "you can pad a flat buffer and split it into the equal slices the ranks own")


# --------------------------------------------------------------------------- sharded step


def check_sharded_step(fn: Callable) -> None:
    """Notebook 03: fn(flat_param, flat_grad, shard_param, optimizer) -> None, stage 1's step.

    flat_param: the padded flat parameters (N·S elements, the same on every rank);
    flat_grad: this rank's local, not yet averaged, gradient (N·S elements);
    shard_param: an nn.Parameter of S elements holding this rank's slice, the only tensor
    `optimizer` updates. Afterwards flat_param must hold every rank's updated slice, as one
    process applying `optimizer` to the average gradient would give, after one reduce-scatter
    and one all-gather of the padded buffer (2Ψ).
    """
    name = "check_sharded_step"
    judge_sharded_step(name, run_exercise(name, SHARDED_STEP, [fn]))


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return close(got, expected, RTOL, ATOL)


def _sharded_step_verdicts(name: str, reports: list, k: int, case, n: int) -> list[tuple]:
    """(rank, facts) for case k on every rank, at the first step whose values are wrong (or
    the last step): the facts today's verdict reads, from the values the rank reported."""
    numel, shard = case.numel, -(-case.numel // n)
    padded = shard * n
    averaged, summed = one_process_steps(case, n), one_process_steps(case, n, average=False)
    start = torch.zeros(padded, dtype=torch.float64)
    start[:numel] = case.init()
    label = case.label(n)
    verdicts = []
    for rank in range(n):
        record = case_record(name, reports, rank, k, f"case {k} ({label})")
        steps = record.get("steps")
        if not isinstance(steps, list) or len(steps) != case.steps or not all(
                isinstance(s, dict) for s in steps):
            unreadable(name, f"case {k} ({label}), rank {rank}", f"{case.steps} steps")
        before = start
        for step, (reported, ref, ref_sum) in enumerate(zip(steps, averaged, summed,
                                                            strict=True), start=1):
            at = f"case {k} ({label}), step {step}, rank {rank}"
            got = as_floats(name, at, reported.get("flat_param"), padded, "flat_param")
            state = reported.get("state_numels")
            if not isinstance(state, list):
                unreadable(name, at, "the optimizer's state sizes")
            facts = {
                "case": k, "label": label, "step": step, "padded": padded, "shard": shard,
                "match": _close(got[:numel], ref),
                "match_if_summed": _close(got[:numel], ref_sum),
                "own_slice_match": _close(got[rank * shard:min((rank + 1) * shard, numel)],
                                          ref[rank * shard:(rank + 1) * shard]),
                "unchanged": same(got, before),
                "expected": ref[:4].tolist(), "got": got[:4].tolist(),
                "comm": as_comm(name, at, reported.get("comm")),
                "state_numels": [as_count(name, at, v, "a state size") for v in state],
            }
            before = got
            if not facts["match"]:
                break  # the first wrong step is the one to show
        verdicts.append((rank, facts))
    return verdicts


def judge_sharded_step(name: str, reports: list[dict], seed: int | None = None,
                       cases: Sequence[int] | None = None) -> None:
    """The verdict on every rank's steps: one process's values, then 2Ψ sent, no more."""
    n = len(reports)
    all_cases = sharded_step_cases(seed)
    records = [verdict for k, case in chosen_cases(name, all_cases, cases)
               for verdict in _sharded_step_verdicts(name, reports, k, case, n)]

    def where(rank: int, record: dict) -> str:
        return f"case {record['case']} ({record['label']}), step {record['step']}, rank {rank}"

    for rank, record in records:
        if record["unchanged"]:
            fail(name, f"{where(rank, record)}: flat_param did not change",
                 "after optimizer.step() has updated shard_param, all-gather every "
                 "rank's updated slice into flat_param (dist.all_gather_single)")
    wrong = [(rank, record) for rank, record in records if not record["match"]]
    if wrong:
        # Show the case where the values are furthest apart. Adam divides by the gradient's
        # size, so a gradient N times too large (summed, not averaged) moves Adam's values
        # by ~1e-8 only: SGD's case shows that mistake plainly.
        rank, record = max(wrong, key=lambda w: (
            largest_difference(w[1]["expected"], w[1]["got"]) or (0.0, 0.0))[1])
        detail = (f"{where(rank, record)}: flat_param differs from one process stepping on "
                  "the average gradient" + first_values_differ(record["expected"], record["got"]))
        if record["match_if_summed"]:
            hint = SUMMED_NOT_AVERAGED_HINT
        elif record["own_slice_match"]:
            hint = ("this rank's own slice is right but the others are stale: "
                    "all-gather the updated slices into flat_param")
        else:
            hint = ("reduce-scatter flat_grad (averaging) into shard_param.grad, "
                    "call optimizer.step(), then all-gather shard_param into flat_param")
        fail(name, detail, hint)
    for rank, record in records:
        at, padded_bytes = where(rank, record), record["padded"] * 8
        ops = [c["op"] for c in record["comm"]]
        sizes = [c["nbytes"] for c in record["comm"]]
        if "all_reduce" in ops:
            fail(name, f"{at}: the values are right, but you sent "
                       f"{comm_summary(record['comm'])}",
                 "an all-reduce of the full gradient (2Ψ) plus the all-gather (Ψ) is "
                 "3Ψ per step; a reduce-scatter gives each rank just its averaged slice "
                 "for Ψ, so stage 1 costs 2Ψ, the same as plain data parallelism")
        if ops.count("broadcast") > 1:
            fail(name, f"{at}: the values are right, but you sent "
                       f"{comm_summary(record['comm'])}",
                 "N broadcasts move the same bytes as one all-gather but pay N "
                 "latencies and N synchronisations: use one dist.all_gather_single")
        if sorted(ops) != ["all_gather", "reduce_scatter"] or set(sizes) != {padded_bytes}:
            fail(name, f"{at}: expected one reduce_scatter and one all_gather of the "
                       f"padded buffer ({padded_bytes} bytes each); got "
                       f"{comm_summary(record['comm'])}",
                 "reduce-scatter flat_grad itself (N·S elements) and all-gather into "
                 "flat_param itself: no copies, no concatenation")
        if record["state_numels"] and record["state_numels"] != [record["shard"]]:
            fail(name, f"{at}: optimizer state tensors have {record['state_numels']} "
                       f"elements; expected {record['shard']} (this rank's slice)",
                 "step only shard_param")
    if cases is None:
        total = len(all_cases)
        passed(name, f"{total}/{total} cases pass on {n} ranks: same values as one process, "
                     "2Ψ sent",
               "you wrote stage 1: reduce-scatter, step your slice, all-gather, the bytes of DDP")
