"""Will `nproc` ranks fit this machine? Cores and memory, checked before anything starts.

A launch of 64 ranks on 2 cores is not slow, it is fatal: each rank imports torch (~150 MB
here before it builds a model), the kernel's out-of-memory killer ends the notebook's kernel
after ~30 s, and on a shared teaching server it takes other users' memory first. So:

- more ranks than cores: allowed with a warning (the ranks take turns; the course's default
  of 2 ranks on a 1-core machine is still instructive), refused past `MAX_RANKS_PER_CORE`
  per core;
- ranks times the memory one needs above what this process may still use: refused, with
  the numbers and the limit that says so. That is the tightest of the machine's available
  memory and every cgroup memory limit above this process (a shared server such as
  JupyterHub limits each user's cgroup, below the machine's);
- an address-space limit (`ulimit -v`) below what one rank maps: refused, for any nproc.

The memory a rank needs is estimated by whoever knows the work (a notebook from its
parameters); `RANK_BASE_BYTES` is what any rank costs before its work: the interpreter, torch
and a process group, measured here as ~150 MB resident per rank.

Where the out-of-memory killer strikes anyway, `oom_kills()` read before and after says so:
the launch's error (failures.py) and the course runner name it as the cause.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MiB = 2**20
RANK_BASE_BYTES = 200 * MiB  # python + torch + a gloo group: ~150 MB measured, with a margin
MAX_RANKS_PER_CORE = 4


_warned: set[tuple[int, int]] = set()  # (nproc, cores) this process has warned of


class CapacityWarning(UserWarning):
    """More ranks than cores: they will take turns on the cores."""


def available_cores() -> int:
    """The cores this process may run on: its affinity where the OS tells it (Linux; a
    container or `taskset` may allow fewer than the machine has), else every core."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Available(int):
    """Bytes that may still be allocated (an int, so it compares and divides as one), and the
    limit that says so, in words: `source`."""

    source: str

    def __new__(cls, available: int, source: str):
        self = super().__new__(cls, max(available, 0))
        self.source = source
        return self


ROOT = Path("/")  # where /proc and /sys are; tests pass a folder of fake files instead
UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a huge number (9223372036854771712)


def available_memory(root: Path = ROOT) -> Available | None:
    """Bytes this process and the ranks it starts could still allocate: the tightest of
    MemAvailable and every cgroup memory limit above this process (each limit less what its
    cgroup already uses); None where the OS says nothing (then nothing is refused on memory).

    The tightest one, not the top one: JupyterHub (systemd, a container runtime) limits each
    user's cgroup, below the machine's, and the out-of-memory killer acts at that limit.
    """
    found = [*_meminfo(root), *_cgroup_v2_limits(root), *_cgroup_v1_limits(root)]
    return min(found) if found else None


