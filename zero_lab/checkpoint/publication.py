"""Publishing a checkpoint: at every instant the published name reaches a complete one.

The name a learner saves to, `runs/ckpt`, is a folder: its step directories, and the file
`latest` naming the one that is the checkpoint (pointer.py). Replacing a checkpoint is
replacing `latest`, and rename(2) replaces a file in one atomic step, so no reader ever sees a
half-published checkpoint:

    1. the ranks write their shards into `runs/.ckpt.partial-<token>`, each forcing its file
       to disk (fsync); rank 0 writes the manifest last, fsyncs it, then the directory (its
       entries are data too: without it a power loss can lose a file's name)
    2. rename it into the folder, `runs/ckpt/step3-<token>`; fsync the folder and its parent
    3. write `runs/ckpt/.latest-<token>` naming `step3-<token>`; fsync it
    4. rename it over `runs/ckpt/latest`; fsync the folder              <- published, durably
    5. remove the previous step directory, unless a reader holds it (in_use.py)

The partial directory is beside the folder, not in it, so a save killed before it publishes
its first checkpoint leaves no folder, and a copy of the folder never carries a half-written
save. The first save to a name builds the folder beside it (`runs/.ckpt.new-<token>`: the step
directory, `latest`), then renames it to the name at step 4, so the name appears complete. A
name that holds a checkpoint of the previous layout (a link to a step directory beside it, or
a checkpoint directory copied on its own) is replaced the same way: the new folder is exchanged
with it atomically where the OS can (Linux renameat2 RENAME_EXCHANGE); elsewhere the old one
is moved aside first, the one case with an instant where the name reaches nothing.

A process killed between any two steps leaves the name reaching the previous checkpoint
(before 4) or the new one (from 4 on): tests/test_checkpoint_real_world.py kills one at each.
What a killed save leaves (a partial directory, a folder being built, a step directory that
`latest` does not name, a `.latest-` file) is removed by the next save to the name, before it
writes anything, so retries on a full disk do not pile up copies. That save holds the name's
lock (locking.py): no other live job is saving to the name, so all it removes is dead saves'
leftovers and step directories that no reader holds any more.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable
from pathlib import Path

from zero_lab.checkpoint import in_use, pointer

STEPS = ("step directory in place", "latest written", "latest replaced", "previous removed")
INSIDE = re.compile(rf"\.{pointer.LATEST}-[0-9a-f]+|{pointer.STEP.pattern}")


def fsync_file(path: Path, flags: int = 0) -> None:
    """Force a file's bytes to disk."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Force a directory's entries (the names in it) to disk."""
    fsync_file(path, getattr(os, "O_DIRECTORY", 0))


def hidden(directory: Path, kind: str, token: str) -> Path:
    """`.NAME.<kind>-<token>` beside `directory`: partial, new (a folder being built); the
    previous layout's step<N>, link, old."""
    return directory.parent / f".{directory.name}.{kind}-{token}"


def _ours(directory: Path) -> re.Pattern:
    """What a save to `directory` may leave beside it."""
    return re.compile(rf"\.{re.escape(directory.name)}\.(partial|new|link|old|step\d*)-[0-9a-f]+")


def is_folder(directory: Path) -> bool:
    """Is `directory` a checkpoint's folder (it has `latest`), or an empty directory made to
    become one? Then a save publishes into it; anything else under the name is replaced."""
    return directory.is_dir() and ((directory / pointer.LATEST).is_file() or (
        not directory.is_symlink() and not any(directory.iterdir())))


def _link_target(directory: Path) -> Path | None:
    """The step directory beside it that a name of the previous layout links to."""
    if not directory.is_symlink():
        return None
    target = directory.parent / os.readlink(directory)
    return target if _ours(directory).fullmatch(target.name) else None


def leftovers(directory: Path) -> list[Path]:
    """What killed or failed saves left: beside `directory`, every hidden entry of its saves
    but the step directory a link under the name reaches; in its folder, every step
    directory that `latest` does not name, and `.latest-` files."""
    found = []
    if directory.parent.is_dir():
        keep, pattern = _link_target(directory), _ours(directory)
        found += [p for p in directory.parent.iterdir() if pattern.fullmatch(p.name)
                  and p != keep]
    if is_folder(directory):
        keep = pointer.current(directory)
        found += [p for p in directory.iterdir() if INSIDE.fullmatch(p.name) and p != keep]
    return sorted(found)


def clean_leftovers(directory: Path) -> list[Path]:
    """Remove what killed saves left around `directory`, but step directories that readers
    still hold; return what was removed. Call it holding the name's lock (locking.py):
    without it, another job's save in progress looks like leftovers too."""
    return [path for path in leftovers(directory) if in_use.remove_unless_read(path)]


def publish(partial: Path, directory: Path, step: int | None, token: str,
            on_step: Callable[[str], None] | None = None) -> Path:
    """Steps 2-5 above: make the complete, fsynced `partial` the checkpoint under `directory`.
    `on_step(name)` is called after each step of STEPS (tests kill the process there).
    Returns the step directory."""
    done = on_step or (lambda name: None)
    if is_folder(directory):
        folder, previous = directory, pointer.current(directory)
    else:  # a first save, or the previous layout: a new folder, put in place at step 4
        folder, previous = hidden(directory, "new", token), None
        folder.mkdir()
    step_dir = folder / pointer.step_name(step, token)
    partial.rename(step_dir)
    fsync_dir(folder)
    fsync_dir(directory.parent)
    done(STEPS[0])
    written = folder / f".{pointer.LATEST}-{token}"
    written.write_text(step_dir.name + "\n")
    fsync_file(written)
    done(STEPS[1])
    os.replace(written, folder / pointer.LATEST)  # atomic: the old `latest` or the new
    fsync_dir(folder)
    if folder != directory:
        _put_in_place(folder, directory, token)
        fsync_dir(directory.parent)
    done(STEPS[2])
    if previous is not None and previous != step_dir:
        in_use.remove_unless_read(previous)
    done(STEPS[3])
    return directory / step_dir.name


def _put_in_place(folder: Path, directory: Path, token: str) -> None:
    """The new `folder` (built beside) under the name `directory`; what the name held before
    (the previous layout's link or checkpoint directory) removed, unless a reader holds it."""
    if not directory.exists() and not directory.is_symlink():
        folder.rename(directory)  # a first save: the name appears, complete
        return
    linked = _link_target(directory)
    if _exchange(folder, directory):
        old = folder  # the exchange left what the name held where the folder was
    else:
        old = hidden(directory, "old", token)
        directory.rename(old)  # the one instant without a checkpoint under the name
        folder.rename(directory)
    in_use.remove_unless_read(old)
    if linked is not None:
        in_use.remove_unless_read(linked)


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
