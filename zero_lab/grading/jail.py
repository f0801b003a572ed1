"""Each grading child in a bubblewrap sandbox: what the learner's code can see, write, start
and reach is decided by the kernel, not by checks in Python the learner's code could undo.

`bwrap` (bubblewrap, the sandbox Flatpak uses; Debian's package `bubblewrap`) gives the child:

- a filesystem of its own: the system's /usr and /etc, Python and the virtual environment,
  and the course package, all read-only; its scratch folder, the only place it can write; a
  private /tmp and /dev/shm. The rest of the machine is absent: the grader's output folder,
  the submissions, the repository's other folders, /run, /home (so no Unix socket outside);
- its own PID namespace, ended with it (`--die-with-parent`: when the grader ends, however,
  every process the exercise started ends too; a setsid() or a double fork escapes nothing);
- its own network namespace: loopback only, which the ranks meet on (the grader counts the
  bytes sent there: wire.py); abstract Unix sockets are per network namespace, so none
  outside is reachable either;
- no capabilities, no new privileges; run by root, the child drops to a user id of its own
  (`uid`), so RLIMIT_NPROC counts its processes and threads alone (root's are never
  counted); run by anyone else, bwrap's user namespace does the same.
- where this process may create cgroups (v1's memory and pids controllers, or v2's with
  both delegated), a cgroup of its own caps the exercise's total memory and task count.

Without bwrap, or where it cannot make namespaces, `available()` says why and the grader
refuses to run unless told `--unsafe-no-sandbox` (batch.py).
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from zero_lab.launch.paths import PACKAGE

UNSAFE_FLAG = "--unsafe-no-sandbox"
TASKS = 512  # processes and threads: 3 torch ranks, torchrun's agent and the child
MEMORY_BYTES = 6 * 2**30  # all of one exercise's processes together (a cgroup's limit)
# The user ids children run as when the grader is root: a range no account uses, one id a
# child, so the process-count limit counts that child's tasks alone.
FIRST_UID, UID_SPAN = 2_000_000_000, 100_000_000
SYSTEM_DIRS = ("/usr", "/etc", "/sys")


def _python_dirs() -> list[Path]:
    """The folders Python runs from: the interpreter's installation and the environment."""
    found = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                         sys.base_exec_prefix)}
    found.add(Path(os.path.realpath(sys.executable)).parents[1])
    return sorted(p for p in found if not any(p.is_relative_to(d) for d in SYSTEM_DIRS))


def command(scratch: Path, uid: int | None) -> list[str]:
    """The bwrap prefix that runs a command in `scratch`'s sandbox."""
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--cap-drop", "ALL"]
    if uid is None:  # not root: a user namespace of its own instead of a user id
        args.append("--unshare-user")
    else:  # the child drops to `uid` itself (sandbox.py), before any learner code
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    # The private /tmp first: the package or Python may live under the host's /tmp (a copy
    # of the course, a test), and a later bind shows it on top of the private one.
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp",
             "--perms", "1777", "--tmpfs", "/dev/shm"]
    for top in SYSTEM_DIRS:
        args += ["--ro-bind-try", top, top]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    made: set[Path] = set()

    def parents(folder: Path) -> list[str]:  # bwrap would make them 0700: the child's user
        out = []                             # id could not pass through to the folder
        for parent in reversed(folder.parents[:-1]):
            if parent not in made and not any(parent.is_relative_to(d) for d in SYSTEM_DIRS):
                out += ["--perms", "0755", "--dir", str(parent)]
                made.add(parent)
        return out

    for folder in [*_python_dirs(), PACKAGE]:
        args += [*parents(folder), "--ro-bind", str(folder), str(folder)]
    # The scratch folder's parents too: TMPDIR may put it below /tmp (or outside it).
    args += [*parents(scratch), "--bind", str(scratch), str(scratch), "--chdir", str(scratch),
             "--"]
    return args


def child_uid() -> int | None:
    """A user id for one child when this process is root (None otherwise)."""
    return FIRST_UID + secrets.randbelow(UID_SPAN) if os.geteuid() == 0 else None


