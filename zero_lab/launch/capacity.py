"""Will `nproc` ranks fit this machine? Cores and memory, checked before anything starts.

A launch of 64 ranks on 2 cores is not slow, it is fatal: each rank imports torch (~150 MB
here before it builds a model), the kernel's out-of-memory killer ends the notebook's kernel
after ~30 s, and on a shared teaching server it takes other users' memory first. So:

- more ranks than cores: allowed with a warning (the ranks take turns; the course's default
  of 2 ranks on a 1-core machine is still instructive), refused past `MAX_RANKS_PER_CORE`
  per core;
- ranks times the memory one needs above what the machine has available: refused, with
  the numbers.

The memory a rank needs is estimated by whoever knows the work (a notebook from its
parameters); `RANK_BASE_BYTES` is what any rank costs before its work: the interpreter, torch
and a process group, measured here as ~150 MB resident per rank.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

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


def available_memory() -> int | None:
    """Bytes this process could still allocate: MemAvailable, capped by a cgroup (v2 or v1)
    limit less what the cgroup uses; None where the OS does not say (then nothing is refused
    on memory)."""
    found = []
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            used = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            found.append(max(int(limit) - used, 0))
    if not found and sys.platform == "darwin":
        return None
    return min(found) if found else None


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
    this machine's (`memory=None`: unknown, not checked). `stacklevel` as warnings.warn's,
    counted from the caller of this function.
    """
    check_count(nproc, what)
    cores = available_cores() if cores is None else cores
    memory = available_memory() if memory == -1 else memory
    if nproc > MAX_RANKS_PER_CORE * cores:
        raise ValueError(
            f"{what}={nproc} ranks on {cores} core{'s' if cores != 1 else ''}: refused, more "
            f"than {MAX_RANKS_PER_CORE} ranks a core only take turns and fill the memory. "
            f"Use {what} <= {MAX_RANKS_PER_CORE * cores} (2 shows every idea in the course).")
    if memory is not None and nproc * rank_bytes > memory:
        raise ValueError(
            f"{what}={nproc} ranks need about {nproc * rank_bytes / MiB:,.0f} MiB "
            f"({rank_bytes / MiB:,.0f} MiB a rank) but this machine has "
            f"{memory / MiB:,.0f} MiB available: refused before the out-of-memory killer "
            f"ends the kernel (and, on a shared server, other users' work). Use "
            f"{what} <= {max(memory // rank_bytes, 1)}.")
    if nproc > cores and (nproc, cores) not in _warned:
        # once a process: a notebook that runs its 3-rank checks on a 2-core laptop on
        # purpose would otherwise repeat it under every such cell
        _warned.add((nproc, cores))
        warnings.warn(f"{what}={nproc} ranks on {cores} core{'s' if cores != 1 else ''} take "
                      f"turns: timings mean less", CapacityWarning, stacklevel=stacklevel)
