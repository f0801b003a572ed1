"""Per-rank cases for tests/test_transports.py: a collective plugged into the seam
(zero_lab/collectives/transports.py) carries the all-gathers and reduce-scatters of stages
1-3. The plugged one counts its calls and sends as the direct exchange does, so training with
it must give the direct exchange's weights, bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives import transports
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard

CALLS: list[str] = []


def counted(kind: str, send):
    def call(*args, **kwargs):
        CALLS.append(kind)
        return send(*args, **kwargs)
    return call


def train(stage: int, transport: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, opt = shard(model, stage, transport=transport)
    CALLS.clear()
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    calls = sorted(set(CALLS))
    weights = full_state_dict(model)
    return {"calls": calls, "weights": {k: v.flatten().tolist() for k, v in weights.items()}}


def run(_rank: int, _world: int) -> dict:
    """Every case (tests/workers/world_cases.py runs it at N = 2)."""
    direct = transports.TRANSPORTS["direct"]
    transports.register(transports.Transport(
        "counted", counted("all_gather", direct.all_gather),
        counted("reduce_scatter", direct.reduce_scatter),
        counted("all_reduce", direct.all_reduce)))
    return {f"{stage} {transport}": train(stage, transport)
            for stage in (1, 2, 3) for transport in ("counted", "direct")}


if __name__ == "__main__":  # this part alone, to debug it: torchrun(this file, nproc=2)
    info = init_worker()
    report(run(info.rank, info.world_size))
