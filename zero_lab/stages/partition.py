"""The flat-buffer partition every ZeRO stage is built on.

A *group* of parameters is copied into one 1-D buffer, padded at the end to a multiple of the
world size N, and the parameters become views into it. Rank r owns the contiguous slice
[r*S, (r+1)*S) of that buffer, S = ceil(numel / N):

    flat buffer   | w1 ........ | b1 | w2 .......... | b2 | pad |
    owned by      |  rank 0        |  rank 1        |  rank 2   |    (N = 3, S elements each)

Ownership is by flat slice, not by whole parameter (the seed blog's ZeRO hands whole
parameters to ranks, which unbalances memory and cannot split one big layer): every rank holds
exactly S elements whatever the parameter sizes, and a parameter may straddle two owners.

One buffer layout serves every state of the group: the parameters, a full gradient buffer
(`new_full()`), a gradient or fp32 master slice (`new_shard()`). The two collectives ZeRO
needs work on whole buffers, one call per group (sent as collectives/transports.py chooses;
one sent during backward waits in `InFlight`, below, until the stage lands it):

    reduce_scatter(shard_out, full_in)   full gradients -> the averaged slice this rank owns
    all_gather(full_out, shard_in)       every rank's slice -> the full buffer on every rank

Stage 3 frees the full parameter buffer between uses: `free_storage` releases a buffer's
memory, keeping the tensor and its views (the parameters); `allocate_storage` gives it back,
the views see what is written next. Rebinding `.data` would not free what autograd holds.

Hybrid sharding (hybrid.py): a group sharded over the S ranks of `process_group` and
replicated across `replicate_group`; its averages run inside the group, then across.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives import transports
from zero_lab.collectives.chain import Chain, one_after_another
from zero_lab.collectives.exchange import Exchange
from zero_lab.profiling import marks


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls inside one rank's slice.

    Elements [param_start, param_end) of the flattened parameter sit at
    [shard_start, shard_start + (param_end - param_start)) of that rank's slice.
    """

    index: int  # position of the parameter in its group
    name: str
    param_start: int
    param_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


