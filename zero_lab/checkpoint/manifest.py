"""The manifest of a checkpoint, and the checks every reader runs before it trusts one.

Each check raises `CheckpointError` naming the file and what is wrong: a directory that is
not a checkpoint, a manifest that cannot be read or is of another format, a shard file that
is missing, truncated or corrupted (its size and SHA-256 are in the manifest), a checkpoint
of a different model (parameter names, shapes), or pieces that do not cover a parameter.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT = "zero_lab checkpoint 1"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the file and the problem."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, manifest: dict) -> None:
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()


def read_manifest(directory: Path | str) -> dict:
    """The manifest of `directory`, after checking it is one of ours."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a zero_lab checkpoint (no {MANIFEST}; an "
                              "interrupted save leaves only a hidden .partial directory)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT!r} manifest")
    return manifest


def verify_files(directory: Path | str, manifest: dict, files: list[str] | None = None) -> None:
    """Every shard file (or those named) exists with the size and SHA-256 the manifest says."""
    directory = Path(directory)
    for name in files if files is not None else sorted(manifest["files"]):
        expected = manifest["files"][name]
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: shard file missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{path}: truncated or overwritten: {size:,} bytes, the "
                                  f"manifest says {expected['bytes']:,}")
        if sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: corrupted: its SHA-256 differs from the manifest's "
                                  "(a changed or swapped shard)")


def check_same_model(directory: Path | str, manifest: dict, shapes: dict[str, list[int]],
                     others: dict[str, list[int]]) -> None:
    """The checkpoint's parameters and buffers are the model's: same names, same shapes."""
    where = Path(directory) / MANIFEST
    for kind, saved, ours in (("parameter", manifest["parameters"], shapes),
                              ("buffer or frozen parameter", manifest["others"], others)):
        missing = sorted(set(ours) - set(saved))
        extra = sorted(set(saved) - set(ours))
        if missing or extra:
            raise CheckpointError(
                f"{where}: a checkpoint of a different model: "
                + (f"the model's {kind}(s) {missing[:5]} are not in it" if missing else "")
                + ("; " if missing and extra else "")
                + (f"its {kind}(s) {extra[:5]} are not in the model" if extra else ""))
        for name, shape in ours.items():
            if list(saved[name]["shape"]) != list(shape):
                raise CheckpointError(
                    f"{where}: a checkpoint of a different model: {kind} {name!r} has shape "
                    f"{tuple(saved[name]['shape'])} in it and {tuple(shape)} in the model")
