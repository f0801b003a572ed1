"""Ring reduce-scatter, all-gather and all-reduce, built only on point-to-point messages.

`ring_reduce_scatter(output, input)`, `ring_all_gather(output, input)` and
`ring_all_reduce(tensor)` have the signatures of torch's own (SUM, default group), and
all-reduce is literally reduce-scatter followed by all-gather. Notebook 02 steps through them
for N = 4 and checks them against torch's collectives; `ring_schedule` draws who sends what.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

#
# The N ranks form a ring: rank r sends only to its right neighbour r+1 and receives only
# from its left neighbour r-1 (mod N). The message is cut into N chunks. In every step each
# rank sends one chunk and receives one chunk at the same time, so every link is busy every
# step and no rank ever sends more than one chunk at a time. That is why the ring is
# bandwidth-optimal: each rank sends (N-1) chunks per phase, i.e. (N-1)/N of the message.


def reduce_scatter_step(rank: int, step: int, world_size: int) -> tuple[int, int]:
    """(chunk `rank` sends, chunk it receives and adds to) at `step` of ring reduce-scatter.

    At step 0 rank r sends its own copy of chunk r-1; each later step it forwards the partial
    sum it has just grown. After N-1 steps chunk r has visited every rank and, arriving back
    at rank r, holds the sum over all ranks.
    """
    return (rank - step - 1) % world_size, (rank - step - 2) % world_size


def all_gather_step(rank: int, step: int, world_size: int) -> tuple[int, int]:
    """(chunk `rank` sends, chunk it receives) at `step` of ring all-gather.

    Rank r starts with chunk r complete, sends it right, then passes on whatever arrived
    from the left; after N-1 steps every rank has every chunk.
    """
    return (rank - step) % world_size, (rank - step - 1) % world_size


def ring_schedule(op: str, world_size: int) -> list[list[tuple[int, int, int]]]:
    """Who sends which chunk to whom: one list per step of (src, dst, chunk) triples.

    The same index arithmetic as the implementations below, for figures and for predicting
    traffic by hand. `op` is "reduce_scatter", "all_gather" or "all_reduce" (both phases).
    """
    n = world_size
    phases = {"reduce_scatter": [reduce_scatter_step], "all_gather": [all_gather_step],
              "all_reduce": [reduce_scatter_step, all_gather_step]}
    if op not in phases:
        raise ValueError(f"op must be one of {sorted(phases)}, got {op!r}")
    steps = []
    for step_fn in phases[op]:
        for step in range(n - 1):
            steps.append([(r, (r + 1) % n, step_fn(r, step, n)[0]) for r in range(n)])
    return steps


def _pass_along(send_buf: torch.Tensor, recv_buf: torch.Tensor, right: int, left: int) -> None:
    """Send `send_buf` to the right neighbour while receiving `recv_buf` from the left one.

    Both are posted before either is waited on: with a blocking send first, every rank would
    wait for its neighbour to receive, and the ring would deadlock. Empty chunks (a tensor
    smaller than N) are skipped on both sides, which agree because all ranks see equal sizes.
    """
    requests = []
    if send_buf.numel() > 0:
        requests.append(dist.isend(send_buf, dst=right))
    if recv_buf.numel() > 0:
        requests.append(dist.irecv(recv_buf, src=left))
    for request in requests:
        request.wait()


def _ring_reduce_scatter_chunks(chunks: Sequence[torch.Tensor], after_step=None) -> None:
    """In place: afterwards chunks[rank] holds the sum over ranks of everyone's chunk[rank].

    The other chunks are left holding partial sums (scratch). `after_step(phase, step)`, if
    given, is called after each step (notebook 02 records the chunks there to draw them).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_chunk, recv_chunk = reduce_scatter_step(rank, step, n)
        incoming = torch.empty_like(chunks[recv_chunk])
        _pass_along(chunks[send_chunk], incoming, right, left)
        chunks[recv_chunk].add_(incoming)  # my contribution joins the partial sum
        if after_step:
            after_step("reduce-scatter", step)


def _ring_all_gather_chunks(chunks: Sequence[torch.Tensor], after_step=None) -> None:
    """In place: chunks[rank] is complete on entry; afterwards every chunk is, on every rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_chunk, recv_chunk = all_gather_step(rank, step, n)
        _pass_along(chunks[send_chunk], chunks[recv_chunk], right, left)  # lands in place
        if after_step:
            after_step("all-gather", step)


def _check_sizes(whole: torch.Tensor, part: torch.Tensor, n: int, whole_name: str,
                 part_name: str) -> None:
    """`whole` must hold N chunks of `part`'s size, of the same dtype."""
    if whole.numel() != n * part.numel():
        raise ValueError(f"{whole_name} must have world_size x {part_name}.numel() = {n} x "
                         f"{part.numel()} elements, got {whole.numel()}")
    if whole.dtype != part.dtype:
        raise ValueError(f"dtypes differ: {whole_name} {whole.dtype}, {part_name} {part.dtype}")


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor) -> None:
    """Like `dist.reduce_scatter_single(output, input)` (SUM), on isend/irecv only.

    `input` holds N equal chunks of `output.numel()` elements (in flat order); rank r's
    `output` receives the sum over ranks of chunk r. `input` is not modified.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    _check_sizes(input, output, n, "input", "output")
    if output.numel() == 0:
        return
    scratch = input.detach().reshape(-1).clone()  # partial sums grow here, not in `input`
    chunks = scratch.split(output.numel())
    _ring_reduce_scatter_chunks(chunks)
    output.copy_(chunks[rank].view(output.shape))


def ring_all_gather(output: torch.Tensor, input: torch.Tensor) -> None:
    """Like `dist.all_gather_single(output, input)`, on isend/irecv only.

    `output` (N x `input.numel()` elements) receives every rank's `input`, in rank order.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    _check_sizes(output, input, n, "output", "input")
    if input.numel() == 0:
        return
    # Receive straight into `output` when it is one contiguous block, else via a buffer.
    contiguous = output.is_contiguous()
    flat = output.view(-1) if contiguous else output.new_empty(output.numel())
    chunks = flat.split(input.numel())
    chunks[rank].copy_(input.reshape(-1))
    _ring_all_gather_chunks(chunks)
    if not contiguous:
        output.copy_(flat.view(output.shape))


def ring_all_reduce(tensor: torch.Tensor, after_step=None) -> None:
    """Like `dist.all_reduce(tensor)` (SUM), on isend/irecv only: reduce-scatter + all-gather.

    Works for any size: the tensor is cut into N chunks whose sizes differ by at most one
    element (`torch.tensor_split`), so N need not divide `tensor.numel()`. `after_step(phase,
    step)` is called after each of the 2(N-1) steps, with `tensor` as it stands (contiguous).
    """
    n = dist.get_world_size()
    contiguous = tensor.is_contiguous()
    flat = tensor.view(-1) if contiguous else tensor.reshape(-1).clone()
    chunks = flat.tensor_split(n)  # views: both phases work inside `flat` itself
    _ring_reduce_scatter_chunks(chunks, after_step)  # now rank r holds chunk r's full sum ...
    _ring_all_gather_chunks(chunks, after_step)  # ... and passes it round to every rank
    if not contiguous:
        tensor.copy_(flat.view(tensor.shape))
