"""Collectives from first principles: ring algorithms, a byte ledger, an alpha-beta cost model.

Every ZeRO stage is a choice of *which collective moves which bytes when*. This module holds
the three tools the course uses to reason about that, in reading order:

1. **Ring algorithms** built only on point-to-point `isend`/`irecv`:
   `ring_reduce_scatter(output, input)`, `ring_all_gather(output, input)` and
   `ring_all_reduce(tensor)`, with the signatures of torch's own (SUM, default group).
   All-reduce is literally reduce-scatter followed by all-gather.
2. **`CommLedger`**, a context manager that records every collective a block of code issues,
   however it is called (plain `dist.*` calls, `async_op=True`, autograd hooks, inside
   backward, functional collectives), with the bytes each rank sends under the ring algorithm.
3. **The alpha-beta model**: time each collective over message sizes, fit a per-message
   latency alpha and a bandwidth beta by least squares, report algorithm and bus bandwidth
   as nccl-tests defines them, and `predict(op, nbytes, world_size)`.

How many bytes does a rank send? (the ring algorithm, N ranks, a message of `nbytes`)
    reduce-scatter, all-gather: (N-1)/N x nbytes     all-reduce: 2(N-1)/N x nbytes
    broadcast: nbytes (the root must send every byte once)
The ZeRO paper drops the (N-1)/N and counts an all-reduce of Ψ elements as 2Ψ and a
reduce-scatter or all-gather as Ψ; the ledger reports both conventions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# The collectives the course times and models. Sizes follow nccl-tests: for all-reduce and
# broadcast the buffer; for reduce-scatter the (full) input; for all-gather the (full) output.
RING_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


# =========================================================================== cost formulas


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


# =========================================================================== ring algorithms
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


def _exchange(send_buf: torch.Tensor, recv_buf: torch.Tensor, right: int, left: int) -> None:
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


def _ring_reduce_scatter_chunks(chunks: Sequence[torch.Tensor]) -> None:
    """In place: afterwards chunks[rank] holds the sum over ranks of everyone's chunk[rank].

    The other chunks are left holding partial sums (scratch).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_chunk, recv_chunk = reduce_scatter_step(rank, step, n)
        incoming = torch.empty_like(chunks[recv_chunk])
        _exchange(chunks[send_chunk], incoming, right, left)
        chunks[recv_chunk].add_(incoming)  # my contribution joins the partial sum


