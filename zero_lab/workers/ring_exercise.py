"""The graded ring reduce-scatter of notebook 02, run on every rank and compared with torch's.

Started by `zero_lab.grading.check_ring_reduce_scatter` (3 ranks, gloo):

    ring_exercise.py SOURCE_FILE ring_reduce_scatter:FUNCTION [...]

SOURCE_FILE holds the learner's function; it runs with `torch`, `dist`, `nn` and `math`
already imported. Each rank reports, per case: whether its output matched
`dist.reduce_scatter_single`, the first values expected and received, the collectives the
function issued (it must use only isend/irecv) and the bytes it sent; the check in
`zero_lab.grading` turns them into a verdict and a hint. An exception is reported with its
case, then re-raised so that torchrun stops every rank at once instead of leaving the others
waiting (`zero_lab.course.exercises.run_exercises`).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from zero_lab.collectives import CommLedger
from zero_lab.course.exercises import learner_error, run_exercises

# (output shape, dtype): chunk sizes that are odd, prime, 1, and a 2-D output
CASES = [((1,), torch.int64), ((5,), torch.int64), ((7,), torch.float64),
         ((1001,), torch.float32), ((4, 3), torch.float64)]


def run_ring_reduce_scatter(fn, out: dict) -> None:
    """fn(output, input) on every case, next to `dist.reduce_scatter_single` on the same input.

    Reported per case: match, first values, this rank's own chunk (to recognise a ring that
    never adds), whether `input` changed, the collectives issued besides send/recv, and the
    bytes sent against the ring's (N-1)/N of the input.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + rank)
    out["results"] = results = []
    for i, (shape, dtype) in enumerate(CASES):
        in_shape = (n * shape[0], *shape[1:])
        if dtype.is_floating_point:
            data = torch.randn(in_shape, generator=gen, dtype=dtype)
        else:
            data = torch.randint(-50, 50, in_shape, generator=gen, dtype=dtype)
        keep = data.clone()
        expected = torch.empty(shape, dtype=dtype)
        dist.reduce_scatter_single(expected, data)
        got = torch.full(shape, -7, dtype=dtype)
        label = (f"output {tuple(shape)} {str(dtype).removeprefix('torch.')}, "
                 f"input {tuple(in_shape)}")
        try:
            with CommLedger() as ledger:
                fn(got, data)
        except BaseException as exc:
            results.append({"case": i + 1, "label": label, "error": learner_error(exc)})
            raise
        tol = 1e-5 if dtype == torch.float32 else 1e-9
        ok = bool(torch.allclose(got.double(), expected.double(), rtol=tol, atol=tol))
        results.append({
            "case": i + 1, "label": label, "ok": ok,
            "expected": expected.flatten()[:6].tolist(), "got": got.flatten()[:6].tolist(),
            "own_chunk": data.reshape(n, -1)[rank][:6].tolist(),
            "input_modified": not torch.equal(data, keep),
            "collectives": sorted({r.op for r in ledger.records} - {"send", "recv"}),
            "sent_bytes": ledger.total_bytes("send"),
            "expected_sent_bytes": (n - 1) * math.prod(shape) * data.element_size(),
        })


RUNNERS = {"ring_reduce_scatter": run_ring_reduce_scatter}


def main(argv: list[str]) -> None:
    """ring_exercise.py SOURCE_FILE ring_reduce_scatter:FUNCTION [...]

    Records hold "results".
    """
    run_exercises(argv, RUNNERS)


if __name__ == "__main__":
    main(sys.argv[1:])
