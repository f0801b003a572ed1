"""Stage 3 (ZeRO P_os+g+p, FSDP's full sharding): shard the parameters too.

Each rank keeps its slice of the parameters, gradients and optimizer states: (p + g + K)·Ψ/N
bytes (ZeRO paper, section 5.3). Full parameters exist only while the *unit* that needs them
computes. One training step, for one unit of Ψ_u elements (the collectives in CAPITALS):

    forward pre-hook     ALL-GATHER the unit (Ψ_u) into its full buffer; the parameters
                         become parameter-shaped views of it
    the unit's forward   computes; autograd saves what backward needs (the weight, and views
                         of it such as weight.t())
    forward post-hook    release: the parameters become local pieces again and the full
                         buffer's storage is freed in place (`free_storage`); a hook is put
                         on the unit's outputs
    pre-backward hook    (the first gradient reaching the outputs) ALL-GATHER again, into
                         the *same* storage, so every view autograd saved sees the
                         parameters again: that is why the storage is resized, not replaced
    the unit's backward  gradients of the full parameters; each is copied into the unit's
                         full gradient buffer and dropped (stage 2's hook)
    last gradient in     release the full parameters; REDUCE-SCATTER the full gradient
                         (Ψ_u), asynchronously, into this rank's gradient slice

Per step: two all-gathers and one reduce-scatter of Ψ = 3Ψ, 1.5x stages 0-2 (section 7.2.2).
`Zero3` holds stage 2's gradient path (zero2.py's `ShardedGradients`) and gathers and
releases the units around it.

The plain stage (`zero_lab/plain/stage3.py`) plus:

    addition                          module              why a real implementation needs it
    units by class (`unit_classes`),  units.py            a model's blocks are its natural units;
      tied weights in the unit that                       a tied embedding must be one weight;
      encloses their users, the root                      the root's norms shard or replicate
      unit sharded or replicated                          (`root_params`)
    a resting parameter is its 1-D    at_rest.py          names, tied weights and references (from
      piece; other reads refused                          shard() on) stay valid; torch steps the
                                                          pieces; a stray read (an L2 term) is
                                                          refused by name, not wrong silently
    prefetch of the next k units      unit_order.py       the all-gather overlaps compute (order
                                                          learnt in the first step; k + 1 units
                                                          gathered at most)
    `reshard_after_forward` False or  zero3.py            2Ψ a step for resident parameters, or
      an int d                          (Unit.post)       backward's gather kept in d ranks
    no_sync, `grad_accumulation`      accumulation.py     micro-batches: reduce-scatter each, or
                                                          hold one full gradient and send once
    mixed precision: fp32 masters,    mixed_precision.py  16-bit compute, the update in fp32
      `keep_fp32`, `reduce_dtype`
    frozen parameters sharded         units.py, zero3.py  LoRA: the frozen base is most of the
      (FrozenPart), released after                        memory; backward may still need a
      their inputs' gradients                             frozen weight after the last gradient
    lockstep; every gather checked    lockstep.py,        ranks apart pair wrong gathers; a unit
      in forward 1, `check_order`: all  unit_order.py     called on one rank only is named at it
    refusals: torch.compile, pieces   refusals.py,        a compiled graph cannot follow storage
      in `model.state_dict()`           state_dicts.py    freed and refilled; pieces are no
                                                          checkpoint (full_state_dict is)
    activation checkpointing          recompute.py        a recomputed forward finds its unit
                                                          gathered and leaves it so
    hybrid sharding (`mesh`)          hybrid.py           all-gathers stay inside a group
    the direct exchange on gloo       collectives/        gloo runs a reduce-scatter as a whole
                                        exchange.py       all-reduce (twice the bytes)
    profiler marks                    profiling/marks.py  each unit's forward, backward and
                                                          collectives named in a trace
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.profiling.marks import UnitSpans
from zero_lab.stages.at_rest import label, rest, wake
from zero_lab.stages.gradient_sync import GradientSync
from zero_lab.stages.partition import FlatParamGroup, allocate_storage, free_storage
from zero_lab.stages.refusals import refuse_compile
from zero_lab.stages.unit_order import UnitOrder
from zero_lab.stages.unused_params import refuse_unfrozen
from zero_lab.stages.zero2 import ShardedGradients

# ============================================================================ the units

class ShardedPart:
    """A flat group of parameters sharded over the ranks, with the three moves of its
    lifecycle: start the all-gather, finish it, release.

    `local` (S elements) holds this rank's part of the parameters, in memory of its own.
    `full` (N·S elements) is allocated, all-gathered into, and freed in place again;
    `full_views` are the parameter-shaped views of it the module computes with, and
    `local_views` each parameter's piece of `local` (1-D, possibly empty): the parameters
    at rest. A unit's trainable parameters are one (`Unit`), its frozen ones another
    (`FrozenPart`).
    """

    replicated = False  # (ReplicatedUnit: kept whole on every rank)

    def __init__(self, unit_name: str, group: FlatParamGroup, local: torch.Tensor) -> None:
        self.group = group
        self.params = group.params
        self.local = local
        self.full = group.new_full(local.dtype)
        self.full_views = group.views(self.full)  # made while the storage exists
        free_storage(self.full)  # nothing gathered yet
        # Where each parameter's local piece sits in `local`: [start, end).
        ranges = [(0, 0)] * len(self.params)
        for piece in group.shard_pieces():
            ranges[piece.index] = (piece.shard_start, piece.shard_start + piece.numel)
        self.ranges = ranges
        self.local_views = self.pieces(local)
        self.work: dist.Work | None = None  # an all-gather in flight (prefetch)
        # reshard_after_forward=d (attach_post_forward_groups): the layout over d ranks, and
        # from forward to backward this rank's 1/d of `full`, which backward gathers from.
        self.post_group: FlatParamGroup | None = None
        self.post: torch.Tensor | None = None
        for p, piece, name, shape in zip(self.params, self.local_views, group.names,
                                         group.shapes, strict=True):
            p.data = piece
            label(p, name, unit_name, shape, local)
            rest(p)

    def pieces(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's 1-D piece of a slice-sized tensor (the parameters, a gradient)."""
        return [shard[start:end] for start, end in self.ranges]

    def start_gather(self) -> None:
        """Give `full` its memory back and start the all-gather into it (asynchronously)."""
        allocate_storage(self.full)
        over, source = (self.group, self.local) if self.post is None else (self.post_group,
                                                                           self.post)
        self.work = over.all_gather(self.full, source, async_op=True)  # (post: over d ranks)

    def finish_gather(self) -> None:
        """Wait for the all-gather; the parameters become views of the full buffer."""
        if self.work is not None:
            self.work.wait()
        self.work = None
        self.post = None  # used (or never made)
        for p, view in zip(self.params, self.full_views, strict=True):
            wake(p)  # whole first: the .data write below is then a plain one
            p.data = view

    def full_copy(self) -> torch.Tensor:
        """A full copy of the flat buffer, out of the lifecycle (an all-gather: every rank)."""
        full = self.group.new_full(self.local.dtype)
        self.group.all_gather(full, self.local)
        return full

    def keep_post(self) -> None:
        """reshard_after_forward=d: keep this rank's 1/d of `full` for backward's gather."""
        self.post = self.post_group.shard(self.full).clone()

    def release(self) -> None:
        """The parameters become local pieces again and the full buffer's memory is freed.

        Free the storage, in place: views of `full` that autograd saved keep the same
        storage object, which the next all-gather refills.
        """
        if self.work is not None:  # a prefetched all-gather nobody used
            self.work.wait()
            self.work = None
        for p, piece in zip(self.params, self.local_views, strict=True):
            p.data = piece
            rest(p)
        free_storage(self.full)


