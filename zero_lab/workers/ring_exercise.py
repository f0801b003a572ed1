"""The graded ring reduce-scatter of notebook 02, run on every rank; judged by the grader.

Started by `zero_lab.grading.check_ring_reduce_scatter` (3 ranks, gloo):

    ring_exercise.py SOURCE_FILE [--seed N] ring_reduce_scatter:FUNCTION [...]

SOURCE_FILE holds the learner's function; it runs with `torch`, `dist`, `nn` and `math`
already imported. The cases (the notebook's, or those drawn from the batch grader's seed) and
every rank's inputs come from zero_lab/course/rank_cases/ring.py. Each rank reports, per case,
what it observed: the output's values, the input's values after the call, the operations the
function issued and the bytes it sent. It compares nothing: the learner's function runs in
this process and could replace any comparison made here, so the judge in
`zero_lab.grading.nb02_collectives` rebuilds every rank's input and decides, in its own
process. An exception is reported with its case, then re-raised so that torchrun stops every
rank at once instead of leaving the others waiting (`zero_lab.course.exercises.run_exercises`).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from zero_lab.collectives import CommLedger
from zero_lab.course.exercises import learner_error, run_exercises
from zero_lab.course.rank_cases.ring import (
    DTYPES,
    OUTPUT_FILL,
    rank_inputs,
    ring_reduce_scatter_cases,
)


def run_ring_reduce_scatter(fn, out: dict, seed: int | None) -> None:
    """fn(output, input) on every case of `seed`; reported per case: the output's values, the
    input's values after the call, the operations the ledger saw, the bytes sent."""
    rank, n = dist.get_rank(), dist.get_world_size()
    cases = ring_reduce_scatter_cases(seed)
    out["results"] = results = []
    for i, (case, data) in enumerate(zip(cases, rank_inputs(cases, rank, n), strict=True)):
        got = torch.full(case.shape, OUTPUT_FILL, dtype=DTYPES[case.dtype])
        label = case.label(n)
        try:
            with CommLedger() as ledger:
                fn(got, data)
        except BaseException as exc:
            results.append({"case": i + 1, "label": label, "error": learner_error(exc)})
            raise
        results.append({
            "case": i + 1, "label": label,
            "output": got.reshape(-1).tolist(),
            "input_after": data.reshape(-1).tolist(),  # the judge knows what it was before
            "ops": sorted({r.op for r in ledger.records}),
            "sent_bytes": ledger.total_bytes("send"),
        })


RUNNERS = {"ring_reduce_scatter": run_ring_reduce_scatter}


def main(argv: list[str]) -> None:
    """ring_exercise.py SOURCE_FILE [--seed N] ring_reduce_scatter:FUNCTION [...]

    Records hold "results".
    """
    run_exercises(argv, RUNNERS)


if __name__ == "__main__":
    main(sys.argv[1:])
