"""What every data-parallel stage does during backward: hooks, buckets, the final callback.

Each stage registers its own gradient hook (`on_grad`) and writes its own end of backward
(`end_of_backward`), as the plain stages do; the calls they share live here:

- `hook_each_gradient(on_grad)`: a post-accumulate-grad hook on every trainable parameter,
  which fires once per backward, after autograd has added this backward's contribution to
  `p.grad` (a tied weight used twice still fires once, with both contributions summed);
- `gradient_arrived(g, i)`: the first of a backward queues the stage's `end_of_backward` on
  the autograd engine (`Variable._execution_engine.queue_callback`, as torch's DDP does), so
  when `loss.backward()` returns, gradients are final;
- `groups_ready(g)`: the groups whose gradients are all in, in one fixed order
  (`handover_order`), a group only once all groups before it were, so every rank issues the
  same collectives in the same order even when readiness differs (a rank that did not use a
  parameter this step); `groups_left()` at the end of backward: those that never filled;
- `backward_over()`: which parameters have a gradient (unused_params.py: unused and frozen
  ones), no_sync's bookkeeping;
- a backward that raises (an out-of-memory error caught by an OOM-skip loop, a NaN guard)
  never reaches that callback: the next `zero_grad()` or backward notices the callback still
  pending, finishes the collectives that backward had started (every rank started the same
  ones if every rank failed at the same place) and forgets its half-done bookkeeping, so
  training goes on as in one process. (A backward that fails on one rank only leaves the
  others waiting in a collective, as with torch's DDP.)

Not supported (as with torch's DDP without static_graph): reentrant activation
checkpointing (`torch.utils.checkpoint(..., use_reentrant=True)`), whose inner backward
would run the end-of-backward callback too early; the default non-reentrant one is fine.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from zero_lab.stages.accumulation import MICRO_BATCHES_DIFFER, refuse_unsynced_step
from zero_lab.stages.lockstep import Lockstep
from zero_lab.stages.param_gather import ParamGather
from zero_lab.stages.partition import FlatParamGroup, InFlight
from zero_lab.stages.unused_params import agree_on_grads, refuse_unfrozen


def _weak_hook(on_grad: Callable, g: int, i: int) -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook of parameter i of group g: `on_grad(g, i, param)`, a
    stage's method, held weakly.

    torch keeps a tensor's post-accumulate-grad hooks where Python's garbage collector cannot
    see them: a hook holding the stage, which holds the parameters, would be a reference
    cycle that is never freed, and a dropped model would keep its memory for good.
    """
    ref = weakref.WeakMethod(on_grad)

    def hook(param: torch.Tensor) -> None:
        method = ref()
        if method is not None:
            method(g, i, param)

    return hook


