"""save(): every rank writes what it holds; the checkpoint is published only when complete.

In three phases, each ending in one small all-gather so that the ranks go on or refuse
together (agreement.py):

    1. check: `step`, the extras, the optimizer's settings, the target; every rank names the
       same path and step. Nothing is written before this passes, so bad input leaves nothing.
       Then rank 0 takes the name's lock for the rest of the save (locking.py), or every rank
       refuses: another job is saving to the same name.
    2. write: each rank writes its shard (and its extras) into a hidden partial directory and
       forces it to disk.
    3. publish (rank 0): the manifest last, fsynced with the directory, then the name's
       `latest` is pointed at the new step directory in one atomic rename (publication.py).
"""

from __future__ import annotations

import operator
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from zero_lab.checkpoint import layout, locking, pointer, publication
from zero_lab.checkpoint.agreement import check_same, failure, gather, refuse_together
from zero_lab.checkpoint.extras import check_extras, file_of, states
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


def check_step(step: object) -> int | None:
    """`step` as the plain int the JSON manifest holds (or None): anything that is an integer
    to Python (`operator.index`: an int, a numpy integer, an integer tensor of one element),
    not negative. A bool is refused (True is no step number), and so is a float, even 3.0."""
    if step is None:
        return None
    is_bool = isinstance(step, bool) or (isinstance(step, torch.Tensor)
                                         and step.dtype == torch.bool)
    try:
        value = None if is_bool else operator.index(step)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise CheckpointError(f"step must be a non-negative int or None, got "
                              f"{type(step).__module__}.{type(step).__qualname__} {step!r}")
    return value


def _check_target(directory: Path) -> None:
    """Refuse a target that is not ours to replace: a checkpoint's folder, an empty directory,
    or a checkpoint of the previous layout (a link to a step directory, a copied one) are."""
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory} exists and is not a directory")
    if (directory.is_dir() and not publication.is_folder(directory)
            and not (directory / MANIFEST).exists()):
        raise CheckpointError(f"{directory} exists and is not a checkpoint (no "
                              f"{pointer.LATEST} nor {MANIFEST}); refusing to overwrite it")


def _settings(opt) -> list[dict]:
    return [{k: _jsonable(k, v) for k, v in pg.items() if k != "params"}
            for pg in opt.optim.param_groups]


def _write(path: Path, write) -> dict:
    """Write a file with `write(path)`, force it to disk; its size and SHA-256."""
    write(path)
    publication.fsync_file(path)
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def save(model, optimizer, directory: Path | str, step: int | None = None,
         extras: dict | None = None) -> Path:
    """Save `model` (sharded by `shard()`), its optimizer and the `extras` ({name: anything
    with state_dict/load_state_dict}, see extras.py) under `directory`; call it on every
    rank. `step` is recorded in the manifest. Returns the directory."""
    opt = layout.sharded_optimizer(model, optimizer)
    directory = Path(directory)
    rank = dist.get_rank()

    # 1. Check everything, agree on one checkpoint; nothing is written before this.
    problem, settings, extra_states, digests = None, [], {}, {}
    try:
        step = check_step(step)  # numpy.int64(3) -> 3: the manifest is JSON
        stateful = check_extras(extras)
        settings = _settings(opt)
        extra_states, digests = states(stateful)
        if rank == 0:
            _check_target(directory)
    except Exception as exc:  # noqa: BLE001 - told to every rank, raised on every rank
        problem = failure(exc)
    everyone = gather({"problem": problem, "token": uuid.uuid4().hex[:12], "digests": digests,
                       "names": (str(directory.absolute()), repr(step), sorted(digests))})
    refuse_together([e["problem"] for e in everyone])
    check_same("saves to (path, step, extras)", [e["names"] for e in everyone])
    # The name's lock, held by rank 0 to the end of the save (locking.py): another job saving
    # to this name is refused on every rank, before anything is written or removed; and what
    # lies beside the name while we hold it is dead saves' leftovers, never a live job's.
    with locking.held(directory):
        token = everyone[0]["token"]
        partial = publication.hidden(directory, "partial", token)
        problem = None
        if rank == 0:
            try:
                publication.clean_leftovers(directory)
                partial.mkdir(parents=True)
            except OSError as exc:
                problem = f"{partial}: cannot create the checkpoint directory ({exc})"
            except Exception as exc:  # noqa: BLE001 - a hand-edited `latest`: every rank refuses
                problem = failure(exc)
        refuse_together(gather(problem))

        # 2. Each rank writes what it holds, and forces it to disk.
        tensors, pieces, groups = {}, [], {}
        group_of = {id(t): k for k, pg in enumerate(opt.optim.param_groups) for t in pg["params"]}
        full_frozen = layout.frozen_full(opt)  # stage 3's frozen pieces, whole (every rank)
        file = f"rank{rank}.safetensors"

        def keep(kind: str, span: layout.Span, state: str | None = None) -> None:
            key = f"{kind}/{state + '/' if state else ''}{span.name}/{span.start}"
            value = span.tensor.detach()
            tensors[key] = (value.float() if kind == "value" else value).clone().contiguous()
            pieces.append({"file": file, "key": key, "kind": kind, "state": state,
                           "name": span.name, "start": span.start, "numel": span.numel})

        mine: dict = {"problem": None, "files": {}, "digests": digests}
        try:
            for span in layout.value_spans(opt, rank):
                keep("value", span)
            for state, span in layout.state_spans(opt, rank):
                keep("state", span, state)
            for pc, view in zip(opt.pieces, opt.views, strict=True):
                if id(view) in group_of:
                    groups[opt.sync.groups[pc.group].names[pc.param]] = group_of[id(view)]
            if rank == 0:
                for name, t in layout.others(model, opt, full_frozen).items():
                    keep("other", layout.Span(name, 0, t.numel(), t))
            mine["files"][file] = _write(partial / file, lambda p: save_file(tensors, str(p)))
            tensors.clear()  # the copies, freed before the extras and the manifest
            if extra_states:
                mine["files"][file_of(rank)] = _write(
                    partial / file_of(rank), lambda p: torch.save(extra_states, p))
            mine.update(pieces=pieces, groups=groups)
        except Exception as exc:  # noqa: BLE001 - a full disk on one rank stops every rank
            mine["problem"] = failure(exc)
        everyone = gather(mine)
        refuse_together([e["problem"] for e in everyone])

        # 3. Rank 0: the manifest, last, then publication.
        problem = None
        if rank == 0:
            try:
                _publish(model, opt, directory, partial, token, step, settings, everyone)
            except Exception as exc:  # noqa: BLE001
                problem = failure(exc)
        refuse_together(gather(problem))
    return directory


def _publish(model, opt, directory: Path, partial: Path, token: str, step: int | None,
             settings: list[dict], everyone: list[dict]) -> None:
    params = layout.trainable(opt)
    shapes = layout.logical_shapes(model, opt)
    param_groups = {k: v for r in everyone for k, v in r["groups"].items()}
    digests = [r["digests"] for r in everyone]
    manifest = {
        "format": FORMAT, "id": token, "stage": opt.sync.stage, "world_size": len(everyone),
        "step": step,
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
                      "param_groups": settings},
        "extras": {name: {"same_on_every_rank": all(d[name] == digests[0][name]
                                                    for d in digests)}
                   for name in digests[0]},
        "files": {name: meta for r in everyone for name, meta in r["files"].items()},
        "pieces": [p for r in everyone for p in r["pieces"]],
    }
    write_manifest(partial, manifest)
    publication.fsync_dir(partial)
    publication.publish(partial, directory, step, token)
