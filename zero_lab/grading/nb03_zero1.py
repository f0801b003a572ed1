"""Notebook 03's checks: ZeRO stage 1's owned slice and sharded step, on 3 ranks.

The learner's function runs inside a real process group: its source is written to a file
and zero_lab/workers/zero1_zero2_exercises.py runs it on every rank (gloo, CPU), next to the
reference. The ranks report facts (values, the collectives issued and their bytes); the
judges here decide the verdict and the hint.
"""

from __future__ import annotations

from collections.abc import Callable

from zero_lab.grading.framework import (
    NOT_IMPLEMENTED_HINT,
    SUMMED_NOT_AVERAGED_HINT,
    fail,
    first_values_differ,
    largest_difference,
    passed,
)
from zero_lab.grading.remote import RankExercise, comm_summary, run_exercise


def _sharded_step_probe() -> tuple:
    import torch
    from torch import nn

    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.zeros(2)
    return torch.zeros(6), torch.zeros(6), param, torch.optim.SGD([param], lr=0.1)


OWNED_RANGE = RankExercise("zero1_zero2_exercises.py", "owned_range", lambda: (10, 3, 0))
SHARDED_STEP = RankExercise("zero1_zero2_exercises.py", "sharded_step", _sharded_step_probe)


def check_owned_range(fn: Callable) -> None:
    """Notebook 03: fn(numel, world_size, rank) -> (start, end) of the slice `rank` owns.

    The flat buffer of `numel` elements is padded at the end to N·S, S = ceil(numel / N);
    rank r owns [r·S, (r+1)·S). Each of 3 ranks asks for its own slice; the slices are then
    used in a real all-gather that must rebuild the buffer.
    """
    name = "check_owned_range"
    judge_owned_range(name, run_exercise(name, OWNED_RANGE, [fn]))


def judge_owned_range(name: str, reports: list[dict]) -> None:
    """The verdict on rank 0's report of every rank's slice: equal, contiguous, covering."""
    report = reports[0]  # rank 0 gathered every rank's answers
    n = report["world_size"]
    for i, case in enumerate(report["cases"], start=1):
        numel, answers = case["numel"], case["answers"]
        size = -(-numel // n)
        expected = [[r * size, (r + 1) * size] for r in range(n)]
        got = [a["got"] for a in answers]
        where = f"case {i}/{len(report['cases'])} (numel={numel}, world_size={n})"
        for rank, a in enumerate(answers):
            if a["error"]:
                if a["error"].startswith("NotImplementedError"):
                    fail(name, "not implemented yet", NOT_IMPLEMENTED_HINT)
                fail(name, f"{where}: rank {rank} raised {a['error']}")
        if got == expected:
            if not case["roundtrip"]:
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
    passed(name, f"{len(report['cases'])}/{len(report['cases'])} buffer sizes pass on {n} ranks",
           "you can pad a flat buffer and split it into the equal slices the ranks own")


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


def judge_sharded_step(name: str, reports: list[dict]) -> None:
    """The verdict on every rank's steps: one process's values, then 2Ψ sent, no more."""
    n = reports[0]["world_size"]
    records = [(rank, record) for rank, report in enumerate(reports)
               for record in report["results"]]

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
        # by ~1e-10 only: SGD's case shows that mistake plainly.
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
    cases = len(reports[0]["results"])
    passed(name, f"{cases}/{cases} cases pass on {n} ranks: same values as one process, 2Ψ sent",
           "you wrote stage 1: reduce-scatter, step your slice, all-gather, the bytes of DDP")
