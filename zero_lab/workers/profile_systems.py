"""Rank side of notebook 06: profile each system's training steps, one trace per rank.

    profile_systems.py --systems stage0 stage3 ... --config '{"width": 512, ...}'
                       --out runs/profiles [--steps 3] [--timed 6]

Every system is built on the same initial model (`zero_lab.course.bench_systems`), then:
1. `warmup` unrecorded steps each;
2. `timed` rounds of one unprofiled step per system, each after a barrier and an untimed
   step of the same system (a steady step: it waits for what the step before left in
   flight, zero_lab/measure/step_timing.py): the step times the trace's numbers are compared with
   (rounds, so that whatever else the machine does falls on every system alike); then per
   system:
3. `steps` steps under torch.profiler (zero_lab.profiling.capture), each after an unrecorded
   one of the same system: --out/<system>/rank<r>.json;
   if even the fastest of them was 30% slower than the fastest unprofiled step, something
   else had the machine (on 2 shared cores a whole recording can be slowed): the recording
   is retaken, at most twice, and the retakes are reported;
4. one more step under the profiler (recording shapes) *and* a CommLedger:
   --out/<system>/ledger/rank<r>.json, so that the trace's collectives (count and size) can
   be checked against the ledger's for the same step (the ledger's dispatch mode and the
   shapes cost time, so they stay out of the timed traces).
With `--no-comm stage0 ...`, each named zero_lab stage also gets a twin with its
communication removed (`transport="none"`: the same copies, hooks, buckets and 1/N update,
nothing sent, numerically meaningless), timed unprofiled right after it in every round, and
recorded under the profiler in turn with it, a step of each (--out/<stage>_ab/): step(stage)
- step(twin) is what the stage's communication costs, the A/B check of the trace's exposed
communication.
Reports per system: the unprofiled step times (slowest rank), the twin's ("no_comm_step_times"),
the page faults of each unprofiled and profiled step (this rank), the ledger's records, the
model-state bytes held when the ledger step began, the trace's path.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zero_lab.collectives import CommLedger
from zero_lab.course.bench_systems import NO_COMM, PROFILE_SYSTEMS, TWINS, BenchConfig
from zero_lab.course.workloads import count_parameters, deep_mlp, mlp_batch, mse_loss, rank_slice
from zero_lab.launch import init_worker, report
from zero_lab.measure.memory import held_bytes
from zero_lab.measure.step_timing import settle_in_flight
from zero_lab.profiling.capture import capture
from zero_lab.profiling.run_queue import WaitingForCores


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


RETAKES = 2  # recordings retaken when disturbed
SLOWER = 1.3  # disturbed: the fastest recorded step is 30% (+2 ms) slower than unprofiled


def _minor_faults() -> int:
    """Page faults served without I/O so far: each is a fresh 4 KiB page the kernel had to
    hand this process (large temporaries newly mapped show up here)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Run:
    """One system on this rank: its trainer, the steps it has taken, what was measured."""

    def __init__(self, name: str, config: BenchConfig, info) -> None:
        torch.manual_seed(config.seed)  # every system starts from the same weights
        model = deep_mlp(config.width, config.depth).to(info.device)
        self.name, self.config, self.info = name, config, info
        self.trainer = PROFILE_SYSTEMS[name].build(model, config, info.device)  # twins too
        self.done = 0
        self.times: list[float] = []
        self.profiled: list[float] = []
        self.faults: dict[str, list[int]] = {"unprofiled": [], "profiled": []}

    def step(self) -> None:
        """One training step on the next global batch (this rank's rows of it)."""
        c, n = self.config, self.info.world_size
        full = mlp_batch(self.done, c.batch * n, c.width, seed=c.seed, device=self.info.device)
        mse_loss(self.trainer.model, rank_slice(full, self.info.rank, n)).backward()
        self.trainer.optimizer.step()
        self.trainer.optimizer.zero_grad()
        self.done += 1

    def settle(self) -> None:
        """Nothing left in flight (an overlapped stage's all-gathers): see capture.py."""
        settle_in_flight(self.trainer.model)

    def measured_step(self, kind: str) -> float:
        """A step, timed (seconds) and its page faults counted under `kind`."""
        before, start = _minor_faults(), time.perf_counter()
        self.step()
        _sync(self.info.device)
        self.faults[kind].append(_minor_faults() - before)
        return time.perf_counter() - start

    def steady_step(self) -> float:
        """A step timed as training runs it (seconds): right after an untimed step of this
        system, with no barrier between, so that it inherits the communication that step
        left in flight (an overlapped stage's all-gathers) and waits for it; what it leaves
        is finished afterwards, untimed (zero_lab/measure/step_timing.py)."""
        self.step()
        seconds = self.measured_step("unprofiled")
        self.settle()
        return seconds

    def record(self, out: Path, steps: int) -> tuple[Path, int]:
        """Profile `steps` steps into out/<name>/; retake a disturbed recording."""
        for retakes in range(RETAKES + 1):  # noqa: B007 (returned)
            self.profiled, self.faults["profiled"] = [], []
            path = capture(lambda: self.profiled.append(self.measured_step("profiled")),
                           out / self.name, steps=steps, device=self.info.device,
                           profile_memory=False, prime=self.step, settle=self.settle)
            disturbed = torch.tensor([float(min(self.profiled[-steps:]) >
                                            SLOWER * min(self.times) + 0.002)],
                                     device=self.info.device)  # NCCL reduces CUDA tensors
            dist.all_reduce(disturbed, op=dist.ReduceOp.MAX)  # the ranks decide together
            if not disturbed.item():
                break
        return path, retakes

    def record_in_turn(self, twin: Run, out: Path, steps: int) -> Path:
        """Profile this system and its twin in one recording, a step of each in turn (this,
        twin, this, ...), into out/<name>_ab/: whatever else the machine does falls on both
        alike. The trace's step windows 0, 2, 4, ... are this system's, 1, 3, 5, ... the
        twin's (the two unrecorded warm-up steps keep the turn). Each recorded step follows an
        unrecorded one of the same system, as in `record`."""
        turn, now = itertools.cycle((self, twin)), [self]

        def prime() -> None:
            now[0] = next(turn)
            now[0].step()

        return capture(lambda: now[0].step(), out / f"{self.name}_ab", steps=2 * steps,
                       warmup=2, device=self.info.device, profile_memory=False,
                       prime=prime, settle=lambda: now[0].settle())

    def ledger_step(self, out: Path) -> tuple[list[dict], int]:
        """One more step under the profiler (with shapes and memory) and a CommLedger.
        Returns the ledger's records and the bytes of model states this rank held when the
        step began: the profiler counts only what is allocated while it records, so a memory
        curve is "held + allocated since"."""
        ledger = CommLedger()
        # (the seed blog's trainer keeps its torch optimizer one level down, in .blog.optim)
        optimizer = getattr(self.trainer.optimizer, "blog", self.trainer.optimizer)
        held = held_bytes(self.trainer.model, optimizer)["total"]

        def step() -> None:
            with ledger:  # the step only: capture's barriers stay out of it
                self.step()

        capture(step, out / self.name / "ledger", steps=1, warmup=0, device=self.info.device,
                record_shapes=True, profile_memory=True,  # sizes and memory, not timings
                settle=self.settle)
        return [{"op": r.op, "numel": r.numel, "nbytes": r.nbytes} for r in ledger.records], held


