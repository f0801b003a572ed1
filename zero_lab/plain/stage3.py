"""Stage 3 (ZeRO P_os+g+p, FSDP's full sharding): parameters sharded too, gathered per unit.

    forward pre-hook    regrow the unit's full buffer; ALL-GATHER its slices into it
    the unit's forward  computes; autograd saves views of the full parameters
    forward post-hook   release: the buffer's memory freed in place; a hook on the output
    pre-backward hook   (the output's gradient is in) ALL-GATHER again, into the same memory,
                        which the views autograd saved see
    gradient hooks      each full gradient copied into the unit's buffer, `.grad` dropped;
                        the last one in: release, REDUCE-SCATTER (average), asynchronously
    end of backward     wait for the last one: each rank holds its slices' gradients
    opt.step()          the optimizer updates the local slices; nothing to send

Units: each child module with parameters (containers looked into), and the model itself
for what none claims. At rest a parameter is empty (the real stage keeps its piece there).
Per step: 2 all-gathers + 1 reduce-scatter of Ψ = 3Ψ, 1.5x stages 0-2.
On gloo, torch runs a reduce-scatter as a whole all-reduce, keeping its own chunk (twice the
bytes of a reduce-scatter): the real stages send a direct exchange there (collectives/exchange.py).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.plain.partition import Flat, free_storage, regrow_storage

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
MAX_IN_FLIGHT = 1  # reduce-scatters not yet landed: at most two full gradients alive


def shard(model: nn.Module, make_optimizer):
    return model, FullySharded(model, make_optimizer)


def cut_into_units(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    found = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, CONTAINERS):
                visit(child)
            elif any(p.requires_grad for p in child.parameters()):
                found.append(child)

    visit(model)
    claimed = {id(p) for unit in found for p in unit.parameters()}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in claimed]
    return ([(m, [p for p in m.parameters() if p.requires_grad]) for m in found]
            + ([(model, rest)] if rest else []))  # the root unit: the model's own, last


class Unit:
    """A module whose parameters are gathered together; between uses, only a slice lives."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        self.module, self.flat = module, Flat(params)
        self.full_views = [p.data for p in params]  # the parameters, once gathered
        self.local = nn.Parameter(self.flat.shard(self.flat.data).clone(), requires_grad=False)
        self.release()  # only the slice (memory of its own) stays
        self.full_grad, self.arrived = None, 0

    def gather(self) -> None:
        regrow_storage(self.flat.data)
        dist.all_gather_single(self.flat.data, self.local.detach())
        for p, view in zip(self.flat.params, self.full_views, strict=True):
            p.data = view

    def release(self) -> None:
        free_storage(self.flat.data)  # the views of it (autograd saved some) stay valid
        for p in self.flat.params:  # at rest, empty: a read finds nothing, not freed memory
            p.data = p.data.new_empty(0)


class FullySharded:
    """Units gathered just in time and released after use; stage 2's gradient path."""

    def __init__(self, model: nn.Module, make_optimizer) -> None:
        self.units = [Unit(module, params) for module, params in cut_into_units(model)]
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda _module, _args, unit=unit: unit.gather())
            unit.module.register_forward_hook(partial(self.after_forward, unit))
            for i, p in enumerate(unit.flat.params):
                p.register_post_accumulate_grad_hook(partial(self.on_grad, unit, i))
        self.optimizer = make_optimizer([unit.local for unit in self.units])
        self.in_flight: list[tuple[Unit, dist.Work, torch.Tensor, torch.Tensor]] = []
        self.callback_queued = False

    def after_forward(self, unit: Unit, _module, _args, output: torch.Tensor) -> None:
        unit.release()
        if output.requires_grad:  # training: gather again when backward reaches the unit
            output.register_hook(lambda _grad: self.before_backward(unit))

    def before_backward(self, unit: Unit) -> None:
        if not self.callback_queued:  # the first unit of this backward
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
        unit.gather()

    def on_grad(self, unit: Unit, i: int, p: nn.Parameter) -> None:
        if unit.full_grad is None:
            unit.full_grad = unit.flat.new_full()
        unit.flat.view(unit.full_grad, i).copy_(p.grad)
        p.grad = None  # the full gradient is freed now
        unit.arrived += 1
        if unit.arrived == len(unit.flat.params):  # the unit's backward is over
            unit.release()
            full, unit.full_grad, unit.arrived = unit.full_grad, None, 0
            mine = torch.empty_like(unit.local)
            work = dist.reduce_scatter_single(mine, full, op=dist.ReduceOp.AVG, async_op=True)
            self.in_flight.append((unit, work, full, mine))
            while len(self.in_flight) > MAX_IN_FLIGHT:
                self.land()

    def land(self) -> None:  # the oldest reduce-scatter: wait, keep the slice, drop the buffer
        unit, work, _full, mine = self.in_flight.pop(0)
        work.wait()
        unit.local.grad = mine

    def end_of_backward(self) -> None:
        while self.in_flight:
            self.land()
        self.callback_queued = False

    def step(self) -> None:
        self.optimizer.step()  # the local slices, in place; the next forward gathers them

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def full_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's weights, whole: every unit gathered, read (copies), released again."""
        for unit in self.units:
            unit.gather()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for unit in self.units:
            unit.release()
        return weights
