"""One save to a name at a time: two jobs saving to one name would remove each other's files.

Every save first removes what killed saves left beside its name (publication.py), partial
directories among them. Two jobs saving to `runs/ckpt` at once (two notebook kernels, `make
test` beside JupyterLab) would each take the other's half-written partial directory for such
a leftover and remove it, and both saves would fail. So rank 0 of a save holds a lock file
beside the name for the whole save, hidden like everything else a save puts there:

    runs/.ckpt.lock   {"pid": 4242, "host": "node1", "started": "2025-06-01T10:00:00.123+02:00",
                       "job": "python train.py", "token": "5f0c2a9e1b7d"}

It is created with O_CREAT | O_EXCL, which exactly one process can do, and removed when the
save ends, well or not. A job that finds it refuses at once with `CheckpointBusy`, naming the
job that holds it: waiting would leave a cell hanging with no word of why. And a save that
holds the lock knows that no other live job is saving to its name, so every partial directory
beside the name is a dead save's: removing leftovers never touches a live job's files.

A save killed part-way (SIGKILL, a crash, a restarted kernel) leaves its lock behind. The lock
is *stale* when it was taken on this host and no process has its pid any more: the next save
takes it over. A lock of another host cannot be checked from here, so it is refused like a live
one, and the message names the file to remove once that job is gone.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import torch.distributed as dist

from zero_lab.checkpoint.agreement import failure, gather
from zero_lab.checkpoint.manifest import CheckpointError


class CheckpointBusy(RuntimeError):
    """Another job is saving to the same checkpoint name; the message names it (pid, host, when
    it started, its command) and the lock file."""


def lock_path(directory: Path) -> Path:
    """`.NAME.lock` beside `directory`."""
    return directory.parent / f".{directory.name}.lock"


@contextmanager
def held(directory: Path) -> Iterator[None]:
    """Inside the `with`, rank 0 holds the lock of `directory`; released however it ends.
    One lock per save, so rank 0 alone takes it, and tells the other ranks: if another job
    holds it, every rank raises the same CheckpointBusy (a rank going on alone would wait for
    ever in a collective the others never reach)."""
    mine, refusal = None, None
    if dist.get_rank() == 0:
        try:
            mine = acquire(directory)
        except CheckpointBusy as exc:
            refusal = ("busy", str(exc))
        except Exception as exc:  # noqa: BLE001 - a read-only folder, say: every rank refuses
            refusal = ("error", f"{lock_path(directory)}: cannot take the lock ({failure(exc)})")
    refusal = gather(refusal)[0]
    if refusal is not None:
        kind, message = refusal
        if dist.get_world_size() > 1:
            message += " (found by rank 0; every rank refused)"
        raise (CheckpointBusy if kind == "busy" else CheckpointError)(message)
    try:
        yield
    finally:
        if mine is not None:
            release(directory, mine)


def acquire(directory: Path) -> dict:
    """Take the lock of `directory` for this process, or raise CheckpointBusy naming the job
    that holds it. Returns what it wrote in the lock (`release` checks it is still that)."""
    path = lock_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.now().astimezone().isoformat(timespec="milliseconds"),
            "job": shlex.join([Path(sys.executable).name, *sys.argv])[:200],
            "token": uuid.uuid4().hex[:12]}  # two saves of one process (threads) differ by it
    while True:  # each turn takes the lock, refuses, or removes a stale lock and tries again
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None and not path.exists():
                continue  # released between our two looks: try again
            if not _stale(holder):
                raise CheckpointBusy(_busy(directory, path, holder)) from None
            _take_over(path, holder)  # its save was killed part-way: a stale lock, ours now
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        return mine


def release(directory: Path, mine: dict) -> None:
    """Remove the lock, if it is still `mine` (not removed by hand, then taken by another job:
    that one is theirs)."""
    path = lock_path(directory)
    if _read(path) == mine:
        path.unlink(missing_ok=True)


def _read(path: Path) -> dict | None:
    """What a lock holds; None if it cannot be read (gone, being written this instant, or
    damaged)."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _stale(holder: dict | None) -> bool:
    """Is the job that took this lock gone? Only this host's processes can be looked up: a
    lock of another host, or one that cannot be read, is never stale. (A pid that a new
    process has reused looks alive: refused, and the message says what to remove.)"""
    if holder is None or holder.get("host") != socket.gethostname() or os.name != "posix":
        return False  # (on Windows, os.kill would end the process, not look it up)
    pid = holder.get("pid")
    if type(pid) is not int or pid <= 0:  # 0 and below name process groups
        return False
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, another user's
        pass
    return False


def _take_over(path: Path, stale: dict) -> None:
    """Remove the stale lock, and only it. It is moved aside first (rename is atomic): of two
    jobs taking over one stale lock, one moves it, and the other moves nothing or the lock
    the first has just taken, which it sees is not the stale one and puts back."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # another job took it over first
    if _read(aside) == stale:
        aside.unlink()
    else:
        os.rename(aside, path)  # another job's live lock: put back


def _busy(directory: Path, path: Path, holder: dict | None) -> str:
    who = ("its lock cannot be read (being written this instant, or damaged)" if holder is None
           else f"pid {holder.get('pid')} on host {holder.get('host')}, since "
                f"{holder.get('started')}, running `{holder.get('job')}`")
    return (f"{directory}: another job is saving to this checkpoint name: {who}. Two saves to "
            "one name would remove each other's files: wait for that save to end, or save "
            "under another name. If that job is gone (killed on another host, or its pid now "
            f"another process's), remove its lock, {path}")
