"""The graded ZeRO exercises of notebooks 03 and 04 (stages 1 and 2), run on every rank.

Started by `zero_lab.grading.check_owned_range`, `check_sharded_step` and `check_bucket_hook`
(3 ranks, gloo):

    zero1_zero2_exercises.py SOURCE_FILE EXERCISE:FUNCTION [EXERCISE:FUNCTION ...]

EXERCISE is "owned_range", "sharded_step" or "bucket_hook". SOURCE_FILE holds the learner's
functions; they run with `torch`, `dist`, `nn` and `math` already imported. Several pairs run
in one launch (the tests grade a reference and wrong answers together). Each rank runs the
hidden cases and reports facts (values, shapes, the collectives the function issued with their
bytes); the checks in `zero_lab.grading` turn them into a verdict and a hint. An exception is
reported with its case, then re-raised so that torchrun stops every rank at once instead of
leaving the others waiting in a collective (`zero_lab.course.exercises.run_exercises`).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.course.exercises import GradBucket, learner_error, ledger_records, run_exercises
from zero_lab.stages.partition import bucket_parameters

# --------------------------------------------------------------------------- owned range

OWNED_RANGE_NUMELS = [1, 2, 3, 7, 9, 10, 1000, 1001, 1_048_577]


def run_owned_range(fn, out: dict) -> None:
    """Each rank asks fn for its own slice; rank 0 reports every rank's answers.

    When every rank's slice has the same size, the slices are also used for real: each rank
    sends its part of a padded buffer through one all-gather, and rank 0 reports whether the
    buffer came back whole.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    cases = out.setdefault("cases", [])
    for numel in OWNED_RANGE_NUMELS:
        try:
            got = fn(numel, n, rank)
            got = [int(got[0]), int(got[1])]
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the check
            got, error = None, f"{type(exc).__name__}: {exc}"
        answers = [None] * n
        dist.all_gather_object(answers, {"got": got, "error": error})
        roundtrip = None
        sizes = {a["got"][1] - a["got"][0] if a["got"] else -1 for a in answers}
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
            roundtrip = bool(torch.equal(gathered[:numel], data[:numel]))
        cases.append({"numel": numel, "answers": answers, "roundtrip": roundtrip})


# --------------------------------------------------------------------------- sharded step

SHARDED_STEP_CASES = [  # (numel, optimizer name, steps)
    (10, "adam", 3),
    (1001, "sgd_momentum", 3),
    (4099, "adamw", 3),
]


