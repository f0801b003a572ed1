"""Stage 3's units: how a model is cut into them, each laid out and sharded (at shard()).

A *unit* is a module whose trainable parameters stage 3 gathers and releases together, as
FSDP wraps modules. `plan_units` decides which parameters each unit holds (a tied or shared
weight goes to the unit that encloses all its users); `make_units` makes each a `Unit`
(zero3.py, where its lifecycle is: start the all-gather, finish it, release), broadcasts
rank 0's values and keeps this rank's slice. Between its calls a unit's parameters rest as
their 1-D pieces, guarded against reads that would take a piece for the parameter
(at_rest.py). A unit's frozen parameters are a `FrozenPart`, gathered with it, never reduced
or stepped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives.ledger import name_level
from zero_lab.stages.hybrid import HybridMesh
from zero_lab.stages.mixed_precision import kept_parameter_ids
from zero_lab.stages.partition import FlatParamGroup
from zero_lab.stages.zero3 import FrozenPart, ReplicatedUnit, Unit

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
               also: Sequence[type] = (), frozen: bool = False) -> list[tuple]:
    """[(unit name, module, [(parameter name, parameter)])], the root unit last; with
    `frozen`, a fourth item: the unit's frozen parameters (requires_grad=False).

    A trainable parameter belongs to the innermost unit enclosing the module that owns it.
    A parameter owned by several modules (a tied weight) goes to the innermost unit that
    encloses all of them, their common ancestor: it is gathered whenever any of them runs.
    A frozen parameter goes by the same rule, to the innermost unit that has trainable
    parameters (it is gathered with them). Units left without trainable parameters are
    dropped; a frozen parameter no unit with trainable parameters encloses stays whole. So a
    wholly frozen block is no unit: its parameters join the root unit if the root trains a
    parameter of its own, else stay whole on every rank (FSDP2's fully_shard shards such a
    block like any other; tests/test_finding_frozen_block.py).
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
    held: list[list[tuple[str, nn.Parameter]]] = [[] for _ in candidates]  # frozen ones
    for name, p in model.named_parameters():  # each distinct parameter once
        if p.requires_grad:
            members[_common_prefix([chain(m) for m in owners[id(p)]])[-1]].append((name, p))
    for name, p in model.named_parameters():
        if not p.requires_grad:
            enclosing = [u for u in _common_prefix([chain(m) for m in owners[id(p)]])
                         if members[u]]
            if enclosing:
                held[enclosing[-1]].append((name, p))
    return [(name, module, params, cold) if frozen else (name, module, params)
            for (name, module), params, cold in zip(candidates, members, held, strict=True)
            if params]


def root_parameters(model: nn.Module, unit_classes: Sequence[type] | None) -> set[int]:
    """ids of the trainable parameters no unit claims: the root unit's, before a precision
    policy cuts its kept modules out (plan_units without `also`)."""
    return {id(p) for _, module, named in plan_units(model, unit_classes) if module is model
            for _, p in named}


def _common_prefix(chains: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The longest chain of units that starts every one of `chains`."""
    common: list[int] = []
    for level in zip(*chains, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return tuple(common)


def make_units(model: nn.Module, unit_classes: Sequence[type] | None, transport: str,
               compute_dtype: torch.dtype | None = None, replicate_root: bool = False,
               keep_fp32: Sequence[type] = (), mesh: HybridMesh | None = None,
               group_type: type[FlatParamGroup] = FlatParamGroup,
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
    across its replicate group. `group_type`: the units' groups' class (ReducedInFp32 sends
    their gradients' reductions in fp32; their frozen parts' groups are FlatParamGroups).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = {}
    if mesh is not None:
        world, rank = mesh.shards, mesh.shard_rank
        groups = {"process_group": mesh.shard_group, "replicate_group": mesh.replicate_group}
    units, masters = [], []
    kept = kept_parameter_ids(model, keep_fp32)
    # replicate_root keeps whole what the root holds without the precision policy: keep_fp32
    # cuts the kept modules out as units of their own (a flat buffer has one dtype), and
    # those the root would hold stay whole too: the policy changes a dtype, not a layout.
    at_root = root_parameters(model, unit_classes) if replicate_root else set()
    for name, module, named, cold in plan_units(model, unit_classes, also=keep_fp32,
                                                frozen=True):
        params = [p for _, p in named]
        names = [n for n, _ in named]
        group = group_type(params, world, rank, names, transport=transport, **groups)
        flat = group.flatten()
        dist.broadcast(flat, src=0)  # every rank starts from rank 0's parameters
        whole = replicate_root and all(id(p) in at_root for p in params)
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
            group = group_type(params, world, rank, names, transport=transport, **groups)
        del flat
        group.label = f"unit {len(units)}"  # its collectives' names in a profiler trace
        unit = (ReplicatedUnit if whole else Unit)(name, module, group, local)
        if compute_dtype is not None:  # one dtype a part: a frozen one of another dtype
            cold = [(n, p) for n, p in cold  # (kept in fp32 by keep_fp32) stays whole
                    if (id(p) in kept) == (stays_fp32 == {True})]
        if cold and not whole:  # frozen parameters: sharded too (a replicated unit's stay whole)
            unit.frozen = _frozen_part(name, cold, len(units), compute_dtype, kept,
                                       world, rank, transport, groups)
        units.append(unit)
    return units, masters


def attach_post_forward_groups(units: list[Unit], d: int) -> None:
    """reshard_after_forward=d: groups of d consecutive ranks (as FSDP2's post-forward mesh;
    every rank makes every group, in order), each unit's buffer cut into d chunks over its
    group instead of N. A CommLedger records them at level "post_forward"."""
    world, rank = dist.get_world_size(), dist.get_rank()
    made = [dist.new_group(list(range(start, start + d))) for start in range(0, world, d)]
    group = made[rank // d]
    name_level(group, "post_forward")
    for unit in units:
        if not unit.replicated:
            unit.post_group = unit.group.sharded_over(group, d, rank % d)
            if unit.frozen is not None:
                unit.frozen.post_group = unit.frozen.group.sharded_over(group, d,
                                                                             rank % d)


def _frozen_part(unit_name: str, named, index: int, compute_dtype, kept: set[int], world: int,
                 rank: int, transport: str, groups: dict) -> FrozenPart:
    """A unit's frozen parameters laid out, rank 0's values broadcast, this rank's slice kept
    (in the compute dtype in mixed precision, unless keep_fp32 keeps them)."""
    params, names = [p for _, p in named], [n for n, _ in named]
    group = FlatParamGroup(params, world, rank, names, transport=transport, **groups)
    flat = group.flatten()
    dist.broadcast(flat, src=0)
    if compute_dtype is not None and not all(id(p) in kept for p in params):
        flat = flat.to(compute_dtype)
        for p in params:
            p.data = p.data.to(compute_dtype)
        group = FlatParamGroup(params, world, rank, names, transport=transport, **groups)
    group.label = f"unit {index} frozen"
    return FrozenPart(unit_name, group, group.shard(flat).clone())
