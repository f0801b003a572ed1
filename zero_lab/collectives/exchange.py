"""Reduce-scatter and all-gather as one direct exchange of point-to-point messages.

Why this exists. The ZeRO stages' cost argument is that a reduce-scatter plus an all-gather
send exactly what one all-reduce sends (2Ψ, ZeRO paper section 7). On GPUs NCCL's
reduce-scatter is a real one. But torch 2.13's gloo backend (CPU) implements
`reduce_scatter_single` as a clone of the whole input, a full all-reduce and a copy of the
wanted slice: it sends *more* than the all-reduce it should halve. Measured on a 2-core
laptop, 2 ranks, 24 MiB of fp32: all-reduce 18 ms, torch's reduce-scatter 27 ms, the direct
exchange below 9.5 ms (best of 15; `make bench` times it too, and notebook 03 checks what the
profiler names a gloo reduce-scatter).

So on gloo the stages send the bytes themselves (`transports.py` picks the transport):

    reduce-scatter   rank r sends every other rank p the chunk p owns, receives the N-1
                     copies of its own chunk, and adds them up (in a fixed order);
    all-gather       rank r sends its chunk to every other rank and receives theirs in place.

Each rank sends (N-1) chunks: exactly the (N-1)/N of the message a ring sends
(`zero_lab.collectives.ring`, notebook 02). The ring needs N-1 rounds, each waiting
for the last; here every message is posted at once, so the whole collective runs in the
background behind one handle (`Exchange`), which is what stage 2 needs to overlap it with
backward. The price, N-1 connections per rank instead of 2, is nothing at the N of one
machine; NCCL picks its own algorithms on GPUs.

A `CommLedger` records each exchange as the one collective it implements (a reduce-scatter of
the full input, an all-gather of the full output), not as its 2(N-1) messages, so the
ledger's bytes and the ZeRO paper's volumes read the same whichever transport ran.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from zero_lab.collectives.ledger import recorded_as


class Exchange:
    """The handle of an exchange in flight, used like `dist.Work`: `wait()` finishes it."""

    def __init__(self, requests: list, finish: Callable[[], None] | None = None) -> None:
        self._requests = requests  # the isend/irecv works; they keep their tensors alive
        self._finish = finish  # what to do once everything arrived (the sum)
        _IN_FLIGHT.add(self)

    def is_completed(self) -> bool:
        return self._finish is None and not self._requests

    def wait(self) -> bool:
        for request in self._requests:
            request.wait()
        self._requests = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def __del__(self) -> None:
        # A handle dropped in flight (a model deleted between its step and the next forward
        # with overlap_param_gather, the reductions overlap_step leaves after backward, any
        # `async_op=True` result never waited on) finishes its messages first. gloo does not
        # keep a dropped isend/irecv or its buffer alive: the peer's message would land in
        # freed memory (glibc heap corruption) or never be matched (the launch hangs). Every
        # peer posted its side when the collective was issued, so this wait ends. The sum
        # (`finish`) is skipped: nobody holds its output any more.
        for request in self._requests:
            request.wait()


# Every exchange not yet collected, so that a rank finishes its own before it leaves
# (launch/rank_side.py): a rank that ends its script with messages still posted (the all-gathers
# overlap_param_gather leaves for a next forward that never comes) closes its connections
# under a slower peer's receives, and the peer fails with "Connection closed by peer"
# (seen once in a CI run of notebook 07's checkpoint demo).
_IN_FLIGHT: weakref.WeakSet[Exchange] = weakref.WeakSet()


def finish_in_flight() -> int:
    """Wait for every exchange this process still has in flight; returns how many there were."""
    pending = [x for x in list(_IN_FLIGHT) if not x.is_completed()]
    for exchange in pending:
        exchange.wait()
    return len(pending)


def _chunks(full: torch.Tensor, part: torch.Tensor, n: int, what: str) -> list[torch.Tensor]:
    """`full` cut into N chunks of `part.numel()` elements (views), after checking the sizes."""
    if full.numel() != n * part.numel():
        raise ValueError(f"{what} must have world_size x {part.numel()} = "
                         f"{n * part.numel()} elements, got {full.numel()}")
    if full.dtype != part.dtype:
        raise ValueError(f"dtypes differ: {full.dtype} and {part.dtype}")
    if not (full.is_contiguous() and part.is_contiguous()):
        raise ValueError("the direct exchange needs contiguous tensors")
    return list(full.view(-1).split(part.numel()))


def _exchange(sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group) -> list:
    """Post every send and receive at once (none waits for another: no deadlock). Empty
    chunks are not sent; every rank skips them alike, as all see the same sizes."""
    requests = []
    for peer, tensor in sends.items():
        if tensor.numel():
            requests.append(dist.isend(tensor, group=group, group_dst=peer))
    for peer, tensor in recvs.items():
        if tensor.numel():
            requests.append(dist.irecv(tensor, group=group, group_src=peer))
    return requests


def reduce_scatter(output: torch.Tensor, input: torch.Tensor,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None,
                   async_op: bool = False) -> Exchange | None:
    """Like `dist.reduce_scatter_single(output, input, op)` for SUM and AVG.

    `input` holds N chunks of `output.numel()` elements; rank r's `output` receives the sum
    (or the average) over ranks of chunk r. `input` is not modified but must stay untouched
    until the exchange is waited on.
    """
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"the direct reduce-scatter supports SUM and AVG, got {op}")
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = _chunks(input, output, n, "input")
    peers = [p for p in range(n) if p != rank]
    # The first peer's copy of our chunk lands in `output` itself, the others in buffers of
    # their own (none at N = 2).
    received = {p: output if i == 0 else torch.empty_like(output) for i, p in enumerate(peers)}

    def finish() -> None:
        # Add the other copies to the first one in rank order, whichever message arrived
        # first: the same inputs always give the same bits.
        if not peers:  # one rank: the sum of one copy
            output.copy_(chunks[rank])
        for p in range(n):
            if p == rank and peers:
                output.add_(chunks[rank])
            elif p != rank and p != peers[0]:
                output.add_(received[p])
        if op == dist.ReduceOp.AVG:
            output.div_(n)

    with recorded_as("reduce_scatter", input, group_size=n, async_op=async_op, group=group):
        work = Exchange(_exchange({p: chunks[p] for p in peers}, received, group), finish)
    if async_op:
        return work
    work.wait()
    return None


def all_gather(output: torch.Tensor, input: torch.Tensor,
               group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Exchange | None:
    """Like `dist.all_gather_single(output, input)`: `output` receives every rank's `input`
    in rank order. `input` may be this rank's own chunk of `output` (in place)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = _chunks(output, input, n, "output")
    mine = chunks[rank]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input.view(-1))
    peers = [p for p in range(n) if p != rank]
    with recorded_as("all_gather", output, group_size=n, async_op=async_op, group=group):
        work = Exchange(_exchange({p: mine for p in peers}, {p: chunks[p] for p in peers},
                                  group))
    if async_op:
        return work
    work.wait()
    return None


