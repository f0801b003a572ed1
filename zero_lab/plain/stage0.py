"""Stage 0, plain data parallelism: every rank holds everything, gradients are averaged.

    backward    each parameter's gradient, as it is made, is copied into its bucket's flat
                gradient buffer (a post-accumulate-grad hook); a full bucket goes out at
                once: ALL-REDUCE (average), asynchronously, while backward goes on
    its end     a callback queued on the autograd engine waits for every all-reduce
    opt.step()  the torch optimizer updates the full parameters; nothing to send

Per step: one all-reduce of Ψ elements (2Ψ in the ZeRO paper's count).
No reduce-scatter here (on gloo, torch runs one as a whole all-reduce, keeping its own chunk:
twice the bytes, so the real stages 1-3 send a direct exchange there, collectives/exchange.py).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.plain.partition import Flat, buckets


def shard(model: nn.Module, make_optimizer, bucket_mb: float = 25.0):
    return model, DataParallel(model, make_optimizer, bucket_mb)


class DataParallel:
    """Bucketed gradient all-reduce from hooks, overlapped with backward."""

    def __init__(self, model: nn.Module, make_optimizer, bucket_mb: float) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self.flats = [Flat(bucket) for bucket in buckets(params, bucket_mb)]
        self.grads = [flat.new_full() for flat in self.flats]  # one gradient buffer a bucket
        self.optimizer = make_optimizer(params)  # on the full parameters, as in one process
        self.arrived = [0] * len(self.flats)
        self.in_flight: list[dist.Work] = []
        self.callback_queued = False
        for b, (flat, grad) in enumerate(zip(self.flats, self.grads, strict=True)):
            for p, view in zip(flat.params, flat.views(grad), strict=True):
                p.register_post_accumulate_grad_hook(partial(self.on_grad, b, view))

    def on_grad(self, b: int, view: torch.Tensor, p: nn.Parameter) -> None:
        if not self.callback_queued:  # the first gradient of this backward
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
        view.copy_(p.grad)
        p.grad = view  # the all-reduce averages it in place
        self.arrived[b] += 1
        if self.arrived[b] == len(self.flats[b].params):  # the bucket is full: send it
            work = dist.all_reduce(self.grads[b], op=dist.ReduceOp.AVG, async_op=True)
            self.in_flight.append(work)

    def end_of_backward(self) -> None:
        for work in self.in_flight:
            work.wait()
        self.in_flight, self.arrived = [], [0] * len(self.flats)
        self.callback_queued = False

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()  # every .grad to None; the next backward copies anew
