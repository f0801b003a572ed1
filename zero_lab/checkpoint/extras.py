"""Training state beyond the model and the optimizer, carried by save() and load().

A resume needs more than weights and Adam's moments: the learning-rate scheduler's position
(rebuilt fresh, it starts the warm-up again), the random generators (dropout masks, shuffling)
and the data position (which batch comes next). As in torch.distributed.checkpoint, anything
with `state_dict()` and `load_state_dict()` (a "Stateful") can be given by name:

    extras = {"scheduler": scheduler, "rng": RNGState(), "data": sampler}
    checkpoint.save(model, opt, "runs/ckpt", step=step, extras=extras)
    checkpoint.load(model, opt, "runs/ckpt", extras=extras)

Each rank saves its own states in its own file (`extras-rank<r>.pt`), because some differ per
rank (RNG seeded per rank, a data position in a per-rank shard of the data). The manifest
records for each name whether every rank saved the same; that one can be loaded at another
world size, a per-rank one only at the world size it was saved at (refused otherwise, named).
States are written with torch.save and read with `torch.load(weights_only=True)`: tensors,
numbers, strings and containers of them, never arbitrary pickled code.
"""

from __future__ import annotations

import hashlib
import io
import random
from typing import Protocol, runtime_checkable

import torch

from zero_lab.checkpoint.manifest import CheckpointError


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


class RNGState:
    """The random generators of this process as a Stateful: torch's CPU generator (dropout,
    torch.randperm), CUDA's when CUDA is in use, and Python's `random`."""

    def state_dict(self) -> dict:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}

    def load_state_dict(self, state_dict: dict) -> None:
        torch.set_rng_state(state_dict["torch"])
        if state_dict["cuda"]:
            torch.cuda.set_rng_state_all(state_dict["cuda"])
        version, internal, gauss = state_dict["python"]
        random.setstate((version, tuple(internal), gauss))


def file_of(rank: int) -> str:
    return f"extras-rank{rank}.pt"


def check_extras(extras: object) -> dict[str, Stateful]:
    """`extras` is None or {name: Stateful}; anything else is refused naming the entry."""
    if extras is None:
        return {}
    if not isinstance(extras, dict):
        raise CheckpointError(f"extras must be a dict {{name: object with state_dict and "
                              f"load_state_dict}}, got {type(extras).__name__}")
    for name, obj in extras.items():
        if not isinstance(name, str):
            raise CheckpointError(f"extras: the name {name!r} is not a string")
        if not isinstance(obj, Stateful):
            raise CheckpointError(f"extras[{name!r}] is a {type(obj).__name__}, which has no "
                                  "state_dict() and load_state_dict(): wrap it in an object "
                                  "that has")
    return dict(extras)


def encode(name: str, state: object) -> bytes:
    """torch.save bytes of one extra's state, checked to load back with weights_only=True
    (so a state that could not be loaded is refused at save, before anything is written)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reason it cannot be read back is named
        raise CheckpointError(f"extras[{name!r}].state_dict() holds something torch.load("
                              f"weights_only=True) cannot read back: {str(exc)[:300]}") from None
    return data


def states(extras: dict[str, Stateful]) -> tuple[dict[str, object], dict[str, str]]:
    """({name: state_dict()}, {name: SHA-256 of its bytes}) for this rank."""
    found, digests = {}, {}
    for name, obj in extras.items():
        found[name] = obj.state_dict()
        digests[name] = hashlib.sha256(encode(name, found[name])).hexdigest()
    return found, digests


def file_to_read(path, manifest: dict, names: list[str], rank: int, world: int) -> str:
    """The file this rank of `world` reads the extras `names` from (refused, named, where a
    per-rank state would have to go to another world size)."""
    saved = manifest["extras"]
    missing = [n for n in names if n not in saved]
    if missing:
        raise CheckpointError(f"{path}: no extras {missing} in this checkpoint (it holds "
                              f"{sorted(saved)})")
    if world == manifest["world_size"]:
        file = file_of(rank)
    else:
        per_rank = [n for n in names if not saved[n]["same_on_every_rank"]]
        if per_rank:
            raise CheckpointError(
                f"{path}: extras {per_rank} differed between the {manifest['world_size']} ranks "
                f"that saved them, so they cannot be given to {world} ranks (load them at "
                f"world size {manifest['world_size']}, or leave them out)")
        file = file_of(0)
    return file


def load_file(path) -> dict:
    """{name: state} saved in one rank's extras file (already verified by checksum)."""
    return torch.load(path, weights_only=True)
