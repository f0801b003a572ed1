"""`CommLedger`: record every collective a block of code issues, with the bytes it sends.

    with CommLedger() as ledger:
        loss.backward(); opt.step()
    ledger.total_bytes()     # bytes this rank sent (ring algorithm)
    ledger.volume()          # the ZeRO paper's volume: 2Ψ for data parallelism's all-reduce

It sees every collective however it is called (plain `dist.*` calls, `async_op=True`,
autograd hooks, inside backward, functional collectives); see the class for how.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from zero_lab.collectives.volume import ring_bytes_sent, zero_volume


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
    # Which level of a 2-D layout (hybrid sharding, stages/hybrid.py) the collective ran on:
    # "shard" (inside a group of ranks), "replicate" (across the groups), or "world" (the
    # whole world, or a process group nobody named with `name_level`).
    level: str = "world"


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
    (`zero_lab.collectives.exchange`, used on gloo) is recorded once, as that collective (see
    `recorded_as`), not as its messages.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CommRecord] = []
        # Control messages, kept apart from the data: the stages' lockstep check and buffer
        # agreement (a few bytes a step). Not in count(), total_bytes() or volume().
        self.control: list[CommRecord] = []
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
    def signature(self) -> list[list]:
        """[op, dtype, numel] of every data collective, sorted: two runs sent the same
        collectives of the same sizes exactly when their signatures are equal."""
        return sorted([r.op, r.dtype, r.numel] for r in self.records)

    def _select(self, op: str | None, level: str | None = None) -> list[CommRecord]:
        return [r for r in self.records
                if (op is None or r.op == op) and (level is None or r.level == level)]

    def count(self, op: str | None = None, level: str | None = None) -> int:
        """Number of records of `op` (every record when None), on `level` (any when None)."""
        return len(self._select(op, level))

    def total_bytes(self, op: str | None = None, level: str | None = None) -> float:
        """Bytes this rank sends under the ring algorithm, summed over `op` (all when None)
        on `level` (any when None: "shard", "replicate" or "world", see CommRecord)."""
        return sum(r.sent_bytes for r in self._select(op, level))

    def volume(self, op: str | None = None, level: str | None = None) -> int:
        """ZeRO-paper volume summed over `op`: all-reduce 2 x nbytes, others 1 x nbytes."""
        return sum(r.volume for r in self._select(op, level))

    def payload_bytes(self, op: str | None = None, level: str | None = None) -> int:
        """Sum of the records' full message sizes (`nbytes`)."""
        return sum(r.nbytes for r in self._select(op, level))

    def by_level(self) -> dict[str, dict[str, int]]:
        """{level: {op: payload bytes}}: what a 2-D layout sent inside its groups ("shard")
        and across them ("replicate"), op by op (hybrid sharding, stages/hybrid.py)."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            ops = out.setdefault(r.level, {})
            ops[r.op] = ops.get(r.op, 0) + r.nbytes
        return out

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
        if self.control:
            lines.append(f"(and {len(self.control)} control message(s) of "
                         f"{sum(r.nbytes for r in self.control):,} bytes, not counted above)")
        return "\n".join(lines)

    def clear(self) -> None:
        self.records.clear()
        self.control.clear()


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


# Process groups named as a level of a 2-D layout: {group_name: "shard" | "replicate"}.
_LEVELS: dict[str, str] = {}


def name_level(group: dist.ProcessGroup, level: str) -> None:
    """Record the collectives of `group` as run on `level` ("shard": inside a group of ranks,
    "replicate": across the groups) from now on; stages/hybrid.py names its groups so."""
    _LEVELS[group.group_name] = level


def _level(bound: dict) -> str:
    """The level of the op's process group (see `name_level`), "world" if none was named."""
    if not _LEVELS:
        return "world"
    try:
        if "process_group" in bound:
            return _LEVELS.get(dist.ProcessGroup.unbox(bound["process_group"]).group_name,
                               "world")
        name = bound.get("group_name")
        return _LEVELS.get(name if isinstance(name, str) else name.group_name, "world")
    except (RuntimeError, TypeError, AttributeError, ValueError):
        return "world"


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
            _record("send" if "send" in kind else "recv", [t], n, True, in_backward, name,
                    level=_level(bound))
            for kind, t in zip(bound["op_list"], bound["tensors"], strict=False)
        ]
    if name not in _C10D_OPS:
        return []
    op, where = _C10D_OPS[name]
    n = _group_size(bound)
    arg, _, times_n = where.partition("*")
    tensors = _flat_tensors(bound.get(arg)) if arg else []
    return [_record(op, tensors, n, async_op, in_backward, name, n if times_n else 1,
                    _level(bound))]


def _record(op, tensors, world_size, async_op, in_backward, torch_op, times=1,
            level="world") -> CommRecord:
    numel = times * sum(t.numel() for t in tensors)
    nbytes = times * sum(t.numel() * t.element_size() for t in tensors)
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "-"
    return CommRecord(op=op, numel=numel, dtype=dtype, nbytes=nbytes, world_size=world_size,
                      sent_bytes=ring_bytes_sent(op, nbytes, world_size),
                      volume=zero_volume(op, nbytes), async_op=async_op,
                      in_backward=in_backward, torch_op=torch_op, level=level)


_ACTIVE_LEDGERS: list[CommLedger] = []  # the ledgers whose `with` block is running


def recorded_as(op: str, tensor: torch.Tensor, group_size: int,
                async_op: bool = False, group: dist.ProcessGroup | None = None
                ) -> contextlib.AbstractContextManager:
    """Inside the block, active ledgers record one `op` on `tensor` (the full message in
    nccl-tests' sense, as in `CommRecord`) and ignore the point-to-point messages that
    implement it: `zero_lab.collectives.exchange` sends a reduce-scatter as 2(N-1)
    isend/irecv, which should read as the reduce-scatter it is, with the same bytes sent
    per rank. `group`: the process group it runs on, for its level (`name_level`)."""
    level = _LEVELS.get(group.group_name, "world") if group is not None else "world"
    return _noted_once("records", op, tensor, group_size, async_op,
                       "zero_lab.collectives.exchange", level)


def control_message(op: str, tensor: torch.Tensor, group_size: int,
                    source: str) -> contextlib.AbstractContextManager:
    """Inside the block, active ledgers put the collective `op` in `ledger.control`, apart
    from the records: a few bytes the stages send to agree on what to do (the lockstep check,
    stages/lockstep.py; whether buffers changed, stages/buffers.py), which are not the data
    whose volume the ZeRO paper counts. `tensor` is the full message, `source` who sent it."""
    return _noted_once("control", op, tensor, group_size, False, source)


@contextmanager
def _noted_once(where: str, op: str, tensor: torch.Tensor, group_size: int, async_op: bool,
                source: str, level: str = "world") -> Iterator[None]:
    """Active ledgers note one `op` in `ledger.<where>` and ignore what the block issues."""
    in_backward = torch._C._current_graph_task_id() != -1
    ledgers = list(_ACTIVE_LEDGERS)
    for ledger in ledgers:
        getattr(ledger, where).append(_record(op, [tensor], group_size, async_op, in_backward,
                                              source, level=level))
        ledger._muted += 1
    try:
        yield
    finally:
        for ledger in ledgers:
            ledger._muted -= 1
