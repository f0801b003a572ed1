"""Buffers that forward updates (running statistics, an EMA), kept as torch's DDP keeps them.

Buffers are not parameters: no gradient averages them, and a buffer that forward updates
from the batch it sees (InstanceNorm's running statistics with `track_running_stats`, an EMA
of activations) would drift apart on each rank, each following its own data. torch's DDP
answers with `broadcast_buffers=True`, its default: before every training forward, rank 0's
buffers are broadcast to every rank. `shard(..., broadcast_buffers=True)` (the default) does
the same, with one saving: the broadcast is sent only when some buffer changed since the
last one on some rank (torch counts in-place writes in `tensor._version`), so a constant
buffer such as a causal mask costs one all-reduce of one byte per training forward instead
of a broadcast of every buffer. The ranks agree on "changed" with that all-reduce (the
maximum of their flags): a data-dependent update may change a buffer on some ranks only,
and ranks deciding alone would disagree on whether to broadcast (the others' next
collective would meet the broadcast). As in DDP, nothing is sent in a forward without
gradients (evaluation, which may run on rank 0 alone).

`full_state_dict(model)` syncs too, so the buffers it returns are rank 0's, identical on every
rank. With `broadcast_buffers=False` each rank keeps its own, as in DDP with that option.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives.ledger import control_message
from zero_lab.profiling.marks import BUFFERS_CHECK, mark


class BufferSync:
    """Rank 0's buffers to every rank before each training forward, when they changed."""

    def __init__(self, model: nn.Module, before_send: Callable[[], None] | None = None
                 ) -> None:
        self.model = model
        self.before_send = before_send  # the stage's lockstep check (lockstep.py)
        self._seen = self._state()  # shard() has just broadcast them
        model.register_forward_pre_hook(self._before_forward)

    def _device(self) -> torch.device:
        return next(self.model.buffers()).device

    def _state(self) -> list[tuple[int, int]]:
        """Which tensors the buffers are, and how often each was written in place."""
        return [(id(b), b._version) for b in self.model.buffers()]

    def _before_forward(self, _module: nn.Module, _args) -> None:
        if torch.is_grad_enabled():
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """If any buffer changed since the last sync, broadcast all of rank 0's: one
        broadcast per dtype, the buffers packed into one flat tensor."""
        if self.before_send is not None:
            self.before_send()
        # Did a buffer change on *any* rank? A data-dependent update may skip some ranks'
        # batches: ranks deciding alone would then disagree on whether to broadcast.
        changed = torch.tensor([self._state() != self._seen], dtype=torch.uint8,
                               device=self._device())
        with mark(BUFFERS_CHECK), control_message("all_reduce", changed, dist.get_world_size(),
                                                  "zero_lab.stages.buffers"):  # not data
            dist.all_reduce(changed, op=dist.ReduceOp.MAX)
        if not changed.item():
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.model.buffers():
            by_dtype.setdefault(b.dtype, []).append(b)
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=0)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        self._seen = self._state()
