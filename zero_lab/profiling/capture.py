"""Capture: torch.profiler around a few training steps, one Chrome-trace JSON per rank.

    path = capture(lambda: train_step(), RUNS / "profiles" / "stage3", steps=3)
    # -> runs/profiles/stage3/rank<r>.json, openable in https://ui.perfetto.dev or
    #    chrome://tracing, and readable by zero_lab.profiling.analysis without either

Each recorded step runs inside a "train step" mark, between two barriers (so that the ranks
start it together, the wait for a slower rank is not counted in the step, and no rank writes
its trace while another still runs) and, on CUDA, ending
with a synchronize (so that the GPU work of step k lies inside step k's window). The
profiler's schedule skips `wait` steps and warms up for `warmup` more before it records
`steps`: the first recorded steps would otherwise carry the profiler's own start-up.

A step may leave communication in flight (shard()'s overlap_param_gather: the all-gathers
wait for the next forward). Then a step recorded alone is not the step training runs: a
barrier before it gives the last step's all-gathers time that no window sees, and its own
would run under whatever comes next (zero_lab/measure/step_timing.py measured the bench's "gain" of
overlapping as exactly that). So `prime` runs a step of the same system just before each
recorded one, outside its window and with no barrier between: the recorded step inherits
what a step in training inherits. `settle` finishes what the recorded step left, outside
its window, before the next barrier, and after the last step while the profiler still
records: a gloo work issued under the profiler keeps the profiler's record of it open until
it finishes, and finishing after the profiler stopped wrote into freed memory (torch 2.13,
2 gloo ranks, stage 2 with overlap_param_gather: "free(): invalid next size", 5 launches of
5 aborted; with the settle none of 5).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from zero_lab.profiling.marks import mark

STEP = "train step"  # the mark around each recorded step: the analysis's step windows


def trace_path(directory: Path | str, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.json"


def capture(step: Callable[[], None], directory: Path | str, *, steps: int = 3,
            warmup: int = 1, wait: int = 0, device: torch.device | str = "cpu",
            profile_memory: bool = True, record_shapes: bool = False,
            prime: Callable[[], None] | None = None,
            settle: Callable[[], None] | None = None) -> Path:
    """Profile `steps` calls of `step()` (after `wait` + `warmup` unrecorded ones) and write
    this rank's trace to `directory/rank<r>.json`; returns its path.

    `profile_memory` adds the allocator's events (memory over the step). `record_shapes`
    lets the analysis read the size of each collective, but costs more than time: with it,
    every recorded step on 2 CPU ranks was slower than the last (stage 3: 92, 105, 165,
    326 ms; 85 ms steady without), so capture timing steps without it and sizes apart.
    `prime()`, if given, runs right before every step, outside its window: a step of the
    same system, so that the step recorded inherits what it would in training. `settle()`,
    if given, runs after every step (outside its window), the last time before the profiler
    stops: it must leave nothing in flight (`model.wait_for_params`).
    """
    if steps < 1 or warmup < 0 or wait < 0:
        raise ValueError(f"need steps >= 1 and warmup, wait >= 0; got {steps}, {warmup}, {wait}")
    device = torch.device(device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = trace_path(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    total = wait + warmup + steps
    with profile(activities=activities,
                 schedule=schedule(wait=wait, warmup=warmup, active=steps, repeat=1),
                 on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
                 record_shapes=record_shapes, profile_memory=profile_memory) as prof:
        for _ in range(total):
            if dist.is_initialized():
                dist.barrier()
            if prime is not None:
                prime()  # no barrier between it and the step: what it leaves in flight,
            with mark(STEP):  # the step waits for, as in training
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            if settle is not None:
                settle()  # the last time before prof.step() below ends the recording
            if dist.is_initialized():
                # Every rank finishes the step before any writes its trace (a rank writing
                # ~1 MB of JSON slowed another rank's last step 4x on two cores).
                dist.barrier()
            prof.step()
    return path
