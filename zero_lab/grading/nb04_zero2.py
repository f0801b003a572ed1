"""Notebook 04's check: ZeRO stage 2's bucketed gradient hook, on 3 ranks.

Run like notebook 03's checks, by zero_lab/workers/zero1_zero2_exercises.py: the hook is
installed on every parameter of a small model with odd-sized buckets, backward runs twice,
and the ranks report the slices they hold, the gradients left behind and the reduce-scatters
issued. The judge computes the model's gradient on the global batch here, in one process
(zero_lab/course/rank_cases/zero1_zero2.py), and compares: nothing on the ranks does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from zero_lab.course.rank_cases.zero1_zero2 import bucket_hook_cases, global_batch_grads
from zero_lab.grading.framework import fail, passed
from zero_lab.grading.nb03_zero1 import ATOL, RTOL
from zero_lab.grading.rank_reports import (
    as_comm,
    as_count,
    as_floats,
    case_record,
    chosen_cases,
    close,
    unreadable,
)
from zero_lab.grading.remote import RankExercise, comm_summary, run_exercise
from zero_lab.stages.partition import FlatParamGroup, bucket_parameters


def _bucket_hook_probe() -> tuple:
    import torch
    from torch import nn

    from zero_lab.course.exercises import GradBucket

    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.zeros(2)
    bucket = GradBucket([param], 3, 0)
    return param, bucket.slot(param), bucket


BUCKET_HOOK = RankExercise("zero1_zero2_exercises.py", "bucket_hook", _bucket_hook_probe,
                           bucket_hook_cases)


def check_bucket_hook(fn: Callable) -> None:
    """Notebook 04: fn(param, slot, bucket) -> None, stage 2's post-accumulate-grad hook.

    `slot` is param's place in the bucket's flat gradient `bucket.grad`; `bucket` is a
    `zero_lab.course.exercises.GradBucket` (`grad`, `arrived`, `owned_grad`, `len`). The hook
    copies `param.grad` into its slot and frees it, counts it, and once every gradient of the
    bucket has arrived reduce-scatters `bucket.grad` (average) into a slice it adds to
    `bucket.owned_grad`, and frees `bucket.grad`. Checked on 3 ranks, two backward calls,
    several bucket layouts, against one process on the global batch.
    """
    name = "check_bucket_hook"
    judge_bucket_hook(name, run_exercise(name, BUCKET_HOOK, [fn]))


def _expected_slices(case, n: int) -> tuple[int, list[int], list[list[torch.Tensor]]]:
    """The case's parameter count, its buckets' padded bytes, and each rank's slice of each
    bucket's averaged gradient: the same layout as the ranks', from one process's gradient."""
    named = list(case.model().named_parameters())
    layout = bucket_parameters(named[::-1], case.bucket_bytes, element_size=8)
    grads = global_batch_grads(case, n)
    groups = [FlatParamGroup([p for _, p in names[::-1]], n, 0) for names in layout]
    fulls = [g.flatten([grads[name] for name, _ in names[::-1]])
             for g, names in zip(groups, layout, strict=True)]
    slices = [[g.shard(full, rank) for g, full in zip(groups, fulls, strict=True)]
              for rank in range(n)]
    return len(named), [g.padded_numel * 8 for g in groups], slices


