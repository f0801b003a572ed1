"""The graded stage-3 exercises of notebook 05, run on every rank of a real process group.

Started by `zero_lab.grading.check_materialize_release` and `check_post_backward`
(3 ranks, gloo):

    zero3_exercises.py SOURCE_FILE EXERCISE:FUNCTION[,FUNCTION] ...

EXERCISE is "materialize_release" (two functions: materialize, release) or "post_backward".
SOURCE_FILE holds the learner's functions; they run with `torch`, `dist`, `nn`, `math`,
`free_storage` and `allocate_storage` (zero_lab.stages.partition) already imported. Each rank runs
the hidden cases on units of odd sizes and reports facts (shapes, values, storages, the
collectives issued and their bytes); the checks in `zero_lab.grading` turn them into a
verdict and a hint. An exception is reported with its case, then re-raised so that
torchrun stops every rank at once instead of leaving the others waiting in a collective
(`zero_lab.course.exercises.run_exercises`). The learner's functions receive a
`zero_lab.course.exercises.BareUnit` (materialize, release) or a `zero_lab.stages.units.Unit`.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.course.exercises import BareUnit, learner_error, ledger_records, run_exercises
from zero_lab.stages.partition import FlatParamGroup, allocate_storage, free_storage
from zero_lab.stages.units import Unit


class _Scaled(nn.Module):
    """A 3x3 weight and a 0-d scale: 10 elements, padded to 12 on 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t()) * self.scale


CASES = [  # (label, module builder, input features)
    ("Linear(7, 5): 40 elements", lambda: nn.Linear(7, 5), 7),
    ("Linear(4, 6, bias=False) + LayerNorm(6): 36 elements",
     lambda: nn.Sequential(nn.Linear(4, 6, bias=False), nn.LayerNorm(6)), 4),
    ("a 3x3 weight and a 0-d scale: 10 elements", _Scaled, 3),
]


