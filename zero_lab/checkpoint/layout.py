"""What a sharded model holds on this rank, as pieces of parameters.

A piece is elements [start, start + numel) of one parameter, flattened: a parameter's values
(fp32: the master copy in mixed precision), or one of its optimizer states (Adam's exp_avg,
...). Flat buffers are padded to a multiple of N; pieces are cut from the real elements only.

Who writes what: a group that is sharded is written by every rank (each its slice); a group
held whole on every rank (stage 0, a replicated stage-3 root) only by rank 0, as are buffers
and frozen parameters (those stage 3 shards all-gathered first, on every rank, and loaded
back as each rank's piece: `frozen_full`, `frozen_pieces`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.checkpoint.manifest import CheckpointError
from zero_lab.stages import SHARDED_ATTR


@dataclass(frozen=True)
class Span:
    """Elements [start, start + numel) of parameter `name` inside `tensor` (a view of what
    this rank holds: a step target, a master copy, an optimizer state)."""

    name: str
    start: int
    numel: int
    tensor: torch.Tensor


def sharded_optimizer(model: nn.Module, optimizer, weights_only: bool = False) -> object:
    """The ShardedOptimizer behind `model` (shard()'s), checked to be `optimizer` (which may
    be None with `weights_only`: the layout is still the optimizer's to tell)."""
    owner = getattr(model, SHARDED_ATTR, None)
    if owner is None:
        raise TypeError("checkpoints are of sharded models: call zero_lab.stages.shard(model, "
                        "stage) first (stage 0 is plain data parallelism)")
    _refuse_a_mesh(owner)
    owner.sync.settle()  # collectives left in flight (stages/param_gather.py) land first
    if optimizer is None and weights_only:
        return owner
    if optimizer is not owner:
        raise TypeError("`optimizer` must be the one shard(model, ...) returned with this model")
    return owner


def _refuse_a_mesh(opt) -> None:
    """Hybrid sharding (shard(..., mesh=(R, S))) is not yet checkpointed: every group of S
    ranks holds the same slices, so the layout here (one piece per rank) would write each
    element R times. Refused on every rank alike, before anything is read or written."""
    group = opt.sync.groups[0]
    if group.replicate_group is not None:
        replicas = dist.get_world_size(group=group.replicate_group)
        raise CheckpointError(
            f"this model is sharded on a mesh (hybrid sharding, {replicas} x "
            f"{group.world_size}): zero_lab.checkpoint does not save or load it yet (every "
            "group holds the same slices, and only one group should write them). Save "
            "full_state_dict(model) instead, and load it with model.load_state_dict(...)")


def group_base(opt, g: int) -> int:
    """Flat offset of the first element of group g's step target on this rank."""
    group = opt.sync.groups[g]
    return group.shard_start if opt.sync.group_sharded(g) else 0


def writes(opt, g: int, rank: int) -> bool:
    """Does `rank` write group g? Sharded: everyone its slice; whole: rank 0 only."""
    return opt.sync.group_sharded(g) or rank == 0


def spans_of(group, base: int, tensor: torch.Tensor) -> Iterator[Span]:
    """The pieces of each parameter of `group` inside `tensor`, which holds the group's flat
    elements [base, base + tensor.numel()) (the padding past group.numel is left out)."""
    end = min(base + tensor.numel(), group.numel)
    for name, offset, numel in zip(group.names, group.offsets, group.numels, strict=True):
        lo, hi = max(base, offset), min(end, offset + numel)
        if lo < hi:
            yield Span(name, lo - offset, hi - lo, tensor.view(-1)[lo - base:hi - base])


def value_spans(opt, rank: int) -> Iterator[Span]:
    """This rank's pieces of parameter values to save (fp32 masters in mixed precision)."""
    for g, group in enumerate(opt.sync.groups):
        if writes(opt, g, rank):
            yield from spans_of(group, group_base(opt, g), opt.targets[g].detach())


def state_spans(opt, rank: int) -> Iterator[tuple[str, Span]]:
    """(state name, piece) of every optimizer state this rank saves: element-wise states
    (Adam's exp_avg, exp_avg_sq) as pieces of the parameter; a 0-d state (Adam's step) as a
    piece of 0 elements at the piece's start."""
    for pc, view in zip(opt.pieces, opt.views, strict=True):
        if not writes(opt, pc.group, rank):
            continue
        group = opt.sync.groups[pc.group]
        start = group_base(opt, pc.group) + pc.start - group.offsets[pc.param]
        for key, value in opt.optim.state.get(view, {}).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {key!r} is a {type(value).__name__}; only "
                                "tensor states can be checkpointed")
            numel = 0 if value.dim() == 0 else pc.numel
            if value.dim() and value.numel() != pc.numel:
                raise TypeError(f"optimizer state {key!r} has {value.numel()} elements for a "
                                f"piece of {pc.numel}: not element-wise")
            yield key, Span(group.names[pc.param], start, numel, value.detach())


def trainable(opt) -> dict[str, torch.nn.Parameter]:
    """{name: parameter} of every parameter in a flat group (each once)."""
    return {name: p for group in opt.sync.groups
            for name, p in zip(group.names, group.params, strict=True)}


def others(model: nn.Module, opt, full: dict | None = None) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters (whole on every rank), by state-dict name. A frozen
    parameter stage 3 shards (frozen_pieces) is its full value from `full` (`frozen_full`),
    or without it a tensor of its full shape and dtype on the meta device (no data)."""
    params = {id(p) for p in trainable(opt).values()}
    frozen = frozen_pieces(model, opt)
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in params:
            continue
        if name in frozen:
            p, _, _, shape = frozen[name]
            t = full[id(p)] if full is not None else torch.empty(shape, dtype=p.dtype,
                                                                 device="meta")
        out[name] = t
    return out


def frozen_full(opt) -> dict[int, torch.Tensor]:
    """{id(parameter): full value} of the frozen parameters stage 3 shards: all-gathers,
    call it on every rank ({} at stages 0-2)."""
    gather = getattr(opt.sync, "full_frozen", None)
    return gather() if gather is not None else {}


def frozen_pieces(model: nn.Module, opt) -> dict[str, tuple]:
    """Stage 3's sharded frozen parameters by state-dict name: (parameter, [a, b) of its
    flattened full value that this rank's piece holds, full shape)."""
    by_id = {}
    for unit in getattr(opt.sync, "units", None) or []:
        if unit.frozen is None:
            continue
        group = unit.frozen.group
        lo, hi = group.shard_range(group.rank)
        for i, p in enumerate(group.params):
            start = group.offsets[i]
            a = min(max(lo - start, 0), group.numels[i])
            b = max(min(hi - start, group.numels[i]), a)
            by_id[id(p)] = (p, a, b, tuple(group.shapes[i]))
    return {name: by_id[id(t)] for name, t in model.state_dict(keep_vars=True).items()
            if id(t) in by_id}


def aliases(model: nn.Module, opt) -> dict[str, str]:
    """State-dict names that are a trainable parameter under another name (a tied weight)."""
    name_of = {id(p): name for name, p in trainable(opt).items()}
    return {name: name_of[id(t)] for name, t in model.state_dict(keep_vars=True).items()
            if id(t) in name_of and name_of[id(t)] != name}


def logical_shapes(model: nn.Module, opt) -> dict[str, list[int]]:
    """Each trainable parameter's shape as the model was written (stage 3 keeps 1-D pieces
    at rest; its groups remember the full shapes)."""
    return {name: list(shape) for group in opt.sync.groups
            for name, shape in zip(group.names, group.shapes, strict=True)}
