"""Stage 3's units: how a model is cut into them, and what one unit holds.

A *unit* is a module whose trainable parameters stage 3 gathers and releases together, as
FSDP wraps modules. `plan_units` decides which parameters each unit holds (a tied or shared
weight goes to the unit that encloses all its users); `Unit` keeps one unit's flat layout,
this rank's slice of it, and the full buffer that exists only while the unit computes, with
the three moves of its lifecycle: start the all-gather, finish it, release; `make_units` does
all of it for a model (cut, broadcast rank 0's values, keep this rank's slice). zero3.py drives
them from module and autograd hooks. Between its calls a unit's parameters rest as their
1-D pieces, guarded against reads that would take a piece for the parameter (at_rest.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.partition import FlatParamGroup, allocate_storage, free_storage
from zero_lab.stages.at_rest import label, rest, wake
from zero_lab.stages.hybrid import HybridMesh
from zero_lab.stages.mixed_precision import kept_parameter_ids

# Modules that only hold other modules: their children are the units, not they.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
ROOT_NAME = "(root)"


def unit_modules(model: nn.Module, unit_classes: Sequence[type] | None = None,
                 also: Sequence[type] = ()) -> list[tuple[str, nn.Module]]:
    """(name, module) of every unit candidate below the root, in registration order.

    Default: each child that owns trainable parameters, looking into containers. With
    `unit_classes`: every module (at any depth, nested ones included) of those classes.
    `also`: modules of these classes are units too, at any depth (a precision policy's
    fp32 modules, mixed_precision.py: a unit's flat buffer holds one dtype).
    """
    if unit_classes is not None:
        classes = tuple(unit_classes)
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module)
                                  for c in classes):
            raise TypeError(f"unit_classes must be nn.Module subclasses, got {unit_classes!r}")
        found = [(name, m) for name, m in model.named_modules()
                 if m is not model and isinstance(m, classes)]
    else:
        found = []

        def visit(prefix: str, module: nn.Module) -> None:
            for name, child in module.named_children():
                if isinstance(child, CONTAINERS):
                    visit(f"{prefix}{name}.", child)
                elif any(p.requires_grad for p in child.parameters()):
                    found.append((f"{prefix}{name}", child))

        visit("", model)
    if also:
        chosen = {id(m) for _, m in found} | {id(m) for m in model.modules()
                                              if isinstance(m, tuple(also))}
        found = [(name, m) for name, m in model.named_modules()
                 if m is not model and id(m) in chosen]
    return found


def plan_units(model: nn.Module, unit_classes: Sequence[type] | None = None,
               also: Sequence[type] = ()
               ) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """[(unit name, module, [(parameter name, parameter)])], the root unit last.

    A trainable parameter belongs to the innermost unit enclosing the module that owns it.
    A parameter owned by several modules (a tied weight) goes to the innermost unit that
    encloses all of them, their common ancestor: it is gathered whenever any of them runs.
    Units left without trainable parameters are dropped.
    """
    candidates = unit_modules(model, unit_classes, also) + [(ROOT_NAME, model)]
    index = {id(m): i for i, (_, m) in enumerate(candidates)}

    # For every module, the units enclosing it from outside, outermost (the root) first; for
    # a module placed at two places in the tree (a shared submodule), the units common to both.
    outer: dict[int, tuple[int, ...]] = {}

    def walk(module: nn.Module, enclosing: tuple[int, ...]) -> None:
        if id(module) in outer:
            seen = outer[id(module)]
            common = _common_prefix([seen, enclosing])
            if common == seen:
                return
            enclosing = common
        outer[id(module)] = enclosing
        for child in module.children():
            walk(child, chain(module))

    def chain(module: nn.Module) -> tuple[int, ...]:
        return outer[id(module)] + ((index[id(module)],) if id(module) in index else ())

    walk(model, ())
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)

    members: list[list[tuple[str, nn.Parameter]]] = [[] for _ in candidates]
    for name, p in model.named_parameters():  # each distinct parameter once
        if not p.requires_grad:
            continue
        members[_common_prefix([chain(m) for m in owners[id(p)]])[-1]].append((name, p))
    return [(name, module, params) for (name, module), params
            in zip(candidates, members, strict=True) if params]


def _common_prefix(chains: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The longest chain of units that starts every one of `chains`."""
    common: list[int] = []
    for level in zip(*chains, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return tuple(common)


class Unit:
    """One unit: its flat layout, this rank's slice, and a full buffer that exists only
    while the unit computes.

    `local` (S elements) holds this rank's part of the parameters, in memory of its own.
    `full` (N·S elements) is allocated, all-gathered into, and freed in place again;
    `full_views` are the parameter-shaped views of it the module computes with, and
    `local_views` each parameter's piece of `local` (1-D, possibly empty): the parameters
    at rest.
    """

    def __init__(self, name: str, module: nn.Module, group: FlatParamGroup,
                 local: torch.Tensor, replicated: bool = False) -> None:
        self.name = name
        self.module = module
        self.group = group
        self.params = group.params
        self.local = local
        # A replicated unit (shard(..., root_params="replicate")) keeps the whole flat
        # buffer on every rank: `local` is it, nothing is gathered or freed, and each
        # parameter keeps its full shape.
        self.replicated = replicated
        if replicated:
            self.full = local
            self.full_views = group.views(local)
        else:
            self.full = group.new_full(local.dtype)
            self.full_views = group.views(self.full)  # made while the storage exists
            free_storage(self.full)  # nothing gathered yet
        # Where each parameter's local piece sits in `local`: [start, end).
        spans = [(0, 0)] * len(self.params)
        for piece in group.shard_pieces():
            spans[piece.index] = (piece.shard_start, piece.shard_start + piece.numel)
        self.spans = spans
        self.local_views = self.pieces(local)
        self.work: dist.Work | None = None  # an all-gather in flight (prefetch)
        self.gathered = False
        for p, piece, name, shape in zip(self.params, self.local_views, group.names,
                                         group.shapes, strict=True):
            p.data = piece
            label(p, name, self.name, shape, local)
            if not replicated:  # a replicated unit's parameters are whole: never a piece
                rest(p)

    def pieces(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's 1-D piece of a slice-sized tensor (the parameters, a gradient);
        for a replicated unit, each parameter's full-shaped view of the whole buffer."""
        if self.replicated:
            return self.group.views(shard)
        return [shard[start:end] for start, end in self.spans]

    def start_gather(self) -> None:
        """Give `full` its memory back and start the all-gather into it (asynchronously)."""
        if self.replicated:
            return
        allocate_storage(self.full)
        self.work = self.group.all_gather(self.full, self.local, async_op=True)

    def finish_gather(self) -> None:
        """Wait for the all-gather; the parameters become views of the full buffer."""
        if self.work is not None:  # a replicated unit has none to wait for
            self.work.wait()
        self.work = None
        for p, view in zip(self.params, self.full_views, strict=True):
            wake(p)  # first: re-pointing a guarded parameter would pay the guard's call
            p.data = view
        self.gathered = True

    def release(self) -> None:
        """The parameters become local pieces again and the full buffer's memory is freed.

        Free the storage, in place: views of `full` that autograd saved keep the same
        storage object, which the next all-gather refills.
        """
        if self.work is not None:  # a prefetched all-gather nobody used
            self.work.wait()
            self.work = None
        self.gathered = False
        if self.replicated:
            return
        for p, piece in zip(self.params, self.local_views, strict=True):
            p.data = piece
            rest(p)
        free_storage(self.full)

    @property
    def busy(self) -> bool:
        """Gathered, or being gathered."""
        return self.gathered or self.work is not None

    def __repr__(self) -> str:
        g = self.group
        return (f"Unit({self.name}: {len(self.params)} params, numel={g.numel}, "
                f"padded={g.padded_numel}, slice={g.shard_numel})")


def make_units(model: nn.Module, unit_classes: Sequence[type] | None, transport: str,
               compute_dtype: torch.dtype | None = None, replicate_root: bool = False,
               keep_fp32: Sequence[type] = (), mesh: HybridMesh | None = None,
               ) -> tuple[list[Unit], list[torch.Tensor]]:
    """Cut `model` into units (units.py) and shard each: returns (units, fp32 slices).

    Every rank starts from rank 0's parameters (one broadcast per unit) and keeps only its
    slice, in memory of its own; with `replicate_root`, the root unit (the parameters no
    other unit claims) is kept whole instead. With `compute_dtype` (mixed precision) the
    slices, and so the all-gathers and reduce-scatters, are in that dtype, and the fp32
    slices returned are the masters the optimizer steps; without, the list is empty. Modules
    of the classes in `keep_fp32` are units of their own that stay fp32 (their slice is its
    own master), as FSDP2's fully_shard call with an fp32 policy on a norm. With a
    `mesh` (hybrid.py), each unit is sharded over this rank's shard group and replicated
    across its replicate group.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = {}
    if mesh is not None:
        world, rank = mesh.shards, mesh.shard_rank
        groups = {"process_group": mesh.shard_group, "replicate_group": mesh.replicate_group}
    units, masters = [], []
    kept = kept_parameter_ids(model, keep_fp32)
    for name, module, named in plan_units(model, unit_classes, also=keep_fp32):
        params = [p for _, p in named]
        names = [n for n, _ in named]
        group = FlatParamGroup(params, world, rank, names, transport=transport, **groups)
        flat = group.flatten()
        dist.broadcast(flat, src=0)  # every rank starts from rank 0's parameters
        whole = replicate_root and module is model
        local = flat if whole else group.shard(flat).clone()  # in memory of its own
        stays_fp32 = {id(p) in kept for p in params}
        if stays_fp32 == {True, False}:
            raise ValueError(f"unit {name} holds parameters kept in fp32 (keep_fp32) and "
                             "16-bit ones; a unit's flat buffer has one dtype")
        if compute_dtype is not None and stays_fp32 == {True}:
            masters.append(local)  # kept in fp32: the slice is its own master
        elif compute_dtype is not None:
            masters.append(local)  # fp32, taken before anything is rounded
            local = local.to(compute_dtype)
            for p in params:  # the same layout, in the compute dtype
                p.data = p.data.to(compute_dtype)
            group = FlatParamGroup(params, world, rank, names, transport=transport, **groups)
        del flat
        group.label = f"unit {len(units)}"  # its collectives' names in a profiler trace
        units.append(Unit(name, module, group, local, replicated=whole))
    return units, masters
