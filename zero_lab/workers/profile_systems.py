"""Rank side of notebook 06: profile each system's training steps, one trace per rank.

    profile_systems.py --systems stage0 stage3 ... --config '{"width": 512, ...}'
                       --out runs/profiles [--steps 3] [--timed 6]

For every system (built on the same initial model, `zero_lab.bench_systems`), in order:
1. `warmup` unrecorded steps;
2. `timed` steps without the profiler, each after a barrier: the step time the trace's
   numbers are compared with (the profiler's own cost is the difference);
3. `steps` steps under torch.profiler (zero_lab.profiling.capture): --out/<system>/rank<r>.json;
   if even the fastest of them was 30% slower than the fastest unprofiled step, something
   else had the machine (on 2 shared cores a whole recording can be slowed): the recording
   is retaken, at most twice, and the retakes are reported;
4. one more step under the profiler (recording shapes) *and* a CommLedger:
   --out/<system>/ledger/rank<r>.json, so that the trace's collectives (count and size) can
   be checked against the ledger's for the same step (the ledger's dispatch mode and the
   shapes cost time, so they stay out of the timed traces).
Reports per system: the unprofiled step times (slowest rank), the page faults of each
unprofiled and profiled step (this rank), the ledger's records, the trace's path.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zero_lab.bench_systems import PROFILE_SYSTEMS, BenchConfig
from zero_lab.collectives import CommLedger
from zero_lab.launch import init_worker, report
from zero_lab.profiling.capture import capture
from zero_lab.workloads import count_parameters, deep_mlp, mlp_batch, mse_loss, rank_slice


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


RETAKES = 2  # recordings retaken when disturbed
SLOWER = 1.3  # disturbed: the fastest recorded step is 30% (+2 ms) slower than unprofiled


def _minor_faults() -> int:
    """Page faults served without I/O so far: each is a fresh 4 KiB page the kernel had to
    hand this process (large temporaries newly mapped show up here)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems", nargs="+", required=True, choices=list(PROFILE_SYSTEMS))
    parser.add_argument("--config", default="{}")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timed", type=int, default=6)
    args = parser.parse_args()
    config = BenchConfig(**json.loads(args.config))
    info = init_worker()
    n, rank, device = info.world_size, info.rank, info.device
    results = {}
    for name in args.systems:
        torch.manual_seed(config.seed)  # every system starts from the same weights
        model = deep_mlp(config.width, config.depth).to(device)
        trainer = PROFILE_SYSTEMS[name].build(model, config, device)
        done = 0

        def step(trainer=trainer) -> None:
            nonlocal done
            full = mlp_batch(done, config.batch * n, config.width, seed=config.seed,
                             device=device)
            mse_loss(trainer.model, rank_slice(full, rank, n)).backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad()
            done += 1

        for _ in range(config.warmup):
            step()
        times, faults = [], {"unprofiled": [], "profiled": []}
        for _ in range(args.timed):
            dist.barrier()
            _sync(device)
            start, before = time.perf_counter(), _minor_faults()
            step()
            _sync(device)
            times.append(time.perf_counter() - start)
            faults["unprofiled"].append(_minor_faults() - before)

        profiled: list[float] = []

        def counted_step(step=step, faults=faults, profiled=profiled) -> None:
            before, start = _minor_faults(), time.perf_counter()
            step()
            _sync(device)
            profiled.append(time.perf_counter() - start)
            faults["profiled"].append(_minor_faults() - before)

        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when every rank is done
        # A recording during which the machine was busy elsewhere (every recorded step far
        # slower than the unprofiled ones) is retaken, at most RETAKES times, and counted.
        for retakes in range(RETAKES + 1):  # noqa: B007 (reported below)
            profiled.clear()
            faults["profiled"].clear()
            trace = capture(counted_step, args.out / name, steps=args.steps, device=device)
            disturbed = torch.tensor([float(min(profiled[-args.steps:]) >
                                            SLOWER * min(times) + 0.002)])
            dist.all_reduce(disturbed, op=dist.ReduceOp.MAX)  # the ranks decide together
            if not disturbed.item():
                break
        ledger = CommLedger()

        def step_with_ledger(ledger=ledger, step=step) -> None:
            with ledger:  # the step only: capture's barrier stays out of it
                step()

        capture(step_with_ledger, args.out / name / "ledger", steps=1, warmup=0, device=device,
                record_shapes=True)  # the sizes of the collectives, for the ledger check
        results[name] = {"step_times": slowest.tolist(), "trace": str(trace),
                         "minor_faults": faults, "retakes": retakes,
                         "ledger": [{"op": r.op, "numel": r.numel, "nbytes": r.nbytes}
                                    for r in ledger.records]}
        if rank == 0:
            print(f"{name:18s} {1e3 * sorted(times)[len(times) // 2]:7.2f} ms per step "
                  f"(median of {args.timed}, unprofiled); traces in {args.out / name}")
    report({"systems": results, "world_size": n, "backend": info.backend,
            "device": str(device), "n_params": count_parameters(deep_mlp(config.width,
                                                                           config.depth))})


if __name__ == "__main__":
    main()
