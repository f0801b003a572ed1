"""zero_lab.profiling.run_queue: how long this process's threads waited for a core, the
measure notebook 06's A/B check uses to tell when the machine was too busy to judge."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from zero_lab.profiling import run_queue
from zero_lab.profiling.run_queue import WaitingForCores

linux_only = pytest.mark.skipif(run_queue.run_delays() is None, reason="needs /proc schedstat")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@linux_only
def test_a_crowded_thread_waits_for_what_it_does_not_run():
    """A thread that spins beside more spinners than cores is always runnable: each second
    of wall time it either runs or waits, so the share waited is 1 minus its CPU share.
    (The mutant that reads the run time, schedstat's first field, reports the CPU share:
    about 0.4 on 2 cores, against about 0.6 waited.)"""
    import os

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range((os.cpu_count() or 1) + 2)]
    try:
        time.sleep(0.3)  # the spinners are running
        cpu, started = time.process_time(), time.perf_counter()
        with WaitingForCores() as waiting:
            _spin(1.0)
        cpu_share = (time.process_time() - cpu) / (time.perf_counter() - started)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert waiting.share > 0.3
    assert waiting.share + cpu_share == pytest.approx(1.0, abs=0.1)


@linux_only
def test_a_sleeping_thread_does_not_wait_for_a_core():
    """Sleeping is not waiting: a thread that sleeps is not runnable (mutant: counting the
    wall time outside the thread's run time)."""
    with WaitingForCores() as waiting:
        time.sleep(0.5)
    assert 0 <= waiting.share < 0.1


@linux_only
def test_threads_that_start_or_end_inside_count_for_nothing():
    """Only threads alive at both ends are compared: one that ended has no end value, one
    that started has no start (mutant: a missing thread read as 0 makes the sum negative or
    counts its whole life)."""
    started = threading.Event()
    stop = threading.Event()
    gone = threading.Thread(target=stop.wait)
    gone.start()
    with WaitingForCores() as waiting:
        stop.set()
        gone.join()
        born = threading.Thread(target=lambda: (started.set(), _spin(0.2)))
        born.start()
        born.join()
    assert started.is_set() and waiting.share >= 0


def test_off_linux_the_share_is_none(monkeypatch, tmp_path):
    monkeypatch.setattr(run_queue, "TASKS", tmp_path / "no-proc")
    assert run_queue.run_delays() is None
    with WaitingForCores() as waiting:
        pass
    assert waiting.share is None