def _meminfo(root: Path) -> list[Available]:
    meminfo = root / "proc/meminfo"
    if not meminfo.exists():
        return []
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return [Available(int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")]
    return []


def _own_cgroups(root: Path) -> dict[str, str]:
    """This process's cgroup paths from /proc/self/cgroup: "0::/user.slice/..." (v2, key "")
    and "4:memory:/jupyter/user1" (v1, keyed by its controllers, "memory")."""
    own = root / "proc/self/cgroup"
    if not own.exists():
        return {}
    paths = {}
    for line in own.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _up_to_the_root(mount: Path, path: str) -> list[tuple[str, Path]]:
    """The cgroup at `path` and each parent up to the root: (its name, its folder), those
    that exist (in a container the mount may be this process's own cgroup already)."""
    names = [path, *(str(parent) for parent in PurePosixPath(path).parents)]
    return [(name, mount / name.lstrip("/")) for name in names
            if (mount / name.lstrip("/")).is_dir()]


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # absent (the root cgroup has no limit files), or "max"
        return None


def _cgroup_v2_limits(root: Path) -> list[Available]:
    """cgroup v2: memory.max (the OOM killer acts there) and memory.high (throttled and
    reclaimed hard above it) at each level from this process's cgroup up to the root."""
    path = _own_cgroups(root).get("")
    mount = next((m for m in (root / "sys/fs/cgroup", root / "sys/fs/cgroup/unified")
                  if (m / "cgroup.controllers").exists()), None)
    if path is None or mount is None:
        return []
    found = []
    for name, folder in _up_to_the_root(mount, path):
        used = _read_int(folder / "memory.current")
        for file in ("memory.max", "memory.high"):
            limit = _read_int(folder / file)
            if limit is not None and used is not None:
                found.append(_limit(name, file, limit, used))
    return found


def _cgroup_v1_limits(root: Path) -> list[Available]:
    """cgroup v1: memory.limit_in_bytes at each level of the memory controller's hierarchy."""
    path = _own_cgroups(root).get("memory")
    if path is None:
        return []
    found = []
    for name, folder in _up_to_the_root(root / "sys/fs/cgroup/memory", path):
        limit = _read_int(folder / "memory.limit_in_bytes")
        used = _read_int(folder / "memory.usage_in_bytes")
        if limit is not None and limit < UNLIMITED and used is not None:
            found.append(_limit(name, "memory.limit_in_bytes", limit, used))
    return found


def _limit(cgroup: str, file: str, limit: int, used: int) -> Available:
    return Available(limit - used, f"the memory limit of cgroup {cgroup} ({file}): "
                                   f"{limit / MiB:,.0f} MiB, {used / MiB:,.0f} MiB used")


# A rank's address space (VmSize) is far above what it uses (VmRSS): measured here (torch 2.13
# CPU build, gloo, two ranks) 676 MiB against 222 MiB after init_worker, and at most 943 MiB
# against 328 MiB after notebook 03's model trained six steps: torch maps its libraries whole
# and the threads reserve address space they seldom touch. RLIMIT_AS (`ulimit -v`) limits each
# process's address space on its own. So it is compared with one rank's address space, never
# added up over the ranks as memory is: a limit below it stops every rank whatever nproc is,
# one above it stops none. A CUDA build maps more (not measured here), so on a GPU machine
# this catches only the limits certainly too small.
RANK_ADDRESS_SPACE_BYTES = 1024 * MiB  # 676-943 MiB measured, with a margin


def address_space_limit() -> int | None:
    """This process's RLIMIT_AS (`ulimit -v`) in bytes, which every rank inherits; None if
    there is none (or the OS has no such limit)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


@dataclass(frozen=True)
class OomKills:
    """How many processes the out-of-memory killer had ended, as counted in `file`, when read.
    Read before a launch, `since()` after it says whether the killer struck meanwhile."""

    count: int
    file: Path

    def since(self) -> int:
        """How many more processes it has ended since."""
        now = _counter(self.file, "oom_kill")
        return 0 if now is None else now - self.count


def oom_kills(root: Path = ROOT) -> OomKills | None:
    """The out-of-memory killer's count for this process's cgroup (v2 memory.events counts
    its processes and those of the cgroups below it; v1 memory.oom_control), else for the
    whole machine (/proc/vmstat); None where no file says."""
    cgroups = _own_cgroups(root)
    candidates = []
    if "" in cgroups:
        candidates += [root / "sys/fs/cgroup" / cgroups[""].lstrip("/") / "memory.events",
                       root / "sys/fs/cgroup/unified" / cgroups[""].lstrip("/") / "memory.events"]
    if "memory" in cgroups:
        candidates.append(root / "sys/fs/cgroup/memory" / cgroups["memory"].lstrip("/")
                          / "memory.oom_control")
    candidates.append(root / "proc/vmstat")
    for file in candidates:
        count = _counter(file, "oom_kill")
        if count is not None:
            return OomKills(count, file)
    return None


def _counter(file: Path, name: str) -> int | None:
    """The value of line `name` in a file of "name value" lines, or None."""
    try:
        lines = file.read_text().splitlines()
    except OSError:
        return None
    return next((int(value) for key, value in (line.split(None, 1) for line in lines if line)
                 if key == name), None)


def check_count(nproc: int, what: str = "nproc") -> None:
    """A number of ranks is an int >= 1 (TypeError or ValueError naming `what`)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise TypeError(f"{what} must be an int (number of ranks), got {nproc!r} "
                        f"({type(nproc).__name__})")
    if nproc < 1:
        raise ValueError(f"{what} must be >= 1, got {nproc}")


def check_nproc(nproc: int, rank_bytes: int = RANK_BASE_BYTES, *, cores: int | None = None,
                memory: int | None = -1, what: str = "nproc", stacklevel: int = 2) -> None:
    """Refuse `nproc` ranks this machine cannot run (ValueError naming `what`, the rule and
    the numbers); warn (CapacityWarning) when there are more ranks than cores.

    `rank_bytes` is what one rank needs, its work included. `cores` and `memory` default to
    what this process has (`memory=None`: unknown, not checked; an `Available` names its
    limit in the refusal). `stacklevel` as warnings.warn's, counted from the caller of this
    function.
    """
    check_count(nproc, what)
    cores = available_cores() if cores is None else cores
    memory = available_memory() if memory == -1 else memory
    if nproc > MAX_RANKS_PER_CORE * cores:
        raise ValueError(
            f"{what}={nproc} ranks on {cores} core{'s' if cores != 1 else ''}: refused, more "
            f"than {MAX_RANKS_PER_CORE} ranks a core only take turns and fill the memory. "
            f"Use {what} <= {MAX_RANKS_PER_CORE * cores} (2 shows every idea in the course).")
    _check_address_space(rank_bytes)
    if memory is not None and nproc * rank_bytes > memory:
        source = f" ({memory.source})" if isinstance(memory, Available) else ""
        fits = memory // rank_bytes
        todo = (f"Use {what} <= {fits}." if fits else
                "Not one rank fits: close other kernels and programs, or ask for more memory.")
        raise ValueError(
            f"{what}={nproc} ranks need about {nproc * rank_bytes / MiB:,.0f} MiB "
            f"({rank_bytes / MiB:,.0f} MiB a rank) but this process has "
            f"{memory / MiB:,.0f} MiB available{source}: refused before the out-of-memory "
            f"killer ends the kernel (and, on a shared server, other users' work). {todo}")
    if nproc > cores and (nproc, cores) not in _warned:
        # once a process: a notebook that runs its 3-rank checks on a 2-core laptop on
        # purpose would otherwise repeat it under every such cell
        _warned.add((nproc, cores))
        warnings.warn(f"{what}={nproc} ranks on {cores} core{'s' if cores != 1 else ''} take "
                      f"turns: timings mean less", CapacityWarning, stacklevel=stacklevel)


def _check_address_space(rank_bytes: int) -> None:
    """Refuse where RLIMIT_AS is below what one rank maps (see RANK_ADDRESS_SPACE_BYTES): a
    per-process limit, so it does not depend on the number of ranks."""
    limit = address_space_limit()
    needs = RANK_ADDRESS_SPACE_BYTES + max(rank_bytes - RANK_BASE_BYTES, 0)
    if limit is not None and limit < needs:
        raise ValueError(
            f"the address-space limit (RLIMIT_AS, `ulimit -v`) of {limit / MiB:,.0f} MiB a "
            f"process is below the ~{needs / MiB:,.0f} MiB of address space a rank maps "
            f"(torch maps far more than it uses): every rank would fail to start, whatever "
            f"nproc is. Raise it (`ulimit -v unlimited` in the shell that starts Jupyter or "
            f"make), or ask whoever set it.")
