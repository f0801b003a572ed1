"""Stage 2 (ZeRO P_os+g): shard the optimizer states and the gradients.

Each rank keeps the averaged gradient of its own slice only; the parameters stay full:
p·Ψ + (g + K)·Ψ/N bytes per rank (ZeRO paper, section 5.2). The collectives fire *during*
backward, bucket by bucket (a bucket is one flat group of about `bucket_mb` megabytes):

    gradient hook  each fresh gradient is copied into its bucket's full flat gradient buffer
                   and `param.grad` dropped (a post-accumulate-grad hook)
    bucket full    REDUCE-SCATTER (average) it, asynchronously, while autograd goes on; its
                   buffer is freed once that completes (at most `MAX_IN_FLIGHT` wait), so
                   gradient memory peaks at a few buckets instead of Ψ
    backward ends  the callback queued on the autograd engine waits for the last ones; each
                   rank's slice holds its averaged gradient, added to what earlier backward
                   calls left there (gradient accumulation)
    opt.step()     update the owned slice; ALL-GATHER it, one collective per bucket

Per step: reduce-scatter Ψ + all-gather Ψ = 2Ψ, as stages 0 and 1.

The plain stage (`zero_lab/plain/stage2.py`) plus:

    addition                        module              why a real implementation needs it
    the all-gather under the next   param_gather.py,    hides the gather (a raw read waits for
      forward; a step per bucket    partition.py's      its bucket); the update overlaps the
      as its slice lands              InFlight          last reduce-scatters
    no_sync, `grad_accumulation`    accumulation.py     micro-batches: reduce-scatter each (the
      "sharded" or "unsharded"                          saving holds) or hold one full gradient
    mixed precision, fp32 masters   mixed_precision.py  16-bit compute, the update in fp32
    unused and frozen parameters    unused_params.py    a missing gradient named, or agreed on
    torch's clip_grad_norm_         torch_clipping.py   `.grad` is None: the slices' global norm
    lockstep, agreement, refusals   lockstep.py,        ranks that differ fail together, named;
                                      refusals.py       misuse refused before it trains wrong
    the direct exchange on gloo     collectives/        gloo runs a reduce-scatter as a whole
                                      exchange.py       all-reduce (twice the bytes)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.stages.gradient_sync import GradientSync, clear_grads
from zero_lab.stages.partition import FlatParamGroup, InFlight


class ShardedGradients:
    """Stage 2's gradient path (the module docstring's steps), which stage 3 uses too; the
    averaged slice lands on what the stage steps (`sync.step_params[g].grad`)."""

    def __init__(self, sync: GradientSync, max_in_flight: int) -> None:
        self.sync, self.max_in_flight = sync, max_in_flight
        n = len(sync.groups)
        self.buckets: list[torch.Tensor | None] = [None] * n  # full gradients, filling
        # "unsharded" accumulation: bucket g was kept past its backward, and holds the full
        # gradient summed over the backwards run under no_sync since the last one sent.
        self.held = [False] * n
        self.arrived: list[list[bool]] = [[False] * len(g.params) for g in sync.groups]
        self.reductions = InFlight(self.land)  # sent, not landed

    def add(self, g: int, i: int, param: torch.Tensor) -> None:
        """Parameter i of bucket g: its gradient into the bucket's full buffer, then dropped."""
        group = self.sync.groups[g]
        if self.buckets[g] is None:  # first gradient of this bucket in this backward: a
            # fresh buffer, every element of which is written (here, or zeroed in send)
            self.buckets[g] = group.new_full(zeroed=False)
        offset, numel = group.offsets[i], group.numels[i]
        target = self.buckets[g][offset:offset + numel]
        if self.held[g]:  # what no_sync's backwards held: add to it
            target.add_(param.grad.reshape(-1))
        else:
            target.copy_(param.grad.reshape(-1))
        self.arrived[g][i] = True
        param.grad = None  # the full gradient of this parameter is freed now

    def send(self, g: int) -> None:
        """Bucket g is full: REDUCE-SCATTER it (or hold it, under no_sync "unsharded")."""
        sync, group = self.sync, self.sync.groups[g]
        full = self.buckets[g]
        if full is None:  # no parameter of it got a gradient in this backward
            full = group.new_full(zeroed=False)
        if self.held[g]:  # what no_sync's backwards held: every element written already
            self.held[g] = False
        else:  # a fresh buffer: unused parameters and padding contribute zeros
            for i, arrived in enumerate(self.arrived[g]):
                if not arrived:
                    full[group.offsets[i]:group.offsets[i] + group.numels[i]].zero_()
            full[group.numel:].zero_()  # the padding
        self.arrived[g] = [False] * len(group.params)
        if sync.defers():  # no_sync, "unsharded": keep the full gradient, send it later
            self.buckets[g], self.held[g] = full, True
            return
        sync.before_first_collective("backward")  # lockstep.py: once a step, before a send
        self.buckets[g] = None  # sent now, freed once sent
        if sync.replicated[g]:  # kept whole on every rank: average the whole gradient
            owned = full.float() if group.reduces_wide else full  # (reduce_dtype=float32)
            work = group.all_reduce(owned, async_op=True)
        else:
            owned = group.new_shard(zeroed=False)  # (fp32 where reduced in fp32)
            work = group.reduce_scatter(owned, full, op=dist.ReduceOp.AVG, async_op=True)
        self.reductions.send(g, work, full, owned, keep=self.max_in_flight)

    def land(self, g: int, _full: torch.Tensor, owned: torch.Tensor) -> None:
        """Bucket g's reduce-scatter is done: its averaged slice becomes (or adds to, when
        accumulating) the gradient of what this rank steps."""
        step_param = self.sync.step_params[g]
        if owned.dtype != step_param.dtype:  # reduced in fp32: the master's gradient
            main = self.sync.main_grads[g]
            if main is None or step_param.grad is None:
                main = self.sync.main_grads[g] = owned
            else:
                main.add_(owned)  # accumulated in fp32, as FSDP2's fp32 sharded gradient
            owned = main.to(step_param.dtype)  # what `.grad` shows: its rounding
            if step_param.grad is not None:
                step_param.grad.copy_(owned)
                return
        if step_param.grad is None:
            step_param.grad = owned
        else:
            step_param.grad.add_(owned)  # gradient accumulation, on the slice only

    def zero_grad(self, set_to_none: bool) -> None:
        """The stage's zero_grad: the gradient slices, and what no_sync held, dropped."""
        sync = self.sync
        sync.land_reductions()  # overlap_step, no step since: they would land after it
        clear_grads(sync.step_params, set_to_none)  # the owned gradient slices
        self.buckets, self.held = [None] * len(self.held), [False] * len(self.held)  # (no_sync's)
        sync.forget_gradients(set_to_none)

    def held_buffers(self) -> list[torch.Tensor]:
        """The full gradients no_sync keeps ("unsharded"): measure/memory.py counts them."""
        return [full for full, held in zip(self.buckets, self.held, strict=True) if held]

    def abandon(self) -> None:
        """A backward raised: buckets already sent land, as gradients; half-filled ones are
        never sent (a held one keeps what it got)."""
        self.reductions.land(keep=0)
        self.buckets = [full if held else None for full, held in zip(self.buckets, self.held,
                                                                   strict=True)]
        self.arrived = [[False] * len(g.params) for g in self.sync.groups]


