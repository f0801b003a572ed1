"""Notebook 02's checks: the ring reduce-scatter on 3 ranks, and what a ring sends.

`check_ring_reduce_scatter` runs the learner's ring, built from isend/irecv, on 3 gloo ranks
(zero_lab/workers/ring_exercise.py); the ranks report the raw facts (the output's and the
input's values, the operations issued, the bytes sent) and `judge_ring_reduce_scatter`, in
this process where the learner's code does not run, rebuilds every rank's input from the same
cases (zero_lab/course/rank_cases/ring.py), sums them and decides. The reports are untrusted
data: anything malformed fails the check with a message, never crashes the judge.
`check_ring_bytes_sent` is plain input -> output against `zero_lab.collectives`; its cases
come from `ring_bytes_sent_cases(rng)` (rng None: the notebook's; a `random.Random`: drawn
ops, sizes and world sizes, for the batch grader, grading/hidden.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from zero_lab.course import models
from zero_lab.course.rank_cases.ring import (
    OUTPUT_FILL,
    TOLERANCE,
    RingCase,
    rank_inputs,
    reduce_scatter_sum,
    ring_reduce_scatter_cases,
)
from zero_lab.grading.framework import Case, fail, passed, run_cases
from zero_lab.grading.rank_reports import (
    case_record,
    chosen_cases,
    close,
    numbers,
    passed_cases,
    readable,
    world_size,
)
from zero_lab.grading.remote import RankExercise, run_exercise


def _ring_probe() -> tuple:
    import torch

    return torch.zeros(1), torch.zeros(3)


RING_REDUCE_SCATTER = RankExercise("ring_exercise.py", "ring_reduce_scatter", _ring_probe,
                                   ring_reduce_scatter_cases)
# A ring hangs when a message is never sent, not when a collective is skipped.
RING_HANG_HINT = ("a rank is waiting for a message no rank sends. Post the step's isend AND "
                  "irecv before waiting on either; send to (rank + 1) % N, receive from "
                  "(rank - 1) % N; every rank must run the same number of steps (N - 1)")
ELEMENT_BYTES = {"int64": 8, "float32": 4, "float64": 8}
SHOWN = 6  # the first values a failure shows, expected against got


def check_ring_reduce_scatter(fn: Callable, timeout: float | None = None) -> None:
    """Notebook 02: fn(output, input), a ring reduce-scatter (SUM) on isend/irecv only.

    Runs the learner's function (from its source) on 3 ranks under gloo, with chunk sizes 1,
    5, 7, 1001 and a 2-D output (zero_lab/workers/ring_exercise.py), and compares every
    rank's output with the sum of every rank's input chunk, computed here. The ledger must
    show no collective and exactly (N-1)/N of the input sent; the input must be left unchanged.
    """
    name = "check_ring_reduce_scatter"
    reports = run_exercise(name, RING_REDUCE_SCATTER, [fn], timeout, RING_HANG_HINT)
    judge_ring_reduce_scatter(name, reports)


def judge_ring_reduce_scatter(name: str, reports: list[dict], seed: int | None = None,
                              cases: Sequence[int] | None = None) -> None:
    """The verdict on every rank's report: no collective, input intact, values, bytes sent.

    `seed` picks the cases the ranks ran (None: the notebook's); `cases`, the 1-based numbers
    of those to judge (None: all of them; the batch grader judges one at a time, a point each).
    """
    all_cases = ring_reduce_scatter_cases(seed)
    chosen = chosen_cases(name, all_cases, cases)
    numbers = [k for k, _ in chosen]
    n = world_size(name, reports, least=2)
    inputs = [rank_inputs(all_cases, rank, n) for rank in range(n)]  # all: they share draws
    for rank in range(n):
        for k in numbers:
            case = all_cases[k - 1]
            which = f"case {k}/{len(all_cases)} ({case.label(n)})"
            where = f"{which}, rank {rank}"
            record = case_record(name, reports, rank, k, which)
            with readable(name, where):
                _judge_case(name, where, case, n, rank, record, [x[k - 1] for x in inputs])
    judged = passed_cases(all_cases, chosen)
    passed(name, f"{judged} pass on {n} ranks: dist's result, isend/irecv only, (N-1)/N of "
                 "it sent",
           "you can build a reduce-scatter from sends alone: N-1 steps of 1/N of the input")


def _judge_case(name: str, where: str, case: RingCase, n: int, rank: int, record: dict,
                inputs: list) -> None:
    """One rank's record of one case against the sum computed here, at the first problem."""
    ops = record["ops"]
    if not isinstance(ops, list):
        raise TypeError("the operations are not a list")
    collectives = sorted({str(op) for op in ops} - {"send", "recv"})
    if collectives:
        fail(name, f"{where}: your function called {', '.join(collectives)}",
             "build it from dist.isend / dist.irecv only: the point is to see how "
             "torch's collective works inside")
    if numbers(record["input_after"]) != inputs[rank].reshape(-1).double().tolist():
        fail(name, f"{where}: `input` was modified",
             "accumulate partial sums in a copy (input.clone()), as torch does")
    got, expected = numbers(record["output"]), reduce_scatter_sum(inputs, rank)
    tol = TOLERANCE[case.dtype]
    if not close(got, expected, tol, tol):
        detail = (f"{where}\n  expected (first values): {_shown(expected, case)}"
                  f"\n  got:                     {_shown(got, case)}")
        own = inputs[rank].double().reshape(n, -1)[rank].tolist()
        if close(got, own, tol, tol):
            hint = ("this rank kept its own chunk r without the other ranks' "
                    "contributions: at each step add the incoming chunk to yours")
        elif got and all(v == OUTPUT_FILL for v in got):
            hint = "output was never written: copy the finished chunk into it"
        else:
            hint = ("step s: send chunk (rank - s - 1) % N to the right, receive chunk "
                    "(rank - s - 2) % N from the left and add it; after N - 1 steps "
                    "chunk `rank` holds the full sum")
        fail(name, detail, hint)
    sent = float(record["sent_bytes"])
    expected_sent = (n - 1) * case.numel * ELEMENT_BYTES[case.dtype]
    if sent != expected_sent:
        fail(name, f"{where}: right values, but this rank sent {sent:.0f} bytes; the ring "
                   f"sends exactly (N-1)/N of the input = {expected_sent} bytes",
             "send one chunk (input.numel() / N elements) per step, N - 1 steps")


def _shown(values: list[float], case: RingCase) -> list:
    """The first values, as the dtype prints them (ints for int64)."""
    first = values[:SHOWN]
    return [int(v) if case.dtype == "int64" and v.is_integer() else v for v in first]


RING_HINTS = {
    "all_reduce": "all-reduce = reduce-scatter + all-gather: two phases of N-1 chunks",
    "reduce_scatter": "N-1 steps, one chunk of nbytes/N per step",
    "all_gather": "N-1 steps, one chunk of nbytes/N per step",
    "broadcast": "every byte has to leave the root once",
}
RING_OPS = tuple(RING_HINTS)
RING_WORLD_SIZES = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64, 128, 256, 512, 1024)


