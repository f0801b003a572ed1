"""Per-rank part of tests/workers/world_cases.py for tests/test_plain.py: each plain stage
(zero_lab/plain/) beside one process on the global batch and beside the real stage.

Per stage 0-3: the same small model (odd sizes: padding at N = 2 and 3; a parameter at the
root: stage 3's root unit; tiny buckets at stages 0-2: several flat groups) trained a few steps
three ways: the plain stage, `shard(model, k, transport="torch", check_lockstep=False)` (the
real stage on torch's collectives, without its 24-byte lockstep message) and one process on
the whole global batch. Ranks start from different weights: both stages must broadcast rank
0's. Reported: the weights' largest differences and one steady step's ledger of each.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.course import workloads as W
from zero_lab.plain import stage0, stage1, stage2, stage3
from zero_lab.stages import full_state_dict, shard

STEPS = 3  # the ledger records the last: a steady step (stage 3 prefetches from the second)
GLOBAL_BATCH = 12  # splits evenly over 1, 2, 3 and 4 ranks
SEED = 2024
BUCKET_MB = 200 / 2**20  # 200 bytes: three or four buckets of this model at stages 0-2
PLAIN = {0: stage0, 1: stage1, 2: stage2, 3: stage3}


class Net(nn.Module):
    """Linear layers of odd sizes with a nonlinearity, and a scale at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 5), nn.Tanh(),
                                    nn.Linear(5, 3))
        self.scale = nn.Parameter(torch.tensor(0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * self.scale


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def make_optimizer(params):  # SGD: a gradient summed instead of averaged moves it N times
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # farther (Adam would not notice)


def train(model: nn.Module, opt, batch) -> CommLedger:
    """STEPS steps of the ordinary loop; the ledger of the last one."""
    for step in range(STEPS):
        ledger = CommLedger() if step == STEPS - 1 else contextlib.nullcontext()
        with ledger:
            W.mse_loss(model, batch(step)).backward()
            opt.step()
            opt.zero_grad()
    return ledger


def plain_weights(stage: int, model: nn.Module, opt) -> dict[str, torch.Tensor]:
    if stage < 3:  # the parameters are full on every rank after a step
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return opt.full_weights(model)


def largest_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def ledger_report(ledger: CommLedger) -> dict:
    return {"signature": ledger.signature(), "total_bytes": ledger.total_bytes(),
            "volume": ledger.volume(), "control": len(ledger.control),
            "ops": [(r["op"], r["numel"], r["in_backward"]) for r in ledger.as_dicts()]}


def run(rank: int, world: int) -> dict:
    local = lambda step: W.rank_slice(global_batch(step), rank, world)  # noqa: E731
    torch.manual_seed(SEED)
    ref = Net()
    start = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    train(ref, make_optimizer(ref.parameters()), global_batch)
    ref_weights = ref.state_dict()
    cases = []
    for stage, plain in PLAIN.items():
        torch.manual_seed(SEED + rank)  # ranks start apart: rank 0's weights must be broadcast
        kwargs = {"bucket_mb": BUCKET_MB} if stage < 3 else {}
        model, opt = plain.shard(Net(), make_optimizer, **kwargs)
        plain_ledger = train(model, opt, local)
        weights = plain_weights(stage, model, opt)
        torch.manual_seed(SEED + rank)
        real, real_opt = shard(Net(), stage, make_optimizer, bucket_mb=BUCKET_MB,
                               transport="torch", check_lockstep=False)
        real_ledger = train(real, real_opt, local)
        real_weights = full_state_dict(real)
        cases.append({
            "stage": stage, "moved": largest_difference(ref_weights, start),
            "plain_vs_one_process": largest_difference(weights, ref_weights),
            "plain_vs_shard": largest_difference(weights, real_weights),
            "shard_vs_one_process": largest_difference(real_weights, ref_weights),
            "plain": ledger_report(plain_ledger), "shard": ledger_report(real_ledger)})
    return {"cases": cases}