def own(scratch: Path, uid: int | None) -> None:
    """Give the scratch folder to the child's user id; bwrap, root without capabilities,
    must still enter it (x for others)."""
    if uid is not None:
        os.chown(scratch, uid, uid)
        os.chmod(scratch, 0o711)


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """(True, "") where a sandbox can be made here, else (False, why not). Tried once, on
    the command the children run, with a loopback the ranks could meet on."""
    if sys.platform != "linux":
        return False, f"bubblewrap needs Linux, this is {sys.platform}"
    if shutil.which("bwrap") is None:
        return False, "bwrap (Debian's bubblewrap) is not installed"
    with tempfile.TemporaryDirectory(prefix="zero_lab_jail_") as tmp:
        uid = child_uid()
        own(Path(tmp), uid)
        drop = (f"os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); "
                f"os.setresuid({uid}, {uid}, {uid}); " if uid is not None else "")
        probe = (f"import os, socket; {drop}s = socket.socket(); s.bind(('127.0.0.1', 0)); "
                 "s.listen(); open('probe', 'w').write('ok')")
        try:
            done = subprocess.run([*command(Path(tmp), uid), sys.executable, "-c", probe],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"bwrap could not run ({exc})"
        if done.returncode != 0 or not (Path(tmp) / "probe").exists():
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            return False, f"bwrap could not make a sandbox here ({last})"
    return True, ""


# ----------------------------------------------------------------------------- cgroups


def _own_cgroups() -> list[Path]:
    """Where a cgroup with memory and pids limits can be made for a child: v1's controllers'
    folders of this process's cgroups, or one v2 folder with both controllers delegated."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    v1, v2 = {}, None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(","):
            if name in ("memory", "pids"):
                v1[name] = Path("/sys/fs/cgroup") / name / path.lstrip("/")
        if controllers == "":
            v2 = Path("/sys/fs/cgroup") / path.lstrip("/")
    if len(v1) == 2:
        return [v1["memory"], v1["pids"]]
    if v2 is not None:
        try:
            delegated = (v2 / "cgroup.subtree_control").read_text().split()
        except OSError:
            return []
        if {"memory", "pids"} <= set(delegated):
            return [v2]
    return []


def make_cgroup() -> list[Path]:
    """New cgroup folders with the limits set ([] where none can be made): the child joins
    them before it runs anything (`joined`), and `remove` takes them away after."""
    made = []
    try:
        for base in _own_cgroups():
            folder = base / f"zero_lab_grade_{secrets.token_hex(6)}"
            folder.mkdir()
            made.append(folder)
            limits = {"memory.limit_in_bytes": MEMORY_BYTES, "memory.max": MEMORY_BYTES,
                      "memory.swap.max": 0, "pids.max": TASKS}
            for name, value in limits.items():
                if (folder / name).exists():
                    (folder / name).write_text(str(value))
    except OSError:
        remove(made)
        return []
    return made


def joined(cgroups: Sequence[Path], argv: list[str]) -> list[str]:
    """`argv` run by a shell that first moves itself into `cgroups` (then execs: same pid)."""
    if not cgroups:
        return argv
    script = 'for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 97; done; ' \
             'while [ "$1" != -- ]; do shift; done; shift; exec "$@"'
    return ["sh", "-c", script, "sh", *(str(c / "cgroup.procs") for c in cgroups), "--", *argv]


def remove(cgroups: Sequence[Path]) -> None:
    for folder in cgroups:  # its processes die with the PID namespace: give them a moment
        for _ in range(50):
            try:
                folder.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


@functools.lru_cache(maxsize=1)
def cgroups_work() -> bool:
    made = make_cgroup()
    remove(made)
    return bool(made)


def note(unsafe: bool) -> str:
    """What held learner code on this machine, for the start of a run and summary.md."""
    ok, why = available()
    if not ok:
        from zero_lab.grading.offline import network_note

        return (f"NO SANDBOX: {why}. Learner code ran with this user's files and processes "
                f"({UNSAFE_FLAG}). " + network_note())
    limits = (f"a cgroup capped each exercise at {MEMORY_BYTES // 2**30} GiB in all and "
              f"{TASKS} tasks" if cgroups_work() else
              f"no cgroup could be made here, so memory is capped per process only (address "
              f"space), and tasks at {TASKS} by RLIMIT_NPROC")
    return ("Each exercise ran in a bubblewrap sandbox: the course, Python and the system "
            "read-only, only its scratch folder writable, the output and submissions folders "
            "absent, its own PID namespace (every process it started ended with it), no "
            f"network but its own loopback, no Unix socket outside; {limits}.")
