"""load(): a checkpoint into a sharded model at any stage and world size.

Every check runs and every tensor is read into new memory first; only then are the model's
parameters, the optimizer's states and settings and the buffers overwritten. So a load that
fails (a missing or corrupted shard, another model's checkpoint) changes nothing.

What each rank reads is what its new layout holds: stages 0-2 keep every parameter whole
(and, in mixed precision, fp32 masters of their slice), stage 3 its slice of each unit; the
optimizer states of every piece it steps. Pieces are addressed by parameter and element
range, so any saved layout serves any new one (N -> M, stage -> stage).
"""

from __future__ import annotations

from pathlib import Path

import torch

from zero_lab.checkpoint import layout
from zero_lab.checkpoint.manifest import (
    CheckpointError,
    check_same_model,
    read_manifest,
    verify_files,
)
from zero_lab.checkpoint.reader import Reader


def _filled(reader: Reader, group, base: int, like: torch.Tensor) -> torch.Tensor:
    """A new tensor shaped like `like` (holding the group's flat elements [base, ...)), with
    the checkpoint's values; padding stays zero."""
    new = torch.zeros(like.numel(), dtype=torch.float32)
    for span in layout.spans_of(group, base, new):
        span.tensor.copy_(reader.read("value", span.name, span.start, span.numel))
    return new.to(like.dtype).view_as(like)


def _param_homes(opt) -> list[tuple[torch.Tensor, int]]:
    """Per group, the tensor the model's parameters live in on this rank, and the flat offset
    of its first element: the whole flat buffer (stages 0-2), the unit's slice (stage 3)."""
    if opt.sync.stage == 3:
        return [(unit.local, layout.group_base(opt, g)) for g, unit in enumerate(opt.sync.units)]
    return [(group.flat, 0) for group in opt.sync.groups]


def load(model, optimizer, directory: Path | str) -> dict:
    """Load `directory` into `model` (sharded by `shard()`, any stage) and its optimizer;
    call it on every rank. Returns the manifest (its "step", "stage", "world_size", ...)."""
    opt = layout.sharded_optimizer(model, optimizer)
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    others = layout.others(model, opt)
    check_same_model(directory, manifest, layout.logical_shapes(model, opt),
                     {name: list(t.shape) for name, t in others.items()})
    saved_class = manifest["optimizer"]["class"]
    ours = f"{type(opt.optim).__module__}.{type(opt.optim).__qualname__}"
    if saved_class != ours:
        raise CheckpointError(f"{directory}: saved with optimizer {saved_class}, loading into "
                              f"{ours}")
    saved_groups = manifest["optimizer"]["param_groups"]
    if len(saved_groups) != len(opt.optim.param_groups):
        raise CheckpointError(f"{directory}: saved with {len(saved_groups)} optimizer parameter "
                              f"group(s), the optimizer has {len(opt.optim.param_groups)}")
    reader = Reader(directory, manifest)

    # 1. Read everything into new tensors.
    homes = [_filled(reader, group, base, home)
             for group, (home, base) in zip(opt.sync.groups, _param_homes(opt), strict=True)]
    masters = None
    if opt.master_weights is not None:
        masters = [_filled(reader, group, layout.group_base(opt, g), opt.targets[g])
                   for g, group in enumerate(opt.sync.groups)]
    states = []
    for pc, view in zip(opt.pieces, opt.views, strict=True):
        group = opt.sync.groups[pc.group]
        name = group.names[pc.param]
        start = layout.group_base(opt, pc.group) + pc.start - group.offsets[pc.param]
        states.append({key: (reader.scalar(key, name) if reader.is_scalar(key, name)
                             else reader.read("state", name, start, pc.numel, key).view_as(view))
                       for key in reader.states_of(name)})
    buffers = {name: reader.other(name) for name in others}

    # 2. Nothing failed: overwrite.
    with torch.no_grad():
        for (home, _), new in zip(_param_homes(opt), homes, strict=True):
            home.copy_(new)
        if masters is not None:
            for target, new in zip(opt.targets, masters, strict=True):
                target.copy_(new)
        for view, state in zip(opt.views, states, strict=True):
            opt.optim.state.pop(view, None)
            if state:
                opt.optim.state[view] = state
        for group, saved in zip(opt.optim.param_groups, saved_groups, strict=True):
            for key, value in saved.items():
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        for name, t in others.items():
            t.copy_(buffers[name])
    return manifest
