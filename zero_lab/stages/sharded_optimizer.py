"""The optimizer every stage returns: any element-wise torch optimizer, run on flat slices.

`shard()` builds the learner's optimizer (`optimizer(params)`) on the tensors this rank
updates: for stage 0 each whole flat buffer, for stages 1 and 2 only this rank's slice of
each. Its states (Adam's m and v) are therefore created at that size, which *is* the
optimizer-state sharding of ZeRO. This is exact only for optimizers that treat every element
independently (SGD, Adam, AdamW, ...): an optimizer that looks at a whole matrix (Adafactor's
row/column statistics, Muon's orthogonalisation, LBFGS) would see slices of several
parameters glued together, so it is refused.

In mixed precision (`precision="mixed"`) the model computes in bf16, and this rank keeps an
fp32 *master* copy of the elements it updates; the optimizer runs on the masters and the
result is rounded back into the bf16 parameters: 2 + 2 + (4 + 4 + 4) = 16 bytes per
parameter with Adam, the ZeRO paper's mixed-precision recipe (section 3.1).

    opt.step()               # update the slice (masters first in mixed precision), then
                             # stages 1-2 all-gather it into the full parameters
    opt.zero_grad()
    opt.clip_grad_norm_(1.0) # global norm from per-slice sums: one all-reduce of one number
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.stages.gradient_sync import GradientSync

# Optimizers whose update of an element depends only on that element's history.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
)


def check_optimizer(optim: object, given: list[torch.Tensor]) -> None:
    """Refuse what would silently train wrong on flat slices."""
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError("optimizer must be a function of a parameter list returning a "
                        f"torch.optim.Optimizer, e.g. lambda params: torch.optim.Adam(params, "
                        f"lr=1e-3); it returned {type(optim).__name__}")
    if type(optim) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"{type(optim).__name__} is not supported: zero_lab shards optimizer "
                         "state by flat slice, which is exact only for element-wise optimizers "
                         f"({names})")
    built_on = [p for group in optim.param_groups for p in group["params"]]
    if len(built_on) != len(given) or {id(p) for p in built_on} != {id(p) for p in given}:
        raise ValueError("the optimizer function must build the optimizer on exactly the "
                         "parameters it is given (shard() passes it the flat slices this rank "
                         "updates); do not capture model.parameters() inside it")


OPTIMIZER_CHUNK = 1 << 20  # elements (4 MiB of fp32) per tensor the torch optimizer sees


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps the torch optimizer `self.optim` that updates this rank's flat slices.

    A torch.optim.Optimizer itself (LR schedulers accept it); `param_groups` and `state` are
    those of the wrapped optimizer, so changing a learning rate works as usual.
    """

    def __init__(self, sync: GradientSync, make_optimizer: Callable,
                 master_weights: list[torch.Tensor] | None = None) -> None:
        self.sync = sync
        # fp32 masters of exactly the elements this rank updates (mixed precision only).
        self.master_weights = ([nn.Parameter(m, requires_grad=False) for m in master_weights]
                               if master_weights is not None else None)
        self.targets = self.master_weights if self.master_weights is not None else sync.step_params
        # The torch optimizer sees each target in chunks (views) of at most OPTIMIZER_CHUNK
        # elements. The update is element-wise, so the result is the same; but an optimizer
        # stepping one huge flat tensor makes temporaries as big as it, which the C allocator
        # hands back to the OS after every step and faults in again (measured: Adam on one
        # 24 MiB buffer took 55-80 ms vs 36-39 ms on the same elements as 4 MiB tensors).
        self.chunks = [list(t.split(OPTIMIZER_CHUNK)) for t in self.targets]
        flat_chunks = [c for chunks in self.chunks for c in chunks]
        self.optim = make_optimizer(flat_chunks)
        check_optimizer(self.optim, flat_chunks)
        super().__init__(flat_chunks, self.optim.defaults)
        self.param_groups = self.optim.param_groups  # one source of truth: the inner optimizer
        self.state = self.optim.state

    # ------------------------------------------------------------------ the update
    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.sync.before_step()
        if self.master_weights is not None:
            # bf16 gradient slice -> fp32, applied to the fp32 master (transient copy).
            for master, p in zip(self.master_weights, self.sync.step_params, strict=True):
                master.grad = None if p.grad is None else p.grad.float()
        for target, chunks in zip(self.targets, self.chunks, strict=True):
            grads = (target.grad.split(OPTIMIZER_CHUNK) if target.grad is not None
                     else [None] * len(chunks))
            for chunk, grad in zip(chunks, grads, strict=True):
                chunk.grad = grad  # a view: no copy
        self.optim.step()
        for chunks in self.chunks:
            for chunk in chunks:
                chunk.grad = None  # the targets' .grad stay the one source of truth
        if self.master_weights is not None:
            for master, p in zip(self.master_weights, self.sync.step_params, strict=True):
                p.copy_(master)  # round the updated master into the bf16 parameters
                master.grad = None
        self.sync.after_step()  # stages 1-2: all-gather every rank's updated slice
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sync.zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale the gradients so their global norm is at most `max_norm`; return that norm.

        Same formula as torch.nn.utils.clip_grad_norm_. Each rank holds the final gradient of
        its slices only (stages 1-2), so it computes the sum of |g|^p over them and one
        all-reduce adds the sums of all ranks (the max, for norm_type=inf). Padding is zero.
        """
        norm_type = float(norm_type)
        grads = [p.grad for p in self.sync.step_params if p.grad is not None]
        device = self.sync.groups[0].device
        if grads:
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32)
                                 for g in grads])
        else:
            norms = torch.zeros(1, device=device)
        if math.isinf(norm_type):
            total = norms.max()
            if self.sync.sharded:
                dist.all_reduce(total, op=dist.ReduceOp.MAX)
        else:
            total = norms.pow(norm_type).sum()
            if self.sync.sharded:
                dist.all_reduce(total, op=dist.ReduceOp.SUM)
            total = total.pow(1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               "non-finite, so it cannot be clipped")
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(clip_coef.to(g.dtype))
        return total

    # ------------------------------------------------------------------ results
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{name: full tensor} of `model`, identical on every rank (a collective for stages
        1-2 in mixed precision: every rank must call it). Trainable parameters come from the
        fp32 masters in mixed precision; everything else as the model holds it."""
        full: dict[int, torch.Tensor] = {}
        for g, group in enumerate(self.sync.groups):
            if self.master_weights is None:
                flat = self.sync.full_flat_params(g)
            elif self.sync.sharded:
                flat = group.new_full(torch.float32)
                group.all_gather(flat, self.master_weights[g].detach())
            else:
                flat = self.master_weights[g].detach()
            for p, view in zip(group.params, group.views(flat), strict=True):
                full[id(p)] = view
        return {name: full.get(id(t), t).detach().clone()
                for name, t in model.state_dict(keep_vars=True).items()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.optim.load_state_dict(state_dict)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (each rank saves its own)."""
        return self.optim.state_dict()
