"""Stage 1 (ZeRO P_os): shard the optimizer states, keep full parameters and gradients.

What is sharded: the optimizer. Each rank keeps Adam's m and v (and, in mixed precision, the
fp32 master weights) only for the slice of each flat buffer it owns: K·Ψ/N bytes instead of
K·Ψ. Parameters and gradients stay full on every rank: (p + g)·Ψ + K·Ψ/N per rank
(ZeRO paper, section 5.1).

When each collective fires:
1. During backward nothing is sent. Gradients accumulate into a full flat gradient buffer per
   group, as in stage 0 (every `param.grad` is a view of it).
2. When backward ends (the callback queued on the autograd engine), one reduce-scatter per
   group: each rank receives the sum over ranks of *its own slice* only, which is all its
   optimizer needs. The result is written into the owned part of the gradient buffer; the
   rest of the buffer, which another rank owns, is zeroed.
3. `opt.step()` updates the owned slice of the parameters, then one all-gather per group
   brings every rank's updated slice to every rank (not N broadcasts).

Communication per step: reduce-scatter Ψ + all-gather Ψ = 2Ψ, the same as plain data
parallelism, for N times less optimizer memory (ZeRO paper, section 7.2.1).

Hiding it (shard()'s options, Megatron-LM's names; the same bytes, sent at other times):
- `overlap_grad_reduce=True`: step 2 moves into backward. A bucket's reduce-scatter starts
  as soon as its last gradient is in the buffer, with stage 2's queue of buckets in flight
  (in_flight.py), while autograd goes on with earlier layers; backward's end waits for the
  last ones. The full buffer stays (it is stage 1's), so no limit on buckets in flight.
- `overlap_param_gather=True`: step 3's all-gathers are only issued; the next forward waits
  for each bucket in a pre-hook of the modules owning it; a raw read of a parameter
  before then waits for its own bucket (param_gather.py's ParameterInFlight, which also
  lists what else waits).
- `overlap_step=True` (with overlap_grad_reduce): backward's end leaves the last
  reduce-scatters in flight; `opt.step()` updates each bucket as its slice lands and issues
  its all-gather at once.

Gradient accumulation: after one backward, rank r's owned slice holds the averaged gradient
R, and a second backward adds its local gradient L_r on top. Averaging R + L_r with the other
ranks' L_s would divide R by N again. So from the second backward on, gradients are divided
by N on their way in ("pre-divide", as torch's DDP default comm hook does) and the
reduce-scatter *sums*: R + L_r/N + sum over s of L_s/N = R + mean(L). Correct.

Under `model.no_sync()` (accumulation.py) a backward only adds into the full buffer (by the
same rule: pre-divided once the slice holds an average); the next backward outside it
reduce-scatters the sum: Ψ + Ψ per optimizer step whatever the number of micro-batches, the
gradient memory stage 1 pays anyway (Megatron-LM's distributed optimizer is this stage).

The seed notes' variant, `variant="all_reduce"`, all-reduces the full gradients instead and
keeps the owned slice: 2Ψ + Ψ for the all-gather = 3Ψ per step, for the same memory.
Notebook 03 measures both with the ledger.

`ZeroRedundancyOptimizer` at the bottom is the same stage 1 reducing in `step()` instead of
at the end of backward, behind the signature of `torch.distributed.optim.ZeroRedundancyOptimizer`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.partition import FlatParamGroup, make_flat_groups
from zero_lab.stages.agreement import check_ranks_agree
from zero_lab.stages.gradient_sync import GradientSync
from zero_lab.stages.in_flight import InFlight
from zero_lab.stages.mixed_precision import install_fresh_start, land_wide, reduces_wide
from zero_lab.stages.sharded_optimizer import (
    ShardedOptimizer,
    make_plan,
    refuse_outside_optimizers,
)

VARIANTS = ("reduce_scatter", "all_reduce")


class Zero1(GradientSync):
    """Reduce-scatter the full gradients when backward ends; step and all-gather the slice."""

    stage = 1
    sharded = True

    def __init__(self, groups: list[FlatParamGroup], variant: str = "reduce_scatter",
                 reduce_in_step: bool = False, find_unused_parameters: bool = False,
                 overlap_grad_reduce: bool = False) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"stage 1 variant must be one of {VARIANTS}, got {variant!r}")
        if overlap_grad_reduce and (variant != "reduce_scatter" or reduce_in_step):
            raise ValueError("overlap_grad_reduce reduce-scatters during backward: not with "
                             "the all_reduce variant nor a reduction in step()")
        super().__init__(groups, find_unused_parameters)
        self.variant = variant
        # Reduce-scatter each bucket as soon as its gradients are in, during backward, with
        # stage 2's queue of buckets in flight (in_flight.py); else all when backward ends.
        self.overlap_grad_reduce = overlap_grad_reduce
        self.reductions = InFlight(self._land)
        # When gradients are reduced: at the end of backward (shard()), or in opt.step()
        # (ZeroRedundancyOptimizer below, an optimizer that leaves backward alone).
        self.reduce_in_step = reduce_in_step
        self.make_grad_buffers()  # full gradients, kept for the whole run (g·Ψ bytes)
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
                    self._hook_handles.append(p.register_hook(self._pre_divide))
        install_fresh_start(self)  # reduce_dtype=float32: accumulation in fp32

    def _pre_divide(self, grad: torch.Tensor) -> torch.Tensor | None:
        # Before autograd adds into the buffer, the last backward's reductions land
        # (overlap_step leaves them in flight after backward; landing rewrites the buffer).
        # Not in the middle of this backward (its own are in flight): only before its first
        # gradient, when its end-of-backward callback is not queued yet.
        if not self._callback_queued:
            self.finish_reductions()
        return grad / self.world_size if self._holds_average else None  # None: unchanged

    def on_param_grad(self, g: int, i: int, param: torch.Tensor) -> None:
        self.adopt_grad(g, i, param)

    def on_group_ready(self, g: int) -> None:
        if not self.overlap_grad_reduce or self.defers():
            return  # reduced when backward ends (or, under no_sync, kept here)
        self.adopt_grads(g, self.grad_views[g])  # the buffer holds every gradient of g
        self._send(g)

    def _send(self, g: int) -> None:
        """Start group g's reduce-scatter (its full buffer in, this rank's slice out)."""
        group, buf = self.groups[g], self.grad_buffers[g]
        op = dist.ReduceOp.SUM if self._holds_average else dist.ReduceOp.AVG  # pre-divided
        owned = group.new_shard(self._slice_dtype(g), zeroed=False)
        work = group.reduce_scatter(owned, buf, op=op, async_op=True)
        self.reductions.send(g, work, buf, owned, keep=None)  # the buffer stays: no limit

    def _slice_dtype(self, g: int) -> torch.dtype | None:
        """The reduced slice's dtype: fp32 when reduced in fp32 (kept for the optimizer)."""
        return torch.float32 if reduces_wide(self, g) else None

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

    def on_backward_end(self) -> None:
        if self.defers():  # no_sync: the gradients stay in the full buffer, summed locally
            for g in range(len(self.groups)):
                self.adopt_grads(g, self.grad_views[g])
        elif self.overlap_grad_reduce:  # sent during backward: land them (or leave them
            self.reductions.land(keep=None if self.overlap_step else 0)  # to opt.step())
            self._holds_average = True  # a later backward adds on top
        elif not self.reduce_in_step:
            self.reduce_gradients()

    def on_backward_abandoned(self) -> None:
        self.finish_reductions()  # buckets already sent land, as gradients (see Zero2)


    def reduce_gradients(self) -> None:
        """The stage's one gradient collective per group (after backward, or in step())."""
        for g in range(len(self.groups)):
            self.adopt_grads(g, self.grad_views[g])
        if self.variant == "all_reduce":
            # Every rank gets the full averaged gradient and will use only its slice of it.
            wides = [buf.float() if reduces_wide(self, g) else None
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
            owned = [group.new_shard(self._slice_dtype(g), zeroed=False)
                     for g, group in enumerate(self.groups)]
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
        self.finish_reductions()  # overlap_step, no step since: they would land after it
        self.zero_grad_buffers(set_to_none)
        self._holds_average = False
        self.drop_unsynced()


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
