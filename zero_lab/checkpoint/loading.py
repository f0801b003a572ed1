"""load(): a checkpoint into a sharded model at any stage and world size.

In three phases, the ranks agreeing after each (agreement.py), so that they go on or refuse
together and a load that fails on any rank changes nothing on any rank:

    1. which checkpoint: rank 0 resolves the published name once (a save may replace it
       meanwhile, publication.py), every rank given the same name reads the step directory
       rank 0 found, and each holds it until its reads are done, so no save removes it
       (in_use.py). Every rank compares the SHA-256 of the manifest it read: ranks that name
       different checkpoints (a per-rank path) refuse. Rank 0 checks the manifest's own
       checksum; the others read the very same bytes.
    2. every check, and every tensor this rank needs read into new memory: its files verified
       (size, SHA-256) as it opens them, only those (reader.py).
    3. nothing failed anywhere: the extras' states, then the model's parameters, the
       optimizer's states and settings and the buffers are overwritten.

What each rank reads is what its new layout holds: stages 0-2 keep every parameter whole
(and, in mixed precision, fp32 masters of their slice), stage 3 its slice of each unit; the
optimizer states of every piece it steps. Pieces are addressed by parameter and element
range, so any saved layout serves any new one (N -> M, stage -> stage). The optimizer's groups
take the settings of the saved groups that held their parameters (groups.py).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

from zero_lab.checkpoint import in_use, layout
from zero_lab.checkpoint.agreement import failure, gather, refuse_together
from zero_lab.checkpoint.extras import check_extras, file_to_read, load_file
from zero_lab.checkpoint.groups import local_names, match_groups, merged
from zero_lab.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    check_same_model,
    read_manifest_bytes,
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


def load(model, optimizer, directory: Path | str, extras: dict | None = None) -> dict:
    """Load `directory` into `model` (sharded by `shard()`, any stage) and its optimizer, and
    the states of `extras` ({name: Stateful}, as given to save); call it on every rank.
    `optimizer=None` loads the weights only (the parameters, fp32 masters in mixed precision,
    buffers), e.g. to evaluate; the optimizer is left as it is. Returns the manifest."""
    weights_only = optimizer is None
    opt = layout.sharded_optimizer(model, optimizer, weights_only=weights_only)
    rank, world = dist.get_rank(), dist.get_world_size()

    with ExitStack() as holding:  # the step directory read, held until the reads are done
        # 1. Which checkpoint: every rank must have read the same manifest.
        directory, problem = _held_step(holding, Path(directory), rank)
        manifest, identity = {}, None
        try:
            stateful = check_extras(extras)
            if problem is None:
                manifest, identity = read_manifest_bytes(directory, check_checksum=rank == 0)
        except Exception as exc:  # noqa: BLE001 - told to every rank, raised on every rank
            problem = failure(exc)
        everyone = gather({"problem": problem, "identity": identity, "where": str(directory),
                           "step": manifest.get("step"), "groups": local_names(opt)})
        refuse_together([e["problem"] for e in everyone])
        for r, e in enumerate(everyone):
            if e["identity"] != everyone[0]["identity"]:
                raise CheckpointError(
                    f"the ranks name different checkpoints: rank 0 loads "
                    f"{everyone[0]['where']} (step {everyone[0]['step']}), rank {r} "
                    f"{e['where']} (step {e['step']}). Every rank must load the same "
                    "checkpoint (a per-rank path, or a 'latest' read at different times, "
                    "mixes two); every rank refused")

        # 2. Every check and every read, into new memory.
        problem = None
        try:
            new = _read(model, opt, directory, manifest, weights_only, stateful,
                        merged([e["groups"] for e in everyone]), rank, world)
        except Exception as exc:  # noqa: BLE001
            problem = failure(exc)
        refuse_together(gather(problem))

    # 3. Nothing failed on any rank: overwrite.
    problem = None
    try:
        for name, obj in stateful.items():
            obj.load_state_dict(new["extras"][name])
    except Exception as exc:  # noqa: BLE001
        problem = f"extras: {failure(exc)}"
    refuse_together(gather(problem))
    _overwrite(opt, new)
    return manifest


def _held_step(holding: ExitStack, name: Path, rank: int) -> tuple[Path, str | None]:
    """The step directory this rank reads, held until `holding` closes (in_use.py), and the
    problem met if any. Rank 0 resolves `name`; a rank given the same name reads the step
    directory rank 0 found: each resolving it on its own, a save publishing between two
    ranks' looks would make them name two checkpoints. Every rank calls it (one all-gather)."""
    found, problem = name, None
    if rank == 0:
        try:
            found = holding.enter_context(in_use.reading(name))
        except Exception as exc:  # noqa: BLE001 - told to every rank in load's next gather
            problem = failure(exc)
    zeros_name, zeros_step = gather((str(name.absolute()), str(found.absolute())))[0]
    if rank != 0:
        same = zeros_name == str(name.absolute())
        try:  # rank 0 holds its step directory: no save can remove it before this rank's lock
            found = holding.enter_context(in_use.reading(Path(zeros_step) if same else name))
        except Exception as exc:  # noqa: BLE001
            problem = failure(exc)
    return found, problem