def _ring_all_gather_chunks(chunks: Sequence[torch.Tensor]) -> None:
    """In place: chunks[rank] is complete on entry; afterwards every chunk is, on every rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_chunk, recv_chunk = all_gather_step(rank, step, n)
        _exchange(chunks[send_chunk], chunks[recv_chunk], right, left)  # lands in place


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor) -> None:
    """Like `dist.reduce_scatter_single(output, input)` (SUM), on isend/irecv only.

    `input` holds N equal chunks of `output.numel()` elements (in flat order); rank r's
    `output` receives the sum over ranks of chunk r. `input` is not modified.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    if input.numel() != n * output.numel():
        raise ValueError(
            f"input must have world_size x output.numel() = {n} x {output.numel()} elements, "
            f"got {input.numel()}"
        )
    if input.dtype != output.dtype:
        raise ValueError(f"dtypes differ: input {input.dtype}, output {output.dtype}")
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
    if output.numel() != n * input.numel():
        raise ValueError(
            f"output must have world_size x input.numel() = {n} x {input.numel()} elements, "
            f"got {output.numel()}"
        )
    if input.dtype != output.dtype:
        raise ValueError(f"dtypes differ: input {input.dtype}, output {output.dtype}")
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


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Like `dist.all_reduce(tensor)` (SUM), on isend/irecv only: reduce-scatter + all-gather.

    Works for any size: the tensor is cut into N chunks whose sizes differ by at most one
    element (`torch.tensor_split`), so N need not divide `tensor.numel()`.
    """
    n = dist.get_world_size()
    contiguous = tensor.is_contiguous()
    flat = tensor.view(-1) if contiguous else tensor.reshape(-1).clone()
    chunks = flat.tensor_split(n)  # views: both phases work inside `flat` itself
    _ring_reduce_scatter_chunks(chunks)  # now rank r holds the full sum of chunk r ...
    _ring_all_gather_chunks(chunks)  # ... and passes it round so everyone has every chunk
    if not contiguous:
        tensor.copy_(flat.view(tensor.shape))


# =========================================================================== the ledger


@dataclass(frozen=True)
class CommRecord:
    """One collective (or point-to-point message) as this rank issued it.

    `nbytes` is the full message in nccl-tests' sense: the all-reduced or broadcast tensor,
    the reduce-scatter *input* (N chunks), the all-gather *output* (N chunks), the message
    of a send/recv. `sent_bytes` is what this rank sends under the ring algorithm
    (`ring_bytes_sent`); for a point-to-point send it is exactly the message, for a recv 0.
    `volume` is the ZeRO paper's count (all-reduce 2 x nbytes, others nbytes, recv 0).
    """

    op: str
    numel: int
    dtype: str
    nbytes: int
    world_size: int
    sent_bytes: float
    volume: int
    async_op: bool
    in_backward: bool
    torch_op: str


class CommLedger(TorchDispatchMode):
    """Record every collective issued inside a `with` block, with its bytes.

        with CommLedger() as ledger:
            loss.backward(); opt.step()
        ledger.total_bytes()                  # bytes this rank sent (ring algorithm)
        ledger.total_bytes("reduce_scatter")  # ... by reduce-scatters only
        ledger.volume()                       # ZeRO-paper volume: 2Ψ for DP's all-reduce
        ledger.count("all_gather")            # how many all-gathers were issued
        print(ledger.table())

    Op names: "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
    "all_to_all", "gather", "scatter", "send", "recv", "barrier".
    For a step of ZeRO on a flat buffer of Ψ elements of `b` bytes, padded to a multiple of
    N: stages 0-2 give `volume() == 2*Ψ*b` and `total_bytes() == 2*Ψ*b*(N-1)/N`; the
    all-reduce variant of stage 1 and stage 3 give 3Ψ.

    How it sees everything: `dist.all_reduce` & co. end in a dispatcher op of the `c10d`
    namespace (`c10d::allreduce_`, `c10d::_allgather_base_`, `c10d::_reduce_scatter_base_`,
    `c10d::broadcast_`, `c10d::send`, ...), and functional collectives in
    `_c10d_functional::*`. A TorchDispatchMode receives those ops with their tensor
    arguments. Autograd copies the active dispatch modes into backward, so collectives
    issued from hooks or from a `Function.backward` are seen too (checked on gloo and
    torch 2.13 in tests/test_collectives.py). torch's `CommDebugMode` sees the same ops but
    keeps only counts; this ledger adds sizes. Not seen: collectives issued from another
    Python thread you start yourself (dispatch modes are per thread).
    Every torch op in the block passes through this mode, which costs a few microseconds
    each: fine for a training step, not for a timing loop.

    A collective that zero_lab implements itself out of point-to-point messages
    (`zero_lab.exchange`, used on gloo) is recorded once, as that collective (see
    `recorded_as`), not as its messages.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CommRecord] = []
        self._muted = 0  # > 0 inside `recorded_as`: the messages are already accounted for

    def __enter__(self) -> CommLedger:
        _ACTIVE_LEDGERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        _ACTIVE_LEDGERS.remove(self)
        return super().__exit__(*exc)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # By default torch wraps every mode's __torch_dispatch__ in torch._dynamo.disable,
        # whose first call imports all of torch._dynamo (~800 modules, ~3 s per rank on a
        # laptop CPU). The ledger only reads arguments and never runs under torch.compile,
        # so it opts out, as the hook's docstring in torch/utils/_python_dispatch.py allows.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional") and not self._muted:
            self.records.extend(_describe(func, args, kwargs))
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ queries
    def _select(self, op: str | None) -> list[CommRecord]:
        return [r for r in self.records if op is None or r.op == op]

    def count(self, op: str | None = None) -> int:
        """Number of records of `op` (every record when None)."""
        return len(self._select(op))

    def total_bytes(self, op: str | None = None) -> float:
        """Bytes this rank sends under the ring algorithm, summed over `op` (all when None)."""
        return sum(r.sent_bytes for r in self._select(op))

    def volume(self, op: str | None = None) -> int:
        """ZeRO-paper volume summed over `op`: all-reduce 2 x nbytes, others 1 x nbytes."""
        return sum(r.volume for r in self._select(op))

    def payload_bytes(self, op: str | None = None) -> int:
        """Sum of the records' full message sizes (`nbytes`)."""
        return sum(r.nbytes for r in self._select(op))

    def summary(self) -> dict[str, dict[str, float]]:
        """{op: {"count", "nbytes", "sent_bytes", "volume"}} in the order ops first appeared."""
        out: dict[str, dict[str, float]] = {}
        for r in self.records:
            s = out.setdefault(r.op, {"count": 0, "nbytes": 0, "sent_bytes": 0.0, "volume": 0})
            s["count"] += 1
            s["nbytes"] += r.nbytes
            s["sent_bytes"] += r.sent_bytes
            s["volume"] += r.volume
        return out

    def as_dicts(self) -> list[dict]:
        """The records as JSON-serialisable dicts (for `report()` from a worker)."""
        return [asdict(r) for r in self.records]

    def table(self) -> str:
        """A small fixed-width table of the records, one line each, then the total."""
        head = f"{'op':<15}{'numel':>12}{'dtype':>10}{'nbytes':>14}{'sent by rank':>15}  where"
        lines = [head, "-" * len(head)]
        for r in self.records:
            where = ("backward" if r.in_backward else "") + (" async" if r.async_op else "")
            lines.append(f"{r.op:<15}{r.numel:>12,}{r.dtype:>10}{r.nbytes:>14,}"
                         f"{r.sent_bytes:>15,.0f}  {where.strip()}")
        lines.append(f"{'total':<15}{'':>12}{'':>10}{self.payload_bytes():>14,}"
                     f"{self.total_bytes():>15,.0f}")
        return "\n".join(lines)

    def clear(self) -> None:
        self.records.clear()


