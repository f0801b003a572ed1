"""Per-rank side of `python -m zero_lab.course.bench` (started by `zero_lab.course.bench.run`).

    bench_worker.py --systems ddp stage0 ... --config '{"width": 1024, ...}' [--profile]

Builds every system on the same initial model, then, in this order:
1. `warmup` untimed steps per system;
2. one measured step per system (untimed): bytes held after backward, peak bytes, and the
   collectives it issued (`CommLedger`);
3. `rounds` rounds; round k times `steps` steps of every system, in the system order rotated
   by k. A system's steps in a round run back to back after one barrier, each timed from its
   start to the next one's, the last one also waiting for what it left in flight
   (zero_lab/measure/step_timing.py); per step the slowest rank's time is kept, and so is each
   phase's (forward, backward, step, zero_grad); each rank also counts the CPU seconds the
   block cost its process (every thread: compute and gloo's copies), per step;
4. the trained weights of every system are compared with the first system's (every system
   consumed the same batches, so they must agree);
5. with --profile, `steps` more steps per system under torch.profiler.
Reports (rank 0 also reports timings and profiles): see `zero_lab.course.bench.summarize`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from zero_lab.collectives import CommLedger
from zero_lab.course.bench_systems import BENCH_SYSTEMS, PHASES, BenchConfig, Trainer
from zero_lab.course.workloads import (
    count_parameters,
    deep_mlp,
    mlp_batch,
    mse_loss,
    rank_slice,
)
from zero_lab.launch import init_worker, report
from zero_lab.launch.capacity import available_cores
from zero_lab.measure.memory import MemoryTimeline, held_bytes, model_state_tensors
from zero_lab.measure.step_timing import (
    CpuMeter,
    settle_in_flight,
    time_back_to_back,
    training_step,
)


class Run:
    """One system on this rank: its trainer and how many steps it has taken."""

    def __init__(self, name: str, trainer: Trainer, config: BenchConfig, info) -> None:
        self.name, self.trainer, self.config, self.info = name, trainer, config, info
        self.steps_done = 0
        # zero_lab's lockstep check (stages/lockstep.py), if this system has one
        self.lockstep = getattr(getattr(trainer.optimizer, "sync", None), "lockstep", None)
        self.cpu_ms_per_step: list[float] = []  # this rank's, one per timed block (round)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of global batch `step` (the same for every system)."""
        c, n = self.config, self.info.world_size
        full = mlp_batch(step, c.batch * n, c.width, seed=c.seed, device=self.info.device)
        return rank_slice(full, self.info.rank, n)

    def step(self, labelled: bool = False) -> None:
        """One training step on the next batch; `labelled` wraps each phase for profiling."""
        batch = self.batch(self.steps_done)
        model, opt = self.trainer.model, self.trainer.optimizer
        if labelled:
            with record_function(PHASES[0]):
                loss = mse_loss(model, batch)
            with record_function(PHASES[1]):
                loss.backward()
            with record_function(PHASES[2]):
                opt.step()
            with record_function(PHASES[3]):
                opt.zero_grad()
        else:
            mse_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
        self.steps_done += 1

    def timed_steps(self, steps: int) -> list[list[float]]:
        """Per step [total, forward, backward, optimizer.step, zero_grad] in seconds: after
        one barrier, `steps` steps back to back, the last one also waiting for what it left
        in flight (zero_lab/measure/step_timing.py: a barrier before each step hid the overlapped
        stages' all-gathers)."""
        model, opt = self.trainer.model, self.trainer.optimizer
        batches = [self.batch(self.steps_done + i) for i in range(steps)]

        _synchronize(self.info.device)
        run_step = training_step(lambda i: mse_loss(model, batches[i]), opt)
        with CpuMeter() as cpu:
            rows = time_back_to_back(steps, run_step, start_together=dist.barrier,
                                     settle=lambda: settle_in_flight(model),
                                     now=lambda: _now(self.info.device))
        self.cpu_ms_per_step.append(1e3 * cpu.seconds / steps)
        self.steps_done += steps
        return rows

    def measured_step(self) -> tuple[dict, int, dict]:
        """One untimed step: held bytes after backward, peak bytes, the collectives sent.

        The peak comes from `MemoryTimeline`, which re-reads every storage's size after each
        op: stage 3 and FSDP2 free and regrow full parameters in place (storage resize),
        which a tracker that notes storages only when they are created cannot see.
        """
        model, opt = self.trainer.model, self.trainer.optimizer
        batch = self.batch(self.steps_done)
        start = [t for ts in model_state_tensors(model, opt).values() for t in ts] + list(batch)
        with CommLedger() as ledger, MemoryTimeline(self.info.device, start) as timeline:
            mse_loss(model, batch).backward()
            held = held_bytes(model, opt)
            opt.step()
            opt.zero_grad()
        self.steps_done += 1
        comm = {"sent_bytes": ledger.total_bytes(), "volume": ledger.volume(),
                "by_op": ledger.summary()}
        return held, timeline.peak_bytes, comm