class FlatParamGroup:
    """A group of parameters laid out in one padded flat buffer, sharded over N ranks.

    Construction only computes the layout; `flatten()` and `bind()` create and adopt a buffer:

        group = FlatParamGroup(params, world_size=3, rank=1)
        group.bind(group.flatten())      # parameters are now views into group.flat
        group.shard(group.flat)          # this rank's S elements (a view)
        group.views(grad_buffer)         # parameter-shaped views into any flat buffer
    """

    # Reduced in fp32 and kept so (reduce_dtype=torch.float32: mixed_precision.ReducedInFp32)?
    reduces_wide = False

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        world_size: int,
        rank: int,
        names: Sequence[str] | None = None,
        process_group: dist.ProcessGroup | None = None,
        transport: str = "auto",
        replicate_group: dist.ProcessGroup | None = None,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("FlatParamGroup needs at least one parameter")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("FlatParamGroup got the same parameter twice; pass each tensor once")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        devices, dtypes = {p.device for p in params}, {p.dtype for p in params}
        if len(devices) != 1 or len(dtypes) != 1:
            raise ValueError("a flat group has one device and one dtype; its parameters have "
                             f"{sorted(map(str, devices))} and {sorted(map(str, dtypes))}")
        self.params = params
        self.names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
        self.world_size = world_size
        self.rank = rank
        self.process_group = process_group  # the ranks the group is sharded over
        # Hybrid sharding: the ranks holding the same slice in the other groups (None: 1-D).
        self.replicate_group = replicate_group
        self.device = params[0].device
        self.dtype = params[0].dtype
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)  # real elements, Ψ of this group
        self.shard_numel = -(-self.numel // world_size)  # S = ceil(Ψ / N)
        self.padded_numel = self.shard_numel * world_size  # N·S, padding at the end
        self.padding = self.padded_numel - self.numel
        self.shard_start, self.shard_end = self.shard_range(rank)
        self.flat: torch.Tensor | None = None  # the buffer the parameters view, once bound
        if transport not in transports.TRANSPORTS:  # (collectives/transports.py)
            raise ValueError(f"transport must be one of {tuple(transports.TRANSPORTS)}, got "
                             f"{transport!r}")
        self.transport = transport  # how this group's collectives are sent (`sends`)
        self._sends: transports.Transport | None = None  # resolved at the first collective
        self.label = "group"  # how its collectives are named in a profiler trace ("bucket 2")

    # ------------------------------------------------------------------ layout
    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s slice in the flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_pieces(self, rank: int | None = None) -> list[ShardPiece]:
        """For each parameter overlapping `rank`'s slice (this rank by default), which part."""
        lo, hi = self.shard_range(self.rank if rank is None else rank)
        pieces = []
        for i, (offset, numel) in enumerate(zip(self.offsets, self.numels, strict=True)):
            start, end = max(lo, offset), min(hi, offset + numel)
            if start < end:
                piece = ShardPiece(i, self.names[i], start - offset, end - offset, start - lo)
                pieces.append(piece)
        return pieces

    # ------------------------------------------------------------------ buffers
    def new_full(self, dtype: torch.dtype | None = None, zeroed: bool = True) -> torch.Tensor:
        """A buffer of the padded size (e.g. the group's full gradient), zeroed by default."""
        make = torch.zeros if zeroed else torch.empty
        return make(self.padded_numel, dtype=dtype or self.dtype, device=self.device)

    def new_shard(self, dtype: torch.dtype | None = None, zeroed: bool = True) -> torch.Tensor:
        """A buffer of one slice (e.g. the averaged gradient this rank owns)."""
        make = torch.zeros if zeroed else torch.empty
        return make(self.shard_numel, dtype=dtype or self.dtype, device=self.device)

    def flatten(self, tensors: Iterable[torch.Tensor] | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new padded buffer holding copies of `tensors` (the parameters by default)."""
        tensors = self.params if tensors is None else list(tensors)
        flat = self.new_full(dtype)
        with torch.no_grad():
            for view, t in zip(self.views(flat), tensors, strict=True):
                view.copy_(t)
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Parameter-shaped views into `flat` (any dtype, `padded_numel` elements)."""
        if flat.dim() != 1 or flat.numel() != self.padded_numel:
            raise ValueError(f"expected a 1-D buffer of {self.padded_numel} elements, "
                             f"got shape {tuple(flat.shape)}")
        return [flat[o:o + n].view(s)
                for o, n, s in zip(self.offsets, self.numels, self.shapes, strict=True)]

    def shard(self, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """`rank`'s slice of `flat` (this rank by default), as a view."""
        lo, hi = self.shard_range(self.rank if rank is None else rank)
        return flat[lo:hi]

    def bind(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into `flat`; the group's parameters now live there.

        `p.data = view` keeps each nn.Parameter object (so modules, tied weights and user
        references stay valid) but moves its storage into the buffer.
        """
        for p, view in zip(self.params, self.views(flat), strict=True):
            p.data = view
        self.flat = flat
        self.dtype = flat.dtype  # new buffers (gradients, slices) follow the parameters

    def sharded_over(self, process_group: dist.ProcessGroup, world_size: int, rank: int
                     ) -> FlatParamGroup:
        """This layout's padded buffer cut into `world_size` chunks over `process_group`
        instead of N (stage 3's reshard_after_forward=d): a new group, this one unchanged."""
        over = copy.copy(self)
        over.process_group, over.replicate_group = process_group, None
        over.world_size, over.rank = world_size, rank
        over.shard_numel = self.padded_numel // world_size
        over.shard_start, over.shard_end = over.shard_range(rank)
        over._sends, over.label = None, f"{self.label} after forward"  # resolved anew
        return over

    # ------------------------------------------------------------------ collectives
    @property
    def sends(self) -> transports.Transport:
        """The collectives this group sends with (collectives/transports.py). Resolved at the
        first collective: a group can be laid out before its process group exists."""
        if self._sends is None:
            name = self.transport
            if name == "auto":  # the direct exchange on gloo with CPU tensors, else torch's
                gloo = "gloo" in str(dist.get_backend(self.process_group))
                name = "direct" if gloo and self.device.type == "cpu" else "torch"
            self._sends = transports.TRANSPORTS[name]
        return self._sends

    def all_gather(self, full_out: torch.Tensor, shard_in: torch.Tensor,
                   async_op: bool = False) -> dist.Work | Exchange | None:
        """Every rank's slice -> the full buffer on every rank: one all-gather.

        `shard_in` may be this rank's own slice of `full_out` (in place).
        """
        return marks.collective(f"all-gather / {self.label}", lambda: self.sends.all_gather(
            full_out, shard_in, group=self.process_group, async_op=async_op), async_op)

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                       op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
                       async_op: bool = False) -> dist.Work | Exchange | None:
        """Full buffers on every rank -> this rank's slice of their reduction (average by
        default): one reduce-scatter. `shard_out` must not be a view of `full_in`."""
        def issue():
            return self.sends.reduce_scatter(shard_out, full_in, op=op,
                                             group=self.process_group, async_op=async_op)

        if self.replicate_group is None:
            return marks.collective(f"reduce-scatter / {self.label}", issue, async_op)
        # Hybrid: the slice averaged inside the group, then across the groups.
        return one_after_another(
            async_op, lambda: marks.collective(f"reduce-scatter / {self.label}", issue, True),
            lambda: self._across(shard_out, op))

    def all_reduce(self, buffer: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
                   async_op: bool = False) -> dist.Work | Chain | None:
        """A full buffer (gradients) reduced in place on every rank: one all-reduce (hybrid:
        reduce-scatter inside the group, all-reduce of the slice across, all-gather inside)."""
        if self.replicate_group is not None:
            piece = self.new_shard(buffer.dtype, zeroed=False)
            return one_after_another(async_op,
                                     lambda: self.reduce_scatter(piece, buffer, op, True),
                                     lambda: self.all_gather(buffer, piece, True))
        return marks.collective(f"all-reduce / {self.label}", lambda: self.sends.all_reduce(
            buffer, op=op, group=self.process_group, async_op=async_op), async_op)

    def _across(self, piece: torch.Tensor, op: dist.ReduceOp.RedOpType):
        """Hybrid sharding's second level: this rank's slice reduced with the same slice of
        the other groups (an all-reduce over `replicate_group`), asynchronously."""
        return marks.collective(f"all-reduce across groups / {self.label}", lambda: self.sends
                                .all_reduce(piece, op=op, group=self.replicate_group,
                                            async_op=True), True)

    def __repr__(self) -> str:
        return (f"FlatParamGroup({len(self.params)} params, numel={self.numel}, "
                f"padded={self.padded_numel}, shard={self.shard_numel} x {self.world_size}, "
                f"rank {self.rank} owns [{self.shard_start}, {self.shard_end}))")


# ---------------------------------------------------------------------- in flight

class Sent(NamedTuple):  # bucket g's collective: `full` is read until done, `owned` written
    g: int
    work: dist.Work
    full: torch.Tensor
    owned: torch.Tensor


class InFlight:
    """Buckets sent, oldest first, kept with the tensors their collective reads and writes;
    `land(g, full, owned)` puts each result where the stage keeps gradients, in order: a few
    at most while backward runs (stage 2 bounds its memory so), all when it ends, or, with
    overlap_step, each just before the optimizer updates its bucket (`land_through`)."""

    def __init__(self, land: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        self._land = land
        self._sent: deque[Sent] = deque()

    def __len__(self) -> int:
        return len(self._sent)

    def __contains__(self, g: int) -> bool:
        return any(s.g == g for s in self._sent)

    def groups(self) -> list[int]:
        """The groups still in flight, in the order they were sent."""
        return [s.g for s in self._sent]

    def send(self, g: int, work: dist.Work, full: torch.Tensor, owned: torch.Tensor,
             keep: int | None = None) -> None:
        """Queue bucket g's collective; then land the oldest beyond `keep` (None: no limit)."""
        self._sent.append(Sent(g, work, full, owned))
        self.land(keep)

    def land(self, keep: int | None = 0) -> None:
        """Finish sent buckets, oldest first: all beyond `keep`, and any already complete."""
        while self._sent and ((keep is not None and len(self._sent) > keep)
                              or self._sent[0].work.is_completed()):
            self._land_oldest()

    def land_through(self, g: int) -> None:
        """Finish every bucket sent up to and including group g (nothing if g is not sent)."""
        if g in self:
            while self._land_oldest() != g:
                pass

    def _land_oldest(self) -> int:
        done = self._sent.popleft()
        done.work.wait()
        self._land(done.g, done.full, done.owned)
        return done.g  # `done.full` goes out of scope here: a buffer of its own is freed


# ---------------------------------------------------------------------- storage

def free_storage(t: torch.Tensor) -> None:
    """Release the memory behind `t`; `t` and its views stay valid objects (size unchanged)."""
    t.untyped_storage().resize_(0)


def allocate_storage(t: torch.Tensor) -> None:
    """Give `t` (a whole buffer, not a view) its memory back after `free_storage`; its
    contents are undefined until written (e.g. by an all-gather)."""
    if t.storage_offset() != 0:
        raise ValueError("allocate_storage expects the whole buffer, not a view into it")
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != nbytes:
        t.untyped_storage().resize_(nbytes)


def storage_is_allocated(t: torch.Tensor) -> bool:  # (after free_storage: False)
    return t.untyped_storage().nbytes() > 0


# ---------------------------------------------------------------------- grouping

def bucket_parameters(
    named_params: Sequence[tuple[str, nn.Parameter]], bucket_bytes: float, element_size: int,
    *, first_bucket_bytes: float | None = None,
) -> list[list[tuple[str, nn.Parameter]]]:
    """Split parameters, in the order given, into buckets of at most `bucket_bytes`.

    A parameter larger than a bucket gets a bucket of its own. Pass the parameters in
    reverse registration order so buckets fill in roughly the order backward produces
    gradients (the last layer's first), as torch's DDP does. `first_bucket_bytes` sizes the
    first bucket by DDP's rule (1 MiB there): it takes parameters until it holds that much
    (never more than `bucket_bytes`), so it is ready early in backward (the last layer's
    bias *and* weight) and its collective runs while most of backward is still to come.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in named_params:
        nbytes = p.numel() * element_size
        fits = bool(buckets) and size + nbytes <= bucket_bytes
        if len(buckets) == 1 and first_bucket_bytes:
            fits = fits and size < first_bucket_bytes  # until it is full enough
        if fits:
            buckets[-1].append((name, p))
            size += nbytes
        else:
            buckets.append([(name, p)])
            size = nbytes
    return buckets


def make_flat_groups(
    named_params: Sequence[tuple[str, nn.Parameter]], bucket_bytes: float,
    *, element_size: int | None = None, first_bucket_bytes: float | None = None,
    src: int | None = 0, process_group: dist.ProcessGroup | None = None,
    transport: str = "auto", replicate_group: dist.ProcessGroup | None = None,
    group_type: type[FlatParamGroup] = FlatParamGroup,
) -> list[FlatParamGroup]:
    """Bucket `named_params` (reverse registration order: see `bucket_parameters`) into flat
    groups whose buffers the parameters then view; with `src`, every rank starts from rank
    `src`'s values (one broadcast per group). Inside a bucket, parameters keep forward
    order, so a layout reads like the model. Buckets are sized at `element_size` bytes per
    element (the parameters' own by default; 2 when they will be cast to bf16); `group_type`
    may be a subclass that sends its reductions otherwise (ReducedInFp32)."""
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    element_size = element_size or named_params[0][1].element_size()
    groups = []
    for bucket in bucket_parameters(named_params, bucket_bytes, element_size,
                                    first_bucket_bytes=first_bucket_bytes):
        bucket = bucket[::-1]
        group = group_type([p for _, p in bucket], world, rank, [n for n, _ in bucket],
                           process_group, transport, replicate_group)
        flat = group.flatten()
        if src is not None:
            dist.broadcast(flat, src=src,
                           group=process_group if replicate_group is None else None)
        group.bind(flat)
        group.label = f"bucket {len(groups)}"
        groups.append(group)
    return groups
