"""Reading pieces back: any element range of any parameter, from whichever shards hold it.

Shards are safetensors files, opened for each read and read by slice (`get_slice`), so
reading one range costs that range, not the file; no file stays mapped between reads, so
what a reader holds is only what it returned.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from zero_lab.checkpoint.manifest import CheckpointError


class Reader:
    def __init__(self, directory: Path | str, manifest: dict) -> None:
        self.directory = Path(directory)
        self.manifest = manifest
        self._pieces: dict[tuple, list[dict]] = defaultdict(list)
        for piece in manifest["pieces"]:
            self._pieces[piece["kind"], piece.get("state"), piece["name"]].append(piece)
        for pieces in self._pieces.values():
            pieces.sort(key=lambda p: p["start"])

    def _get(self, piece: dict, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """A piece's tensor, or its elements [lo, hi), read from its shard file."""
        with safe_open(str(self.directory / piece["file"]), framework="pt") as f:
            if lo is None:
                return f.get_tensor(piece["key"])
            return f.get_slice(piece["key"])[lo:hi]

    def states_of(self, name: str) -> list[str]:
        """The optimizer states saved for parameter `name` (none if it was never stepped)."""
        return sorted({p["state"] for p in self.manifest["pieces"]
                       if p["kind"] == "state" and p["name"] == name})

    def read(self, kind: str, name: str, start: int, numel: int,
             state: str | None = None) -> torch.Tensor:
        """Elements [start, start + numel) of parameter `name`'s values (kind "value") or of
        its optimizer state `state` (kind "state"), as one 1-D tensor."""
        out, covered = None, 0
        for piece in self._pieces.get((kind, state, name), []):
            lo, hi = max(start, piece["start"]), min(start + numel, piece["start"] + piece["numel"])
            if lo >= hi:
                continue
            part = self._get(piece, lo - piece["start"], hi - piece["start"])
            if out is None:
                out = torch.empty(numel, dtype=part.dtype)
            out[lo - start:hi - start] = part
            covered += hi - lo
        if covered != numel:
            what = f"state {state!r} of" if state else "values of"
            raise CheckpointError(f"{self.directory}: elements [{start}, {start + numel}) of the "
                                  f"{what} {name!r} are in no shard ({covered} of {numel} found)")
        return out if out is not None else torch.empty(0)

    def scalar(self, state: str, name: str) -> torch.Tensor:
        """A 0-d optimizer state of `name` (Adam's step), as saved with any of its pieces."""
        for piece in self._pieces.get(("state", state, name), []):
            if piece["numel"] == 0:
                return self._get(piece)
        raise CheckpointError(f"{self.directory}: no 0-d state {state!r} for {name!r}")

    def is_scalar(self, state: str, name: str) -> bool:
        return any(p["numel"] == 0 for p in self._pieces.get(("state", state, name), []))

    def other(self, name: str) -> torch.Tensor:
        """A buffer or frozen parameter, whole."""
        pieces = self._pieces.get(("other", None, name))
        if not pieces:
            raise CheckpointError(f"{self.directory}: buffer {name!r} is in no shard")
        return self._get(pieces[0])
