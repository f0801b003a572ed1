"""Full tensors from a sharded checkpoint, without a process group.

`iter_consolidated` assembles one tensor at a time from the pieces in the shards (read by
slice), so the memory it needs beyond what the caller keeps is about the largest tensor;
`consolidate` collects them into a state dict for `model.load_state_dict`, or for FSDP2's
`torch.distributed.checkpoint.state_dict.set_model_state_dict`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from zero_lab.checkpoint import in_use
from zero_lab.checkpoint.manifest import read_manifest, verify_files
from zero_lab.checkpoint.reader import Reader


def iter_consolidated(directory: Path | str, optimizer: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter (fp32; a tied weight under each of its names),
    buffer and frozen parameter; with `optimizer`, also ("optimizer.<state>.<name>", tensor)
    for every optimizer state (element-wise ones in the parameter's shape). It keeps no
    reference to a tensor once yielded: what the caller drops is freed before the next one is
    read, so the peak is about the largest tensor (read in place, reader.py)."""
    # One step directory, read to the end even if a save replaces the name meanwhile: held
    # until the generator is done (or closed), so no save removes it (in_use.py).
    with in_use.reading(directory) as step:
        yield from _tensors(step, optimizer)


def _tensors(directory: Path, optimizer: bool) -> Iterator[tuple[str, torch.Tensor]]:
    manifest = read_manifest(directory)
    verify_files(directory, manifest)  # it reads every file: verify them all up front
    reader = Reader(directory, manifest, verify=False)
    for name, meta in manifest["parameters"].items():
        full = reader.read("value", name, 0, meta["numel"]).view(meta["shape"])
        yield name, full
        for alias, target in manifest["aliases"].items():
            if target == name:
                yield alias, full
        del full
        if optimizer:
            for key in reader.states_of(name):
                if reader.is_scalar(key, name):
                    yield f"optimizer.{key}.{name}", reader.scalar(key, name)
                else:
                    yield (f"optimizer.{key}.{name}",
                           reader.read("state", name, 0, meta["numel"], key).view(meta["shape"]))
    for name in manifest["others"]:
        yield name, reader.other(name)


def consolidate(directory: Path | str, optimizer: bool = False) -> dict[str, torch.Tensor]:
    """{name: full tensor} of the checkpoint in `directory` (see `iter_consolidated`): what
    `full_state_dict(model)` returned when it was saved, loadable into the plain model."""
    return dict(iter_consolidated(directory, optimizer))
