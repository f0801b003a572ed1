"""save(): every rank writes what it holds; the checkpoint appears only when complete.

The ranks write into a hidden directory beside the target (`.<name>.partial-<token>`); rank 0
writes the manifest last, once every shard is written and hashed, then renames the directory
into place (a previous checkpoint there is moved aside first and deleted after). A save that
dies part-way leaves only the hidden directory: nothing that looks like a checkpoint, and an
existing checkpoint under the same name untouched.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from zero_lab.checkpoint import layout
from zero_lab.checkpoint.manifest import FORMAT, MANIFEST, CheckpointError, sha256, write_manifest


def _jsonable(key: str, value):
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.item()
    if isinstance(value, (tuple, list)):
        return [_jsonable(key, v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"optimizer setting {key!r} is a {type(value).__name__}; only "
                          "numbers, strings, booleans and lists of them can be saved")


def _check_target(directory: Path) -> str | None:
    """Why `directory` must not be replaced (None if it may)."""
    if directory.exists() and not directory.is_dir():
        return f"{directory} exists and is not a directory"
    if directory.is_dir() and any(directory.iterdir()) and not (directory / MANIFEST).exists():
        return (f"{directory} exists and is not a checkpoint (no {MANIFEST}); refusing to "
                "overwrite it")
    return None


def save(model, optimizer, directory: Path | str, step: int | None = None) -> Path:
    """Save `model` (sharded by `shard()`) and its optimizer into `directory`; call it on
    every rank. `step` is recorded in the manifest. Returns the directory."""
    opt = layout.sharded_optimizer(model, optimizer)
    directory = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    decided = [uuid.uuid4().hex[:12], _check_target(directory)] if rank == 0 else [None, None]
    dist.broadcast_object_list(decided, src=0)  # one token, one verdict for every rank
    token, refusal = decided
    if refusal:
        raise CheckpointError(refusal)
    partial = directory.parent / f".{directory.name}.partial-{token}"
    if rank == 0:
        partial.mkdir(parents=True)
    dist.barrier()

    tensors, pieces, groups = {}, [], {}
    group_of = {id(t): k for k, pg in enumerate(opt.optim.param_groups) for t in pg["params"]}
    file = f"rank{rank}.safetensors"

    def keep(kind: str, span: layout.Span, state: str | None = None) -> None:
        key = f"{kind}/{state + '/' if state else ''}{span.name}/{span.start}"
        value = span.tensor.detach()
        tensors[key] = (value.float() if kind == "value" else value).clone().contiguous()
        pieces.append({"file": file, "key": key, "kind": kind, "state": state,
                       "name": span.name, "start": span.start, "numel": span.numel})

    for span in layout.value_spans(opt, rank):
        keep("value", span)
    for state, span in layout.state_spans(opt, rank):
        keep("state", span, state)
    for pc, view in zip(opt.pieces, opt.views, strict=True):
        if id(view) in group_of:
            groups[opt.sync.groups[pc.group].names[pc.param]] = group_of[id(view)]
    if rank == 0:
        for name, t in layout.others(model, opt).items():
            keep("other", layout.Span(name, 0, t.numel(), t))
    save_file(tensors, str(partial / file))
    mine = {"file": file, "bytes": (partial / file).stat().st_size,
            "sha256": sha256(partial / file), "pieces": pieces, "groups": groups}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)

    if rank == 0:
        params = layout.trainable(opt)
        shapes = layout.logical_shapes(model, opt)
        param_groups = {k: v for r in everyone for k, v in r["groups"].items()}
        manifest = {
            "format": FORMAT, "stage": opt.sync.stage, "world_size": world, "step": step,
            "parameters": {name: {"shape": shapes[name],
                                  "numel": int(torch.Size(shapes[name]).numel()),
                                  "dtype": str(p.dtype).removeprefix("torch."),
                                  "param_group": param_groups.get(name)}
                           for name, p in params.items()},
            "others": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                       for name, t in layout.others(model, opt).items()},
            "aliases": layout.aliases(model, opt),
            "layout": [{"label": g.label, "params": g.names, "numel": g.numel,
                        "padded_numel": g.padded_numel, "shard_numel": g.shard_numel}
                       for g in opt.sync.groups],
            "optimizer": {"class": f"{type(opt.optim).__module__}.{type(opt.optim).__qualname__}",
                          "param_groups": [{k: _jsonable(k, v) for k, v in pg.items()
                                            if k != "params"} for pg in opt.optim.param_groups]},
            "files": {r["file"]: {"bytes": r["bytes"], "sha256": r["sha256"]} for r in everyone},
            "pieces": [p for r in everyone for p in r["pieces"]],
        }
        write_manifest(partial, manifest)
        old = directory.parent / f".{directory.name}.old-{token}"
        if directory.exists():
            directory.rename(old)
        partial.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return directory
