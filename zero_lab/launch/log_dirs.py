"""A launch's log folder: made in the temp dir, recorded as its launching process's, and
removed by a later launch once that process is gone.

torchrun() removes the folder of a launch that succeeded or was interrupted, and keeps the
folder of a failed one, whose error names its files. A process killed during a launch (a
notebook kernel restarted, or killed by Jupyter after its grace period) runs no clean-up, so
its folder stayed in the temp dir, one more each time. Each folder therefore records which
process made it (`OWNER`), and every launch first removes, with `sweep()`, the folders whose
process is gone: those of killed kernels, and the failed launches' of kernels since closed.
A live process keeps all of its folders, whatever the launch that made them.

A process is known by its pid, the time it started (a pid is given again to a new process
once the old one has died) and its pid namespace (a container sharing this temp dir numbers
its processes in a namespace of its own: its pids say nothing here). The last two are read
from Linux's /proc; elsewhere a folder goes once no process has its pid, and a pid given
again keeps a dead kernel's folder until that process ends too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "zero_lab-"
OWNER = ".launched_by.json"  # in each folder: {"pid", "started", "pid_namespace"}


def new(stem: str) -> Path:
    """A new log folder for a launch of `stem`, recorded as this process's."""
    folder = None
    try:
        folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{stem}-"))
        # Until this record exists the folder is no one's, and sweep() leaves it alone.
        owner = {"pid": os.getpid(), "started": started(os.getpid()),
                 "pid_namespace": pid_namespace()}
        (folder / OWNER).write_text(json.dumps(owner))
    except OSError as exc:
        if folder is not None:  # made, but no one's: nothing would ever remove it
            shutil.rmtree(folder, ignore_errors=True)
        raise OSError(exc.errno, (
            f"cannot make the launch's log folder in {tempfile.gettempdir()}: "
            f"{(exc.strerror or str(exc)).lower()}. Free space there, or point TMPDIR at a "
            f"folder with space that you can write.")) from None
    return folder


def sweep() -> list[Path]:
    """Remove the launch folders in the temp dir whose launching process is gone; return them.

    Only this user's folders that record their process are looked at: a folder made before
    folders recorded one, or someone else's, is left where it is."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(tempfile.gettempdir()) as entries:
        for entry in entries:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                if not (entry.name.startswith(PREFIX) and entry.is_dir(follow_symlinks=False)
                        and entry.stat(follow_symlinks=False).st_uid == os.getuid()):
                    continue
                owner = json.loads((Path(entry.path) / OWNER).read_text())
                if _gone(owner):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(Path(entry.path))
    return removed


def _gone(owner: dict) -> bool:
    """Whether the process `owner` records has ended (False when that cannot be told)."""
    if owner["pid_namespace"] != pid_namespace():
        return False  # another namespace's pid: not one of the processes seen here
    pid = int(owner["pid"])
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, only whether the pid exists is checked
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's process has the pid: ours may still be it, unknown
    # The pid exists: still our process, unless a new process was given it since.
    return owner["started"] is not None and started(pid) != owner["started"]


def started(pid: int) -> str | None:
    """When process `pid` started, in clock ticks since boot (Linux: /proc/PID/stat, field
    22); None where it cannot be read (another system, a process that has gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # after the command name, which may hold spaces and ends with ")": fields 3, 4...
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_namespace() -> str | None:
    """This process's pid namespace, e.g. 'pid:[4026531836]' (Linux); None elsewhere."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
