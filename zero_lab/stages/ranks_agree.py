"""Ranks that were given different things to shard refuse together, before any collective.

Ranks that disagree would still pair their collectives by size and order, and two models
with the same number of elements but other shapes, or two stages, would train wrong in
silence. So every rank describes what it was given (a dict of plain values: settings,
parameter names, shapes and dtypes, the optimizer's groups) and one all-gather compares the
descriptions: if they differ, every rank raises the same error, naming the first difference.
"""

from __future__ import annotations

import torch.distributed as dist


def check_ranks_agree(call: str, mine: dict) -> None:
    """Raise ValueError on every rank if any rank's description differs from rank 0's."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        for key in mine:
            ours, other = first[key], theirs[key]
            if ours == other:
                continue
            if isinstance(ours, list) and isinstance(other, list):  # the first entry apart
                pairs = zip(ours, other, strict=False)  # lengths may differ too
                i = next((i for i, (a, b) in enumerate(pairs) if a != b),
                         min(len(ours), len(other)))
                ours = ours[i] if i < len(ours) else "nothing more"
                other = other[i] if i < len(other) else "nothing more"
                key = f"{key}[{i}]"
            raise ValueError(
                f"the ranks called {call} differently: rank {rank} has {key} = {other!r} "
                f"where rank 0 has {ours!r}. Every rank must shard the same model (same "
                "parameter names and shapes) with the same settings")
