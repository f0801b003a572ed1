"""Where a stage's collectives are chosen: the seam a new collective plugs into.

A stage's collectives go through its flat groups (stages/partition.py), which send them with
the `Transport` named by `transport`: "torch", "direct" (exchange.py: gloo's reduce-scatter is
an all-reduce), "none" (nothing sent: notebook 06's A/B) or "auto" (direct on gloo, CPU).
A new collective (ZeRO++'s quantized all-gather, say) is a Transport `register`ed on every
rank before `shard(model, k, transport=its_name)` (tests/test_transports.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from zero_lab.collectives import exchange


class Transport(NamedTuple):
    """Three collectives, called with keywords `group`, `async_op` (and `op` for the two
    reductions); each returns a handle with `wait()` when `async_op`, else None."""

    name: str
    all_gather: Callable  # (full_out, shard_in, *, group, async_op): shard_in may be in place
    reduce_scatter: Callable  # (shard_out, full_in, *, op, group, async_op)
    all_reduce: Callable  # (buffer, *, op, group, async_op): in place


def _torch_all_gather(output: torch.Tensor, input: torch.Tensor, *, group, async_op: bool):
    if input.data_ptr() == output.chunk(dist.get_world_size(group))[
            dist.get_rank(group)].data_ptr():
        input = input.clone()  # torch's all-gather wants an input apart from the output
    return dist.all_gather_single(output, input, group=group, async_op=async_op)


TRANSPORTS: dict[str, Transport | None] = {
    "auto": None,  # resolved per flat group (partition.py's FlatParamGroup.sends)
    "torch": Transport("torch", _torch_all_gather,
                       lambda *args, **kwargs: dist.reduce_scatter_single(*args, **kwargs),
                       lambda *args, **kwargs: dist.all_reduce(*args, **kwargs)),
    "none": Transport("none", exchange.all_gather_skipped, exchange.reduce_scatter_skipped,
                      lambda *_args, async_op, **_kwargs: exchange.Exchange([]) if async_op
                      else None),  # the buffer keeps this rank's values
}
TRANSPORTS["direct"] = Transport("direct", exchange.all_gather, exchange.reduce_scatter,
                                 TRANSPORTS["torch"].all_reduce)


def register(transport: Transport) -> None:
    """Make `shard(..., transport=transport.name)` send with `transport`."""
    TRANSPORTS[transport.name] = transport

