"""Notebook 05's checks: a ZeRO stage-3 unit's materialize/release and post-backward, on 3 ranks.

The learner's functions run inside a real process group, as for notebooks 03 and 04, here
started through zero_lab/workers/zero3_exercises.py (which also provides free_storage and
allocate_storage to them). The ranks report raw facts (values as lists, collectives, storage
bytes and addresses, shapes); the judges here compute the expected values from the same cases
(zero_lab/course/rank_cases/zero3.py) in this process, where the learner's code does not run,
and decide verdicts and hints. The reports are untrusted data: anything malformed fails the
check with a message, never crashes the judge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from zero_lab.course.rank_cases.zero3 import (
    UnitCase,
    build_module,
    flat,
    materialize_release_cases,
    post_backward_cases,
    reduced_slices,
    reference_gradients,
    shard_numel,
)
from zero_lab.grading.framework import SUMMED_NOT_AVERAGED_HINT, fail, first_values_differ, passed
from zero_lab.grading.rank_reports import (
    as_comm,
    case_record,
    chosen_cases,
    close,
    ints,
    numbers,
    passed_cases,
    readable,
    world_size,
)
from zero_lab.grading.remote import RankExercise, comm_summary, run_exercise
from zero_lab.memory import model_state_bytes

RTOL, ATOL = 1e-10, 1e-12  # float64 all the way: only the order of additions differs


def _probe_unit():
    """A small unit outside any process group, for the stub probe."""
    import torch
    from torch import nn

    from zero_lab.stages.partition import FlatParamGroup
    from zero_lab.stages.zero3 import Unit

    params = [nn.Parameter(torch.zeros(2, 3))]
    unit = Unit("probe", nn.Module(), FlatParamGroup(params, 3, 0), torch.zeros(2))
    unit.grad, unit.full_grad = None, torch.zeros(6)
    return unit


def _bare_unit_probe() -> tuple:
    from zero_lab.course.exercises import BareUnit

    return (BareUnit(_probe_unit()),)


MATERIALIZE_RELEASE = RankExercise("zero3_exercises.py", "materialize_release",
                                   _bare_unit_probe, materialize_release_cases)
POST_BACKWARD = RankExercise("zero3_exercises.py", "post_backward", lambda: (_probe_unit(),),
                             post_backward_cases)


def _close(got: list[float], expected: list[float]) -> bool:
    return close(got, expected, RTOL, ATOL)


# ------------------------------------------------------------------ materialize / release


def check_materialize_release(materialize: Callable, release: Callable) -> None:
    """Notebook 05: materialize(unit) and release(unit), a stage-3 unit's lifecycle.

    `unit` (a zero_lab.course.exercises.BareUnit) has `params`, `group`, `local` (this rank's
    slice), `full` (the padded flat buffer, its storage freed at rest), `full_views` and
    `local_views`. materialize gives `full` its memory back, all-gathers every rank's
    slice into it (one collective) and makes each parameter its view of `full`; release
    makes each parameter its local piece again and frees `full`'s storage in place. Checked
    on 3 ranks and three odd-sized units; between the two, a forward pass saves activations,
    and a backward after a second materialize must give an unsharded copy's gradients.
    """
    name = "check_materialize_release"
    reports = run_exercise(name, MATERIALIZE_RELEASE, [materialize, release])
    judge_materialize_release(name, reports)


def judge_materialize_release(name: str, reports: list[dict], seed: int | None = None,
                              cases: Sequence[int] | None = None) -> None:
    """The verdict on every rank's units: gathered into `full` itself, freed in place.

    `seed` picks the cases the ranks ran (None: the notebook's); `cases`, the 1-based
    numbers of those to judge (None: all of them).
    """
    n = world_size(name, reports)
    all_cases = materialize_release_cases(seed)
    chosen = chosen_cases(name, all_cases, cases)
    expected = {}
    for k, case in chosen:  # the unsharded module's parameters and gradients
        params = list(build_module(case).parameters())
        expected[k] = ([list(p.shape) for p in params],
                       [p.detach().reshape(-1).tolist() for p in params],
                       flat(case, params, n),
                       [g.reshape(-1).tolist() for g in reference_gradients(case)])
    for rank in range(n):
        for k, case in chosen:
            r = case_record(name, reports, rank, k, f"case {k} ({case.label})")
            where = f"case {k} ({case.label}), rank {rank}"
            with readable(name, where):
                _judge_unit(name, where, case, n, rank, r, *expected[k])
    passed(name, f"{passed_cases(all_cases, chosen, 'units')} pass on {n} ranks: one all-gather "
                 "each, storage freed in place",
           "you wrote stage 3's gather, use and free: one unit is whole at a time")


def _judge_unit(name: str, where: str, case: UnitCase, n: int, rank: int, r: dict,
                shapes: list, values: list, full, grads: list) -> None:
    s = shard_numel(case, n)
    padded = s * n * 8
    if [ints(x) for x in r["shapes"]] != shapes:
        fail(name, f"{where}: after materialize the parameters do not have their full "
                   "shapes", "set each p.data to its view in unit.full_views")
    got = r["values"]
    if not isinstance(got, list) or len(got) != len(values):
        raise ValueError("not one list of values per parameter")
    if any(v is None for v in got):
        fail(name, f"{where}: after materialize the parameters' memory is freed",
             "give unit.full its memory back (allocate_storage(unit.full)), then all-gather "
             "every rank's slice into it: dist.all_gather_single(unit.full, unit.local)")
    if any(numbers(v) != e for v, e in zip(got, values, strict=True)):
        fail(name, f"{where}: after materialize the parameters differ from the full "
                   "model's", "all-gather every rank's slice (unit.local) into "
                              "unit.full: dist.all_gather_single(unit.full, unit.local)")
    ids, storage = [int(i) for i in r["full_ids"]], int(r["full_storage"])
    if len(set(ids)) != 1 or any(int(p) != storage for p in r["param_storages"]):
        fail(name, f"{where}: the parameters are right but do not view unit.full's own "
                   "storage",
             "gather into unit.full itself (after allocate_storage(unit.full)), not into "
             "a new tensor: autograd keeps views of the first one (weight.t(), ...), "
             "and only a refill of that same storage reaches them for backward")
    comm = as_comm(name, where, r["materialize_comm"])
    if [(c["op"], c["nbytes"]) for c in comm] != [("all_gather", padded)]:
        fail(name, f"{where}: materialize sent {comm_summary(comm)}; expected one "
                   f"all_gather of the padded buffer ({padded} bytes)",
             "one dist.all_gather_single of the whole flat buffer, not one collective "
             "per parameter or N broadcasts")
    released = as_comm(name, where, r["release_comm"])
    if released:
        fail(name, f"{where}: release sent {comm_summary(released)}",
             "releasing needs no communication: every rank keeps its own slice")
    if any(int(i) != ids[0] for i in r["released_ids"]):
        fail(name, f"{where}: after release, unit.full is a different tensor",
             "free the storage in place (free_storage(unit.full), i.e. "
             "unit.full.untyped_storage().resize_(0)); dropping or replacing the "
             "tensor leaves the memory alive in the views autograd saved")
    freed = int(r["freed_bytes"])
    if freed:
        fail(name, f"{where}: after release unit.full still holds {freed} bytes",
             "rebinding p.data alone frees nothing (a common way to release): "
             "autograd still references the full tensors. Free the storage itself: "
             "free_storage(unit.full)")

    def facts(items) -> list:  # [shape, storage address, data address] per tensor
        return [[ints(shape), int(storage), int(ptr)] for shape, storage, ptr in items]

    if facts(r["released"]) != facts(r["pieces"]) or len(r["pieces"]) != len(shapes):
        fail(name, f"{where}: after release the parameters are not their local pieces",
             "set each p.data back to its piece in unit.local_views")
    local = r["local"]
    if local is None or numbers(local) != full[rank * s:(rank + 1) * s].tolist():
        fail(name, f"{where}: unit.local changed", "never write into the local slice")
    got_grads = r.get("grads")
    if not isinstance(got_grads, list) or len(got_grads) != len(grads) or any(
            g is None or not _close(numbers(g), e)
            for g, e in zip(got_grads, grads, strict=True)):
        fail(name, f"{where}: backward after the second materialize gave wrong "
                   "gradients", "materialize must refill the same storage each time")


# ------------------------------------------------------------------ post-backward


def check_post_backward(fn: Callable) -> None:
    """Notebook 05: fn(unit), the end of a stage-3 unit's backward.

    Every gradient of the gathered `unit` (a zero_lab.stages.zero3.Unit) has arrived in
    `unit.full_grad` (N·S elements, this rank's local gradient). fn frees the full
    parameters (`unit.release()`), reduce-scatters `unit.full_grad` (average) into this
    rank's slice, ADDS it to `unit.grad` (None at first: then the slice itself) and drops
    `unit.full_grad`. Checked on 3 ranks, three units, two backward calls (accumulation).
    """
    name = "check_post_backward"
    judge_post_backward(name, run_exercise(name, POST_BACKWARD, [fn]))


def judge_post_backward(name: str, reports: list[dict], seed: int | None = None,
                        cases: Sequence[int] | None = None) -> None:
    """The verdict on every rank's backward calls: averaged slice added, Ψ sent, all freed.

    `seed` and `cases` as for judge_materialize_release.
    """
    n = world_size(name, reports)
    all_cases = post_backward_cases(seed)
    chosen = chosen_cases(name, all_cases, cases)
    for rank in range(n):
        for k, case in chosen:
            r = case_record(name, reports, rank, k, f"case {k} ({case.label})")
            calls = r.get("calls")
            if not isinstance(calls, list) or len(calls) < case.calls:
                fail(name, f"case {k} ({case.label}), rank {rank}: the rank reported "
                           f"{len(calls) if isinstance(calls, list) else 'no'} of "
                           f"{case.calls} backward calls",
                     "run the check again; if it repeats, the ranks stopped early")
            for i in range(case.calls):
                where = f"case {k} ({case.label}), backward call {i + 1}, rank {rank}"
                with readable(name, where):
                    _judge_call(name, where, case, n, rank, i, calls[i])
    counts = " or ".join(str(c) for c in sorted({case.calls for _, case in chosen}))
    passed(name, f"{passed_cases(all_cases, chosen, 'units')} x {counts} backward calls pass on "
                 f"{n} ranks: slice averaged and added, unit freed",
           "you finished stage 3: each unit's gradient is reduce-scattered and freed in backward")


def _judge_call(name: str, where: str, case: UnitCase, n: int, rank: int, i: int,
                call: dict) -> None:
    s = shard_numel(case, n)
    padded_bytes, shard_bytes = s * n * 8, s * 8
    slices = {key: t.tolist() for key, t in reduced_slices(case, i, rank, n).items()}
    comm = as_comm(name, where, call["comm"])
    shape = None if call["grad_shape"] is None else ints(call["grad_shape"])
    got = None if call["grad"] is None else numbers(call["grad"])
    fits = shape == [s] and got is not None and len(got) == s
    if not (fits and _close(got, slices["mean"])):
        if got is not None:
            shown = got[:3]
        elif shape is None:
            shown = str(call["grad_repr"])[:200]
        else:
            shown = "(a tensor whose memory is freed)"
        detail = (f"{where}: unit.grad differs from this rank's slice of the averaged gradient"
                  + first_values_differ(slices["mean"][:3], shown))
        if any(c["op"] == "all_reduce" and c["nbytes"] == shard_bytes for c in comm):
            hint = ("each rank all-reduced ITS OWN chunk of its gradient (a common "
                    "ZeRO-3 bug): rank 0's chunk 0 was summed with rank 1's "
                    "chunk 1, slices of different parameters. A reduce-scatter "
                    "sums chunk r of every rank and hands it to rank r")
        elif fits and _close(got, slices["summed"]):
            hint = SUMMED_NOT_AVERAGED_HINT
        elif fits and _close(got, slices["last"]):
            hint = ("unit.grad holds only this backward's gradient: ADD the new "
                    "slice to unit.grad (gradient accumulation)")
        elif shape is not None and shape != [s]:
            hint = f"unit.grad has shape {shape}; it is this rank's slice: {s} elements"
        else:
            hint = ("dist.reduce_scatter_single(slice, unit.full_grad, "
                    "op=dist.ReduceOp.AVG), then add the slice to unit.grad")
        fail(name, detail, hint)
    if any(c["op"] == "all_reduce" for c in comm):
        fail(name, f"{where}: the values are right, but you sent {comm_summary(comm)}",
             "an all-reduce of the full gradient is 2Ψ and every rank then keeps "
             "only its slice; a reduce-scatter delivers just that slice for Ψ")
    if [(c["op"], c["nbytes"]) for c in comm] != [("reduce_scatter", padded_bytes)]:
        fail(name, f"{where}: expected one reduce_scatter of the padded buffer "
                   f"({padded_bytes} bytes); got {comm_summary(comm)}",
             "reduce-scatter unit.full_grad itself: no copies, no concatenation")
    param_shapes = [ints(x) for x in call["param_shapes"]]
    if int(call["full_bytes"]) != 0 or param_shapes != [ints(x) for x in call["piece_shapes"]]:
        fail(name, f"{where}: the unit's full parameters are still gathered",
             "the unit's backward is over: call unit.release()")
    if call["full_grad_set"] is not False:
        fail(name, f"{where}: unit.full_grad is still set",
             "once reduce-scattered, the full gradient is not needed: "
             "unit.full_grad = None frees it")


# ------------------------------------------------------------------ the notebook's claims


def check_stage3_step_memory(step: dict, activations: int, psi: int, world: int) -> dict:
    """Section 2's claims on one measured stage-3 step (`measure.memory_timeline.measure_step`'s
    report), on one rank. Returns the rises above the step's start, in bytes.

    - After backward the rank holds its slices' parameters and gradients (padding included)
      and Adam's m and v for the real elements: `memory.model_state_bytes(Ψ, 3, N)` up to
      less than N elements of padding per unit.
    - Forward and backward rise at least one unit (it was gathered) and at most the gradient
      slices, the full parameters and full gradients of two units (the current and the next)
      and the activations the same step needs in one process (`activations`).
    - The optimizer's step adds, above what backward left, at most one set of the slices:
      Adam's temporaries. Its foreach implementation (torch's default for CUDA tensors)
      computes sqrt(v) for every slice at once, exactly one set; the for-loop one (CPU's
      default) one parameter's at a time. Bounding the whole step by the lifecycle's bound
      failed on one GPU (and on one CPU rank with foreach Adam).
    """
    held = step["held"]["total"]
    slices = sum(u["slice"] for u in step["units"])
    expected = 8 * slices + 8 * step["stepped_numel"]
    assert held == expected, f"held {held:,} B after backward, slices say {expected:,} B"
    formula = model_state_bytes(psi, 3, world, "fp32", "adam")["total"]
    assert abs(held - formula) < 16 * len(step["units"]), (
        f"held {held:,} B, 16Ψ/N = {formula:,} B: more than the padding apart")
    unit, start = max(step["unit_param_bytes"]), step["start_bytes"]
    lifecycle = step["peak_forward_backward"] - start
    bound = step["grad_shard_bytes"] + 2 * (unit + unit) + activations
    assert unit <= lifecycle <= bound, (
        f"forward and backward rose {lifecycle:,} B above the start; the bound is one unit "
        f"({unit:,} B) to the gradient slices + two units' parameters and gradients + "
        f"the activations = {bound:,} B")
    optimizer = step["peak_optimizer_step"] - step["backward_done_bytes"]
    slice_bytes = step["element_bytes"] * step["stepped_numel"]
    assert 0 <= optimizer <= slice_bytes, (
        f"the optimizer's step added {optimizer:,} B, more than one set of the slices "
        f"({slice_bytes:,} B): a temporary beyond Adam's own")
    return {"forward_backward": lifecycle, "optimizer_step": optimizer,
            "step": step["peak_bytes"] - start}

