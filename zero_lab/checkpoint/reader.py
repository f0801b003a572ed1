"""Reading pieces back: any element range of any parameter, from whichever shards hold it.

Shards are safetensors files: 8 bytes giving the header's length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes. A range of a tensor is read with
`readinto` straight into the tensor that will hold it, so reading costs that range and
nothing else (no memory map whose touched pages would add a second copy to the resident
memory). A file is verified (size, SHA-256) the first time this reader opens it, so a rank
hashes only the files it reads.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from pathlib import Path

import torch

from zero_lab.checkpoint.manifest import CheckpointError, verify_files

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_header(path: Path) -> tuple[dict, int]:
    """(safetensors header {key: {"dtype", "shape", "data_offsets"}}, offset of the data)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


class Reader:
    def __init__(self, directory: Path | str, manifest: dict, verify: bool = True) -> None:
        self.directory = Path(directory)
        self.manifest = manifest
        self.verify = verify
        self.verified: list[str] = []  # the files this reader hashed, in order
        self._headers: dict[str, tuple[dict, int]] = {}
        self._pieces: dict[tuple, list[dict]] = defaultdict(list)
        for piece in manifest["pieces"]:
            self._pieces[piece["kind"], piece.get("state"), piece["name"]].append(piece)
        for pieces in self._pieces.values():
            pieces.sort(key=lambda p: p["start"])

    def _entry(self, piece: dict) -> tuple[Path, dict, int]:
        """(file, its header entry for the piece, data offset), the file verified once."""
        file = piece["file"]
        if file not in self._headers:
            if self.verify:
                verify_files(self.directory, self.manifest, [file])
                self.verified.append(file)
            self._headers[file] = read_header(self.directory / file)
        header, data = self._headers[file]
        if piece["key"] not in header:
            raise CheckpointError(f"{self.directory / file}: holds no tensor {piece['key']!r}")
        return self.directory / file, header[piece["key"]], data

    def _read_into(self, piece: dict, lo: int, out: torch.Tensor) -> None:
        """Elements [lo, lo + out.numel()) of the piece's (flattened) tensor, into `out`."""
        path, entry, data = self._entry(piece)
        dtype = DTYPES[entry["dtype"]]
        if dtype != out.dtype:
            staged = torch.empty(out.numel(), dtype=dtype)
            self._read_into(piece, lo, staged)
            out.copy_(staged)
            return
        begin = data + entry["data_offsets"][0] + lo * out.element_size()
        target = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(path, "rb", buffering=0) as f:
            f.seek(begin)
            if f.readinto(target) != len(target):
                raise CheckpointError(f"{path}: ends inside tensor {piece['key']!r}")

    def _dtype(self, piece: dict) -> torch.dtype:
        return DTYPES[self._entry(piece)[1]["dtype"]]

    def states_of(self, name: str) -> list[str]:
        """The optimizer states saved for parameter `name` (none if it was never stepped)."""
        return sorted({state for kind, state, n in self._pieces
                       if kind == "state" and n == name})

    def read(self, kind: str, name: str, start: int, numel: int,
             state: str | None = None) -> torch.Tensor:
        """Elements [start, start + numel) of parameter `name`'s values (kind "value") or of
        its optimizer state `state` (kind "state"), as one 1-D tensor."""
        out, covered = None, 0
        for piece in self._pieces.get((kind, state, name), []):
            lo, hi = max(start, piece["start"]), min(start + numel, piece["start"] + piece["numel"])
            if lo >= hi:
                continue
            if out is None:
                out = torch.empty(numel, dtype=self._dtype(piece))
            self._read_into(piece, lo - piece["start"], out[lo - start:hi - start])
            covered += hi - lo
        if covered != numel:
            what = f"state {state!r} of" if state else "values of"
            raise CheckpointError(f"{self.directory}: elements [{start}, {start + numel}) of the "
                                  f"{what} {name!r} are in no shard ({covered} of {numel} found)")
        return out if out is not None else torch.empty(0)

    def scalar(self, state: str, name: str, near: int = 0) -> torch.Tensor:
        """A 0-d optimizer state of `name` (Adam's step), as saved with its pieces: the one
        saved with the piece that starts at or before element `near` (the range being read;
        at the same layout that is this rank's own file)."""
        saved = [p for p in self._pieces.get(("state", state, name), []) if p["numel"] == 0]
        if not saved:
            raise CheckpointError(f"{self.directory}: no 0-d state {state!r} for {name!r}")
        piece = max((p for p in saved if p["start"] <= near), key=lambda p: p["start"],
                    default=saved[0])
        path, entry, _ = self._entry(piece)
        out = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
        self._read_into(piece, 0, out)
        return out

    def is_scalar(self, state: str, name: str) -> bool:
        return any(p["numel"] == 0 for p in self._pieces.get(("state", state, name), []))

    def other(self, name: str) -> torch.Tensor:
        """A buffer or frozen parameter, whole."""
        pieces = self._pieces.get(("other", None, name))
        if not pieces:
            raise CheckpointError(f"{self.directory}: buffer {name!r} is in no shard")
        _, entry, _ = self._entry(pieces[0])
        out = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
        self._read_into(pieces[0], 0, out)
        return out
