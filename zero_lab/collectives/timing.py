"""How long a collective takes: timed over message sizes, fitted to an alpha-beta model.

Time each collective over message sizes (`time_collective`, `sweep`, inside a process
group), fit a per-message latency alpha and a bandwidth beta by least squares
(`fit_alpha_beta`), report algorithm and bus bandwidth as nccl-tests defines them
(`algbw`, `busbw`), and predict: t = ring_steps x alpha + ring_bytes_sent / beta
(the byte counts are `volume.py`'s).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero_lab.collectives import exchange
from zero_lab.collectives.volume import RING_OPS, bus_factor, ring_bytes_sent, ring_steps


def message_sizes(min_bytes: int = 1 << 10, max_bytes: int = 64 << 20,
                  factor: int = 4) -> list[int]:
    """Geometric message sizes from `min_bytes` to `max_bytes` (both included when reachable)."""
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError("need 1 <= min_bytes <= max_bytes and factor >= 2")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def _buffers(op: str, nbytes: int, n: int, device, dtype) -> tuple[int, tuple]:
    """Tensors for one call of `op` on a message of about `nbytes` (rounded to N elements)."""
    elem = torch.empty((), dtype=dtype).element_size()
    numel = max(n, nbytes // elem // n * n)  # N equal chunks, so every op is well defined
    full = torch.ones(numel, dtype=dtype, device=device)
    part = torch.empty(numel // n, dtype=dtype, device=device)
    return numel * elem, {"all_reduce": (full,), "broadcast": (full,),
                          "reduce_scatter": (part, full), "all_gather": (full, part)}[op]


# How a timed collective is sent: "torch" (torch.distributed's own) or "direct" (the
# reduce-scatter and all-gather the stages send on gloo, `exchange.py`: one round of messages).
TRANSPORTS = ("torch", "direct")


def _call(op: str, bufs: tuple, transport: str = "torch") -> None:
    if transport == "direct":
        if op == "reduce_scatter":
            exchange.reduce_scatter(bufs[0], bufs[1])
        elif op == "all_gather":
            exchange.all_gather(bufs[0], bufs[1])
        else:
            raise ValueError(f"the direct exchange cannot send {op!r}")
    elif op == "all_reduce":
        dist.all_reduce(bufs[0])
    elif op == "broadcast":
        dist.broadcast(bufs[0], src=0)
    elif op == "reduce_scatter":
        dist.reduce_scatter_single(bufs[0], bufs[1])
    elif op == "all_gather":
        dist.all_gather_single(bufs[0], bufs[1])
    else:
        raise ValueError(f"cannot time {op!r}; choose from {RING_OPS}")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device) -> float:
    """The largest value over ranks: a collective is as slow as its slowest rank."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_collective(op: str, nbytes: int, repeats: int = 3, target_s: float = 0.01,
                    device="cpu", dtype=torch.float32, transport: str = "torch") -> dict:
    """Time `op` on a message of about `nbytes` inside an initialised process group, sent by
    torch's collective or (`transport="direct"`) as the direct exchange (`exchange.py`).

    One warm-up call; then the calls are repeated back to back in batches lasting about
    `target_s` (so microsecond latencies are not lost in timer noise), `repeats` batches.
    Returns {"op", "nbytes", "world_size", "seconds", "transport"}: the per-call time of the
    slowest rank in the fastest batch (other processes sharing the machine can only add time,
    so the fastest batch is the least disturbed), and `nbytes` the exact size used (rounded
    down to N equal chunks).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}; got {transport!r}")
    if transport == "direct" and op not in ("reduce_scatter", "all_gather"):
        raise ValueError(f"the direct exchange sends reduce_scatter and all_gather; got {op!r}")
    n = dist.get_world_size()
    nbytes, bufs = _buffers(op, nbytes, n, device, dtype)
    dist.barrier()
    start = time.perf_counter()
    _call(op, bufs, transport)
    _sync(device)
    one = _slowest(time.perf_counter() - start, device)  # all ranks agree on the batch size
    calls = int(min(1000, max(1, target_s / max(one, 1e-7))))
    per_call = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            _call(op, bufs, transport)
        _sync(device)
        per_call.append(_slowest((time.perf_counter() - start) / calls, device))
    return {"op": op, "nbytes": nbytes, "world_size": n, "seconds": min(per_call),
            "transport": transport}


def sweep(ops: Iterable[str] = RING_OPS, sizes: Iterable[int] | None = None, repeats: int = 3,
          target_s: float = 0.01, device="cpu", transport: str = "torch") -> list[dict]:
    """`time_collective` for every op and size; call it on every rank of a process group."""
    sizes = list(sizes) if sizes is not None else message_sizes()
    return [time_collective(op, s, repeats, target_s, device, transport=transport)
            for op in ops for s in sizes]


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth (bytes/s), nccl-tests: message size / time."""
    return nbytes / seconds