class FrozenPart(ShardedPart):
    """A unit's frozen parameters, sharded as its trainable ones (FSDP2 shards them too) and
    gathered and released with them; no gradient, reduce-scatter or optimizer state."""


class Unit(ShardedPart):
    """One unit: a module, its trainable parameters sharded (ShardedPart), and its frozen
    ones (`frozen`), which every move of the lifecycle takes along."""

    def __init__(self, name: str, module: nn.Module, group: FlatParamGroup,
                 local: torch.Tensor) -> None:
        super().__init__(name, group, local)
        self.name = name
        self.module = module
        self.gathered = False
        self.frozen: FrozenPart | None = None  # its frozen parameters (make_units)

    def start_gather(self) -> None:
        super().start_gather()
        if self.frozen is not None:
            self.frozen.start_gather()

    def finish_gather(self) -> None:
        super().finish_gather()
        if self.frozen is not None:
            self.frozen.finish_gather()
        self.gathered = True

    def reshard_after_forward(self) -> None:
        """reshard_after_forward=d: keep this rank's 1/d of the gathered buffers, release."""
        self.keep_post()
        if self.frozen is not None:
            self.frozen.keep_post()
        self.release()

    def drop_post(self) -> None:
        """A forward whose backward never came (or the step): its 1/d copy is stale."""
        self.post = None
        if self.frozen is not None:
            self.frozen.post = None

    def release(self) -> None:
        super().release()
        self.gathered = False
        if self.frozen is not None:
            self.frozen.release()

    @property
    def busy(self) -> bool:
        """Gathered, or being gathered."""
        return self.gathered or self.work is not None

    def __repr__(self) -> str:
        g = self.group
        return (f"Unit({self.name}: {len(self.params)} params, numel={g.numel}, "
                f"padded={g.padded_numel}, slice={g.shard_numel})")


