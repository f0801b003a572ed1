"""The flat partition the plain stages share: parameters as views of one padded buffer.

    buffer   | w1 ........ | b1 | w2 .......... | b2 | pad |    numel padded to N·S
    owner    |  rank 0        |  rank 1        |  rank 2   |    rank r owns [r·S, (r+1)·S)

A rank owns a contiguous slice of S = ceil(numel / N) elements, whatever the parameter
sizes (a parameter may straddle two owners). Stage 3 frees the buffer's memory between uses
and regrows it in place, so every view of it (the parameters, what autograd saved) stays
valid. `buckets` is the rule the real stages use (zero_lab/stages/partition.py), so the plain stages
send collectives of the same sizes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

FIRST_BUCKET_BYTES = 2**20  # torch DDP's rule: a small first bucket starts sending early


class Flat:
    """Parameters moved into one flat buffer, padded to a multiple of the world size N."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]  # where each starts
        self.shard_numel = -(-sum(self.numels) // self.world)  # S = ceil(numel / N)
        self.data = self.new_full()  # N·S elements: the padding at the end stays zero
        with torch.no_grad():
            for p, view in zip(params, self.views(self.data), strict=True):
                view.copy_(p)
                p.data = view  # the same nn.Parameter, its memory now inside the buffer
        dist.broadcast(self.data, src=0)  # every rank starts from rank 0's weights

    def new_full(self) -> torch.Tensor:  # a zeroed buffer of the padded size (gradients)
        p = self.params[0]
        return torch.zeros(self.shard_numel * self.world, dtype=p.dtype, device=p.device)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:  # parameter i's shape
        return flat[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.params[i].shape)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:  # every parameter's
        return [self.view(flat, i) for i in range(len(self.params))]

    def shard(self, flat: torch.Tensor) -> torch.Tensor:  # this rank's slice, a view
        return flat[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]


def free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)  # memory gone; `t` and its views stay valid objects


def regrow_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())  # contents undefined


def buckets(params: list[torch.Tensor], bucket_mb: float) -> list[list[torch.Tensor]]:
    """Parameters in buckets of at most bucket_mb, the last layers' first (the order backward
    makes their gradients), each bucket in forward order; one too big gets its own."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        fits = bool(out) and size + nbytes <= bucket_mb * 2**20
        if len(out) == 1:
            fits = fits and size < FIRST_BUCKET_BYTES  # the first closes once it holds 1 MiB
        if fits:
            out[-1].append(p)
            size += nbytes
        else:
            out.append([p])
            size = nbytes
    return [bucket[::-1] for bucket in out]