def _make_unit(case: int) -> tuple[nn.Module, nn.Module, Unit, torch.Tensor]:
    """(module sharded as one unit, an unsharded copy, the unit, an input), same on every rank."""
    label, build, features = CASES[case]
    torch.manual_seed(100 + case)
    module = build().double()
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    group = FlatParamGroup(params, dist.get_world_size(), dist.get_rank(),
                           [n for n, _ in module.named_parameters()])
    local = group.shard(group.flatten()).clone()
    unit = Unit(label, module, group, local)  # parameters are now local pieces
    x = torch.randn(5, features, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return module, reference, unit, x


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ------------------------------------------------------------------ materialize / release


def run_materialize_release(materialize, release, out: dict) -> None:
    """Per case: materialize, forward, release, materialize again, backward, release.

    Reported per case: what materialize did (collectives; parameter shapes and values;
    whether the parameters view `unit.full`'s own storage), what release did (collectives;
    whether `unit.full` is still the same tensor with its storage freed; whether the
    parameters are their local pieces again), and whether backward through the saved
    activations, after a second materialize, gives the gradients of an unsharded copy.
    """
    out["results"] = results = []
    for c in range(len(CASES)):
        module, reference, unit, x = _make_unit(c)
        bare = BareUnit(unit)
        record = {"case": c + 1, "label": CASES[c][0], "padded_bytes": unit.full.numel() * 8}
        results.append(record)
        full_object, full_storage = unit.full, unit.full.untyped_storage()
        ref_params = list(reference.parameters())
        try:
            with CommLedger() as ledger:
                materialize(bare)
            record["materialize_comm"] = ledger_records(ledger)
            record["shapes_ok"] = all(p.shape == r.shape
                                      for p, r in zip(unit.params, ref_params, strict=True))
            record["values_ok"] = record["shapes_ok"] and all(
                torch.equal(p.detach(), r.detach())
                for p, r in zip(unit.params, ref_params, strict=True))
            record["views_full"] = bare.full is full_object and all(
                _storage(p) == full_storage.data_ptr() for p in unit.params)
            if not (record["values_ok"] and record["views_full"]):
                continue  # backward through stale views could read freed memory: stop here
            loss = module(x).square().sum()  # autograd saves the weight (and views of it)
            with CommLedger() as ledger:
                release(bare)
            record["release_comm"] = ledger_records(ledger)
            record["same_full"] = bare.full is full_object and unit.full is full_object
            record["freed_bytes"] = full_storage.nbytes()
            record["local_again"] = all(
                p.shape == piece.shape and _storage(p) == _storage(unit.local)
                and p.data_ptr() == piece.data_ptr()
                for p, piece in zip(unit.params, unit.local_views, strict=True))
            record["local_unchanged"] = torch.equal(
                unit.local, unit.group.shard(unit.group.flatten(ref_params)))
            if not (record["same_full"] and record["local_again"]
                    and record["freed_bytes"] == 0):
                continue
            materialize(bare)  # gathered again for backward, into the same storage
            loss.backward()
            reference(x).square().sum().backward()
            record["grads_ok"] = all(
                p.grad is not None and torch.allclose(p.grad, r.grad, rtol=1e-10, atol=1e-12)
                for p, r in zip(unit.params, ref_params, strict=True))
            for p in unit.params:
                p.grad = None
            release(bare)
        except BaseException as exc:
            record["error"] = learner_error(exc)
            raise


# ------------------------------------------------------------------ post-backward


def _local_full_grad(case: int, call: int, rank: int, unit: Unit) -> torch.Tensor:
    """Rank `rank`'s full flat gradient of the unit for backward call `call` (padding 0)."""
    gen = torch.Generator().manual_seed(1000 * case + 10 * call + rank)
    full = torch.zeros(unit.group.padded_numel, dtype=torch.float64)
    full[:unit.group.numel] = torch.randn(unit.group.numel, generator=gen, dtype=torch.float64)
    return full


CALLS = 2  # backward calls before checking: gradient accumulation


def run_post_backward(fn, out: dict) -> None:
    """Per case, twice (accumulating): gather the unit, fill `unit.full_grad` with this
    rank's local gradient, call fn(unit). Reported: the collectives fn issued, whether the
    unit's full parameters and `unit.full_grad` were freed, and whether `unit.grad` equals
    this rank's slice of the average (or, a known mistake, of the sum) over ranks.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    out["results"] = results = []
    for c in range(len(CASES)):
        _, _, unit, _ = _make_unit(c)
        unit.grad = None
        record = {"case": c + 1, "label": CASES[c][0], "padded_bytes": unit.full.numel() * 8,
                  "shard_bytes": unit.local.numel() * 8, "calls": []}
        results.append(record)
        try:
            for call in range(CALLS):
                unit.start_gather()
                unit.finish_gather()
                unit.full_grad = _local_full_grad(c, call, rank, unit)
                with CommLedger() as ledger:
                    fn(unit)
                every = torch.stack([sum(_local_full_grad(c, k, r, unit) for k in range(call + 1))
                                     for r in range(n)])
                got = unit.grad
                mean, total = unit.group.shard(every.mean(0)), unit.group.shard(every.sum(0))
                last = unit.group.shard(torch.stack(
                    [_local_full_grad(c, call, r, unit) for r in range(n)]).mean(0))
                ok_shape = isinstance(got, torch.Tensor) and got.shape == mean.shape
                record["calls"].append({
                    "call": call + 1,
                    "comm": ledger_records(ledger),
                    "params_freed": unit.full.untyped_storage().nbytes() == 0,
                    "params_local": all(p.shape == v.shape for p, v
                                        in zip(unit.params, unit.local_views, strict=True)),
                    "full_grad_dropped": unit.full_grad is None,
                    "grad_shape": list(got.shape) if isinstance(got, torch.Tensor) else None,
                    "match": ok_shape and bool(torch.allclose(got, mean, rtol=1e-10, atol=1e-12)),
                    "match_if_summed": ok_shape and bool(torch.allclose(got, total, rtol=1e-10,
                                                                        atol=1e-12)),
                    "match_last_only": ok_shape and bool(torch.allclose(got, last, rtol=1e-10,
                                                                        atol=1e-12)),
                    "expected": mean[:3].tolist(),
                    "got": got[:3].tolist() if isinstance(got, torch.Tensor) else repr(got),
                })
                unit.release()  # whatever fn did, start the next call from rest
                unit.full_grad = None
        except BaseException as exc:
            record["error"] = learner_error(exc, f"backward call {len(record['calls']) + 1}")
            raise


RUNNERS = {"materialize_release": run_materialize_release, "post_backward": run_post_backward}


def main(argv: list[str]) -> None:
    """zero3_exercises.py SOURCE_FILE EXERCISE:FUNCTION[,FUNCTION] [...]

    Records hold "results"; the learner's functions also see free_storage and
    allocate_storage.
    """
    run_exercises(argv, RUNNERS, {"free_storage": free_storage,
                                  "allocate_storage": allocate_storage})


if __name__ == "__main__":
    main(sys.argv[1:])