def busbw(op: str, nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth (bytes/s), nccl-tests: algbw x bus_factor(op, N).

    It equals the bytes each rank sends under the ring algorithm divided by the time, so it
    is comparable to a link's bandwidth for any op and any N.
    """
    return algbw(nbytes, seconds) * bus_factor(op, world_size)


@dataclass(frozen=True)
class AlphaBeta:
    """t = ring_steps(op, N) x alpha + ring_bytes_sent(op, nbytes, N) / beta.

    `alpha`: seconds of latency per message (one ring step); `beta`: bytes/s one rank can
    push to its neighbour (the bus bandwidth the op achieves on large messages).
    """

    alpha: float
    beta: float

    def time(self, op: str, nbytes: float, world_size: int) -> float:
        return (ring_steps(op, world_size) * self.alpha
                + ring_bytes_sent(op, nbytes, world_size) / self.beta)


@dataclass(frozen=True)
class AlphaBetaModel:
    """A fitted AlphaBeta per op, plus `pooled`, fitted to all ops at once."""

    per_op: dict[str, AlphaBeta]
    pooled: AlphaBeta

    def predict(self, op: str, nbytes: float, world_size: int) -> float:
        """Predicted seconds for `op` on `nbytes` over `world_size` ranks.

        Uses the op's own fit when it was measured, else the pooled one. Across world sizes
        this assumes every ring link is as fast as the measured ones (true inside one NVLink
        or one CPU box, not across a slower network).
        """
        return self.per_op.get(op, self.pooled).time(op, nbytes, world_size)


def fit_alpha_beta_points(steps: Sequence[float], sent: Sequence[float],
                          seconds: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of t = steps x alpha + sent / beta, in relative error.

    The sizes span five decades, so plain least squares would fit only the largest
    messages; dividing each equation by its measured time weighs every point alike.
    alpha is clipped at zero (a negative latency is noise on a bandwidth-bound fit).
    """
    import numpy as np

    s, b, t = (np.asarray(x, dtype=np.float64) for x in (steps, sent, seconds))
    if len(t) < 2 or np.any(t <= 0):
        raise ValueError("need at least two timings, all positive")
    design = np.stack([s / t, b / t], axis=1)
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0:  # refit bandwidth alone
        alpha = 0.0
        inv_beta = float(np.sum(b / t) / np.sum((b / t) ** 2))
    if inv_beta <= 0:
        raise ValueError("the timings do not grow with message size; cannot fit a bandwidth")
    return AlphaBeta(alpha=float(alpha), beta=float(1.0 / inv_beta))


def fit_alpha_beta(timings: Iterable[dict]) -> AlphaBetaModel:
    """Fit the model to `time_collective` results (dicts with op, nbytes, world_size, seconds)."""
    timings = [t for t in timings if t["world_size"] > 1]
    if any(t.get("transport", "torch") != "torch" for t in timings):
        # its latency is one round, not ring_steps: links.fit_op_links counts it so
        raise ValueError("timings of the direct exchange do not fit a ring's alpha-beta model; "
                         "fit them with zero_lab.predict.links.fit_op_links")
    if not timings:
        raise ValueError("no timings with world_size > 1 (one rank sends nothing)")

    def fit(rows):
        return fit_alpha_beta_points(
            [ring_steps(r["op"], r["world_size"]) for r in rows],
            [ring_bytes_sent(r["op"], r["nbytes"], r["world_size"]) for r in rows],
            [r["seconds"] for r in rows])

    order = {op: i for i, op in enumerate(RING_OPS)}  # course order, then any others
    ops = sorted({t["op"] for t in timings}, key=lambda o: (order.get(o, len(order)), o))
    per_op = {op: fit([t for t in timings if t["op"] == op]) for op in ops}
    return AlphaBetaModel(per_op=per_op, pooled=fit(timings))