# How each c10d / functional op maps to a collective: (name, argument holding the full message,
# how to read it). "input_xN" means the full message is N x the named (local) argument.
_C10D_OPS: dict[str, tuple[str, str]] = {
    "c10d::allreduce_": ("all_reduce", "tensors"),
    "c10d::allreduce_coalesced_": ("all_reduce", "tensors"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "c10d::reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "c10d::_allgather_base_": ("all_gather", "output_tensor"),
    "c10d::allgather_": ("all_gather", "output_tensors"),
    "c10d::allgather_coalesced_": ("all_gather", "output_lists"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "c10d::broadcast_": ("broadcast", "tensors"),
    "c10d::reduce_": ("reduce", "tensors"),
    "c10d::alltoall_": ("all_to_all", "input_tensors"),
    "c10d::alltoall_base_": ("all_to_all", "input"),
    "c10d::gather_": ("gather", "input_tensors*N"),
    "c10d::scatter_": ("scatter", "output_tensors*N"),
    "c10d::send": ("send", "tensors"),
    "c10d::recv_": ("recv", "tensors"),
    "c10d::recv_any_source_": ("recv", "tensors"),
    "c10d::barrier": ("barrier", ""),
    "c10d::monitored_barrier_": ("barrier", ""),
    "_c10d_functional::all_reduce": ("all_reduce", "input"),
    "_c10d_functional::all_reduce_": ("all_reduce", "input"),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "inputs"),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "inputs"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "input*N"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "input*N"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "inputs*N"),
    "_c10d_functional::broadcast": ("broadcast", "input"),
    "_c10d_functional::broadcast_": ("broadcast", "input"),
    "_c10d_functional::all_to_all_single": ("all_to_all", "input"),
    "_c10d_functional::isend": ("send", "tensor"),
    "_c10d_functional::irecv": ("recv", "tensor"),
}


def _flat_tensors(value) -> list[torch.Tensor]:
    """Every tensor in a (nested) list/tuple argument."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def _group_size(bound: dict) -> int:
    """World size of the op's process group (the default group if it cannot be read)."""
    if isinstance(bound.get("group_size"), int):
        return bound["group_size"]
    try:
        if "process_group" in bound:
            return dist.ProcessGroup.unbox(bound["process_group"]).size()
        if "group_name" in bound:
            from torch.distributed.distributed_c10d import _resolve_process_group

            name = bound["group_name"]
            return name.size() if hasattr(name, "size") else _resolve_process_group(name).size()
    except (RuntimeError, TypeError, AttributeError, ValueError):
        pass
    return dist.get_world_size() if dist.is_initialized() else 1


