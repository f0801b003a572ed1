"""Ranks of one save or load agree, or refuse together.

A rank that raises alone leaves the others waiting in the next collective (a hang), or, worse,
training on while it stopped. So what can differ between ranks goes through one small
all-gather: which checkpoint each rank names (its path and step at save, the SHA-256 of the
manifest it read at load), and whether each rank's part went well. If one rank failed, every
rank raises the same `CheckpointError`, naming the rank and its reason, and no rank has
changed its model.
"""

from __future__ import annotations

import torch.distributed as dist

from zero_lab.checkpoint.manifest import CheckpointError


def gather(mine: object) -> list:
    """Every rank's `mine` (small, picklable), in rank order."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def failure(exc: BaseException) -> str:
    """What a rank tells the others about its exception."""
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def refuse_together(problems: list[str | None]) -> None:
    """Raise on every rank if any rank reported a problem (the first one, by rank)."""
    for rank, problem in enumerate(problems):
        if problem is not None:
            where = (f" (found by rank {rank} of {len(problems)}; every rank refused)"
                     if len(problems) > 1 else "")
            raise CheckpointError(problem + where)


def check_same(what: str, values: list, describe=repr) -> None:
    """Raise on every rank if the ranks' `values` are not all equal, naming two that differ."""
    for rank, value in enumerate(values):
        if value != values[0]:
            raise CheckpointError(
                f"the ranks name different checkpoints: rank 0 {what} {describe(values[0])}, "
                f"rank {rank} {describe(value)}. Every rank must save or load the same "
                "checkpoint (a per-rank path, or a 'latest' read at different times, mixes "
                "two); every rank refused")
