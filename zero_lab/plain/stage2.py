"""Stage 2 (ZeRO P_os+g): gradients sharded too; a full gradient lives until its bucket is sent.

    backward    each gradient, as it is made, is copied into its bucket's full buffer and
                `.grad` dropped (a post-accumulate-grad hook); a full bucket goes out at once:
                REDUCE-SCATTER (average), asynchronously, while backward goes on; its full
                buffer is freed once sent (at most MAX_IN_FLIGHT wait)
    its end     a callback queued on the autograd engine waits for the last reduce-scatters:
                each rank holds the averaged gradient of its slices only (g·Ψ/N bytes)
    opt.step()  the optimizer updates the owned slices; ALL-GATHER each bucket

Per step: reduce-scatter Ψ + all-gather Ψ = 2Ψ, as stages 0 and 1.
On gloo, torch runs a reduce-scatter as a whole all-reduce, keeping its own chunk (twice the
bytes of a reduce-scatter): the real stages send a direct exchange there (collectives/exchange.py).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.plain.partition import Flat, buckets

MAX_IN_FLIGHT = 2  # buckets sent and not yet landed: each holds a full gradient buffer


def shard(model: nn.Module, make_optimizer, bucket_mb: float = 25.0):
    return model, ShardedGradients(model, make_optimizer, bucket_mb)


class ShardedGradients:
    """Stage 0's hooks and buckets, sending a reduce-scatter; stage 1's step on the slices."""

    def __init__(self, model: nn.Module, make_optimizer, bucket_mb: float) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.flats = [Flat(bucket) for bucket in buckets(params, bucket_mb)]
        self.slices = [nn.Parameter(flat.shard(flat.data), requires_grad=False)
                       for flat in self.flats]
        self.optimizer = make_optimizer(self.slices)
        self.full_grads: list[torch.Tensor | None] = [None] * len(self.flats)  # filling now
        self.arrived = [0] * len(self.flats)
        self.in_flight: list[tuple[int, dist.Work, torch.Tensor, torch.Tensor]] = []
        self.callback_queued = False
        for b, flat in enumerate(self.flats):
            for i, p in enumerate(flat.params):
                p.register_post_accumulate_grad_hook(partial(self.on_grad, b, i))

    def on_grad(self, b: int, i: int, p: nn.Parameter) -> None:
        if not self.callback_queued:  # the first gradient of this backward
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
        flat = self.flats[b]
        if self.full_grads[b] is None:
            self.full_grads[b] = flat.new_full()
        flat.view(self.full_grads[b], i).copy_(p.grad)
        p.grad = None  # this parameter's full gradient is freed now
        self.arrived[b] += 1
        if self.arrived[b] == len(flat.params):  # the bucket is full: send it
            full, self.full_grads[b] = self.full_grads[b], None
            mine = torch.empty_like(self.slices[b])
            work = dist.reduce_scatter_single(mine, full, op=dist.ReduceOp.AVG, async_op=True)
            self.in_flight.append((b, work, full, mine))
            while len(self.in_flight) > MAX_IN_FLIGHT:
                self.land()

    def land(self) -> None:  # the oldest reduce-scatter: wait, keep the slice, drop the buffer
        b, work, _full, mine = self.in_flight.pop(0)
        work.wait()
        self.slices[b].grad = mine

    def end_of_backward(self) -> None:
        while self.in_flight:
            self.land()
        self.arrived, self.callback_queued = [0] * len(self.flats), False

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()  # on the owned slices only
        for flat in self.flats:  # each rank's slice to every rank (torch wants a copy as input)
            dist.all_gather_single(flat.data, flat.shard(flat.data).clone())

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()  # the gradient slices; the full ones are gone already