def _describe(func, args: tuple, kwargs: dict) -> list[CommRecord]:
    """Turn one dispatcher call into ledger records (none for wait_tensor and friends)."""
    schema = func._schema
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound.update(zip((a.name for a in schema.arguments), args, strict=False))
    bound.update(kwargs)
    name = schema.name
    in_backward = torch._C._current_graph_task_id() != -1
    async_op = bool(bound.get("async_op", True))  # functional collectives are always async

    if name == "_c10d_functional::batch_p2p_ops":  # a batch of isend/irecv: one record each
        n = _group_size(bound)
        return [
            _record("send" if "send" in kind else "recv", [t], n, True, in_backward, name)
            for kind, t in zip(bound["op_list"], bound["tensors"], strict=False)
        ]
    if name not in _C10D_OPS:
        return []
    op, where = _C10D_OPS[name]
    n = _group_size(bound)
    arg, _, times_n = where.partition("*")
    tensors = _flat_tensors(bound.get(arg)) if arg else []
    return [_record(op, tensors, n, async_op, in_backward, name, n if times_n else 1)]


def _record(op, tensors, world_size, async_op, in_backward, torch_op, times=1) -> CommRecord:
    numel = times * sum(t.numel() for t in tensors)
    nbytes = times * sum(t.numel() * t.element_size() for t in tensors)
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "-"
    return CommRecord(op=op, numel=numel, dtype=dtype, nbytes=nbytes, world_size=world_size,
                      sent_bytes=ring_bytes_sent(op, nbytes, world_size),
                      volume=zero_volume(op, nbytes), async_op=async_op,
                      in_backward=in_backward, torch_op=torch_op)


_ACTIVE_LEDGERS: list[CommLedger] = []  # the ledgers whose `with` block is running


@contextmanager
def recorded_as(op: str, tensor: torch.Tensor, group_size: int,
                async_op: bool = False) -> Iterator[None]:
    """Inside the block, active ledgers record one `op` on `tensor` (the full message in
    nccl-tests' sense, as in `CommRecord`) and ignore the point-to-point messages that
    implement it: `zero_lab.exchange` sends a reduce-scatter as 2(N-1) isend/irecv, which
    should read as the reduce-scatter it is, with the same bytes sent per rank."""
    in_backward = torch._C._current_graph_task_id() != -1
    ledgers = list(_ACTIVE_LEDGERS)
    for ledger in ledgers:
        ledger.records.append(_record(op, [tensor], group_size, async_op, in_backward,
                                      "zero_lab.exchange"))
        ledger._muted += 1
    try:
        yield
    finally:
        for ledger in ledgers:
            ledger._muted -= 1


# =========================================================================== alpha-beta model


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


def _call(op: str, bufs: tuple) -> None:
    if op == "all_reduce":
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
                    device="cpu", dtype=torch.float32) -> dict:
    """Time torch's `op` on a message of about `nbytes` inside an initialised process group.

    One warm-up call; then the calls are repeated back to back in batches lasting about
    `target_s` (so microsecond latencies are not lost in timer noise), `repeats` batches.
    Returns {"op", "nbytes", "world_size", "seconds"}: the per-call time of the slowest rank
    in the fastest batch (other processes sharing the machine can only add time, so the
    fastest batch is the least disturbed), and `nbytes` the exact size used (rounded down
    to N equal chunks).
    """
    n = dist.get_world_size()
    nbytes, bufs = _buffers(op, nbytes, n, device, dtype)
    dist.barrier()
    start = time.perf_counter()
    _call(op, bufs)
    _sync(device)
    one = _slowest(time.perf_counter() - start, device)  # all ranks agree on the batch size
    calls = int(min(1000, max(1, target_s / max(one, 1e-7))))
    per_call = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            _call(op, bufs)
        _sync(device)
        per_call.append(_slowest((time.perf_counter() - start) / calls, device))
    return {"op": op, "nbytes": nbytes, "world_size": n, "seconds": min(per_call)}


def sweep(ops: Iterable[str] = RING_OPS, sizes: Iterable[int] | None = None, repeats: int = 3,
          target_s: float = 0.01, device="cpu") -> list[dict]:
    """`time_collective` for every op and size; call it on every rank of a process group."""
    sizes = list(sizes) if sizes is not None else message_sizes()
    return [time_collective(op, s, repeats, target_s, device) for op in ops for s in sizes]


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


def describe_bytes(nbytes: float) -> str:
    """'1.0 KiB', '64.0 MiB', ... for tables and axis labels."""
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    exp = min(int(math.log(nbytes, 1024)), 4)
    return f"{nbytes / 1024 ** exp:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exp]}"