# ------------------------------------------------------------ no communication at all
# transport="none" (transports.py), for notebook 06's A/B check of what communication costs:
# a collective's local work only (this rank's chunk copied, the average's division), nothing
# sent or recorded. Meaningless but finite: the all-gather writes this rank's chunk where the
# others' would land (a fresh stage-3 buffer's NaN or denormals made Adam 1.7x slower).


def reduce_scatter_skipped(output: torch.Tensor, input: torch.Tensor,
                           op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                           group: dist.ProcessGroup | None = None,
                           async_op: bool = False) -> Exchange | None:
    """`reduce_scatter` without the messages: `output` gets this rank's own chunk (the sum of
    one copy instead of N), divided by N for AVG as the real one would."""
    n = dist.get_world_size(group)
    output.copy_(_chunks(input, output, n, "input")[dist.get_rank(group)])
    if op == dist.ReduceOp.AVG:
        output.div_(n)
    return Exchange([]) if async_op else None


def all_gather_skipped(output: torch.Tensor, input: torch.Tensor,
                       group: dist.ProcessGroup | None = None,
                       async_op: bool = False) -> Exchange | None:
    """`all_gather` without the messages: every chunk of `output` gets this rank's `input`,
    the bytes the real receives would write, with values that are real parameters."""
    chunks = _chunks(output, input, dist.get_world_size(group), "output")
    mine = chunks[dist.get_rank(group)]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input.view(-1))
    for chunk in chunks:
        if chunk.data_ptr() != mine.data_ptr():
            chunk.copy_(mine)
    return Exchange([]) if async_op else None
