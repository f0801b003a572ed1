"""A step directory a reader has resolved stays until the reader is done with it.

A save publishes its checkpoint, then removes the previous step directory (publication.py).
A load that resolved the name a moment earlier may still be reading that directory: removed
under it, the load failed ("shard file missing": 27 of 150 loads in a probe, issue 47). So a
reader holds a shared lock on the step directory it reads (flock(2) on the directory itself),
and removing a step directory takes the exclusive lock *without waiting*: while a reader holds
it, the directory stays, and a later save removes it (to that save it is a leftover). A save
never waits for a load, and a load waits at most for a removal already under way:

    reader                                  a save that has just published step4
    resolve the name: step3
    open step3, take the shared lock
                                            remove step3? its exclusive lock is refused:
    reads step3 to the end                  step3 stays
    closes it, and the lock goes            (the next save removes step3)

The reader's lock can come too late: between its look at the name and its lock, a save may
publish and remove step3. The reader then finds step3 gone (it cannot open it, or step3 was
removed while the reader waited for the lock) and resolves the name again: it now reaches the
newer step directory. flock locks are advisory: they bind processes that take them, as every
reader and save of zero_lab does.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from zero_lab.checkpoint import manifest, pointer


@contextmanager
def reading(name: Path | str) -> Iterator[Path]:
    """Inside the `with`: the step directory `name` reaches (pointer.resolve), kept in place
    until the `with` ends. A name that reaches nothing is yielded as it is: reading its
    manifest then says what is wrong."""
    step = pointer.resolve(name)
    fd = _open_locked(step, fcntl.LOCK_SH)
    while fd is None:
        again = pointer.resolve(name)
        if again == step:  # not removed by a save that moved the name on: simply missing
            break
        step, fd = again, _open_locked(again, fcntl.LOCK_SH)
    try:
        yield step
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def read_manifest(name: Path | str, check_checksum: bool = True) -> dict:
    """The manifest of the checkpoint `name` reaches (a checkpoint's folder or a step
    directory), checked as manifest.read_manifest checks it."""
    with reading(name) as step:
        return manifest.read_manifest(step, check_checksum)


def remove_unless_read(path: Path) -> bool:
    """Remove a step directory (or a leftover file or link) unless a reader holds it; True
    if it is gone. Never waits: a held directory is left for a later save to remove."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return True
    try:
        fd = _open_locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a reader holds it
    if fd is None:
        return True  # already gone
    try:
        shutil.rmtree(path, ignore_errors=True)  # holding the lock: no reader starts on it
    finally:
        os.close(fd)
    return True


def _open_locked(directory: Path, how: int) -> int | None:
    """An open descriptor of `directory` holding the lock `how`; None if the directory is not
    there, or was removed while this waited for the lock."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        _lock(fd, how)
        if not os.path.samestat(os.fstat(fd), os.stat(directory)):
            raise FileNotFoundError  # removed, and the name reused: not ours any more
    except FileNotFoundError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock(fd: int, how: int) -> None:
    """flock(fd, how); on a filesystem that has no locks (some network or FUSE ones) nothing:
    readers and saves then go on unprotected, as before there were locks, rather than fail."""
    try:
        fcntl.flock(fd, how)
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
