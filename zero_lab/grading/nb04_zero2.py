"""Notebook 04's check: ZeRO stage 2's bucketed gradient hook, on 3 ranks.

Run like notebook 03's checks, by zero_lab/workers/zero1_zero2_exercises.py: the hook is
installed on every parameter of a small model with odd-sized buckets, backward runs twice,
and the ranks report the slices, the gradients left behind and the reduce-scatters issued.
"""

from __future__ import annotations

from collections.abc import Callable

from zero_lab.grading.framework import fail, passed
from zero_lab.grading.remote import RankExercise, comm_summary, run_exercise


def _bucket_hook_probe() -> tuple:
    import torch
    from torch import nn

    from zero_lab.course.exercises import GradBucket

    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.zeros(2)
    return param, GradBucket([param], 3, 0)


BUCKET_HOOK = RankExercise("zero1_zero2_exercises.py", "bucket_hook", _bucket_hook_probe)


def check_bucket_hook(fn: Callable) -> None:
    """Notebook 04: fn(param, bucket) -> None, stage 2's post-accumulate-grad hook.

    `bucket` is a `zero_lab.course.exercises.GradBucket`. The hook copies `param.grad` into the
    bucket's flat buffer (`bucket.full`, allocated by the bucket's first gradient), frees
    `param.grad`, and once every gradient of the bucket has arrived reduce-scatters the
    buffer (average) into this rank's slice, adds it to `bucket.owned_grad`, and frees
    `bucket.full`. Checked on 3 ranks, two backward calls,
    several bucket layouts, against one process on the global batch.
    """
    name = "check_bucket_hook"
    judge_bucket_hook(name, run_exercise(name, BUCKET_HOOK, [fn]))


def judge_bucket_hook(name: str, reports: list[dict]) -> None:
    """The verdict on every rank's layouts: one reduce-scatter per bucket, grads freed, slices."""
    n = reports[0]["world_size"]
    for rank, report in enumerate(reports):
        for record in report["results"]:
            where = f"case {record['case']} ({record['label']}), rank {rank}"
            comm = [c for c in record["comm"] if c["op"] != "barrier"]
            rs = [c for c in comm if c["op"] == "reduce_scatter"]
            expected_sizes = record["bucket_padded_bytes"]
            if any(c["op"] == "all_reduce" for c in comm):
                fail(name, f"{where}: you sent {comm_summary(comm)}",
                     "stage 2 never all-reduces gradients: a reduce-scatter (Ψ) gives each "
                     "rank only the averaged slice it owns")
            blown_up = [c for c in rs if c["nbytes"] in {b * n for b in expected_sizes}]
            if blown_up:
                fail(name, f"{where}: a reduce-scatter's input was {blown_up[0]['nbytes']} "
                           f"bytes, {n} times the bucket",
                     "you concatenated N copies of the gradient (the ZeRO blog post's "
                     "'reduce-scatter'): that sends N times the bytes and briefly holds N "
                     "copies in memory. Reduce-scatter the bucket's flat buffer itself: each "
                     "rank contributes its own full gradient, and receives its slice")
            if len(rs) != len(expected_sizes) * 2 or not all(c["in_backward"] for c in rs):
                fail(name, f"{where}: expected one reduce_scatter per bucket per backward "
                           f"({len(expected_sizes)} buckets x 2 backward calls), during "
                           f"backward; got {len(rs)}: {comm_summary(rs)}",
                     "send a bucket once, when its last gradient has arrived "
                     "(bucket.arrived == len(bucket.group.params)), then reset arrived")
            if sorted(c["nbytes"] for c in rs) != sorted(expected_sizes * 2):
                fail(name, f"{where}: reduce-scatter sizes {[c['nbytes'] for c in rs]}; "
                           f"expected the padded buckets {expected_sizes}",
                     "reduce-scatter bucket.full (N·S elements) into a buffer of S elements")
            if record["grads_kept"]:
                fail(name, f"{where}: after backward {record['grads_kept']} of "
                           f"{record['params']} parameters still hold a full .grad "
                           f"({record['grads_kept_bytes']} bytes)",
                     "set param.grad = None once it is copied into the bucket. Returning "
                     "None from a hook discards nothing (the ZeRO blog post's mistake): a hook's "
                     "return value None means 'leave the gradient as it is'. The kept "
                     "gradient also spoils accumulation: the next backward adds to it, so "
                     "the bucket receives the earlier gradient twice")
            if not record["match"]:
                fail(name, f"{where}: owned_grad differs from this rank's slice of the "
                           f"averaged gradient (largest error {record['max_abs_error']:.3g})",
                     "average across ranks (op=dist.ReduceOp.AVG) and ADD the slice to "
                     "bucket.owned_grad (+=): the second backward call accumulates")
            if record["full_left"]:
                fail(name, f"{where}: {record['full_left']} bucket(s) still hold their full "
                           "gradient buffer after backward",
                     "set bucket.full = None once its reduce-scatter is done")
    cases = len(reports[0]["results"])
    passed(name, f"{cases}/{cases} layouts pass on {n} ranks: right slices, gradients freed, "
                 "one reduce-scatter a bucket",
           "you wrote stage 2's core: a gradient leaves for its owner once its bucket fills")