class ReplicatedUnit(Unit):
    """A unit kept whole on every rank (shard(..., root_params="replicate")): `local` is the
    whole flat buffer and `full` too, each parameter keeps its full shape, nothing is gathered
    (Zero3.gather passes it by) or freed, and its gradient is all-reduced (zero2.py)."""

    replicated = True

    def __init__(self, name: str, module: nn.Module, group: FlatParamGroup,
                 local: torch.Tensor) -> None:  # a Unit's state, laid out whole
        self.name, self.module, self.group, self.params = name, module, group, group.params
        self.local = self.full = local
        self.full_views = self.local_views = group.views(local)
        self.gathered, self.frozen, self.work, self.post_group, self.post = (False, None, None,
                                                                             None, None)
        for p, view, p_name, shape in zip(self.params, self.full_views, group.names,
                                          group.shapes, strict=True):
            p.data = view
            label(p, p_name, name, shape, local)  # whole: never at rest

    def pieces(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's full-shaped view of a whole-buffer-sized tensor (a gradient)."""
        return self.group.views(shard)

    def start_gather(self) -> None:
        """Nothing to gather: the whole buffer is this rank's own."""

    def release(self) -> None:
        """Nothing to free."""

    def full_copy(self) -> torch.Tensor:
        return self.local


# ============================================================================ the stage


class Zero3(GradientSync):
    """Stage 2's gradient path, plus units gathered just in time and released after use."""

    stage = 3
    sharded = True
    MAX_IN_FLIGHT = 1  # reduce-scatters not yet complete: keeps at most two full gradients

    def __init__(self, model: nn.Module, units: list[Unit], prefetch: bool | int = True,
                 find_unused_parameters: bool = False, check_order: bool = False,
                 reshard_after_forward: bool = True, grad_accumulation: str = "sharded"
                 ) -> None:
        super().__init__([u.group for u in units], find_unused_parameters)
        self.grad_accumulation = grad_accumulation  # what no_sync keeps (accumulation.py)
        # The optimizer updates each unit's slice (memory of its own); stage 2's gradient
        # path lands each unit's averaged gradient slice on it.
        self.step_params += [nn.Parameter(u.local, requires_grad=False) for u in units]
        self.grads = ShardedGradients(self, self.MAX_IN_FLIGHT)
        self.hook_each_gradient(self.on_grad)
        self.reductions = self.grads.reductions
        self.units = units
        self.reshard_after_forward = reshard_after_forward
        # What a unit's forward ends with when its backward will come (reshard_after_forward):
        # release it (True), keep it gathered for that backward (False: 2Ψ a step instead of
        # 3Ψ), or keep this rank's 1/d of it for backward to gather over d ranks (an int d).
        if isinstance(reshard_after_forward, bool):
            self.after_forward = self.release if reshard_after_forward else self._keep_gathered
        else:
            self.after_forward = self._keep_1_of_d
        # reshard_after_forward=d: the units that keep a 1/d copy from forward to backward
        # (attach_post_forward_groups); a copy whose backward did not come is dropped.
        self._resharded = [unit for unit in units if unit.post_group is not None]
        self._kept: set[int] = set()  # gathered past their forward (reshard_after_forward)
        self._withheld: set[int] = set()  # kept units whose .grad pieces were not given out
        self.replicated = [unit.replicated for unit in units]
        # The order units run in, learnt in the first step: what each prefetches (`prefetch`
        # units ahead: False 0, True 1), and the ranks' checks that they gather the same units.
        self.order = UnitOrder(units, int(prefetch), check_order)
        self._grads_taken = [False] * len(units)
        # Called as listen(what, u) at unit u's "forward", "forward done", "backward",
        # "backward done", "gather", "release" and "reduce_scatter" (its gradient handed to
        # stage 2's path: sent, or under no_sync "unsharded" kept): the profiler's marks
        # ("forward / unit 3", profiling/marks.py), and notebook 05's memory timeline
        # (measure/memory_timeline.py) while it records.
        self.listeners: list[Callable[[str, int], None]] = [UnitSpans()]
        # Frozen parameters (zero3.FrozenPart) may be needed by backward after the unit's last
        # gradient is in (a frozen Linear's grad-input): such a unit is released once the
        # gradients of its inputs are computed (`_pending_inputs` hooks), and the root or a
        # unit enclosing others (whose inputs say nothing of what runs inside) when backward ends.
        modules = {id(unit.module) for unit in units}
        self._late = {u for u, unit in enumerate(units) if unit.frozen is not None and (
            unit.module is model or any(id(m) in modules for m in unit.module.modules()
                                        if m is not unit.module))}
        self._pending_inputs = [0] * len(units)
        self._grads_in: set[int] = set()  # all its gradients in, waiting for its inputs'
        root = None
        for u, unit in enumerate(units):
            if unit.module is model:
                root = u
                continue
            unit.module.register_forward_pre_hook(partial(self._pre_forward, u))
            unit.module.register_forward_hook(partial(self._post_forward, u))
            if unit.frozen is not None:
                unit.module.register_forward_pre_hook(partial(self._watch_inputs, u),
                                                      with_kwargs=True)
        # The model's own hooks run first and last: they bracket the whole forward.
        model.register_forward_pre_hook(partial(self._forward_start, root))
        model.register_forward_hook(partial(self._forward_end, root))

    # ------------------------------------------------------------------ gather / release
    def gather(self, u: int, wait: bool = True) -> None:
        """Make unit u's full parameters available (start only, when `wait` is False)."""
        unit = self.units[u]
        if unit.gathered or unit.replicated:
            return
        if unit.work is None:
            self.order.before_gather(u, self)  # the ranks gather the same unit (first forward)
            self._event("gather", u)
            unit.start_gather()
        if wait:
            unit.finish_gather()

    def release(self, u: int) -> None:
        unit = self.units[u]
        self._kept.discard(u)
        if unit.busy:
            unit.release()
            self._event("release", u)

    def _release_unkept(self) -> None:
        """Release every unit but those kept gathered (reshard_after_forward=False)."""
        for u in range(len(self.units)):
            if u not in self._kept:
                self.release(u)

    def _event(self, what: str, u: int) -> None:
        for listen in self.listeners:
            listen(what, u)

    # ------------------------------------------------------------------ forward hooks
    def _forward_start(self, root: int | None, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():  # true only while torch.compile traces
            refuse_compile()
        refuse_unfrozen(self.frozen)  # a sharded frozen piece would get a full-shaped gradient
        self.order.forward_starts()
        if root is not None:
            self._pre_forward(root, module, args)

    def _pre_forward(self, u: int, module: nn.Module, args) -> None:
        if _in_backward():  # recomputed by activation checkpointing: already gathered
            self.gather(u)
            return
        self.gather(u)
        for ahead in self.order.next_units("forward", u):  # prefetch (unit_order.py)
            self.gather(ahead, wait=False)
        self._event("forward", u)

    def _watch_inputs(self, u: int, module: nn.Module, args, kwargs) -> None:
        """A unit with frozen parameters: its backward is over once its inputs' gradients
        are computed (FSDP2 hooks its post-backward on the inputs the same way)."""
        if _in_backward() or not torch.is_grad_enabled():
            return
        inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        if inputs:
            self._pending_inputs[u] += 1
            torch.autograd.graph.register_multi_grad_hook(
                inputs, partial(self._inputs_done, u), mode="all")

    def _inputs_done(self, u: int, _grads) -> None:
        self._pending_inputs[u] = max(0, self._pending_inputs[u] - 1)
        if not self._pending_inputs[u] and u in self._grads_in:
            self._grads_in.discard(u)
            self.release(u)

    def _post_forward(self, u: int, module: nn.Module, args, output) -> None:
        if _in_backward():  # a recomputation inside the unit's backward: keep it gathered
            return
        self._event("forward done", u)
        outputs = ([t for t in _tensors(output) if t.requires_grad]
                   if torch.is_grad_enabled() else [])
        if outputs:  # its backward will come: gather again (if released) when it reaches u
            self.after_forward(u)  # release, by default (reshard_after_forward)
            torch.autograd.graph.register_multi_grad_hook(
                outputs, partial(self._pre_backward, u), mode="any")
        else:
            self.release(u)

    def _keep_gathered(self, u: int) -> None:
        """reshard_after_forward=False: the unit stays gathered; its backward needs no second
        all-gather."""
        self._kept.add(u)

    def _keep_1_of_d(self, u: int) -> None:
        """reshard_after_forward=d: keep this rank's 1/d of the unit; backward gathers over d
        ranks."""
        unit = self.units[u]
        if unit.post_group is None or not unit.gathered:  # (replicated: nothing to keep)
            return self.release(u)
        unit.reshard_after_forward()
        self._event("release", u)

    def _forward_end(self, root: int | None, module: nn.Module, args, output) -> None:
        if root is not None:
            self._post_forward(root, module, args, output)
        self._release_unkept()  # a unit prefetched for a call that did not come
        self.order.forward_ends(self)  # the first: learnt; every one: the ranks compare it

    def before_first_collective(self, phase: str) -> None:
        """Stage 3 checks at the end of every forward instead (unit_order.py): its
        steps send nothing, and its forward gathers before any other collective of a step."""

    # ------------------------------------------------------------------ backward
    @property
    def grad_buffers(self) -> list[torch.Tensor]:  # held under no_sync: measure/memory.py's
        return self.grads.held_buffers()

    def on_grad(self, g: int, i: int, param: torch.Tensor) -> None:
        """Parameter i of unit g has its gradient: into the unit's full gradient buffer
        (stage 2's path); a unit whose gradients are all in is released and sent."""
        self.gradient_arrived(g, i)  # (queued end_of_backward already: _pre_backward)
        self.grads.add(g, i, param)
        for ready in self.groups_ready(g):  # all in, in the order every rank sends
            self.on_group_ready(ready)

    def _pre_backward(self, u: int, _grad: torch.Tensor) -> None:
        self.queue_backward_callback()
        self._take_grads(u)
        self.gather(u)
        for ahead in self.order.next_units("backward", u):
            self.gather(ahead, wait=False)
        self._event("backward", u)

    def _take_grads(self, u: int) -> None:
        """Before unit u's gradients arrive: fold into the gradient slice what was done to
        the parameters' `.grad` pieces since the last backward (a torch optimizer built on
        model.parameters() zeroes them by setting them to None), then clear `.grad`:
        autograd is about to deliver full-shaped gradients."""
        if self._grads_taken[u]:
            return
        self._grads_taken[u] = True
        unit, step_param = self.units[u], self.step_params[u]
        if u in self._withheld:  # kept gathered: no piece was given out, nothing to fold
            self._withheld.discard(u)
        elif step_param.grad is not None:
            main = self.main_grads[u]  # reduced in fp32: follows what was done to `.grad`
            mains = unit.pieces(main) if main is not None else [None] * len(unit.params)
            for i, (p, piece, wide) in enumerate(zip(unit.params, unit.pieces(step_param.grad),
                                                     mains, strict=True)):
                if p.grad is None:  # no gradient (any more): as in one process
                    piece.zero_()
                    self.has_grad[u][i] = False
                elif p.grad.data_ptr() != piece.data_ptr():
                    piece.copy_(p.grad)
                else:
                    continue
                if wide is not None:
                    wide.copy_(piece)
            if not any(self.has_grad[u]):
                step_param.grad = None
        for p in unit.params:
            p.grad = None

    def on_group_ready(self, g: int) -> None:
        # Every gradient of unit g is in its full gradient buffer: the full parameters are
        # no longer needed (unless kept for the next micro-batch); the gradient goes out as
        # in stage 2.
        self._take_grads(g)
        self._event("backward done", g)
        if self.reshard_after_forward or self._syncing:  # else kept for the next one
            if g in self._late or self._pending_inputs[g]:
                self._grads_in.add(g)  # its frozen parameters may still be needed
            else:
                self.release(g)
        self._event("reduce_scatter", g)  # (or, under no_sync "unsharded", kept)
        self.grads.send(g)  # REDUCE-SCATTER, as stage 2 sends a bucket

    def end_of_backward(self) -> None:
        for g in self.groups_left():  # a unit with a parameter unused: zeros, still sent
            self.on_group_ready(g)
        self.land_reductions()  # wait for the last reduce-scatters
        self._pending_inputs, self._grads_in = [0] * len(self.units), set()
        for unit in self._resharded:
            unit.drop_post()  # a unit whose backward did not come
        self._release_unkept()  # a unit prefetched for a backward that did not come
        self._give_out_grads()
        self._grads_taken = [False] * len(self.units)
        self.order.backward_ends()
        self.backward_over()

    def on_backward_abandoned(self) -> None:
        self.grads.abandon()
        self._pending_inputs, self._grads_in = [0] * len(self.units), set()
        for u in range(len(self.units)):
            self._event("backward done", u)
            self.release(u)  # gathered for a backward that raised
        self._give_out_grads()
        self._grads_taken = [False] * len(self.units)
        self.order.backward_ends(completed=False)  # learn from a backward that completes

    def _give_out_grads(self) -> None:
        """Each parameter's `.grad` becomes its piece of the unit's gradient slice."""
        for u, (unit, step_param) in enumerate(zip(self.units, self.step_params, strict=True)):
            grad = step_param.grad
            if unit.gathered:  # kept (a replicated unit is never gathered): full-shaped
                pieces = [None] * len(unit.params)  # the slice keeps the sum meanwhile
                self._withheld.add(u)
            else:
                pieces = unit.pieces(grad) if grad is not None else [None] * len(unit.params)
                self._withheld.discard(u)
            for p, piece in zip(unit.params, pieces, strict=True):
                p.grad = piece

    # ------------------------------------------------------------------ optimizer side
    def before_step(self) -> None:
        """A unit still gathered (kept by reshard_after_forward=False, or by a forward with
        no backward) would be stale after the update: release it; the next forward gathers."""
        for u in range(len(self.units)):
            self.release(u)
        for unit in self._resharded:
            unit.drop_post()
        if self._withheld:
            self._give_out_grads()  # now at rest: each parameter's .grad is its piece

    def after_step(self) -> None:
        """Nothing to send: the slices were updated in place, and the next forward gathers."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.zero_grad(set_to_none)  # stage 2's; and each parameter's piece of it:
        if set_to_none:
            for unit in self.units:
                for p in unit.params:
                    p.grad = None

    def full_flat_params(self, g: int) -> torch.Tensor:
        """A full copy of unit g's flat parameters (an all-gather: call it on every rank)."""
        return self.units[g].full_copy()

    def full_frozen(self) -> dict[int, torch.Tensor]:
        """{id(parameter): full tensor} of the frozen parameters the units shard (all-gathers:
        call it on every rank)."""
        full = {}
        for unit in self.units:
            if unit.frozen is not None:
                views = unit.frozen.group.views(unit.frozen.full_copy())
                full.update(zip(map(id, unit.frozen.params), views, strict=True))
        return full

    # ------------------------------------------------------------------ for learners
    def gathered_bytes(self) -> int:
        """Bytes of full parameter buffers allocated right now (0 between steps); a
        replicated unit's buffer is its local one, never gathered, so it does not count."""
        return sum(u.full.untyped_storage().nbytes()
                   + (u.frozen.full.untyped_storage().nbytes() if u.frozen else 0)
                   for u in self.units if not u.replicated)

    def describe(self) -> list[dict]:
        """One row per unit: name, parameters, elements, padded elements, slice size."""
        return [{"unit": u.name, "params": len(u.params), "numel": u.group.numel,
                 "padded": u.group.padded_numel, "slice": u.group.shard_numel}
                for u in self.units]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor inside a module's output (tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []
