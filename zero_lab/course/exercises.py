"""What both sides of a graded exercise share: the objects a learner's function receives, and
the rank-side runner that loads and runs it.

A graded exercise runs the learner's function inside a real process group. The parent side
(`zero_lab.grading`) writes the function's source to a file and starts one of the scripts in
`zero_lab/workers/` on N ranks; each rank loads the source with `load_learner_code` and runs
the hidden cases through `run_exercises`, reporting facts (values, the collectives issued,
`learner_error` records). The verdict and the hint are decided back on the parent side.

- `GradBucket` (notebook 04) and `BareUnit` (notebook 05) are what those exercises' functions
  receive: the grader builds them to probe for a stub; the rank scripts grade with them.
- `load_learner_code`, `learner_error`, `ledger_records` and `run_exercises` run on the ranks.
- On gloo, `run_exercises` sends the learner's reduce-scatters as one (`send_reduce_scatters_
  directly`): torch's is an all-reduce on the wire, and the grader weighs the wire's bytes.

This module imports only shared modules, never the grader, the bench, the plots or a script.
"""

from __future__ import annotations

import math
import traceback
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.stages.partition import FlatParamGroup

if TYPE_CHECKING:
    from zero_lab.collectives import CommLedger
    from zero_lab.stages.zero3 import Unit

# The file name the learner's code is compiled under: tracebacks show it for their frames.
LEARNER_FILE = "<your function>"


# --------------------------------------------------------------- what the learner receives


class GradBucket:
    """Parameters whose gradients travel together: one flat gradient, one reduce-scatter.

    Notebook 04's hook `on_grad_ready(param, slot, bucket)` uses three attributes and len():

        grad         the bucket's flat gradient: its parameters' gradients end to end, zero
                     padding after them, N·S elements; None when no gradient is in it. Freed by
                     `bucket.grad = None`, as `param.grad = None` frees a parameter's.
        arrived      how many of its gradients arrived in this backward (0 before each one)
        owned_grad   this rank's slice of the averaged gradient, S elements: add to it
        len(bucket)  how many parameters it holds

    `slot(param)` is what the hook is handed as `slot`: param's place in `grad`, shaped like
    param (it allocates `grad`, zeroed, when there is none). The layout is a
    `FlatParamGroup`'s (notebook 03), so the slices are stage 2's own.
    """

    def __init__(self, params: list[nn.Parameter], world_size: int, rank: int) -> None:
        self.params = list(params)
        self.grad: torch.Tensor | None = None
        self.arrived = 0
        self._layout = FlatParamGroup(self.params, world_size, rank)
        self.owned_grad = self._layout.new_shard()
        self._position = {id(p): i for i, p in enumerate(self.params)}

    def __len__(self) -> int:
        return len(self.params)

    def slot(self, param: torch.Tensor) -> torch.Tensor:
        """`param`'s place in the bucket's flat gradient (a view), `grad` allocated if None."""
        if self.grad is None:
            self.grad = self._layout.new_full()
        return self._layout.views(self.grad)[self._position[id(param)]]


class BareUnit:
    """What `materialize(unit)` and `release(unit)` receive: one unit's buffers, no methods.

    params       the unit's nn.Parameters (at rest each one's .data is its local piece)
    group        their FlatParamGroup (layout: numel, padded_numel, shard_numel, ...)
    local        this rank's slice of the flat parameters (S elements, memory of its own)
    full         the full flat buffer (N·S elements); its storage is freed at rest
    full_views   parameter-shaped views of `full`, one per parameter
    local_views  each parameter's 1-D piece of `local` (possibly empty)
    """

    def __init__(self, unit: Unit) -> None:
        self.params, self.group = unit.params, unit.group
        self.local, self.full = unit.local, unit.full
        self.full_views, self.local_views = unit.full_views, unit.local_views


# --------------------------------------------------------------- the rank-side runner


def load_learner_code(source_file: str, extra: dict | None = None) -> dict:
    """The namespace of the learner's functions, run with torch, dist, nn, math and `extra`.

    The learner wrote them in a notebook where those names were imported; each rank runs
    them on their own, so exactly these names are provided.
    """
    namespace = {"torch": torch, "dist": dist, "nn": nn, "math": math, "__name__": "learner",
                 **(extra or {})}
    with open(source_file, encoding="utf-8") as f:
        exec(compile(f.read(), LEARNER_FILE, "exec"), namespace)
    return namespace


def learner_error(exc: BaseException, during: str = "") -> dict:
    """The record of an exception the learner's function raised, for the grader to show.

    {"type", "message", "where": the last traceback lines, from the learner's own frame on}
    and, if given, "during": which step of the case was running.
    """
    lines = "".join(traceback.format_exception(exc)).splitlines()
    start = next((i for i, ln in enumerate(lines) if LEARNER_FILE in ln), len(lines) - 1)
    record = {"type": type(exc).__name__, "message": str(exc),
              "where": "\n".join(lines[start:][-6:])}
    if during:
        record["during"] = during
    return record


