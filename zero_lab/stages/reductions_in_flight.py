"""Gradient reductions sent during backward and not yet landed: the queue stages 1 and 2 share.

A stage that reduces its gradients during backward (stage 2 always, stage 1 with
`overlap_grad_reduce=True`) sends each bucket as soon as its last gradient arrives and lets
autograd go on with earlier layers. The handle of every bucket sent waits here, oldest first,
with the tensors the collective reads and writes (kept alive until it is done). When one is
finished, `land(g, full, owned)` puts its result where the stage keeps gradients (stage 2 adds
the slice to the owned gradient; stage 1 writes it into its full buffer's own slice).

When the queue is drained is the stage's choice: a few buckets at most while backward runs
(stage 2 bounds its gradient memory so), all of them when backward ends, or, with
`overlap_step=True`, bucket by bucket inside `opt.step()` (`land_through`), so the optimizer
updates one bucket while the next is still being reduced.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist


class Sent(NamedTuple):
    g: int  # the group (bucket)
    work: dist.Work
    full: torch.Tensor  # the bucket's full gradient, read by the collective until it is done
    owned: torch.Tensor  # receives this rank's slice of the averaged gradient


class InFlight:
    """Buckets sent, oldest first; `land` is called on each as it is finished, in order."""

    def __init__(self, land: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        self._land = land
        self._sent: deque[Sent] = deque()

    def __len__(self) -> int:
        return len(self._sent)

    def __contains__(self, g: int) -> bool:
        return any(s.g == g for s in self._sent)

    def groups(self) -> list[int]:
        """The groups still in flight, in the order they were sent."""
        return [s.g for s in self._sent]

    def send(self, g: int, work: dist.Work, full: torch.Tensor, owned: torch.Tensor,
             keep: int | None = None) -> None:
        """Queue bucket g's collective; then land the oldest beyond `keep` (None: no limit)."""
        self._sent.append(Sent(g, work, full, owned))
        self.land(keep)

    def land(self, keep: int | None = 0) -> None:
        """Finish sent buckets, oldest first: all beyond `keep`, and any already complete."""
        while self._sent and ((keep is not None and len(self._sent) > keep)
                              or self._sent[0].work.is_completed()):
            self._finish_oldest()

    def land_through(self, g: int) -> None:
        """Finish every bucket sent up to and including group g (nothing if g is not sent)."""
        if g in self:
            while self._finish_oldest() != g:
                pass

    def _finish_oldest(self) -> int:
        done = self._sent.popleft()
        done.work.wait()
        self._land(done.g, done.full, done.owned)
        return done.g  # `done.full` goes out of scope here: a buffer of its own is freed
