"""Test worker for tests/test_launch_grading.py: grades a learner function the way the course's
rank scripts do (zero_lab.course.exercises.run_exercises), with rank 1 aborting on request.

    launch_exercise.py SOURCE_FILE EXERCISE:FUNCTION [...]

EXERCISE is "abort_before" (rank 1 aborts before its report exists) or "abort_after" (every
rank reports, then rank 1 aborts on its way out). Either way the function is called on a
one-element tensor holding 1 and its result reported as "value".
"""

import os
import resource
import sys

import torch
import torch.distributed as dist

from zero_lab.course.exercises import run_exercises


def run_summed(fn, out: dict, seed: int | None = None) -> None:
    out["value"] = fn(torch.ones(1)).tolist()


def run_abort_before(fn, out: dict, seed: int | None = None) -> None:
    if dist.get_rank() == 1:
        print("rank 1 aborts before its report", file=sys.stderr, flush=True)
        os.abort()
    run_summed(fn, out)


resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files for the aborts
run_exercises(sys.argv[1:], {"abort_before": run_abort_before, "abort_after": run_summed})
if any(key.startswith("abort_after:") for key in sys.argv[2:]):
    dist.barrier()  # every rank has reported
    if dist.get_rank() == 1:
        os.abort()
