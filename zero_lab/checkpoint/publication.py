"""Publishing a checkpoint: at every instant the published name reaches a complete one.

The name a learner saves to, `runs/ckpt`, is a symbolic link to a *step directory* beside it,
`.ckpt.step3-<token>`, which holds the shards and the manifest. Replacing a checkpoint is
replacing that link, and rename(2) replaces a link in one atomic step. So the name is a
`latest` pointer that every reader follows without knowing it (`ckpt/manifest.json` opens,
`ls ckpt/` lists), and no reader ever sees a half-published checkpoint:

    1. the ranks write their shards into `.ckpt.partial-<token>`, each forcing its file to
       disk (fsync); rank 0 writes the manifest last, fsyncs it, then the directory (its
       entries are data too: without it a power loss can lose a file's name)
    2. rename `.ckpt.partial-<token>` -> `.ckpt.step3-<token>`; fsync the parent
    3. a new link `.ckpt.link-<token>` -> `.ckpt.step3-<token>`
    4. rename the link over `ckpt`; fsync the parent          <- published, durably
    5. remove the previous step directory

A process killed between any two steps leaves `ckpt` reaching the previous checkpoint
(before 4) or the new one (from 4 on): tests/test_checkpoint_real_world.py kills one at each.
What a killed save leaves (a partial directory, an unpublished step directory, a link, an
old step directory) is removed by the next save to the name, before it writes anything, so
retries on a full disk do not pile up copies. That save holds the name's lock (locking.py):
no other live job is saving to the name, so all it removes is dead saves' leftovers.

Why a link and not a `latest` file naming the step: the name stays a checkpoint directory
(everything that opens `ckpt/...` works, `consolidate("ckpt")` included), and a reader that
resolves the link once (`load` does) reads one step directory to the end even if a save
replaces the link meanwhile. A name that holds a real directory (a checkpoint written by an
older zero_lab, or copied with `cp -r`) is exchanged with the link atomically where the OS
can (Linux renameat2 RENAME_EXCHANGE); elsewhere it is moved aside first, the one case with
an instant where the name reaches nothing.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

STEPS = ("step directory in place", "link written", "link swapped", "previous removed")


def fsync_file(path: Path) -> None:
    """Force a file's bytes to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Force a directory's entries (the names in it) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hidden(directory: Path, kind: str, token: str) -> Path:
    """`.NAME.<kind>-<token>` beside `directory`: partial, step<N>, link."""
    return directory.parent / f".{directory.name}.{kind}-{token}"


def _ours(directory: Path) -> re.Pattern:
    """What a save to `directory` may leave beside it (`old`: older zero_lab's)."""
    return re.compile(rf"\.{re.escape(directory.name)}\.(partial|link|old|step\d*)-[0-9a-f]+")


def current_target(directory: Path) -> Path | None:
    """The step directory the published link reaches (None: no link of ours)."""
    if not directory.is_symlink():
        return None
    target = directory.parent / os.readlink(directory)
    return target if _ours(directory).fullmatch(target.name) else None


def resolve(directory: Path | str) -> Path:
    """The step directory a published name reaches, read once: a reader that goes on from it
    reads one checkpoint to the end, even if a save replaces the name meanwhile."""
    directory = Path(directory)
    return directory.parent / os.readlink(directory) if directory.is_symlink() else directory


def leftovers(directory: Path) -> list[Path]:
    """What killed or failed saves left beside `directory`: every hidden entry of ours but
    the step directory the name reaches."""
    if not directory.parent.is_dir():
        return []
    keep = current_target(directory)
    pattern = _ours(directory)
    return sorted(p for p in directory.parent.iterdir()
                  if pattern.fullmatch(p.name) and p != keep)


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def clean_leftovers(directory: Path) -> list[Path]:
    """Remove what killed saves left beside `directory`; return what was removed. Call it
    holding the name's lock (locking.py): without it, another job's save in progress looks
    like leftovers too."""
    found = leftovers(directory)
    for path in found:
        remove(path)
    return found


def publish(partial: Path, directory: Path, step: int | None, token: str,
            on_step: Callable[[str], None] | None = None) -> Path:
    """Steps 2-5 above: make the complete, fsynced `partial` the checkpoint under `directory`.
    `on_step(name)` is called after each step of STEPS (tests kill the process there).
    Returns the step directory."""
    done = on_step or (lambda name: None)
    parent = directory.parent
    previous = current_target(directory)
    step_dir = hidden(directory, f"step{'' if step is None else step}", token)
    partial.rename(step_dir)
    fsync_dir(parent)
    done(STEPS[0])
    link = hidden(directory, "link", token)
    os.symlink(step_dir.name, link)  # relative: the pair can be moved or mounted elsewhere
    done(STEPS[1])
    if directory.is_dir() and not directory.is_symlink():
        _replace_directory(link, directory)
    else:
        os.replace(link, directory)  # atomic: the old link or the new, never neither
    fsync_dir(parent)
    done(STEPS[2])
    if previous is not None and previous != step_dir:
        remove(previous)
    done(STEPS[3])
    return step_dir


def _replace_directory(link: Path, directory: Path) -> None:
    """Put `link` where the real directory `directory` is, then remove that directory."""
    if _exchange(link, directory):
        remove(link)  # now the old directory
        return
    aside = hidden(directory, "old", link.name.rsplit("-", 1)[-1])
    directory.rename(aside)  # the one instant without a checkpoint under the name
    os.replace(link, directory)
    remove(aside)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two names atomically (Linux renameat2 RENAME_EXCHANGE); False where unavailable."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        return False
    return True