def ledger_records(ledger: CommLedger) -> list[dict]:
    """The collectives a CommLedger saw, as JSON-ready dicts: op, bytes, during backward, and
    what sent it ("by": torch's c10d op, or zero_lab.collectives.exchange; for the tests)."""
    return [{"op": r.op, "nbytes": r.nbytes, "in_backward": r.in_backward, "by": r.torch_op}
            for r in ledger.records]


def run_exercises(argv: list[str], runners: dict, extra: dict | None = None) -> None:
    """SOURCE_FILE [--seed N] [--stacks-at T] EXERCISE:FUNCTION[,FUNCTION] [...] on every rank.

    The learner's functions are loaded from SOURCE_FILE (with torch, dist, nn, math and
    `extra` in scope) and `runners[EXERCISE](*functions, out, seed)` fills a record reported
    under the key as {"world_size", ...}. `seed` picks the cases (None: the notebook's; an int:
    the batch grader's, drawn from the instructor's seed: zero_lab/course/rank_cases/). The
    record is reported even when a function raises, with the error in the record of the case
    that raised; the exception then propagates, so that torchrun stops every rank at once
    instead of leaving the others waiting in a collective. `--stacks-at T`: see dump_stacks_at.
    """
    from zero_lab.launch import init_worker, report

    source_file, *runs = argv
    seed = stacks_at = None
    if runs[:1] == ["--seed"]:
        seed, runs = int(runs[1]), runs[2:]
    if runs[:1] == ["--stacks-at"]:
        stacks_at, runs = float(runs[1]), runs[2:]
    namespace = load_learner_code(source_file, extra)
    info = init_worker()
    send_reduce_scatters_directly()
    if stacks_at is not None:
        dump_stacks_at(stacks_at, info.rank)
    for key in runs:
        exercise, names = key.split(":")
        out: dict = {"world_size": info.world_size}
        try:
            runners[exercise](*(namespace[name] for name in names.split(",")), out, seed)
        finally:
            report({key: out})


def send_reduce_scatters_directly() -> None:
    """On gloo, the learner's reduce-scatters (SUM or AVG; `dist.reduce_scatter_single`,
    `reduce_scatter_tensor`, `_reduce_scatter_base` and the list form `reduce_scatter`) run
    as zero_lab.collectives.exchange's direct exchange from here on, in this process.

    torch 2.13's gloo reduce-scatter clones its input and all-reduces all of it: on the wire it
    is the all-reduce it should halve. The batch grader counts the bytes an exercise's ranks
    send (zero_lab/grading/wire.py); with a real reduce-scatter on the wire, a step that
    all-reduces and claims a reduce-scatter sends half as much again as its claim, which the
    count sees. The call, its arguments and the ledger's record are unchanged; only the bytes
    beneath it are now a reduce-scatter's. NCCL's is a real one: left as it is."""
    if dist.get_backend() != "gloo":
        return
    from zero_lab.collectives import exchange

    torch_flat, torch_list = dist.reduce_scatter_tensor, dist.reduce_scatter

    def direct(output, inputs, op) -> bool:  # what the exchange takes; torch's does the rest
        return (op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and output.is_contiguous()
                and all(t.is_contiguous() and t.dtype == output.dtype for t in inputs))

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not direct(output, [input], op):
            return torch_flat(output, input, op=op, group=group, async_op=async_op)
        return exchange.reduce_scatter(output.view(-1), input.view(-1), op=op, group=group,
                                       async_op=async_op)

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not direct(output, input_list, op) or any(t.numel() != output.numel()
                                                     for t in input_list):
            return torch_list(output, input_list, op=op, group=group, async_op=async_op)
        whole = torch.cat([t.view(-1) for t in input_list])
        return exchange.reduce_scatter(output.view(-1), whole, op=op, group=group,
                                       async_op=async_op)

    dist.reduce_scatter_single = dist.reduce_scatter_tensor = reduce_scatter_tensor
    dist._reduce_scatter_base = reduce_scatter_tensor
    dist.reduce_scatter = reduce_scatter


# Kept open until the process ends: faulthandler writes to its file descriptor from C.
_stacks_file = None


def dump_stacks_at(at: float, rank: int) -> None:
    """If this rank still runs at wall-clock time `at`, write its threads' Python stacks to
    `rank{rank}.stacks` in the run directory.

    The grader stops a launch that runs past its limit just after `at`, then reads where each
    rank was (zero_lab.grading.hang): in the learner's own code, or waiting in which
    collective. faulthandler writes from a C thread, so a rank blocked inside gloo, where no
    Python code runs, still says where it is.
    """
    import faulthandler
    import os
    import time
    from pathlib import Path

    from zero_lab.launch.rank_side import ENV_RUN_DIR

    global _stacks_file
    _stacks_file = open(Path(os.environ[ENV_RUN_DIR]) / f"rank{rank}.stacks", "w")  # noqa: SIM115
    faulthandler.dump_traceback_later(max(0.1, at - time.time()), file=_stacks_file)
