"""The graded stage-3 exercises of notebook 05, run on every rank of a real process group.

Started by `zero_lab.grading.check_materialize_release` and `check_post_backward`
(3 ranks, gloo):

    zero3_exercises.py SOURCE_FILE [--seed N] EXERCISE:FUNCTION[,FUNCTION] ...

EXERCISE is "materialize_release" (two functions: materialize, release) or "post_backward".
SOURCE_FILE holds the learner's functions; they run with `torch`, `dist`, `nn`, `math`,
`free_storage` and `allocate_storage` (zero_lab.stages.partition) already imported. Each rank runs
the cases (zero_lab/course/rank_cases/zero3.py: the notebook's, or drawn from --seed) on units
of odd sizes and reports raw facts: the values the functions left (as lists), the collectives
issued and their bytes, storage sizes and addresses, shapes. Nothing here compares them with
an expected value: the learner's code runs in this process and could change any comparison
made here, so the judges in `zero_lab.grading.nb05_zero3` compute the expected values in
the grader's process and decide the verdict and the hint there. An exception is reported with
its case, then re-raised so that torchrun stops every rank at once instead of leaving the
others waiting in a collective (`zero_lab.course.exercises.run_exercises`). The learner's
functions receive a `zero_lab.course.exercises.BareUnit` (materialize, release) or a
`zero_lab.stages.zero3.Unit`.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.course.exercises import BareUnit, learner_error, ledger_records, run_exercises
from zero_lab.course.rank_cases.zero3 import (
    UnitCase,
    build_module,
    case_input,
    loss,
    materialize_release_cases,
    post_backward_cases,
    rank_full_grad,
)
from zero_lab.stages.partition import FlatParamGroup, allocate_storage, free_storage
from zero_lab.stages.zero3 import Unit


def _make_unit(case: UnitCase) -> tuple[nn.Module, Unit]:
    """(the case's module, sharded as one unit; the unit), the same on every rank."""
    module = build_module(case)
    params = list(module.parameters())
    group = FlatParamGroup(params, dist.get_world_size(), dist.get_rank(),
                           [n for n, _ in module.named_parameters()])
    local = group.shard(group.flatten()).clone()
    return module, Unit(case.label, module, group, local)  # parameters are now local pieces


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _values(t: torch.Tensor | None) -> list | float | None:
    """t's values as (nested) lists, or None when its storage no longer holds them (freed):
    reading them would fail, or read memory that is not theirs."""
    if t is None:
        return None
    extent = t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(),
                                                                          strict=True))
    if t.numel() and t.untyped_storage().nbytes() < extent * t.element_size():
        return None
    return t.detach().tolist()


def _views_allocated_full(unit: Unit, full_storage) -> bool:
    """Do the parameters have their full shapes and view `unit.full`'s allocated storage?

    Not a verdict (the judge decides from the reported facts): forward and backward through
    parameters that do not could read freed memory, so the case stops before them.
    """
    return (full_storage.nbytes() >= unit.full.numel() * unit.full.element_size()
            and all(p.shape == v.shape and _storage(p) == full_storage.data_ptr()
                    for p, v in zip(unit.params, unit.full_views, strict=True)))


# ------------------------------------------------------------------ materialize / release


