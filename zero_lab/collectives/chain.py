"""Collectives that must run one after another, behind one handle.

Hybrid sharding (stages/hybrid.py) averages a gradient in two levels: a reduce-scatter
inside a group of ranks, then an all-reduce of its result across the groups; a
hierarchical all-reduce adds an all-gather inside the group. Each needs the last one's
result, yet the stages want one asynchronous handle per bucket, as for one collective:
`Chain` is that handle, and `one_after_another` starts one (partition.py uses both).
"""

from __future__ import annotations

from collections.abc import Sequence


class Chain:
    """Collectives that run one after another, each on the last one's result, behind one
    handle used like `dist.Work`: the next starts once the last has finished (when the
    handle is polled with `is_completed()` or waited on). Every rank polls and waits in the
    same order, so every rank issues them in the same order."""

    def __init__(self, steps: Sequence) -> None:
        self._steps = list(steps)  # functions that start a collective, return its handle
        self._work = self._steps.pop(0)()

    def _advance(self, block: bool) -> bool:
        while True:
            if self._work is not None:
                if not block and not self._work.is_completed():
                    return False
                self._work.wait()
                self._work = None
            if not self._steps:
                return True
            self._work = self._steps.pop(0)()

    def is_completed(self) -> bool:
        return self._advance(block=False)

    def wait(self) -> bool:
        return self._advance(block=True)


def one_after_another(async_op: bool, *steps) -> Chain | None:
    """Run `steps` (each starts a collective, asynchronously) one after another: the Chain
    when `async_op`, else wait for all of them here."""
    chain = Chain(steps)
    if async_op:
        return chain
    chain.wait()
    return None