def _slowest_rank(times: list[float], device: torch.device) -> list[float]:
    """Each step's time on the slowest rank: a step ends when every rank is done. The tensor
    sits on the rank's device: NCCL reduces only CUDA tensors."""
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems", nargs="+", required=True, choices=list(PROFILE_SYSTEMS))
    parser.add_argument("--config", default="{}")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timed", type=int, default=6)
    parser.add_argument("--no-comm", nargs="*", default=[],
                        choices=[name.removesuffix(NO_COMM) for name in TWINS],
                        help="stages timed beside a twin that sends nothing")
    args = parser.parse_args()
    config = BenchConfig(**json.loads(args.config))
    info = init_worker()
    runs = [Run(name, config, info) for name in args.systems]
    twins = {name: Run(name + NO_COMM, config, info) for name in args.no_comm}
    timed = [r for run in runs for r in (run, twins.get(run.name)) if r is not None]
    for run in timed:
        for _ in range(config.warmup):
            run.step()
    # Unprofiled steps in rounds, every system once per round (a twin right after its stage):
    # whatever else the machine does while they run falls on all systems alike.
    for _ in range(args.timed):
        for run in timed:
            dist.barrier()
            _sync(info.device)
            run.times.append(run.steady_step())
    results = {}
    for run in runs:
        slowest = _slowest_rank(run.times, info.device)
        trace, retakes = run.record(args.out, args.steps)
        ledger, held = run.ledger_step(args.out)
        results[run.name] = {"step_times": slowest, "trace": str(trace),
                             "minor_faults": run.faults, "retakes": retakes,
                             "ledger": ledger, "held_bytes": held}
        if run.name in twins:
            twin_times = _slowest_rank(twins[run.name].times, info.device)
            results[run.name]["no_comm_step_times"] = twin_times
            with WaitingForCores() as waiting:
                run.record_in_turn(twins[run.name], args.out, args.steps)
            # How busy the machine was while it recorded: how long this rank's threads
            # waited for a core, and the 1-minute load average per core. The A/B check's
            # band was measured for a range of both (checks.py).
            results[run.name]["waiting_for_cores"] = waiting.share
            results[run.name]["load_per_core"] = os.getloadavg()[0] / (os.cpu_count() or 1)
        if info.rank == 0:
            print(f"{run.name:19s} {1e3 * statistics.median(slowest):6.1f} ms a step (median of "
                  f"{args.timed}, unprofiled) -> {args.out.name}/{run.name}")
    data = {"systems": results, "world_size": info.world_size, "backend": info.backend,
            "device": str(info.device),
            "n_params": count_parameters(deep_mlp(config.width, config.depth))}
    # Kept beside the traces: a run's numbers can be read again after the notebook is closed.
    (args.out / f"report_rank{info.rank}.json").write_text(json.dumps(data))
    report(data)


if __name__ == "__main__":
    main()
