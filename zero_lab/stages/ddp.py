"""Stage 0: plain data parallelism, the baseline every ZeRO stage is measured against.

Nothing is sharded: every rank holds the full parameters, gradients and optimizer states,
(p + g + K)·Ψ bytes per rank (ZeRO paper, section 3.1).

    backward       gradients accumulate straight into a persistent flat buffer per bucket
                   (`param.grad` is a view of it, as torch DDP's gradient_as_bucket_view);
                   a bucket's last gradient in: ALL-REDUCE (average) it, asynchronously,
                   while autograd computes the gradients of earlier layers
    backward ends  the callback queued on the autograd engine waits for the last ones
    opt.step()     the optimizer updates the full parameters; nothing sent

Per step: one all-reduce of Ψ elements, 2Ψ in the paper's count. A second backward adds its
local L_r to the averaged R every rank holds, and the all-reduce averages R + L_r into
R + mean(L): accumulation stays right.

The plain stage (`zero_lab/plain/stage0.py`, which copies each gradient into its bucket) plus
no_sync (accumulation.py: one all-reduce per optimizer step), unused and frozen parameters
(unused_params.py), mixed precision (mixed_precision.py), DDP's broadcast_buffers
(buffers.py), and the lockstep, agreement and refusal checks (lockstep.py, refusals.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.stages.gradient_sync import FullGradients, GradientSync
from zero_lab.stages.mixed_precision import install_fresh_start, land_wide
from zero_lab.stages.partition import FlatParamGroup


class DataParallel(GradientSync):
    """Bucketed all-reduce from post-accumulate-grad hooks, overlapped with backward."""

    stage = 0
    sharded = False

    def __init__(self, groups: list[FlatParamGroup], find_unused_parameters: bool = False
                 ) -> None:
        super().__init__(groups, find_unused_parameters)
        self.grads = FullGradients(self)  # full gradients, kept for the whole run
        self.grad_buffers = self.grads.flat_grads
        # The optimizer updates each whole flat buffer (an alias, no copy).
        for group, grad in zip(groups, self.grad_buffers, strict=True):
            step_param = nn.Parameter(group.flat, requires_grad=False)
            step_param.grad = grad
            self.step_params.append(step_param)
        # (group, its all-reduce in flight, the fp32 buffer it reduces or None)
        self._in_flight: list[tuple[int, dist.Work, torch.Tensor | None]] = []
        install_fresh_start(self)  # reduce_dtype=float32: accumulation in fp32
        self.hook_each_gradient(self.on_grad)

    def on_grad(self, g: int, i: int, param: torch.Tensor) -> None:
        """Parameter i of bucket g has its gradient: into the bucket; a full bucket out."""
        self.gradient_arrived(g, i)  # (the first of a backward queues end_of_backward)
        self.grads.adopt(g, i, param)
        for ready in self.groups_ready(g):  # all in, in the order every rank sends
            self.on_group_ready(ready)

    def on_group_ready(self, g: int) -> None:
        # The bucket is complete: start averaging it across ranks, and do not wait.
        self.grads.adopt_all(g)
        if self.defers():  # no_sync: the gradient stays in the buffer, summed locally
            return
        self.before_first_collective("backward")  # lockstep.py: once a step, before a send
        # reduce_dtype=float32: the buffer widened, reduced and kept in fp32 (land_wide)
        wide = self.grad_buffers[g].float() if self.groups[g].reduces_wide else None
        work = self.groups[g].all_reduce(self.grad_buffers[g] if wide is None else wide,
                                         async_op=True)
        self._in_flight.append((g, work, wide))

    def _land_all(self) -> None:
        for g, work, wide in self._in_flight:
            work.wait()
            if wide is not None:
                land_wide(self, g, wide, self.grad_buffers[g])
        self._in_flight.clear()

    def end_of_backward(self) -> None:
        for g in self.groups_left():  # a parameter unused this backward: zeros, still sent
            self.on_group_ready(g)
        self._land_all()
        for step_param, grad in zip(self.step_params, self.grad_buffers, strict=True):
            step_param.grad = grad  # the averaged gradients (None since a zero_grad)
        self.backward_over()

    def on_backward_abandoned(self) -> None:
        self._land_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.zero_grad(set_to_none)  # (forgets what no_sync held, too)
