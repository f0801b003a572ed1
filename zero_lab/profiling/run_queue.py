"""How much of a stretch of time this process's threads spent waiting for a core.

Linux counts, for each thread, the nanoseconds it was ready to run but had no core (the
second field of /proc/self/task/<tid>/schedstat, its "run delay"). Summed over the process's
threads and divided by the wall time, it says how crowded the cores were for this program
while it ran. The load average cannot say that: it counts every runnable thread on the
machine, decays over a minute, and lags a burst of other programs by tens of seconds.
Notebook 06's A/B check (`checks.check_exposed_matches_removal`) uses it to tell when the
machine was too busy for its timings to be judged. Off Linux the share is None.

    with WaitingForCores() as waiting:
        ...                      # the steps to judge
    waiting.waited, waiting.wall # thread-seconds spent waiting, seconds of wall time
    waiting.share                # their ratio: thread-seconds waiting per second
"""

from __future__ import annotations

import time
from pathlib import Path

TASKS = Path("/proc/self/task")


def run_delays() -> dict[str, int] | None:
    """Nanoseconds each of this process's threads has waited for a core since it started,
    by thread id; None where the kernel does not say (not Linux, or no schedstat)."""
    delays = {}
    try:
        for task in TASKS.iterdir():
            try:
                delays[task.name] = int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # a thread that ended while we read
    except OSError:
        return None
    return delays or None


class WaitingForCores:
    """Measures `waited`: the run delay (seconds) this process's threads accumulated inside
    the `with` block, a thread that started or ended inside it counting for nothing; `wall`:
    the block's seconds; `share`: waited / wall. A rank whose one busy thread ran half the
    time and waited the other half has a share of 0.5."""

    def __init__(self) -> None:
        self.waited: float | None = None
        self.wall = 0.0

    @property
    def share(self) -> float | None:
        return None if self.waited is None or self.wall <= 0 else self.waited / self.wall

    def __enter__(self) -> WaitingForCores:
        self._start, self._delays = time.perf_counter(), run_delays()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, delays = time.perf_counter() - self._start, run_delays()
        if self._delays is None or delays is None:
            return
        waited = sum(delays[t] - self._delays[t] for t in delays.keys() & self._delays.keys())
        self.waited = waited / 1e9
