"""Stage 1 (ZeRO P_os): shard the optimizer states, keep full parameters and gradients.

Each rank keeps Adam's m and v (and, in mixed precision, the fp32 masters) only for the
slice of each flat buffer it owns: (p + g)·Ψ + K·Ψ/N bytes per rank (ZeRO paper, 5.1).

    backward       nothing sent; gradients accumulate into a full flat gradient buffer per
                   bucket, as in stage 0 (every `param.grad` is a view of it)
    backward ends  (the callback queued on the autograd engine) REDUCE-SCATTER per bucket:
                   the averaged gradient of this rank's own slice, written into the owned
                   part of the buffer; the rest of the buffer is zeroed
    opt.step()     update the owned slice; ALL-GATHER per bucket brings every rank's
                   updated slice to every rank (not N broadcasts)

Per step: reduce-scatter Ψ + all-gather Ψ = 2Ψ, as plain data parallelism (section 7.2.1).

Gradient accumulation: after one backward the owned slice holds the average R; a second
backward adds the local L_r on top, and averaging R + L_r would divide R by N again. So from
the second backward on, gradients are divided by N on their way in ("pre-divide", as torch's
DDP default comm hook does) and the reduce-scatter sums: R + sum over s of L_s/N = R + mean(L).

The plain stage (`zero_lab/plain/stage1.py`, which reduces in `opt.step()`) plus:

    addition                        module              why a real implementation needs it
    reduce when backward ends       gradient_sync.py    gradients final when backward returns
                                                        (for clipping and reads), as in DDP
    pre-divide, no_sync             zero1.py,           several backwards a step average right
                                      accumulation.py
    reduce during backward;         partition.py's      overlap (`overlap_grad_reduce`,
      a step per bucket as it lands   InFlight          `overlap_step`): the same bytes, earlier
    the all-gather under the next   param_gather.py     hides the gather; a raw read of a
      forward                                           parameter waits for its own bucket
    mixed precision, fp32 masters   mixed_precision.py  16-bit compute, the update in fp32
    unused and frozen parameters    unused_params.py    a missing gradient named, or agreed on
    lockstep, agreement, refusals   lockstep.py,        ranks that differ fail together, named;
                                      refusals.py       misuse refused before it trains wrong
    the direct exchange on gloo     collectives/        gloo runs a reduce-scatter as a whole
                                      exchange.py       all-reduce (twice the bytes)
    `zero1_variant="all_reduce"`;   zero1.py            the seed notes' stage 1 (3Ψ a step,
      ZeroRedundancyOptimizer                           notebook 03); torch's signature, reducing
                                                        in `step()`
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.stages.gradient_sync import FullGradients, GradientSync
from zero_lab.stages.mixed_precision import install_fresh_start, land_wide
from zero_lab.stages.partition import FlatParamGroup, InFlight, make_flat_groups
from zero_lab.stages.refusals import ZERO1_VARIANTS, check_ranks_agree
from zero_lab.stages.sharded_optimizer import (
    ShardedOptimizer,
    make_plan,
    refuse_outside_optimizers,
)


class Zero1(GradientSync):
    """Reduce-scatter the full gradients when backward ends; step and all-gather the slice."""

    stage = 1
    sharded = True

    def __init__(self, groups: list[FlatParamGroup], variant: str = "reduce_scatter",
                 reduce_in_step: bool = False, find_unused_parameters: bool = False,
                 overlap_grad_reduce: bool = False) -> None:
        if variant not in ZERO1_VARIANTS:
            raise ValueError(f"stage 1 variant must be one of {ZERO1_VARIANTS}, got {variant!r}")
        if overlap_grad_reduce and (variant != "reduce_scatter" or reduce_in_step):
            raise ValueError("overlap_grad_reduce reduce-scatters during backward: not with "
                             "the all_reduce variant nor a reduction in step()")
        super().__init__(groups, find_unused_parameters)
        self.variant = variant
        # Reduce-scatter each bucket as soon as its gradients are in, during backward, with
        # stage 2's queue of buckets in flight (partition.py's InFlight); else all when backward
        # ends.
        self.overlap_grad_reduce = overlap_grad_reduce
        self.reductions = InFlight(self._land)
        # When gradients are reduced: at the end of backward (shard()), or in opt.step()
        # (ZeroRedundancyOptimizer below, an optimizer that leaves backward alone).
        self.reduce_in_step = reduce_in_step
        self.grads = FullGradients(self)  # stage 0's: full gradients, kept (g·Ψ bytes)
        self.grad_buffers = self.grads.flat_grads
        # The optimizer updates only this rank's slice; its gradient is the same slice of the
        # gradient buffer (both are views: no memory of their own).
        for group, grad in zip(groups, self.grad_buffers, strict=True):
            step_param = nn.Parameter(group.shard(group.flat), requires_grad=False)
            step_param.grad = group.shard(grad)
            self.step_params.append(step_param)
        # Pre-divide (see the module docstring), needed only once our slice of the buffer
        # holds an averaged gradient, i.e. from the second backward before a zero_grad().
        self._holds_average = False
        if not reduce_in_step and variant == "reduce_scatter":
            for group in groups:
                for p in group.params:
                    p.register_hook(self._pre_divide)
        install_fresh_start(self)  # reduce_dtype=float32: accumulation in fp32
        self.hook_each_gradient(self.on_grad)

    def _pre_divide(self, grad: torch.Tensor) -> torch.Tensor | None:
        # Before autograd adds into the buffer, the last backward's reductions land
        # (overlap_step leaves them in flight after backward; landing rewrites the buffer).
        # Not in the middle of this backward (its own are in flight): only before its first
        # gradient, when its end-of-backward callback is not queued yet.
        if not self._callback_queued:
            self.land_reductions()
        return grad / self.world_size if self._holds_average else None  # None: unchanged

    def on_grad(self, g: int, i: int, param: torch.Tensor) -> None:
        """Parameter i of bucket g has its gradient: into the full buffer (stage 0's)."""
        self.gradient_arrived(g, i)  # (the first of a backward queues end_of_backward)
        self.grads.adopt(g, i, param)
        for ready in self.groups_ready(g):  # all in, in the order every rank sends
            self.on_group_ready(ready)

    def on_group_ready(self, g: int) -> None:
        if not self.overlap_grad_reduce or self.defers():
            return  # reduced when backward ends (or, under no_sync, kept here)
        self.before_first_collective("backward")  # lockstep.py: once a step, before a send
        self.grads.adopt_all(g)  # the buffer holds every gradient of g
        self._send(g)

    def _send(self, g: int) -> None:
        """Start group g's reduce-scatter (its full buffer in, this rank's slice out)."""
        group, buf = self.groups[g], self.grad_buffers[g]
        op = dist.ReduceOp.SUM if self._holds_average else dist.ReduceOp.AVG  # pre-divided
        owned = group.new_shard(zeroed=False)  # (fp32 where reduced in fp32)
        work = group.reduce_scatter(owned, buf, op=op, async_op=True)
        self.reductions.send(g, work, buf, owned, keep=None)  # the buffer stays: no limit

    def _land_slice(self, g: int, buf: torch.Tensor, owned: torch.Tensor) -> None:
        """The averaged slice into our part of the buffer (fp32: kept, and its rounding)."""
        if owned.dtype != buf.dtype:
            land_wide(self, g, owned, self.groups[g].shard(buf))
        else:
            self.groups[g].shard(buf).copy_(owned)

    def _land(self, g: int, buf: torch.Tensor, owned: torch.Tensor) -> None:
        """Group g's reduce-scatter is done: the averaged slice goes into our part of the
        buffer, the parts other ranks own are zeroed (not ours to keep)."""
        buf.zero_()
        self._land_slice(g, buf, owned)
        self.step_params[g].grad = self.groups[g].shard(buf)  # None since a zero_grad

    def end_of_backward(self) -> None:
        for g in self.groups_left():  # a parameter unused this backward: zeros, still sent
            self.on_group_ready(g)
        self.reduce_when_backward_ends()
        self.backward_over()

    def reduce_when_backward_ends(self) -> None:
        if self.defers():  # no_sync: the gradients stay in the full buffer, summed locally
            for g in range(len(self.groups)):
                self.grads.adopt_all(g)
            return
        self.before_first_collective("backward")  # (checked at the first send if overlapped)
        if self.overlap_grad_reduce:  # sent during backward: land them (or leave them
            self.reductions.land(keep=None if self.overlap_step else 0)  # to opt.step())
            self._holds_average = True  # a later backward adds on top
        elif not self.reduce_in_step:
            self.reduce_gradients()

    def on_backward_abandoned(self) -> None:
        self.land_reductions()  # buckets already sent land, as gradients (see Zero2)


    def reduce_gradients(self) -> None:
        """The stage's one gradient collective per group (after backward, or in step())."""
        for g in range(len(self.groups)):
            self.grads.adopt_all(g)
        if self.variant == "all_reduce":
            # Every rank gets the full averaged gradient and will use only its slice of it.
            wides = [buf.float() if self.groups[g].reduces_wide else None
                     for g, buf in enumerate(self.grad_buffers)]
            works = [group.all_reduce(buf if wide is None else wide, async_op=True)
                     for group, buf, wide in zip(self.groups, self.grad_buffers, wides,
                                                 strict=True)]
            for g, (work, wide) in enumerate(zip(works, wides, strict=True)):
                work.wait()
                if wide is not None:  # reduced in fp32: the whole buffer, our slice kept
                    self.grad_buffers[g].copy_(wide)
                    land_wide(self, g, self.groups[g].shard(wide).clone(),
                                   self.groups[g].shard(self.grad_buffers[g]))
        else:
            op = dist.ReduceOp.SUM if self._holds_average else dist.ReduceOp.AVG
            owned = [group.new_shard(zeroed=False) for group in self.groups]
            works = [group.reduce_scatter(out, buf, op=op, async_op=True)
                     for group, out, buf in zip(self.groups, owned, self.grad_buffers,
                                                strict=True)]
            for g, (work, out, buf) in enumerate(zip(works, owned, self.grad_buffers,
                                                     strict=True)):
                work.wait()
                buf.zero_()  # the slices other ranks own: not ours to keep
                self._land_slice(g, buf, out)  # our slice: the final averaged gradient
            self._holds_average = not self.reduce_in_step  # a later backward adds on top
        for group, buf, step_param in zip(self.groups, self.grad_buffers, self.step_params,
                                          strict=True):
            step_param.grad = group.shard(buf)  # the slice it steps (None since a zero_grad)

    def before_step(self) -> None:
        if self.reduce_in_step:
            self.reduce_gradients()

    def after_step(self) -> None:
        self.all_gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.land_reductions()  # overlap_step, no step since: they would land after it
        self.grads.zero_grad(set_to_none)
        self._holds_average = False


class ZeroRedundancyOptimizer(ShardedOptimizer):
    """ZeRO stage 1 as a drop-in optimizer, with torch's ZeroRedundancyOptimizer signature.

        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        loss.backward(); opt.step(); opt.zero_grad()

    Use it on a model *without* a data-parallel wrapper: backward sends nothing (its hooks
    only move each gradient into the flat buffer and note which parameters got one), and
    `step()` itself reduce-scatters the local gradients (averaging them), updates the owned
    slice and all-gathers it: 2Ψ per step. (torch's own version expects
    DDP's all-reduced gradients and broadcasts each rank's parameters: 3Ψ.) Like `shard()`,
    it moves the parameters into flat buffers and starts every rank from rank 0's values.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict],
                 optimizer_class: type[torch.optim.Optimizer], bucket_mb: float = 25.0,
                 *, transport: str = "auto", **defaults) -> None:
        params = list(params)
        # Per-group options work as in torch: the groups are the plan (sharded_optimizer.py).
        tensors = _parameters_in(params)
        trainable = [p for p in dict.fromkeys(tensors) if p.requires_grad]
        if not trainable:
            raise ValueError("ZeroRedundancyOptimizer got no parameter that requires grad "
                             f"({len(tensors)} parameter(s) given)")
        plan = make_plan(lambda _tensors: optimizer_class(params, **defaults), tensors)
        # As shard(): the ranks refuse together if they were given different things.
        check_ranks_agree("ZeroRedundancyOptimizer()", {
            "optimizer": [type(plan).__name__] + [len(g["params"]) for g in plan.param_groups],
            "defaults": repr(sorted(defaults.items())), "bucket_mb": bucket_mb,
            "transport": transport,
            "parameters": [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in tensors]})
        groups = make_flat_groups([(f"param{i}", p) for i, p in enumerate(trainable)][::-1],
                                  bucket_mb * 2**20, transport=transport)
        # step() calls before_step(), which reduce-scatters the gradients.
        super().__init__(Zero1(groups, variant="reduce_scatter", reduce_in_step=True), plan)
        # A torch optimizer of one's own on these parameters would step a zeroed gradient.
        refuse_outside_optimizers(trainable, stage=1)


def _parameters_in(params: list) -> list[torch.Tensor]:
    """The tensors of a torch-style parameter list: tensors, or dicts with "params"."""
    out = []
    for entry in params:
        if isinstance(entry, dict):
            group = entry["params"]
            out += [group] if isinstance(group, torch.Tensor) else list(group)
        else:
            out.append(entry)
    return out
