"""The optimizer every stage returns: any element-wise torch optimizer, run on flat slices.

`shard(model, stage, optimizer=fn)` calls `fn` once, before anything is sharded, on the
model's trainable parameters with their full shapes: so `fn` is written exactly as for plain
PyTorch, per-group settings included (the usual "no weight decay on biases and norms" split,
as in nanoGPT's `configure_optimizers`, which looks at `p.dim()`). That optimizer is only a
*plan*: which parameters go in which group, with which hyper-parameters. The optimizer that
really steps is the same class, with the same groups and settings, built on the pieces of
those parameters that this rank updates: for stage 0 each whole parameter (a view of its flat
buffer), for stages 1-3 the part of each parameter inside this rank's slice. Its states (Adam's
m and v) are therefore created at that size, which *is* the optimizer-state sharding of ZeRO.
A parameter the plan leaves out is never stepped, as in plain PyTorch; padding never is.

One optimizer parameter per piece (not one per flat slice) keeps every torch semantic exact:
a parameter with no gradient (`.grad` None: unused since the last zero_grad) is skipped,
state and all, and Adam's step count is counted per parameter. This is exact only for
optimizers that treat every element independently (SGD, Adam, AdamW, ...): one that looks at
a whole matrix (Adafactor's row/column statistics, Muon's orthogonalisation, LBFGS) would see
a slice of it, so it is refused.

In mixed precision (`precision="bf16"` or `"fp16"`) the model computes in 16 bits, and this
rank keeps an fp32 *master* copy of the elements it updates; the optimizer runs on the
masters and the result is rounded back into the 16-bit parameters: 2 + 2 + (4 + 4 + 4) = 16
bytes per parameter with Adam, the ZeRO paper's mixed-precision recipe (section 3.1).

    opt.step()               # update the slice (masters first in mixed precision), then
                             # stages 1-2 all-gather it into the full parameters
    opt.zero_grad()
    opt.clip_grad_norm_(1.0) # global norm from per-slice sums: one all-reduce of one number
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from zero_lab.profiling.marks import OPTIMIZER_STEP, ZERO_GRAD, mark
from zero_lab.stages.gradient_sync import GradientSync
from zero_lab.stages.mixed_precision import step_grad

# Optimizers whose update of an element depends only on that element's history.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
)


def make_plan(optimizer: Callable, params: Sequence[nn.Parameter],
              model_params: Sequence[torch.Tensor] | None = None) -> torch.optim.Optimizer:
    """Call the optimizer function on `params` (full shapes, before sharding) and check what
    it returns: an element-wise torch optimizer over parameters of the model only.

    Parameters of the model that do not require grad may be in it (they never get a
    gradient, so they are never stepped, as in plain PyTorch); anything else is refused.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer must be a function that builds the optimizer, not an "
                        f"optimizer: pass e.g. lambda params: torch.optim."
                        f"{type(optimizer).__name__}(params, lr=...) (shard() calls it on the "
                        "model's parameters, then builds the same optimizer on this rank's "
                        "slices)")
    if not callable(optimizer):
        raise TypeError("optimizer must be a function of a parameter list returning a torch "
                        f"optimizer, got {type(optimizer).__name__}")
    plan = optimizer(list(params))
    if not isinstance(plan, torch.optim.Optimizer):
        raise TypeError("optimizer must be a function of a parameter list returning a "
                        f"torch.optim.Optimizer, e.g. lambda params: torch.optim.Adam(params, "
                        f"lr=1e-3); it returned {type(plan).__name__}")
    if type(plan) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        raise ValueError(f"{type(plan).__name__} is not supported: zero_lab shards optimizer "
                         "state by flat slice, which is exact only for element-wise optimizers "
                         f"({names})")
    known = {id(p) for p in (model_params if model_params is not None else params)}
    strangers = [p for group in plan.param_groups for p in group["params"]
                 if id(p) not in known]
    if strangers:
        raise ValueError(f"the optimizer function put {len(strangers)} tensor(s) that are not "
                         "parameters of the model being sharded into the optimizer (shape "
                         f"{tuple(strangers[0].shape)}); build it on the parameters it is given")
    return plan


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + numel) of a step target that belong to parameter `param` of
    group `group`: one tensor the torch optimizer steps."""

    group: int
    param: int
    start: int
    numel: int


OWNER_KEY = "zero_lab_owner"  # in opt.state_dict(): which rank, world size and stage saved it
OPTIMIZER_CHUNK = 1 << 20  # elements (4 MiB of fp32) per tensor the torch optimizer sees
SHARDED_STAGE_ATTR = "_zero_lab_stage"  # set on parameters whose gradients live elsewhere


def refuse_outside_optimizers(params: Sequence[nn.Parameter], stage: int) -> None:
    """Make a torch optimizer built on these parameters (not through shard()) refuse to step.

    At stages 1 and 2 a parameter's `.grad` is not its gradient: the averaged gradient lives
    in this rank's slice, inside the optimizer shard() returns. An optimizer of one's own
    would step on nothing (stage 2: `.grad` is None) or on a zeroed buffer outside this
    rank's slice (stage 1), silently. A global optimizer-step pre-hook (installed once) stops
    it with the reason. Stage 0 holds the full averaged gradients and stage 3's parameters
    are the local slices with theirs, so an optimizer of one's own is right there.
    """
    for p in params:
        setattr(p, SHARDED_STAGE_ATTR, stage)
    global _GUARD
    if _GUARD is None:
        _GUARD = register_optimizer_step_pre_hook(_refuse_step)


_GUARD = None


def _refuse_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if isinstance(optimizer, ShardedOptimizer) or getattr(optimizer, "_zero_lab_inner", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            stage = getattr(p, SHARDED_STAGE_ATTR, None)
            if stage in (1, 2):
                raise RuntimeError(
                    f"this {type(optimizer).__name__} steps parameters of a model sharded at "
                    f"stage {stage}, whose gradients live in the optimizer shard() returned "
                    "(each rank's slice): it would train wrong. Use the optimizer shard() "
                    "returns, built with shard(model, stage, optimizer=lambda params: "
                    f"torch.optim.{type(optimizer).__name__}(params, ...))")


def pieces_of(sync: GradientSync) -> list[Piece]:
    """What this rank steps: per group, each parameter's part of the step target, cut into
    tensors of at most OPTIMIZER_CHUNK elements.

    The cut matters for speed, not for values: an optimizer stepping one huge tensor makes
    temporaries as big as it, which the C allocator hands back to the OS after every step
    and faults in again (measured: Adam on one 24 MiB buffer took 55-80 ms vs 36-39 ms on the
    same elements as 4 MiB tensors)."""
    pieces = []
    for g, group in enumerate(sync.groups):
        if sync.group_sharded(g):
            spans = [(pc.index, pc.shard_start, pc.numel) for pc in group.shard_pieces()]
        else:
            spans = list(zip(range(len(group.params)), group.offsets, group.numels, strict=True))
        for i, start, numel in spans:
            for c in range(0, numel, OPTIMIZER_CHUNK):
                pieces.append(Piece(g, i, start + c, min(OPTIMIZER_CHUNK, numel - c)))
    return pieces


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps the torch optimizer `self.optim` that updates this rank's pieces of parameters.

    A torch.optim.Optimizer itself (LR schedulers accept it); `param_groups` and `state` are
    those of the wrapped optimizer, in the plan's groups and order, so changing a learning
    rate works as usual.
    """

    def __init__(self, sync: GradientSync, plan: torch.optim.Optimizer,
                 master_weights: list[torch.Tensor] | None = None) -> None:
        self.sync = sync
        # fp32 masters of exactly the elements this rank updates (mixed precision only).
        self.master_weights = ([nn.Parameter(m, requires_grad=False) for m in master_weights]
                               if master_weights is not None else None)
        self.targets = self.master_weights if self.master_weights is not None else sync.step_params
        self.pieces = pieces_of(sync)
        self.views = [self.targets[pc.group][pc.start:pc.start + pc.numel] for pc in self.pieces]
        # The plan's groups, each holding the pieces of its parameters (a placeholder when
        # this rank updates none of them, so groups keep their places for LR schedulers).
        group_of = {id(p): k for k, pg in enumerate(plan.param_groups) for p in pg["params"]}
        groups = [{**{key: v for key, v in pg.items() if key != "params"}, "params": []}
                  for pg in plan.param_groups]
        for pc, view in zip(self.pieces, self.views, strict=True):
            k = group_of.get(id(sync.groups[pc.group].params[pc.param]))
            if k is not None:  # a parameter the plan leaves out is never stepped
                groups[k]["params"].append(view)
        target = self.targets[0]
        for group in groups:
            if not group["params"]:
                group["params"].append(target.new_empty(0))
        # The same class and constructor settings (its `defaults` may hold more than the
        # constructor takes: AdamW's records decoupled_weight_decay), groups over the pieces.
        accepted = inspect.signature(type(plan).__init__).parameters
        self.optim = type(plan)(groups, **{k: v for k, v in plan.defaults.items()
                                           if k in accepted})
        self.optim._zero_lab_inner = True  # steps pieces of this rank: never refused
        super().__init__([t for group in groups for t in group["params"]], self.optim.defaults)
        self.param_groups = self.optim.param_groups  # one source of truth: the inner optimizer
        self.state = self.optim.state
        self._built = True  # from now on add_param_group is refused (see there)

    # ------------------------------------------------------------------ the update
    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with mark(OPTIMIZER_STEP):
            self._step()
        return loss

    def _step(self) -> None:
        """The update of this rank's slices (and, at stages 1-2, their all-gather)."""
        self.sync.wait_for_params()  # no forward since the last step: its all-gathers first
        self.sync.step_starts()  # a step with no backward since the last: lockstep check
        self.sync.before_step()
        if self.sync.overlap_step:
            # Bucket by bucket, as each one's reduce-scatter lands (the first sent first),
            # its all-gather issued at once: the update of one overlaps the next's transfer.
            for g in self.sync.landing_order():
                self.sync.land_through(g)
                self._update([g])
                self.sync.all_gather_params([g])
        else:
            self._update(range(len(self.targets)))
            self.sync.after_step()  # stages 1-2: all-gather every rank's updated slice
        self.sync.lockstep.step_taken()

    def _update(self, groups) -> None:
        """One step of the torch optimizer on the pieces of `groups` (a torch optimizer skips
        a tensor whose .grad is None: the other groups' pieces are left alone)."""
        groups = set(groups)
        if self.master_weights is not None:
            # The master's gradient: the fp32 average when reduced in fp32 (reduce_dtype), else
            # the 16-bit gradient slice widened (a transient copy).
            for g in groups:
                grad = step_grad(self.sync, g)
                self.master_weights[g].grad = None if grad is None else grad.float()
        has_grad = self.sync.has_grad
        for pc, view in zip(self.pieces, self.views, strict=True):
            grad = self.targets[pc.group].grad if pc.group in groups else None
            # A parameter with no gradient is skipped by the torch optimizer, state and all.
            view.grad = (grad[pc.start:pc.start + pc.numel]
                         if grad is not None and has_grad[pc.group][pc.param] else None)
        self.optim.step()
        for view in self.views:
            view.grad = None  # the targets' .grad stay the one source of truth
        if self.master_weights is not None:
            for g in groups:
                master = self.master_weights[g]
                self.sync.step_params[g].copy_(master)  # round the updated master into bf16
                master.grad = None

    def wait_for_grads(self) -> None:
        """With overlap_step, backward returns with its last reduce-scatters in flight (the
        step waits for each bucket's): call this before reading a `.grad` yourself."""
        self.sync.land_reductions()

    def zero_grad(self, set_to_none: bool = True) -> None:
        with mark(ZERO_GRAD):
            self.sync.abandon_unfinished_backward()  # after a backward that raised
            self.sync.zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale the gradients so their global norm is at most `max_norm`; return that norm.

        Same formula as torch.nn.utils.clip_grad_norm_. Each rank holds the final gradient of
        its slices only (stages 1-3), so it computes the sum of |g|^p over them and one
        all-reduce adds the sums of all ranks (the max, for norm_type=inf); groups every rank
        holds whole (stage 0, stage 3's replicated root) count once. Padding is zero.
        """
        self.sync.settle()  # reductions left in flight (overlap_step) land first
        norm_type = float(norm_type)
        inf = math.isinf(norm_type)
        grads, sliced, whole, rounded = [], [], [], []
        for g, p in enumerate(self.sync.step_params):
            grad = step_grad(self.sync, g)  # reduced in fp32: the fp32 average the step uses
            if grad is not None:
                if grad is not p.grad:
                    rounded.append((p.grad, grad))
                grads.append(grad)
                (sliced if self.sync.group_sharded(g) else whole).append(grad)

        def part(tensors: list[torch.Tensor]) -> torch.Tensor:  # max |g|, or sum of |g|^p
            if not tensors:
                return torch.zeros((), device=self.sync.groups[0].device)
            norms = torch.stack([torch.linalg.vector_norm(t, norm_type, dtype=torch.float32)
                                 for t in tensors])
            return norms.max() if inf else norms.pow(norm_type).sum()

        total_sliced, total_whole = part(sliced), part(whole)
        if self.sync.sharded:  # over the ranks sharing the slices (with a mesh: one group)
            dist.all_reduce(total_sliced, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                            group=self.sync.groups[0].process_group)
        total = (torch.maximum(total_sliced, total_whole) if inf
                 else (total_sliced + total_whole).pow(1.0 / norm_type))
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               "non-finite, so it cannot be clipped")
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(clip_coef.to(g.dtype))
        for low, wide in rounded:  # what `.grad` shows: the clipped average's rounding
            low.copy_(wide)
        return total

    # ------------------------------------------------------------------ results
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{name: full tensor} of `model`, identical on every rank (a collective for stages
        1-2 in mixed precision: every rank must call it). Trainable parameters come from the
        fp32 masters in mixed precision; everything else as the model holds it."""
        self.sync.settle()  # all-gathers left in flight for the next forward land first
        full: dict[int, torch.Tensor] = {}
        for g, group in enumerate(self.sync.groups):
            if self.master_weights is None:
                flat = self.sync.full_flat_params(g)
            elif self.sync.group_sharded(g):
                flat = group.new_full(torch.float32)
                group.all_gather(flat, self.master_weights[g].detach())
            else:
                flat = self.master_weights[g].detach()
            for p, view in zip(group.params, group.views(flat), strict=True):
                full[id(p)] = view
        if hasattr(self.sync, "full_frozen"):  # stage 3 shards frozen parameters too
            full.update(self.sync.full_frozen())
        return {name: full.get(id(t), t).detach().clone()
                for name, t in model.state_dict(keep_vars=True).items()}

    def add_param_group(self, param_group: dict) -> None:
        """Refused once built: the optimizer steps this rank's pieces of the parameters shard()
        laid out; a parameter added now would be stepped with this rank's own, unaveraged
        gradient, and the ranks would drift apart."""
        if not getattr(self, "_built", False):  # torch.optim.Optimizer.__init__ adds them
            super().add_param_group(param_group)
            return
        raise RuntimeError(
            "opt.add_param_group after shard(): the optimizer shard() returns steps this rank's "
            "pieces of the parameters it laid out, and a parameter added now would be stepped "
            "with each rank's own gradient (the ranks would drift apart). Put every group in "
            "the optimizer function given to shard(); for progressive unfreezing, give the "
            "later parameters a group of their own with lr=0 and raise its "
            "opt.param_groups[k]['lr'] when their time comes")

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (each rank saves its own), labelled with
        the rank, world size and stage it belongs to."""
        return {**self.optim.state_dict(), OWNER_KEY: self._owner()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load this rank's own state. At stages 1-3 every rank's state is that of its own
        slices, so a state saved by another rank (rank 0's, loaded everywhere: the DDP habit)
        would fit by shape and train wrong: refused, as torch's ZeroRedundancyOptimizer does."""
        state_dict = dict(state_dict)
        saved = state_dict.pop(OWNER_KEY, None)
        mine = self._owner()
        whole = saved is not None and saved["stage"] == mine["stage"] == 0  # every rank's
        if saved is not None and saved != mine and not whole:
            raise ValueError(
                f"opt.load_state_dict: this state was saved by rank {saved['rank']} of "
                f"{saved['world_size']} (stage {saved['stage']}), this is rank {mine['rank']} of "
                f"{mine['world_size']} (stage {mine['stage']}). Each rank's optimizer holds the "
                "state of its own slices: save and load each rank's own opt.state_dict() (a file "
                "per rank), or use zero_lab.checkpoint.save / load (any stage and world size)")
        self.optim.load_state_dict(state_dict)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state

    def _owner(self) -> dict:
        group = self.sync.groups[0]
        return {"rank": group.rank, "world_size": group.world_size, "stage": self.sync.stage}