def _make_optimizer(name: str, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _local_grad(case: int, step: int, rank: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * case + 10 * step + rank)
    return torch.randn(numel, generator=gen, dtype=torch.float64)


def run_sharded_step(fn, out: dict) -> None:
    """fn(flat_param, flat_grad, shard_param, optimizer) for a few steps, against one process.

    The reference applies the same optimizer to the whole (unpadded) parameter with the
    average of all ranks' gradients; element-wise optimizers make the two comparable slice
    by slice. Also reported: what fn sent (ledger), and whether it changed flat_param at all.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    results = out.setdefault("results", [])
    for c, (numel, opt_name, steps) in enumerate(SHARDED_STEP_CASES):
        shard = -(-numel // n)
        padded = shard * n
        init = torch.randn(numel, generator=torch.Generator().manual_seed(c),
                           dtype=torch.float64)
        flat_param = torch.zeros(padded, dtype=torch.float64)
        flat_param[:numel] = init
        shard_param = nn.Parameter(flat_param[rank * shard:(rank + 1) * shard].clone())
        optimizer = _make_optimizer(opt_name, [shard_param])
        ref = nn.Parameter(init.clone())
        ref_opt = _make_optimizer(opt_name, [ref])
        ref_sum = nn.Parameter(init.clone())  # the mistake of summing instead of averaging
        sum_opt = _make_optimizer(opt_name, [ref_sum])
        label = f"numel={numel} (padded to {padded}), {opt_name}, {steps} steps"
        record = {"case": c + 1, "label": label, "numel": numel, "padded": padded,
                  "shard": shard, "steps": steps}
        for step in range(steps):
            grads = [_local_grad(c, step, r, numel) for r in range(n)]
            flat_grad = torch.zeros(padded, dtype=torch.float64)
            flat_grad[:numel] = grads[rank]
            before = flat_param.clone()
            try:
                with CommLedger() as ledger:
                    fn(flat_param, flat_grad, shard_param, optimizer)
            except BaseException as exc:
                record["error"] = learner_error(exc)
                results.append(record)
                raise
            ref.grad = torch.stack(grads).mean(0)
            ref_opt.step()
            ref_sum.grad = torch.stack(grads).sum(0)
            sum_opt.step()
            with torch.no_grad():
                record.update({
                    "match": bool(torch.allclose(flat_param[:numel], ref, rtol=1e-9,
                                                 atol=1e-12)),
                    "match_if_summed": bool(torch.allclose(flat_param[:numel], ref_sum,
                                                           rtol=1e-9, atol=1e-12)),
                    "own_slice_match": bool(torch.allclose(
                        flat_param[rank * shard:min((rank + 1) * shard, numel)],
                        ref[rank * shard:(rank + 1) * shard], rtol=1e-9, atol=1e-12)),
                    "unchanged": bool(torch.equal(flat_param, before)),
                    "expected": ref[:4].tolist(),
                    "got": flat_param[:4].tolist(),
                    "comm": ledger_records(ledger),
                    "state_numels": sorted({v.numel() for s in optimizer.state.values()
                                            for v in s.values()
                                            if isinstance(v, torch.Tensor) and v.dim() > 0}),
                    "step": step + 1,
                })
            if not record["match"]:
                break
        results.append(record)


# --------------------------------------------------------------------------- bucket hook


class _OddModel(nn.Module):
    """Odd sizes, a bias-free layer and a nested block: buckets that do not divide by N."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 32)  # 224 + 32 elements
        self.block = nn.Sequential(nn.Tanh(), nn.Linear(32, 16, bias=False), nn.Tanh())  # 512
        self.out = nn.Linear(16, 5)  # 80 + 5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


def _batch(rank: int, backward: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 * backward + rank)
    return (torch.randn(6, 7, generator=gen, dtype=torch.float64),
            torch.randn(6, 5, generator=gen, dtype=torch.float64))


# 3 buckets of 85, 512 and 256 elements; then one of 853. None divides by 3 ranks.
BUCKET_BYTES = [500 * 8, 10**9]
BACKWARDS = 2  # two backward calls before checking: gradient accumulation


def run_bucket_hook(fn, out: dict) -> None:
    """Install fn as every parameter's post-accumulate-grad hook; run backward twice.

    Reported per bucket layout: whether each bucket's owned_grad equals this rank's slice of
    the gradient of the global batch (summed over both backward calls), how many parameters
    still hold a `.grad`, whether `full` buffers were left behind, and the collectives issued
    during backward with their sizes.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    results = out.setdefault("results", [])
    for c, bucket_bytes in enumerate(BUCKET_BYTES):
        torch.manual_seed(0)
        model = _OddModel().double()
        reference = _OddModel().double()
        reference.load_state_dict(model.state_dict())
        named = [(name, p) for name, p in model.named_parameters()]
        layout = bucket_parameters(named[::-1], bucket_bytes, element_size=8)
        buckets = [GradBucket([p for _, p in names[::-1]], n, rank) for names in layout]
        owner = {id(p): b for b in buckets for p in b.group.params}
        handles = [p.register_post_accumulate_grad_hook(
            lambda param, owner=owner: fn(param, owner[id(param)])) for p in model.parameters()]
        record = {"case": c + 1, "buckets": len(buckets),
                  "bucket_padded_bytes": [b.group.padded_numel * 8 for b in buckets],
                  "label": f"{len(buckets)} bucket(s) of at most {bucket_bytes} bytes, "
                           f"{BACKWARDS} backward calls"}
        try:
            with CommLedger() as ledger:
                for k in range(BACKWARDS):
                    x, y = _batch(rank, k)
                    nn.functional.mse_loss(model(x), y).backward()
        except BaseException as exc:
            record["error"] = learner_error(exc)
            results.append(record)
            raise
        finally:
            for h in handles:
                h.remove()
        # Reference: one process, the global batch of every backward call.
        for k in range(BACKWARDS):
            xs, ys = zip(*(_batch(r, k) for r in range(n)), strict=True)
            nn.functional.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
        ref_grads = dict(reference.named_parameters())
        names = {id(p): name for name, p in named}
        matches, max_err = [], 0.0
        for b in buckets:
            full = b.group.flatten([ref_grads[names[id(p)]].grad for p in b.group.params])
            expected = b.group.shard(full)
            max_err = max(max_err, float((b.owned_grad - expected).abs().max()))
            matches.append(bool(torch.allclose(b.owned_grad, expected, rtol=1e-9,
                                               atol=1e-12)))
        record.update({
            "match": all(matches),
            "max_abs_error": max_err,
            "grads_kept": sum(p.grad is not None for p in model.parameters()),
            "grads_kept_bytes": sum(p.grad.numel() * 8 for p in model.parameters()
                                    if p.grad is not None),
            "params": len(named),
            "full_left": sum(b.full is not None for b in buckets),
            "comm": ledger_records(ledger),
        })
        results.append(record)


RUNNERS = {"owned_range": run_owned_range, "sharded_step": run_sharded_step,
           "bucket_hook": run_bucket_hook}


def main(argv: list[str]) -> None:
    """zero1_zero2_exercises.py SOURCE_FILE EXERCISE:FUNCTION [EXERCISE:FUNCTION ...]

    Records hold "results" (or "cases" for owned_range).
    """
    run_exercises(argv, RUNNERS)


if __name__ == "__main__":
    main(sys.argv[1:])