def run_materialize_release(materialize, release, out: dict, seed: int | None) -> None:
    """Per case: materialize, forward, release, materialize again, backward, release.

    Reported per case: what materialize did (collectives; parameter shapes and values; the
    storage address of each parameter and of `unit.full`, and the ids of `unit.full` before
    and after), what release did (collectives; the ids of `unit.full`; its storage's bytes;
    each parameter's shape and addresses beside those of its local piece; `unit.local`'s
    values), and the gradients backward gives through the saved activations after a second
    materialize.
    """
    out["results"] = results = []
    for k, case in enumerate(materialize_release_cases(seed), 1):
        module, unit = _make_unit(case)
        x = case_input(case)
        bare = BareUnit(unit)
        record = {"case": k, "label": case.label}
        results.append(record)
        full_object, full_storage = unit.full, unit.full.untyped_storage()
        try:
            with CommLedger() as ledger:
                materialize(bare)
            record["materialize_comm"] = ledger_records(ledger)
            record["shapes"] = [list(p.shape) for p in unit.params]
            record["values"] = [_values(p) for p in unit.params]
            record["full_ids"] = [id(full_object), id(bare.full), id(unit.full)]
            record["full_storage"] = full_storage.data_ptr()
            record["param_storages"] = [_storage(p) for p in unit.params]
            if bare.full is not full_object or not _views_allocated_full(unit, full_storage):
                continue  # see _views_allocated_full
            activations = loss(module, x)  # autograd saves the weight (and views of it)
            with CommLedger() as ledger:
                release(bare)
            record["release_comm"] = ledger_records(ledger)
            record["released_ids"] = [id(bare.full), id(unit.full)]
            record["freed_bytes"] = full_storage.nbytes()
            record["released"] = [[list(p.shape), _storage(p), p.data_ptr()]
                                  for p in unit.params]
            record["pieces"] = [[list(v.shape), _storage(unit.local), v.data_ptr()]
                                for v in unit.local_views]
            record["local"] = _values(unit.local)
            materialize(bare)  # gathered again for backward, into the same storage
            if not _views_allocated_full(unit, full_storage):
                continue
            activations.backward()
            record["grads"] = [_values(p.grad) for p in unit.params]
            for p in unit.params:
                p.grad = None
            release(bare)
        except BaseException as exc:
            record["error"] = learner_error(exc)
            raise


# ------------------------------------------------------------------ post-backward


def run_post_backward(fn, out: dict, seed: int | None) -> None:
    """Per case, `case.calls` times (accumulating): gather the unit, fill `unit.full_grad`
    with this rank's local gradient, call fn(unit). Reported per call: the collectives fn
    issued, the bytes `unit.full`'s storage holds, the parameters' and their local pieces'
    shapes, whether `unit.full_grad` is still set, and `unit.grad` (its shape and values).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    out["results"] = results = []
    for k, case in enumerate(post_backward_cases(seed), 1):
        _, unit = _make_unit(case)
        unit.grad = None
        record = {"case": k, "label": case.label, "calls": []}
        results.append(record)
        try:
            for call in range(case.calls):
                unit.start_gather()
                unit.finish_gather()
                unit.full_grad = rank_full_grad(case, call, rank, n)
                with CommLedger() as ledger:
                    fn(unit)
                got = unit.grad
                is_tensor = isinstance(got, torch.Tensor)
                record["calls"].append({
                    "call": call + 1,
                    "comm": ledger_records(ledger),
                    "full_bytes": unit.full.untyped_storage().nbytes(),
                    "param_shapes": [list(p.shape) for p in unit.params],
                    "piece_shapes": [list(v.shape) for v in unit.local_views],
                    "full_grad_set": unit.full_grad is not None,
                    "grad_shape": list(got.shape) if is_tensor else None,
                    "grad": _values(got) if is_tensor else None,
                    "grad_repr": None if is_tensor else repr(got)[:200],
                })
                unit.release()  # whatever fn did, start the next call from rest
                unit.full_grad = None
        except BaseException as exc:
            record["error"] = learner_error(exc, f"backward call {len(record['calls']) + 1}")
            raise


RUNNERS = {"materialize_release": run_materialize_release, "post_backward": run_post_backward}


def main(argv: list[str]) -> None:
    """zero3_exercises.py SOURCE_FILE [--seed N] EXERCISE:FUNCTION[,FUNCTION] [...]

    Records hold "results"; the learner's functions also see free_storage and
    allocate_storage.
    """
    run_exercises(argv, RUNNERS, {"free_storage": free_storage,
                                  "allocate_storage": allocate_storage})


if __name__ == "__main__":
    main(sys.argv[1:])
