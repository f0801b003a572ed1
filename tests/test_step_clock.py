"""Steps are timed back to back (zero_lab/measure/step_timing.py), in `make bench` and notebook 06.

A fake world with a clock makes this exact: a "stage" whose `opt.step()` leaves an
all-gather in flight that takes GATHER seconds by itself, which the next forward (or
settle) waits for, and a barrier that takes BARRIER seconds, as a gloo barrier queued behind
the gather's bytes does. Timed back to back, a steady step pays for what its gather costs
beyond the zero_grad it runs under: 1 + 2 + 3 + 1 + (5 - 1) = 11. A barrier before every
step gives the gather 4 untimed seconds and reports 7 (how the bench timed until stop 31).
"""

from __future__ import annotations

import os
import threading
import time
import types

import pytest
import torch
from torch import nn

from zero_lab.launch.capacity import available_cores
from zero_lab.measure.step_timing import (
    CpuMeter,
    settle_in_flight,
    time_back_to_back,
    training_step,
)

FORWARD, BACKWARD, STEP, ZERO_GRAD = 1.0, 2.0, 3.0, 1.0
GATHER, BARRIER = 5.0, 4.0
STEADY = FORWARD + BACKWARD + STEP + ZERO_GRAD + (GATHER - ZERO_GRAD)  # 11


class FakeWorld:
    """The clock, and the one all-gather in flight (when it lands)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.lands_at: float | None = None

    def now(self) -> float:
        return self.t

    def spend(self, seconds: float) -> None:
        self.t += seconds

    def barrier(self, *args, **kwargs) -> None:
        self.spend(BARRIER)  # meanwhile the gather's bytes move

    def wait_for_params(self) -> None:
        if self.lands_at is not None:
            self.t = max(self.t, self.lands_at)
            self.lands_at = None


class FakeStage(nn.Module):
    """forward waits for the last step's all-gather; step() issues the next one."""

    def __init__(self, world: FakeWorld) -> None:
        super().__init__()
        self.world = world
        self.weight = nn.Parameter(torch.ones(4))
        self.wait_for_params = world.wait_for_params  # what settle_in_flight calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.world.wait_for_params()
        self.world.spend(FORWARD)
        out = x * self.weight
        out.register_hook(lambda grad: self.world.spend(BACKWARD))
        return out


class FakeOptimizer:
    def __init__(self, world: FakeWorld) -> None:
        self.world = world

    def step(self) -> None:
        self.world.spend(STEP)
        self.world.lands_at = self.world.t + GATHER  # issued, not waited for

    def zero_grad(self) -> None:
        self.world.spend(ZERO_GRAD)


def fake_step(model: FakeStage, opt: FakeOptimizer):
    return training_step(lambda i: model(torch.ones(4)).sum(), opt)


def test_steady_steps_pay_for_the_gather_they_inherit():
    world = FakeWorld()
    model = FakeStage(world)
    rows = time_back_to_back(5, fake_step(model, FakeOptimizer(world)),
                             start_together=world.barrier,
                             settle=lambda: settle_in_flight(model), now=world.now)
    totals = [row[0] for row in rows]
    # the first inherits nothing; the last also waits for its own gather
    assert totals == [STEADY - (GATHER - ZERO_GRAD), STEADY, STEADY, STEADY,
                      STEADY + (GATHER - ZERO_GRAD)]
    assert sum(totals) / len(totals) == STEADY  # a block's mean is the steady step
    assert [row[1] for row in rows[1:-1]] == [FORWARD + GATHER - ZERO_GRAD] * 3  # waited in forward
    assert world.lands_at is None  # nothing left in flight for what is timed next
    for row in rows:
        assert row[0] == pytest.approx(sum(row[1:]))  # the phases cover the whole step


def test_refuses_an_empty_block():
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        time_back_to_back(0, lambda i, lap: None, start_together=lambda: None,
                          settle=lambda: None)


def test_the_bench_times_steps_back_to_back(monkeypatch):
    """`make bench`'s own loop (bench_worker.Run.timed_steps) on the fake stage."""
    from zero_lab.course.bench_systems import BenchConfig, Trainer
    from zero_lab.workers import bench_worker

    world = FakeWorld()
    monkeypatch.setattr(bench_worker.dist, "barrier", world.barrier)
    monkeypatch.setattr(bench_worker, "_now", lambda device: world.now())
    model = FakeStage(world)
    monkeypatch.setattr(bench_worker, "mse_loss", lambda m, batch: m(torch.ones(4)).sum())
    info = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    run = bench_worker.Run("fake", Trainer(model, FakeOptimizer(world), dict), BenchConfig(
        width=4, batch=1), info)
    totals = [row[0] for row in run.timed_steps(5)]
    assert totals[1:-1] == [STEADY] * 3  # a barrier before each step: [7.0, 7.0, 7.0]
    assert world.lands_at is None


def test_notebook_06_times_a_steady_step(monkeypatch):
    """profile_systems.Run.steady_step (notebook 06's unprofiled step times): right after an
    untimed step of the same system, so it waits for that step's gather; its own is
    finished after, untimed. Mutants: no priming step (7.0), settling inside the time (15.0)."""
    from zero_lab.workers import profile_systems

    world = FakeWorld()
    model = FakeStage(world)
    monkeypatch.setattr(profile_systems, "mse_loss", lambda m, batch: m(torch.ones(4)).sum())
    monkeypatch.setattr(profile_systems.time, "perf_counter", world.now)
    run = object.__new__(profile_systems.Run)  # its __init__ builds a real system
    run.trainer = types.SimpleNamespace(model=model, optimizer=FakeOptimizer(world))
    run.config = profile_systems.BenchConfig(width=4, batch=1)
    run.info = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    run.done, run.faults = 0, {"unprofiled": []}
    world.barrier()
    assert run.steady_step() == STEADY
    assert world.lands_at is None  # finished, for whatever is timed next


# ------------------------------------------------------------------ the CPU a block costs


def _spin_cpu(seconds: float, clock) -> None:
    """Work until `clock` (a CPU clock) has advanced `seconds`: CPU spent, whatever the load."""
    start = clock()
    while clock() - start < seconds:
        pass


def test_cpu_meter_does_not_count_waiting():
    # A rank waiting for its peer's bytes sleeps; a wall clock would call the wait work.
    with CpuMeter() as cpu:
        time.sleep(0.3)
    assert cpu.seconds < 0.1


def test_cpu_meter_counts_every_thread_of_the_process():
    # gloo moves the bytes on threads of its own while the training thread waits: their
    # copies are CPU work the step costs the machine. A per-thread clock would miss them.
    with CpuMeter() as cpu:
        worker = threading.Thread(target=_spin_cpu, args=(0.3, time.thread_time))
        worker.start()
        worker.join()
    assert cpu.seconds >= 0.3


def test_available_cores_are_the_affinity_where_there_is_one(monkeypatch):
    # taskset or a container's cpuset may allow fewer cores than the machine has
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert available_cores() == 3


def test_available_cores_without_an_affinity_call(monkeypatch):
    # macOS has no os.sched_getaffinity
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert available_cores() == 8
