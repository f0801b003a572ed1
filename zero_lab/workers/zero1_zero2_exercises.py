"""The graded ZeRO exercises of notebooks 03 and 04 (stages 1 and 2), run on every rank.

Started by `zero_lab.grading.check_owned_range`, `check_sharded_step` and `check_bucket_hook`
(3 ranks, gloo):

    zero1_zero2_exercises.py SOURCE_FILE [--seed N] EXERCISE:FUNCTION [EXERCISE:FUNCTION ...]

EXERCISE is "owned_range", "sharded_step" or "bucket_hook". SOURCE_FILE holds the learner's
functions; they run with `torch`, `dist`, `nn` and `math` already imported. Several pairs run
in one launch (the tests grade a reference and wrong answers together). Each rank runs the
cases of zero_lab/course/rank_cases/zero1_zero2.py (`--seed`: the batch grader's) and
reports what the function produced: values, storage facts, the collectives it issued with
their bytes. Nothing here compares them with an expected value, nor computes one: the
learner's code runs in this process and could change whatever compares, so the judges in
`zero_lab.grading` do it in the grader's process. An exception is reported with its case,
then re-raised so that torchrun stops every rank at once instead of leaving the others waiting
in a collective (`zero_lab.course.exercises.run_exercises`).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.course.exercises import GradBucket, learner_error, ledger_records, run_exercises
from zero_lab.course.rank_cases.zero1_zero2 import (
    GATHERED_REPORTED,
    bucket_hook_cases,
    make_optimizer,
    owned_range_cases,
    sharded_step_cases,
)
from zero_lab.stages.partition import bucket_parameters


def _values(t) -> list[float] | None:
    """A tensor's values, flattened, for the judge (None if the function left no tensor)."""
    return t.detach().flatten().tolist() if isinstance(t, torch.Tensor) else None


# --------------------------------------------------------------------------- owned range