class GradientSync:
    """Base class of the stages: the state and the calls their gradient paths share (each
    stage registers its own hook and calls them from it).

    `step_params[i]` is the tensor the optimizer updates for group i (the whole flat buffer
    for stage 0, this rank's slice for stages 1 and 2); after backward its `.grad` is the
    final, averaged gradient of exactly those elements.
    """

    stage: int = -1
    sharded: bool = False  # does the optimizer step on this rank's slice only?
    grad_accumulation = "unsharded"  # what no_sync keeps: stages 2-3 take shard()'s choice

    def __init__(self, groups: list[FlatParamGroup], find_unused_parameters: bool = False
                 ) -> None:
        self.groups = groups
        self.find_unused_parameters = find_unused_parameters
        # Groups kept whole on every rank in a sharded stage (stage 3's root_params=
        # "replicate"): their gradients are all-reduced and they are stepped whole.
        self.replicated = [False] * len(groups)
        self.world_size = groups[0].world_size
        self.step_params: list[nn.Parameter] = []  # filled by the subclass
        self._ready_params = [0] * len(groups)
        # The order groups are handed over in: index order (buckets are built last layer
        # first); a stage that learns the real backward order may replace it.
        self.handover_order: list[int] = list(range(len(groups)))
        self._handed_over = 0  # how many groups of handover_order were handed over
        self._callback_queued = False
        self._backward_task = -1  # the autograd graph task the callback was queued on
        # Per parameter: got a gradient in this backward, on this rank; and has a gradient
        # now (since the last zero_grad, on any rank).
        self._arrived_here = [[False] * len(g.params) for g in groups]
        self.has_grad = [[False] * len(g.params) for g in groups]
        # Parameters frozen when shard() ran: outside the flat groups, never averaged nor
        # stepped. One unfrozen later is refused at the end of the next backward.
        self.frozen: list[tuple[str, nn.Parameter]] = []
        # The ranks check once a step that they are still in lockstep (lockstep.py), which
        # also counts the steps and backwards; shard() enables it (a stage built by hand
        # counts, unchecked).
        self.lockstep = Lockstep(groups[0].process_group, groups[0].device, enabled=False)
        # Gradient accumulation (accumulation.py): False inside model.no_sync(); read once
        # per backward, when it starts (`_syncing`). `unsynced`: the last backward kept its
        # gradient on this rank and nothing was sent since.
        self.requires_sync = True
        self._syncing = True
        self.unsynced = False
        self._arrived_unsynced: list[list[bool]] | None = None  # find_unused, under no_sync
        # Overlap (shard()'s options, stages 1-2): all-gathers left for the next forward
        # (param_gather.py), reductions for opt.step() (`overlap_step`).
        self.param_gather: ParamGather | None = None
        self.reductions: InFlight | None = None  # stages 1-3: reductions sent, not landed
        self.overlap_step = False
        # reduce_dtype=float32 (mixed_precision.land_wide): per 16-bit group, the fp32 average
        # the optimizer steps on; `.grad` shows its rounding. None: none since zero_grad.
        self.main_grads: list[torch.Tensor | None] = [None] * len(groups)

    # ------------------------------------------------------------------ plumbing
    def hook_each_gradient(self, on_grad: Callable[[int, int, torch.Tensor], None]) -> None:
        """`on_grad(g, i, param)` once per backward for parameter i of group g, when its
        gradient is complete (a post-accumulate-grad hook)."""
        for g, group in enumerate(self.groups):
            for i, p in enumerate(group.params):
                p.register_post_accumulate_grad_hook(_weak_hook(on_grad, g, i))

    def gradient_arrived(self, g: int, i: int) -> None:
        """Parameter i of group g has its gradient (the first of a backward queues
        `end_of_backward`)."""
        self.queue_backward_callback()
        self._arrived_here[g][i] = True

    def queue_backward_callback(self) -> None:
        """Once per backward: ask autograd to call `end_of_backward` when it finishes."""
        task = torch._C._current_graph_task_id()
        if self._callback_queued:
            if task == self._backward_task:
                return
            self.abandon_unfinished_backward()  # an earlier backward raised half-way
        self._callback_queued = True
        self._syncing = self.requires_sync  # this whole backward sends, or keeps, its gradients
        self._backward_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)

    def abandon_unfinished_backward(self) -> None:
        """If a backward raised before its end-of-backward callback ran, put the stage back
        in the state between two backwards: the collectives that backward started are
        finished (the gradients they carry stay, as a failed backward leaves its partial
        gradients in `.grad` in one process, until zero_grad) and the half-filled
        bookkeeping is dropped. Called by zero_grad() and by the next backward's first hook.
        """
        if not self._callback_queued:
            return
        self.on_backward_abandoned()
        self._ready_params = [0] * len(self.groups)
        self._handed_over = 0
        self._arrived_here = [[False] * len(g.params) for g in self.groups]
        self._callback_queued = False
        self._backward_task = -1

    def groups_ready(self, g: int) -> list[int]:
        """One more gradient of group g is in: the groups to send now, in `handover_order`
        (all their gradients in, every group before them sent)."""
        self._ready_params[g] += 1
        order, ready = self.handover_order, []
        while self._handed_over < len(order):
            h = order[self._handed_over]
            if self._ready_params[h] < len(self.groups[h].params):
                break  # later groups wait for this one: every rank keeps the same order
            ready.append(h)
            self._handed_over += 1
        return ready

    def groups_left(self) -> list[int]:
        """At the end of backward: the groups never filled, in order. They hold parameters
        that got no gradient in this backward (unused this step): their gradient is zero,
        and every rank must still join their collectives. (First, a parameter unfrozen since
        shard() is refused: unused_params.py.)"""
        refuse_unfrozen(self.frozen)
        left = self.handover_order[self._handed_over:]
        self._handed_over = len(self.handover_order)
        return left

    def backward_over(self) -> None:
        """The end of `end_of_backward`: which parameters have a gradient now, on every rank
        (unused_params.py), and the bookkeeping of one more backward."""
        agree_on_grads(self)
        self.unsynced = self.defers()
        self.lockstep.backwards += 1  # (in its check's fingerprint)
        self._ready_params = [0] * len(self.groups)
        self._handed_over = 0
        self._callback_queued = False

    # ------------------------------------------------------------------ in flight (overlap)
    def all_gather_params(self, gs: list[int] | None = None) -> None:
        """Stages 1 and 2, after the optimizer step: every rank's updated slice -> the full
        parameters everywhere, one all_gather_single per group (not N broadcasts), in place.
        With overlap_param_gather they are only issued, and the next forward waits for each
        (param_gather.py)."""
        if self.param_gather is not None:
            return self.param_gather.issue(gs)
        for g in (range(len(self.groups)) if gs is None else gs):
            group = self.groups[g]
            group.all_gather(group.flat, group.shard(group.flat))

    def wait_for_params(self) -> None:
        """Every parameter whole and up to date: the all-gathers opt.step() left in flight
        (overlap_param_gather) are finished. Nothing to do otherwise."""
        if self.param_gather is not None:
            self.param_gather.wait_all()

    def land_reductions(self) -> None:
        """Every gradient reduction still in flight has landed (stages 1-2 send them)."""
        if self.reductions is not None:
            self.reductions.land(keep=0)

    def land_through(self, g: int) -> None:
        """overlap_step: group g's reduction (and those sent before it) has landed."""
        if self.reductions is not None:
            self.reductions.land_through(g)

    def settle(self) -> None:
        """Nothing in flight any more: gradients final, parameters whole."""
        self.land_reductions()
        self.wait_for_params()

    def landing_order(self) -> list[int]:
        """overlap_step: the order the optimizer steps groups in: those landed already, then
        those in flight, in the order they were sent."""
        sent = self.reductions.groups() if self.reductions is not None else []
        return [g for g in range(len(self.groups)) if g not in sent] + sent

    # ------------------------------------------------------------------ lockstep
    def before_first_collective(self, phase: str) -> None:
        """Stages 0-2: the ranks check they are in lockstep before the first collective of
        each step (lockstep.py; called before each send, it checks once a step); a
        different count of backwards is no_sync's mistake."""
        self.lockstep.once_a_step(phase, why=MICRO_BATCHES_DIFFER)  # (said when accumulating)

    def step_starts(self) -> None:
        if self.unsynced:
            refuse_unsynced_step()
        self.before_first_collective("step")

    # ------------------------------------------------------------------ accumulation
    def defers(self) -> bool:
        """Does the backward running now keep its gradients on this rank (no_sync)? Stages
        0 and 1 always can (a full gradient buffer); stages 2-3 with "unsharded" only."""
        return not self._syncing and self.grad_accumulation == "unsharded"

    def forget_gradients(self, set_to_none: bool) -> None:
        """zero_grad(): what no_sync accumulated is gone with the gradients (and main_grads);
        with set_to_none, no parameter has a gradient until the next backward."""
        self.unsynced, self._arrived_unsynced = False, None
        self.main_grads = [None] * len(self.groups)
        if set_to_none:
            self.has_grad = [[False] * len(g.params) for g in self.groups]

    def group_sharded(self, g: int) -> bool:
        """Does the optimizer step only this rank's slice of group g?"""
        return self.sharded and not self.replicated[g]

    def full_flat_params(self, g: int) -> torch.Tensor:
        """Group g's full flat parameters (stages 0-2 hold them; stage 3 all-gathers)."""
        return self.groups[g].flat

    # ------------------------------------------------------------------ what stages define
    def end_of_backward(self) -> None:
        """Backward is over: send `groups_left()`, finish the communication (each
        `step_params[i].grad` final), then `backward_over()`."""
        raise NotImplementedError

    def on_backward_abandoned(self) -> None:
        """A backward raised half-way: finish what it sent, drop what it half-filled."""

    def before_step(self) -> None:
        """The optimizer is about to update `step_params`."""

    def after_step(self) -> None:
        """The optimizer has updated `step_params` (stages 1-2 all-gather them here)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError


class FullGradients:
    """Stage 0's gradient path, which stage 1 uses too: one full flat gradient buffer per
    group, allocated once and reused every step (never freed, as torch's DDP with
    gradient_as_bucket_view); a parameter's `.grad`, when it has one, is a view of it."""

    def __init__(self, sync: GradientSync) -> None:
        self.sync = sync
        self.flat_grads = [group.new_full() for group in sync.groups]
        self.views = [group.views(buf) for group, buf in zip(sync.groups, self.flat_grads,
                                                             strict=True)]
        self.zero_grad(set_to_none=True)

    def zero_grad(self, set_to_none: bool) -> None:
        """set_to_none=True: every `.grad` becomes None, as in one process; autograd then
        allocates the next gradients and `adopt` copies them into the buffer (torch's DDP
        pays the same copy), and `adopt_all` zeroes the part of a parameter that got none:
        every element is written before it is read, so the buffer need not be zeroed here.
        set_to_none=False: a parameter that has a gradient keeps it, as a zeroed view of the
        buffer, and autograd accumulates straight into it."""
        sync = self.sync
        sync.forget_gradients(set_to_none)
        if set_to_none:
            for step_param in sync.step_params:  # given back when backward ends
                step_param.grad = None
        for g, (group, buf, views) in enumerate(zip(sync.groups, self.flat_grads, self.views,
                                                    strict=True)):
            if not set_to_none:
                buf.zero_()
            for p, view, has in zip(group.params, views, sync.has_grad[g], strict=True):
                p.grad = view if has else None

    def adopt(self, g: int, i: int, param: torch.Tensor) -> None:
        """From the hook: a gradient autograd made a tensor of its own (after a zero_grad that
        set `.grad` to None) is copied into the parameter's view at once, while in cache."""
        view = self.views[g][i]
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    def adopt_all(self, g: int) -> None:
        """Every `.grad` of group g its view of the buffer: a fresh `.grad` (something set it
        to None since) is copied in, one still None (not used since) contributes zeros."""
        for p, view in zip(self.sync.groups[g].params, self.views[g], strict=True):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr() or p.grad.shape != view.shape:
                view.copy_(p.grad)
            else:
                continue
            p.grad = view


def clear_grads(tensors: list[torch.Tensor], set_to_none: bool = True) -> None:
    """`optimizer.zero_grad()` semantics for a list of tensors: drop or zero their `.grad`."""
    for t in tensors:
        if set_to_none:
            t.grad = None
        elif t.grad is not None:
            t.grad.zero_()
