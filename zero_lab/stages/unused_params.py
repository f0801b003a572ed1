"""Which parameters have a gradient: unused ones, and frozen ones unfrozen since shard().

In one process a parameter that no backward since
the last `zero_grad()` used keeps `.grad = None`, and the optimizer leaves it and its state
alone (Adam does not move it, AdamW does not decay it). Flat buffers blur that: a group is
reduced as a whole, and an unused parameter's part of it is just zeros. So the stages keep
one flag per parameter, `has_grad[g][i]`, cleared by `zero_grad(set_to_none=True)`; `.grad`
is None while it is down, and the optimizer (sharded_optimizer.py) steps only the parameters
whose flag is up. How it is raised is torch DDP's contract:
- by default every trainable parameter must get a gradient in every backward (the hooks
  check it for free); one that does not is refused with its name, pointing to
- `find_unused_parameters=True`: at the end of every backward the ranks agree on the flags
  with one all-reduce of one byte per parameter, taking the maximum (a parameter used on any
  rank has a gradient, as it would in one process on the global batch). DDP does the same
  all-reduce under the same option; the ledger shows it.

A stage calls both when backward ends (gradient_sync.py); the state they read and write
(`has_grad`, `_arrived_here`, `_arrived_unsynced`, `frozen`) is the stage's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def refuse_unfrozen(frozen: list[tuple[str, nn.Parameter]]) -> None:
    """A parameter frozen when shard() ran and unfrozen since is refused, by name."""
    unfrozen = [name for name, p in frozen if p.requires_grad]
    if unfrozen:
        raise RuntimeError(
            f"{', '.join(unfrozen)} was frozen (requires_grad=False) when shard() ran and "
            "has been unfrozen since: shard() laid out only the parameters trainable then, "
            "so its gradient would never be averaged nor stepped. Unfreeze it before "
            "shard(); for progressive unfreezing, keep it trainable with lr=0 in a "
            "parameter group of its own and raise that group's lr when its time comes")


def agree_on_grads(sync) -> None:
    """Every rank learns which parameters have a gradient now; `.grad` follows (`sync`: the
    stage, a gradient_sync.GradientSync)."""
    arrived_here, sync._arrived_here = sync._arrived_here, [[False] * len(g.params)
                                                            for g in sync.groups]
    if not sync.find_unused_parameters:  # torch DDP's default: each got one on every rank
        if not all(map(all, arrived_here)):
            raise RuntimeError(_missing(sync, arrived_here))
        sync.has_grad = [[True] * len(g.params) for g in sync.groups]
        return
    if sync._arrived_unsynced is not None:  # the ranks agree once, when the gradients are sent
        arrived_here = [[a or b for a, b in zip(x, y, strict=True)]
                        for x, y in zip(arrived_here, sync._arrived_unsynced, strict=True)]
        sync._arrived_unsynced = None
    if sync.defers():
        sync._arrived_unsynced = arrived_here
        return
    flags = torch.tensor([a or h for arrived, had in zip(arrived_here, sync.has_grad,
                                                           strict=True)
                          for a, h in zip(arrived, had, strict=True)],
                         dtype=torch.uint8, device=sync.groups[0].device)
    if sync.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=sync.groups[0].process_group)
    flat, k = flags.tolist(), 0
    for g, group in enumerate(sync.groups):
        sync.has_grad[g] = [bool(f) for f in flat[k:k + len(group.params)]]
        k += len(group.params)
        for p, has in zip(group.params, sync.has_grad[g], strict=True):
            if not has:
                p.grad = None


def _missing(sync, arrived_here: list[list[bool]]) -> str:
    missing = sorted(name for group, arrived in zip(sync.groups, arrived_here, strict=True)
                     for name, a in zip(group.names, arrived, strict=True) if not a)
    return (f"{len(missing)} trainable parameter(s) got no gradient in this backward "
            f"on rank {sync.groups[0].rank}: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}. If the model really leaves "
            "parameters unused in some steps (or on some ranks), pass "
            "find_unused_parameters=True to shard(), as with torch's DDP (one more "
            "small all-reduce per backward); else make every parameter take part in "
            "the loss, or freeze it (requires_grad=False) before shard()")