def reference_bytes_sent(op: str, nbytes: int, world_size: int) -> float:
    """`zero_lab.collectives.ring_bytes_sent`, imported when first used."""
    from zero_lab.collectives import ring_bytes_sent

    return ring_bytes_sent(op, nbytes, world_size)


def _paper_volume(op, nbytes, n):
    return 2 * nbytes if op == "all_reduce" else nbytes


def _whole_message_each_step(op, nbytes, n):
    return (n - 1) * nbytes


def _all_reduce_one_phase(op, nbytes, n):
    return (n - 1) / n * nbytes if op == "all_reduce" else reference_bytes_sent(op, nbytes, n)


def _broadcast_split(op, nbytes, n):
    return (n - 1) / n * nbytes * (2 if op == "all_reduce" else 1)


RING_BYTES_WRONG = (
    (_paper_volume, "that is the ZeRO paper's rounded volume: a rank does not send its own "
                    "chunk, so each phase sends (N-1)/N of the message, not all of it"),
    (_whole_message_each_step, "each step sends one chunk, nbytes/N, not the whole message"),
    (_all_reduce_one_phase, "all-reduce has two phases (reduce-scatter, then all-gather): "
                            "2(N-1)/N"),
    (_broadcast_split, "broadcast cannot split the work: the root must send all nbytes itself "
                       "(nccl-tests' bus factor 1)"),
)


def ring_bytes_sent_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's 8 cases (rng None), or 8 drawn from `rng`: every op once on N >= 3
    ranks (each known mistake gives another value on one of them), three more of any op on
    N >= 2, and one on a single rank; messages of 2 B to 40 GB, in a shuffled order."""
    if rng is None:
        configs = [
            ("all_reduce", 2 * models.PSI_8B, 8),  # Llama 3.1 8B's bf16 gradient on 8 GPUs
            ("all_reduce", 1024, 2),
            ("reduce_scatter", 2_000_000_000, 4),
            ("all_gather", 3 * 2**20, 3),
            ("all_gather", 1000, 2),
            ("reduce_scatter", 64 * 2**20, 64),
            ("broadcast", 4096, 4),
            ("all_reduce", 12, 1),
        ]
    else:
        ops = list(RING_OPS) + [rng.choice(RING_OPS) for _ in range(4)]
        sizes = ([rng.choice(RING_WORLD_SIZES[1:]) for _ in range(4)]
                 + [rng.choice(RING_WORLD_SIZES) for _ in range(3)] + [1])
        configs = [(op, rng.choice((2, 4)) * rng.randrange(1, 10**10), n)
                   for op, n in zip(ops, sizes, strict=True)]
        rng.shuffle(configs)
    return [Case(args=(op, nbytes, n), expected=reference_bytes_sent(op, nbytes, n),
                 hint=RING_HINTS[op] + ("; one rank sends nothing" if n == 1 else ""))
            for op, nbytes, n in configs]


def check_ring_bytes_sent(fn: Callable) -> None:
    """Notebook 02: fn(op, nbytes, world_size) -> bytes one rank sends under the ring algorithm.

    op is "all_reduce", "reduce_scatter", "all_gather" or "broadcast"; nbytes the full message
    (reduce-scatter input, all-gather output), as nccl-tests and `zero_lab.collectives` count.
    """
    run_cases("check_ring_bytes_sent", fn, ring_bytes_sent_cases(None),
              wrong_answers=RING_BYTES_WRONG,
              shows="you can price each collective in the bytes one rank sends on a ring")
