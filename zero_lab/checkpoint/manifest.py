"""The manifest of a checkpoint, and the checks every reader runs before it trusts one.

Each check raises `CheckpointError` naming the file and what is wrong: a directory that is
not a checkpoint, a manifest that cannot be read, is of another format, was edited by hand
(it carries a SHA-256 of its own content, `checksum`), or lacks an entry; a piece that names
a file the manifest does not list, a parameter it does not describe, or elements another
piece already holds; a shard file that is missing, truncated or corrupted (its size and
SHA-256 are in the manifest); a checkpoint of a different model (parameter names, shapes).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

FORMAT = "zero_lab checkpoint 2"  # 2: the manifest checksums itself; extras; step directories
MANIFEST = "manifest.json"
KINDS = ("value", "state", "other")
# Entry -> the type it must have: a manifest that lacks one is refused by name, not KeyError.
ENTRIES = {"format": str, "stage": int, "world_size": int, "parameters": dict, "others": dict,
           "aliases": dict, "layout": list, "optimizer": dict, "files": dict, "pieces": list,
           "extras": dict, "checksum": str}
PIECE_ENTRIES = {"file": str, "key": str, "kind": str, "name": str, "start": int, "numel": int}


class CheckpointError(ValueError):
    """A checkpoint cannot be used, or cannot be saved; the message names the file or the
    argument and the problem."""


def sha256(path: Path) -> str:
    """SHA-256 of a file, read in blocks into one reused buffer (nothing the size of the file
    is ever held)."""
    digest, buffer = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def content_checksum(manifest: dict) -> str:
    """SHA-256 of everything in the manifest but its own `checksum` entry, in a canonical
    spelling (sorted keys, no spaces), so that re-indenting does not change it and any edit
    of a value does."""
    content = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def seal(manifest: dict) -> dict:
    """The manifest with its `checksum` entry (what `write_manifest` writes)."""
    return {**manifest, "checksum": content_checksum(manifest)}


def write_manifest(directory: Path, manifest: dict) -> None:
    """Write the sealed manifest and force it to disk (fsync) before anyone publishes it."""
    with open(directory / MANIFEST, "w") as f:
        json.dump(seal(manifest), f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path | str, check_checksum: bool = True) -> dict:
    """The manifest of `directory`, after checking it is one of ours, complete and, with
    `check_checksum`, not edited since it was written."""
    manifest, _ = read_manifest_bytes(directory, check_checksum)
    return manifest


def read_manifest_bytes(directory: Path | str, check_checksum: bool = True
                        ) -> tuple[dict, str]:
    """(manifest, SHA-256 of its bytes as read): the second is the checkpoint's identity,
    which every rank of a load compares (loading.py)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a zero_lab checkpoint (no {MANIFEST}; an "
                              "interrupted save leaves only a hidden .partial directory)")
    try:
        raw = path.read_bytes()
        manifest = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{path}: not a {FORMAT!r} manifest (format {found!r}"
                              + ("; written by an older zero_lab: save it again)"
                                 if found == "zero_lab checkpoint 1" else ")"))
    check_entries(path, manifest)
    if check_checksum and manifest["checksum"] != content_checksum(manifest):
        raise CheckpointError(f"{path}: edited since it was written (its content does not "
                              "match its checksum): refused, a hand-edited manifest can "
                              "exchange parameters or change settings silently")
    check_pieces(path, manifest)
    return manifest, hashlib.sha256(raw).hexdigest()


def check_entries(path: Path, manifest: dict) -> None:
    """Every entry the readers use is there, of the right type."""
    for key, kind in ENTRIES.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"{path}: entry {key!r} is "
                                  + ("missing" if key not in manifest else
                                     f"a {type(manifest[key]).__name__}, not a {kind.__name__}"))
    if "step" not in manifest or not (manifest["step"] is None
                                      or type(manifest["step"]) is int):
        raise CheckpointError(f"{path}: entry 'step' is missing or not an int (or null)")
    optimizer = manifest["optimizer"]
    if not isinstance(optimizer.get("class"), str) or not isinstance(
            optimizer.get("param_groups"), list):
        raise CheckpointError(f"{path}: entry 'optimizer' lacks 'class' or 'param_groups'")
    for name, meta in manifest["files"].items():
        if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int)
                and isinstance(meta.get("sha256"), str)):
            raise CheckpointError(f"{path}: files[{name!r}] lacks 'bytes' or 'sha256'")
    for i, piece in enumerate(manifest["pieces"]):
        for key, kind in PIECE_ENTRIES.items():
            if not isinstance(piece, dict) or not isinstance(piece.get(key), kind):
                raise CheckpointError(f"{path}: pieces[{i}] lacks {key!r} (a {kind.__name__})")


def check_pieces(path: Path, manifest: dict) -> None:
    """Every piece names a listed file and a described parameter, lies inside it, and no two
    pieces hold the same elements (a duplicated piece would be read twice)."""
    spans: dict[tuple, list[tuple[int, int]]] = {}
    for piece in manifest["pieces"]:
        kind, name = piece["kind"], piece["name"]
        where = f"{path}: the piece {piece['key']!r} of {piece['file']!r}"
        if piece["file"] not in manifest["files"]:
            raise CheckpointError(f"{where} names a file that 'files' does not list (so its "
                                  "checksum could not be verified)")
        if kind not in KINDS:
            raise CheckpointError(f"{where} is of kind {kind!r}, not one of {KINDS}")
        described = manifest["others" if kind == "other" else "parameters"]
        if name not in described:
            raise CheckpointError(f"{where} belongs to {name!r}, which the manifest does "
                                  "not describe")
        start, numel = piece["start"], piece["numel"]
        total = (described[name].get("numel") if kind != "other" else None)
        if start < 0 or numel < 0 or (total is not None and start + numel > total):
            raise CheckpointError(f"{where} holds elements [{start}, {start + numel}) of a "
                                  f"parameter of {total}")
        if numel:
            spans.setdefault((kind, piece.get("state"), name), []).append((start, numel))
    for (_, state, name), found in spans.items():
        found.sort()
        for (a, n), (b, _) in zip(found, found[1:], strict=False):
            if a + n > b:
                what = f"state {state!r}" if state else "values"
                raise CheckpointError(f"{path}: two pieces hold elements {b}.. of the {what} "
                                      f"of {name!r} (a duplicated or overlapping piece)")


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
    """The checkpoint's parameters and buffers are the model's: same names, same shapes; a
    parameter trained when saved and frozen now (or the reverse) is named as such."""
    where = Path(directory) / MANIFEST
    for name in sorted(set(manifest["parameters"]) & set(others)):
        raise CheckpointError(f"{where}: {name!r} was trained when this was saved and is frozen "
                              "(requires_grad=False) in the model: freeze it after load(), "
                              "or load with it trainable")
    for name in sorted(set(manifest["others"]) & set(shapes)):
        raise CheckpointError(f"{where}: {name!r} was frozen (or a buffer) when this was saved "
                              "and is trainable in the model: unfreeze it after load(), or "
                              "load with it frozen")
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