def judge_bucket_hook(name: str, reports: list[dict], seed: int | None = None,
                      cases: Sequence[int] | None = None) -> None:
    """The verdict on every rank's layouts: one reduce-scatter per bucket, grads freed, slices."""
    n = len(reports)
    all_cases = bucket_hook_cases(seed)
    chosen = [(k, case, _expected_slices(case, n))
              for k, case in chosen_cases(name, all_cases, cases)]
    for rank in range(n):
        for k, case, (params, expected_sizes, slices) in chosen:
            which = f"case {k} ({case.label(len(expected_sizes))})"
            where = f"{which}, rank {rank}"
            record = case_record(name, reports, rank, k, which)
            comm = [c for c in as_comm(name, where, record.get("comm")) if c["op"] != "barrier"]
            rs = [c for c in comm if c["op"] == "reduce_scatter"]
            if any(c["op"] == "all_reduce" for c in comm):
                fail(name, f"{where}: you sent {comm_summary(comm)}",
                     "stage 2 never all-reduces gradients: a reduce-scatter (Ψ) gives each "
                     "rank only the averaged slice it owns")
            # N times a bucket, and no bucket's own size: a size may be both (a bucket of
            # 2880 bytes beside one of 960, N = 3), so only the sends beyond the expected
            # ones are looked at.
            surplus = Counter(c["nbytes"] for c in rs) - Counter(
                expected_sizes * case.backwards)
            blown_up = [size for size in surplus if size in {b * n for b in expected_sizes}]
            if blown_up:
                fail(name, f"{where}: a reduce-scatter's input was {blown_up[0]} "
                           f"bytes, {n} times the bucket",
                     "you concatenated N copies of the gradient (a common 'reduce-scatter' "
                     "built by hand): that sends N times the bytes and briefly holds N "
                     "copies in memory. Reduce-scatter bucket.grad itself: each rank "
                     "contributes its own full gradient, and receives its slice")
            calls = len(expected_sizes) * case.backwards
            if len(rs) != calls or not all(c["in_backward"] for c in rs):
                fail(name, f"{where}: expected one reduce_scatter per bucket per backward "
                           f"({len(expected_sizes)} buckets x {case.backwards} backward "
                           f"calls), during backward; got {len(rs)}: {comm_summary(rs)}",
                     "count each gradient (bucket.arrived += 1) and send the bucket once, when "
                     "its last one has arrived (bucket.arrived == len(bucket))")
            if sorted(c["nbytes"] for c in rs) != sorted(expected_sizes * case.backwards):
                fail(name, f"{where}: reduce-scatter sizes {[c['nbytes'] for c in rs]}; "
                           f"expected the padded buckets {expected_sizes}",
                     "reduce-scatter bucket.grad (N·S elements) into a tensor shaped like "
                     "bucket.owned_grad (S elements)")
            kept = as_count(name, where, record.get("grads_kept"), "gradients kept")
            if kept:
                kept_bytes = as_count(name, where, record.get("grads_kept_bytes"), "their bytes")
                fail(name, f"{where}: after backward {kept} of {params} parameters still "
                           f"hold a full .grad ({kept_bytes} bytes)",
                     "set param.grad = None once it is copied into its slot. Returning "
                     "None from a hook discards nothing (a common mistake): a hook's "
                     "return value None means 'leave the gradient as it is'. The kept "
                     "gradient also spoils accumulation: the next backward adds to it, so "
                     "the bucket receives the earlier gradient twice")
            owned = record.get("owned_grads")
            if not isinstance(owned, list) or len(owned) != len(slices[rank]):
                unreadable(name, where, f"{len(slices[rank])} buckets' owned_grad")
            matches, max_err = [], 0.0
            for i, (values, expected) in enumerate(zip(owned, slices[rank], strict=True)):
                got = as_floats(name, where, values, expected.numel(),
                                f"bucket {i}'s owned_grad (this rank's slice)")
                max_err = max(max_err, float((got - expected).abs().max()))
                matches.append(close(got, expected, RTOL, ATOL))
            if not all(matches):
                fail(name, f"{where}: owned_grad differs from this rank's slice of the "
                           f"averaged gradient (largest error {max_err:.3g})",
                     "average across ranks (op=dist.ReduceOp.AVG) and ADD the slice to "
                     "bucket.owned_grad (+=): the second backward call accumulates")
            full_left = as_count(name, where, record.get("full_left"), "full buffers left")
            if full_left:
                fail(name, f"{where}: {full_left} bucket(s) still hold their flat gradient "
                           "(bucket.grad) after backward",
                     "set bucket.grad = None once its reduce-scatter is done, as "
                     "param.grad = None frees a parameter's: a bucket kept holds its "
                     "parameters' full gradient until the next backward")
    if cases is None:
        total = len(all_cases)
        passed(name, f"{total}/{total} layouts pass on {n} ranks: right slices, gradients "
                     "freed, one reduce-scatter a bucket",
               "you wrote stage 2's core: a gradient leaves for its owner once its bucket fills")