def _check_latency_ms(lockstep, repeats: int = 60) -> float:
    """The median time of one lockstep check when the ranks arrive together (after a
    barrier): what the check adds to a step. Inside a step the check also absorbs the ranks'
    skew, which the step's next collective would otherwise wait for."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        lockstep.check("forward", 0)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _now(device: torch.device) -> float:
    _synchronize(device)
    return time.perf_counter()


def _slowest(times: list[list[float]], device) -> list[list[float]]:
    """Per step and phase, the largest time over ranks: a step is done when every rank is."""
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _max_abs_diff(weights: dict, reference: dict, device) -> float:
    worst = max(float((weights[k].double() - reference[k].double()).abs().max())
                for k in reference)
    t = torch.tensor([worst], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _profile_table(run: Run, steps: int) -> str:
    """torch.profiler over `steps` steps: time per phase, then the ops that cost the most."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            dist.barrier()
            run.step(labelled=True)
    events = prof.key_averages()
    phases = {e.key: e.cpu_time_total / steps / 1e3 for e in events if e.key in PHASES}
    head = "per step, ms (CPU time on the training thread): " + ", ".join(
        f"{k} {phases.get(k, 0.0):.2f}" for k in PHASES)
    return head + "\n\n" + events.table(sort_by="cpu_time_total", row_limit=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems", nargs="+", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    config = BenchConfig(**json.loads(args.config))
    info = init_worker()

    runs = []
    for name in args.systems:
        torch.manual_seed(config.seed)  # every system starts from the same weights
        model = deep_mlp(config.width, config.depth).to(info.device)
        n_params = count_parameters(model)
        runs.append(Run(name, BENCH_SYSTEMS[name].build(model, config, info.device), config,
                        info))

    for run in runs:
        for _ in range(config.warmup):
            run.step()
    held, peak, comm = {}, {}, {}
    for run in runs:
        held[run.name], peak[run.name], comm[run.name] = run.measured_step()

    timing: dict[str, list[list[list[float]]]] = {run.name: [] for run in runs}
    order = []
    for k in range(config.rounds):
        rotated = runs[k % len(runs):] + runs[:k % len(runs)]
        order.append([run.name for run in rotated])
        for run in rotated:
            timing[run.name].append(_slowest(run.timed_steps(config.steps), info.device))

    latency = {run.name: _check_latency_ms(run.lockstep) for run in runs
               if run.lockstep and run.lockstep.enabled}
    reference = runs[0].trainer.full_weights()
    max_abs_diff = {run.name: _max_abs_diff(run.trainer.full_weights(), reference, info.device)
                    for run in runs}

    profiles = {}
    if args.profile:
        for run in runs:
            profiles[run.name] = _profile_table(run, config.steps)

    data = {"systems": [run.name for run in runs], "held": held, "peak": peak, "comm": comm,
            "backend": info.backend, "device": str(info.device), "n_params": n_params,
            "cpu_ms_per_step": {run.name: run.cpu_ms_per_step for run in runs},
            "cores": available_cores()}
    if info.rank == 0:
        data.update({"timing": timing, "order": order, "max_abs_diff": max_abs_diff,
                     "profiles": profiles, "lockstep_latency_ms": latency})
        print(f"{len(runs)} systems x {config.rounds} rounds done; "
              f"max |w - w_{runs[0].name}| = {max(max_abs_diff.values()):.2e}")
    report(data)


if __name__ == "__main__":
    main()
