"""The bytes one rank sends per collective: the ring algorithm's count and the ZeRO paper's.

How many bytes does a rank send? (the ring algorithm, N ranks, a message of `nbytes`)
    reduce-scatter, all-gather: (N-1)/N x nbytes     all-reduce: 2(N-1)/N x nbytes
    broadcast: nbytes (the root must send every byte once)
The ZeRO paper drops the (N-1)/N and counts an all-reduce of Ψ elements as 2Ψ and a
reduce-scatter or all-gather as Ψ (`zero_volume`); the ledger reports both conventions.
Pure arithmetic, no torch: the ledger, the projections and the knob formulas all count here.
"""

from __future__ import annotations

import math

# The collectives the course times and models. Sizes follow nccl-tests: for all-reduce and
# broadcast the buffer; for reduce-scatter the (full) input; for all-gather the (full) output.
RING_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


# --------------------------------------------------------------------------- bytes sent


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for `op` on `world_size` ranks, as nccl-tests defines it.

    It is also the fraction of the message each rank sends under the ring algorithm, which
    is why bus bandwidth can be compared with a link's peak bandwidth whatever N is.
    """
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {n}")
    if n == 1 or op in ("recv", "barrier"):
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}; expected one of {RING_OPS} or p2p/others")


def ring_bytes_sent(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for `op` on a message of `nbytes` under the ring algorithm.

    Exact (an integer value) when `nbytes` splits into N equal chunks, as in every ZeRO stage
    whose flat buffers are padded to a multiple of N.
    """
    n = world_size
    if n == 1 or op in ("recv", "barrier"):
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes / n
    if op in ("reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"):
        return (n - 1) * nbytes / n
    return float(nbytes) * bus_factor(op, n)


def ring_steps(op: str, world_size: int) -> int:
    """Messages each rank sends one after another: the number of alpha latencies paid.

    A ring reduce-scatter or all-gather takes N-1 steps, an all-reduce 2(N-1); a pipelined
    ring broadcast needs N-1 hops before the last rank has the first byte.
    """
    n = world_size
    if n == 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("reduce_scatter", "all_gather", "broadcast", "all_to_all", "gather", "scatter",
              "reduce"):
        return n - 1
    if op == "send":
        return 1
    return 0


def zero_volume(op: str, nbytes: int) -> int:
    """Volume in the ZeRO paper's convention (no (N-1)/N): all-reduce 2x, others 1x, recv 0."""
    if op in ("recv", "barrier"):
        return 0
    return 2 * nbytes if op == "all_reduce" else nbytes


def describe_bytes(nbytes: float) -> str:
    """'1.0 KiB', '64.0 MiB', ... for tables and axis labels."""
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    exp = min(int(math.log(nbytes, 1024)), 4)
    return f"{nbytes / 1024 ** exp:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exp]}"