class Zero2(GradientSync):
    """Bucketed reduce-scatter during backward; full gradients freed as their bucket is sent."""

    stage = 2
    sharded = True
    MAX_IN_FLIGHT = 2  # buckets sent but not yet complete (each holds a full bucket buffer)

    def __init__(self, groups: list[FlatParamGroup], find_unused_parameters: bool = False,
                 grad_accumulation: str = "sharded") -> None:
        super().__init__(groups, find_unused_parameters)
        self.grad_accumulation = grad_accumulation  # what no_sync keeps (accumulation.py)
        # The optimizer updates this rank's slice of each flat buffer (a view, no copy). Its
        # gradient appears at the end of backward: grads are sharded.
        self.step_params += [nn.Parameter(group.shard(group.flat), requires_grad=False)
                             for group in groups]
        self.grads = ShardedGradients(self, self.MAX_IN_FLIGHT)
        self.reductions = self.grads.reductions
        self.hook_each_gradient(self.on_grad)

    def on_grad(self, g: int, i: int, param: torch.Tensor) -> None:
        """Parameter i of bucket g has its gradient: into the bucket's full buffer, `.grad`
        dropped; a full bucket goes out (REDUCE-SCATTER)."""
        self.gradient_arrived(g, i)  # (the first of a backward queues end_of_backward)
        self.grads.add(g, i, param)
        for ready in self.groups_ready(g):  # all in, in the order every rank sends
            self.grads.send(ready)

    def end_of_backward(self) -> None:
        """Wait for the last reduce-scatters: each rank holds its slices' averaged gradient."""
        for g in self.groups_left():  # a parameter unused this backward: zeros, still sent
            self.grads.send(g)
        # overlap_step: the last buckets land inside opt.step(), each just before its update
        self.reductions.land(keep=None if self.overlap_step else 0)
        self.backward_over()

    def on_backward_abandoned(self) -> None:
        self.grads.abandon()

    @property
    def grad_buffers(self) -> list[torch.Tensor]:  # held under no_sync: measure/memory.py's
        return self.grads.held_buffers()

    def after_step(self) -> None:
        self.all_gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.zero_grad(set_to_none)