def _read(model, opt, directory: Path, manifest: dict, weights_only: bool, stateful: dict,
          groups: list[list[str]], rank: int, world: int) -> dict:
    """Everything load() will write, read and checked; nothing in the model changed."""
    others = layout.others(model, opt)
    check_same_model(directory, manifest, layout.logical_shapes(model, opt),
                     {name: list(t.shape) for name, t in others.items()})
    matches = None
    if not weights_only:
        saved_class = manifest["optimizer"]["class"]
        ours = f"{type(opt.optim).__module__}.{type(opt.optim).__qualname__}"
        if saved_class != ours:
            raise CheckpointError(f"{directory}: saved with optimizer {saved_class}, loading "
                                  f"into {ours}")
        matches = match_groups(str(directory / MANIFEST), manifest, groups)
    reader = Reader(directory, manifest)
    new: dict = {"others": {name: reader.other(name) for name in others}, "buffers": others,
                 "frozen": layout.frozen_pieces(model, opt),
                 "matches": matches,
                 "reader": reader, "homes": [], "masters": None, "states": None, "extras": {}}
    new["homes"] = [_filled(reader, group, base, home) for group, (home, base)
                    in zip(opt.sync.groups, _param_homes(opt), strict=True)]
    if opt.master_weights is not None:
        new["masters"] = [_filled(reader, group, layout.group_base(opt, g), opt.targets[g])
                          for g, group in enumerate(opt.sync.groups)]
    if not weights_only:
        new["states"] = []
        for pc, view in zip(opt.pieces, opt.views, strict=True):
            group = opt.sync.groups[pc.group]
            name = group.names[pc.param]
            start = layout.group_base(opt, pc.group) + pc.start - group.offsets[pc.param]
            new["states"].append({
                key: (reader.scalar(key, name, near=start) if reader.is_scalar(key, name)
                      else reader.read("state", name, start, pc.numel, key).view_as(view))
                for key in reader.states_of(name)})
    if stateful:
        file = file_to_read(directory, manifest, sorted(stateful), rank, world)
        verify_files(directory, manifest, [file])
        reader.verified.append(file)
        new["extras"] = load_file(directory / file)
    new["settings"] = manifest["optimizer"]["param_groups"]
    return new


def _overwrite(opt, new: dict) -> None:
    with torch.no_grad():
        for (home, _), values in zip(_param_homes(opt), new["homes"], strict=True):
            home.copy_(values)
        if new["masters"] is not None:
            for target, values in zip(opt.targets, new["masters"], strict=True):
                target.copy_(values)
        if new["states"] is not None:
            for view, state in zip(opt.views, new["states"], strict=True):
                opt.optim.state.pop(view, None)
                if state:
                    opt.optim.state[view] = state
            for group, j in zip(opt.optim.param_groups, new["matches"], strict=True):
                if j is None:
                    continue
                for key, value in new["settings"][j].items():
                    group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        for name, t in new["buffers"].items():
            if name in new["frozen"]:  # stage 3 shards it: this rank's piece
                p, a, b, _ = new["frozen"][name]
                p.data.copy_(new["others"][name].reshape(-1)[a:b])
            else:
                t.copy_(new["others"][name])
