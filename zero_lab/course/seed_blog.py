"""The seed blog's ZeRO, paraphrased once, so the course can run it and measure its mistakes.

The course started from a blog post (the seed blog) that implements ZeRO-1, -2 and -3 on a
deep MLP (its section 6, "Implementation Deep Dive"; section numbers below are the blog's).
Its numbers are the course's starting questions: why did its ZeRO-2 peak above its ZeRO-1
(section 3.4.4: 8,470 MB against 8,090 MB), why did its gradients not shrink? This module
holds the blog's versions, each with the blog's own rules, so notebooks and tests reproduce
those numbers instead of retelling them:

- `owned_indices` / `owner_ranks`: the blog's ownership rule (sections 6.2.2 and 6.2.4):
  whole parameter tensors dealt out to ranks, `n // N` each, one more for the first `n % N`.
  Correct, but ranks then own very different numbers of elements (notebook 03).
- `BlogZero`: the blog's ZeRO-1 (section 6.2.4), and its ZeRO-2 (sections 6.3.1-6.3.3) with
  its two mistakes. **Deliberately wrong** where marked: the ZeRO-2 keeps every gradient and
  sends N times too much (notebook 04 measures both); it still trains correctly.
- `blog_zero3_gradient`: the blog's ZeRO-3 gradient step (section 6.4.6). **Deliberately
  wrong**: it averages different chunks of the gradient across ranks, so training diverges
  from one process (tests/workers/zero3_cases.py, case `blog_bug`, must catch it).

zero_lab's own stages (`zero_lab.stages`) are the versions done right. Both sides of a
launch may import this module (it needs torch and torch.distributed only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# ------------------------------------------------------------------ ownership (6.2.2, 6.2.4)


def owned_indices(n_tensors: int, world_size: int, rank: int) -> range:
    """The indices of the whole tensors `rank` owns (section 6.2.2): `n // N` consecutive
    tensors each, one more for each of the first `n % N` ranks."""
    per, extra = divmod(n_tensors, world_size)
    start = rank * per + min(rank, extra)
    return range(start, start + per + (1 if rank < extra else 0))


def owner_ranks(n_tensors: int, world_size: int) -> list[int]:
    """The owner of each tensor index, recomputed the way the blog's step does before it
    broadcasts (section 6.2.4; its "pitfall 4", section 6.9, explains the two branches)."""
    per, extra = divmod(n_tensors, world_size)
    return [i // (per + 1) if i < (per + 1) * extra else (i - extra) // per
            for i in range(n_tensors)]


# ------------------------------------------------------------------ ZeRO-1 and ZeRO-2


class BlogZero:
    """The blog's ZeRO-1 (`stage=1`) or ZeRO-2 (`stage=2`) as an optimizer for `model`.

    Each rank's Adam holds only the parameters it owns (whole tensors, `owned_indices`).
    ZeRO-1 (6.2.4): all-reduce every gradient and divide by N, step, broadcast every
    parameter from its owner. ZeRO-2 adds, deliberately kept:

    1. (6.3.1-6.3.2) a tensor hook on each parameter the rank does not own that returns
       None to "discard" its gradient. A hook's return value *replaces* the gradient and
       None means "unchanged": every gradient is kept.
    2. (6.3.3) a per-parameter "reduce-scatter" whose input is N concatenated copies of the
       flattened gradient and whose output is the size of the whole gradient: every rank
       receives the whole sum (an all-reduce), from an input N times the gradient.

    `optim` is the inner torch optimizer (what `zero_lab.measure.memory.held_bytes` counts).
    """

    def __init__(self, model: nn.Module, stage: int, lr: float = 1e-3) -> None:
        if stage not in (1, 2):
            raise ValueError(f"the blog's ZeRO here is stage 1 or 2, got {stage!r}")
        self.params = list(model.parameters())
        n, rank = dist.get_world_size(), dist.get_rank()
        self.owner = owner_ranks(len(self.params), n)
        self.local = list(owned_indices(len(self.params), n, rank))
        self.stage = stage
        for p in self.params:  # every rank starts from rank 0's initialisation
            dist.broadcast(p.data, src=0)
        if stage == 2:
            for i, p in enumerate(self.params):
                mine = i in self.local
                p.register_hook(lambda grad, mine=mine: grad if mine else None)  # mistake 1
        self.optim = torch.optim.Adam([self.params[i] for i in self.local], lr=lr)

    def step(self) -> None:
        n = dist.get_world_size()
        for i, p in enumerate(self.params):
            if self.stage == 1:
                dist.all_reduce(p.grad)
                p.grad /= n
                continue
            g = p.grad.reshape(-1)
            copies = torch.cat([g for _ in range(n)])  # mistake 2: N copies of the gradient
            out = torch.empty_like(g)
            dist.reduce_scatter_single(out, copies)  # every rank gets the whole sum
            p.grad = (out / n).view_as(p) if i in self.local else None
        self.optim.step()
        for i, p in enumerate(self.params):
            dist.broadcast(p.data, src=self.owner[i])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


# ------------------------------------------------------------------ ZeRO-3 (6.4)


def blog_zero3_gradient(full_grad: torch.Tensor,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The blog's ZeRO-3 gradient step for one gradient (section 6.4.6): cut this rank's
    chunk along dim 0 out of *its own* full gradient (as its `Zero3ParamManager` shards
    parameters, 6.4.1 and 6.4.5), all-reduce that chunk and divide by N.

    Deliberately wrong: the all-reduce adds rank 0's chunk 0 to rank 1's chunk 1, different
    pieces of the gradient. A reduce-scatter of the full gradient is what gives rank r the
    average of chunk r. (Like the blog's, it assumes dim 0 splits into N chunks.)
    Returns the "averaged" chunk; `full_grad` is left untouched.
    """
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = full_grad.chunk(n, dim=0)[rank].clone()
    dist.all_reduce(mine, group=group)
    return mine / n
