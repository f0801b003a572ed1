"""Notebook 05's checks: a ZeRO stage-3 unit's materialize/release and post-backward, on 3 ranks.

The learner's functions run inside a real process group, as for notebooks 03 and 04, here
started through zero_lab/workers/zero3_exercises.py (which also provides free_storage and
allocate_storage to them). The ranks report facts; the judges here decide verdicts and hints.
"""

from __future__ import annotations

from collections.abc import Callable

from zero_lab.grading.framework import SUMMED_NOT_AVERAGED_HINT, fail, first_values_differ, passed
from zero_lab.grading.remote import RankExercise, comm_summary, run_exercise


def _probe_unit():
    """A small unit outside any process group, for the stub probe."""
    import torch
    from torch import nn

    from zero_lab.stages.partition import FlatParamGroup
    from zero_lab.stages.units import Unit

    params = [nn.Parameter(torch.zeros(2, 3))]
    unit = Unit("probe", nn.Module(), FlatParamGroup(params, 3, 0), torch.zeros(2))
    unit.grad, unit.full_grad = None, torch.zeros(6)
    return unit


def _bare_unit_probe() -> tuple:
    from zero_lab.course.exercises import BareUnit

    return (BareUnit(_probe_unit()),)


MATERIALIZE_RELEASE = RankExercise("zero3_exercises.py", "materialize_release",
                                   _bare_unit_probe)
POST_BACKWARD = RankExercise("zero3_exercises.py", "post_backward", lambda: (_probe_unit(),))


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


def judge_materialize_release(name: str, reports: list[dict]) -> None:
    """The verdict on every rank's units: gathered into `full` itself, freed in place."""
    n = reports[0]["world_size"]
    for rank, report in enumerate(reports):
        for r in report["results"]:
            where = f"case {r['case']} ({r['label']}), rank {rank}"
            padded = r["padded_bytes"]
            comm = r["materialize_comm"]
            if not r["shapes_ok"]:
                fail(name, f"{where}: after materialize the parameters do not have their full "
                           "shapes", "set each p.data to its view in unit.full_views")
            if not r["values_ok"]:
                fail(name, f"{where}: after materialize the parameters differ from the full "
                           "model's", "all-gather every rank's slice (unit.local) into "
                                      "unit.full: dist.all_gather_single(unit.full, unit.local)")
            if not r["views_full"]:
                fail(name, f"{where}: the parameters are right but do not view unit.full's own "
                           "storage",
                     "gather into unit.full itself (after allocate_storage(unit.full)), not into "
                     "a new tensor: autograd keeps views of the first one (weight.t(), ...), "
                     "and only a refill of that same storage reaches them for backward")
            ops = [(c["op"], c["nbytes"]) for c in comm]
            if ops != [("all_gather", padded)]:
                fail(name, f"{where}: materialize sent {comm_summary(comm)}; expected one "
                           f"all_gather of the padded buffer ({padded} bytes)",
                     "one dist.all_gather_single of the whole flat buffer, not one collective "
                     "per parameter or N broadcasts")
            if r["release_comm"]:
                fail(name, f"{where}: release sent {comm_summary(r['release_comm'])}",
                     "releasing needs no communication: every rank keeps its own slice")
            if not r["same_full"]:
                fail(name, f"{where}: after release, unit.full is a different tensor",
                     "free the storage in place (free_storage(unit.full), i.e. "
                     "unit.full.untyped_storage().resize_(0)); dropping or replacing the "
                     "tensor leaves the memory alive in the views autograd saved")
            if r["freed_bytes"]:
                fail(name, f"{where}: after release unit.full still holds "
                           f"{r['freed_bytes']} bytes",
                     "rebinding p.data alone frees nothing (the ZeRO blog post's release): "
                     "autograd still references the full tensors. Free the storage itself: "
                     "free_storage(unit.full)")
            if not r["local_again"]:
                fail(name, f"{where}: after release the parameters are not their local pieces",
                     "set each p.data back to its piece in unit.local_views")
            if not r["local_unchanged"]:
                fail(name, f"{where}: unit.local changed", "never write into the local slice")
            if not r["grads_ok"]:
                fail(name, f"{where}: backward after the second materialize gave wrong "
                           "gradients", "materialize must refill the same storage each time")
    cases = len(reports[0]["results"])
    passed(name, f"{cases}/{cases} units pass on {n} ranks: one all-gather each, storage freed "
                 "in place",
           "you wrote stage 3's gather, use and free: one unit is whole at a time")


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


def judge_post_backward(name: str, reports: list[dict]) -> None:
    """The verdict on every rank's backward calls: averaged slice added, Ψ sent, all freed."""
    n = reports[0]["world_size"]
    for rank, report in enumerate(reports):
        for r in report["results"]:
            for call in r["calls"]:
                where = (f"case {r['case']} ({r['label']}), backward call {call['call']}, "
                         f"rank {rank}")
                ops = [c["op"] for c in call["comm"]]
                if not call["match"]:
                    detail = (f"{where}: unit.grad differs from this rank's slice of the "
                              "averaged gradient"
                              + first_values_differ(call["expected"], call["got"]))
                    shard_ar = [c for c in call["comm"] if c["op"] == "all_reduce"
                                and c["nbytes"] == r["shard_bytes"]]
                    if shard_ar:
                        hint = ("each rank all-reduced ITS OWN chunk of its gradient (the seed "
                                "blog's ZeRO-3 bug): rank 0's chunk 0 was summed with rank 1's "
                                "chunk 1, slices of different parameters. A reduce-scatter "
                                "sums chunk r of every rank and hands it to rank r")
                    elif call["match_if_summed"]:
                        hint = SUMMED_NOT_AVERAGED_HINT
                    elif call["match_last_only"]:
                        hint = ("unit.grad holds only this backward's gradient: ADD the new "
                                "slice to unit.grad (gradient accumulation)")
                    elif call["grad_shape"] is not None and call["grad_shape"] != [
                            r["shard_bytes"] // 8]:
                        hint = (f"unit.grad has shape {call['grad_shape']}; it is this rank's "
                                f"slice: {r['shard_bytes'] // 8} elements")
                    else:
                        hint = ("dist.reduce_scatter_single(slice, unit.full_grad, "
                                "op=dist.ReduceOp.AVG), then add the slice to unit.grad")
                    fail(name, detail, hint)
                if "all_reduce" in ops:
                    fail(name, f"{where}: the values are right, but you sent "
                               f"{comm_summary(call['comm'])}",
                         "an all-reduce of the full gradient is 2Ψ and every rank then keeps "
                         "only its slice; a reduce-scatter delivers just that slice for Ψ")
                expected = [("reduce_scatter", r["padded_bytes"])]
                if [(c["op"], c["nbytes"]) for c in call["comm"]] != expected:
                    fail(name, f"{where}: expected one reduce_scatter of the padded buffer "
                               f"({r['padded_bytes']} bytes); got {comm_summary(call['comm'])}",
                         "reduce-scatter unit.full_grad itself: no copies, no concatenation")
                if not call["params_freed"] or not call["params_local"]:
                    fail(name, f"{where}: the unit's full parameters are still gathered",
                         "the unit's backward is over: call unit.release()")
                if not call["full_grad_dropped"]:
                    fail(name, f"{where}: unit.full_grad is still set",
                         "once reduce-scattered, the full gradient is not needed: "
                         "unit.full_grad = None frees it")
    cases = len(reports[0]["results"])
    passed(name, f"{cases}/{cases} units x 2 backward calls pass on {n} ranks: slice averaged "
                 "and added, unit freed",
           "you finished stage 3: each unit's gradient is reduce-scattered and freed in backward")
