"""Stage 1 (ZeRO P_os): each rank keeps the optimizer states of its slice only.

    backward    nothing sent; autograd leaves full gradients in `.grad`, as in one process
    opt.step()  per bucket: its gradients flattened into one padded buffer, REDUCE-SCATTER
                (average): this rank gets the averaged gradient of the slice it owns;
                the optimizer updates that slice (its states: K·Ψ/N bytes);
                ALL-GATHER: every rank's updated slice into every rank's full parameters

Per step: reduce-scatter Ψ + all-gather Ψ = 2Ψ, an all-reduce's bytes, for N times less
optimizer memory. (The real stage reduce-scatters when backward ends, zero_lab/stages/zero1.py.)
On gloo, torch runs a reduce-scatter as a whole all-reduce, keeping its own chunk (twice the
bytes of a reduce-scatter): the real stages send a direct exchange there (collectives/exchange.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.plain.partition import Flat, buckets


def shard(model: nn.Module, make_optimizer, bucket_mb: float = 25.0):
    return model, ShardedOptimizer(model, make_optimizer, bucket_mb)


class ShardedOptimizer:
    """A torch optimizer on this rank's slices; gradients reduce-scattered, slices gathered."""

    def __init__(self, model: nn.Module, make_optimizer, bucket_mb: float) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.flats = [Flat(bucket) for bucket in buckets(params, bucket_mb)]
        # What this rank updates: its slice of each bucket (a view: the parameters move too).
        self.slices = [nn.Parameter(flat.shard(flat.data), requires_grad=False)
                       for flat in self.flats]
        self.optimizer = make_optimizer(self.slices)  # Adam's m and v: slice-sized

    @torch.no_grad()
    def step(self) -> None:
        for flat, mine in zip(self.flats, self.slices, strict=True):
            full_grad = flat.new_full()
            for view, p in zip(flat.views(full_grad), flat.params, strict=True):
                view.copy_(p.grad)
            mine.grad = torch.empty_like(mine)
            dist.reduce_scatter_single(mine.grad, full_grad, op=dist.ReduceOp.AVG)
        self.optimizer.step()  # on the owned slices only
        for flat in self.flats:  # each rank's slice to every rank (torch wants a copy as input)
            dist.all_gather_single(flat.data, flat.shard(flat.data).clone())

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        for flat in self.flats:
            for p in flat.params:
                p.grad = None