def run_owned_range(fn, out: dict, seed: int | None = None) -> None:
    """Each rank asks fn for its own slice and reports it (or the error it raised).

    When every rank's slice has the same size, the slices are also used for real: each rank
    sends its part of a padded buffer 1, 2, ..., numel, 0, ... through one all-gather, and
    reports what came back for the buffers of at most GATHERED_REPORTED elements. (Larger
    ones are all-gathered too, not reported: this code cuts the pieces from the ranks'
    answers, so once the judge has found those exactly right the buffer comes back whole.)
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    results = out.setdefault("results", [])
    for k, case in enumerate(owned_range_cases(seed), start=1):
        numel = case.numel
        try:
            got = fn(numel, n, rank)
            got = [int(got[0]), int(got[1])]
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the judge
            got, error = None, f"{type(exc).__name__}: {exc}"
        answers = [None] * n  # every rank's answer decides whether the all-gather can run
        dist.all_gather_object(answers, got)
        record = {"case": k, "label": case.label(n), "got": got, "error": error,
                  "gathered": None}
        sizes = {a[1] - a[0] if a else -1 for a in answers}
        if len(sizes) == 1 and min(sizes) > 0:
            size = sizes.pop()
            total = size * n
            data = torch.arange(1, total + 1, dtype=torch.float64)
            data[numel:] = 0  # the padding
            start, end = got
            piece = torch.zeros(size, dtype=torch.float64)
            inside = data[max(start, 0):min(end, total)]
            piece[:inside.numel()] = inside
            gathered = torch.empty(total, dtype=torch.float64)
            dist.all_gather_single(gathered, piece)
            if numel <= GATHERED_REPORTED:
                record["gathered"] = gathered[:numel].tolist()
        results.append(record)


# --------------------------------------------------------------------------- sharded step


def run_sharded_step(fn, out: dict, seed: int | None = None) -> None:
    """fn(flat_param, flat_grad, shard_param, optimizer) for each case's steps.

    Reported after every step: all of flat_param's values (the judge steps one process on
    the average gradient and compares), what fn sent (ledger), and the sizes of the
    optimizer's state tensors (they must be this rank's slice only).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    results = out.setdefault("results", [])
    for k, case in enumerate(sharded_step_cases(seed), start=1):
        numel = case.numel
        shard = -(-numel // n)
        padded = shard * n
        flat_param = torch.zeros(padded, dtype=torch.float64)
        flat_param[:numel] = case.init()
        shard_param = nn.Parameter(flat_param[rank * shard:(rank + 1) * shard].clone())
        optimizer = make_optimizer(case.optimizer, [shard_param])
        record = {"case": k, "label": case.label(n), "steps": []}
        for step in range(case.steps):
            flat_grad = torch.zeros(padded, dtype=torch.float64)
            flat_grad[:numel] = case.local_grad(step, rank)
            try:
                with CommLedger() as ledger:
                    fn(flat_param, flat_grad, shard_param, optimizer)
            except BaseException as exc:
                record["error"] = learner_error(exc)
                results.append(record)
                raise
            record["steps"].append({
                "step": step + 1,
                "flat_param": _values(flat_param),
                "comm": ledger_records(ledger),
                "state_numels": sorted({v.numel() for s in optimizer.state.values()
                                        for v in s.values()
                                        if isinstance(v, torch.Tensor) and v.dim() > 0}),
            })
        results.append(record)


# --------------------------------------------------------------------------- bucket hook


def _hand_to(fn, bucket: GradBucket):
    """The post-accumulate-grad hook that calls fn(param, slot, bucket): `slot` is param's
    place in the bucket's flat gradient (`GradBucket.slot`, which allocates it when None)."""
    return lambda param: fn(param, bucket.slot(param), bucket)


def run_bucket_hook(fn, out: dict, seed: int | None = None) -> None:
    """Install fn(param, slot, bucket) as every parameter's post-accumulate-grad hook; run
    backward on this rank's batches (two calls: gradient accumulation), each bucket's
    `arrived` set to 0 before each (as a stage's end-of-backward callback does).

    Reported per bucket layout: each bucket's owned_grad values (the judge computes the
    gradient of the global batch in one process), how many parameters still hold a `.grad`,
    how many buckets were left holding their flat `grad`, and the collectives issued during
    backward with their sizes.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    results = out.setdefault("results", [])
    for k, case in enumerate(bucket_hook_cases(seed), start=1):
        model = case.model()
        named = list(model.named_parameters())
        layout = bucket_parameters(named[::-1], case.bucket_bytes, element_size=8)
        buckets = [GradBucket([p for _, p in names[::-1]], n, rank) for names in layout]
        handles = [p.register_post_accumulate_grad_hook(_hand_to(fn, b))
                   for b in buckets for p in b.params]
        record = {"case": k, "label": case.label(len(buckets))}
        try:
            with CommLedger() as ledger:
                for backward in range(case.backwards):
                    for b in buckets:
                        b.arrived = 0
                    x, y = case.batch(rank, backward)
                    nn.functional.mse_loss(model(x), y).backward()
        except BaseException as exc:
            record["error"] = learner_error(exc)
            results.append(record)
            raise
        finally:
            for h in handles:
                h.remove()
        record.update({
            "owned_grads": [_values(b.owned_grad) for b in buckets],
            "grads_kept": sum(p.grad is not None for p in model.parameters()),
            "grads_kept_bytes": sum(p.grad.numel() * 8 for p in model.parameters()
                                    if p.grad is not None),
            "full_left": sum(b.grad is not None for b in buckets),
            "comm": ledger_records(ledger),
        })
        results.append(record)


RUNNERS = {"owned_range": run_owned_range, "sharded_step": run_sharded_step,
           "bucket_hook": run_bucket_hook}


def main(argv: list[str]) -> None:
    """zero1_zero2_exercises.py SOURCE_FILE [--seed N] EXERCISE:FUNCTION [...]

    Every exercise's record holds "results": one entry per case, {"case": k, "label", ...}.
    """
    run_exercises(argv, RUNNERS)


if __name__ == "__main__":
    main(sys.argv[1:])
