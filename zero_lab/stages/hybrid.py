"""Hybrid sharding (HSDP; DeepSpeed's former MiCS): shard inside a group, replicate across.

Stage 3 sharded over all N ranks all-gathers every unit across all of them, twice a step: on
a cluster of nodes, every all-gather crosses the network. Hybrid sharding lays the N ranks
out in 2-D, R groups of S ranks (S = the GPUs of a node, typically), as torch's FSDP2 does
with a 2-D DeviceMesh whose dimensions are ("replicate", "shard"):

    mesh=(R, S) = (2, 2)       shard group (one row)     replicate group (one column)
        rank 0  rank 1         {0, 1}, {2, 3}            {0, 2}, {1, 3}
        rank 2  rank 3

Each group holds one whole copy of the model states, sharded over its S ranks exactly as
stage 3 shards them over N (partition.py with N = S): 16Ψ/S bytes a rank, not 16Ψ/N. What
moves where, per step and unit of Ψ_u elements (padded to a multiple of S):

    inside the group (S ranks)   ALL-GATHER Ψ_u before forward, again before backward;
                                 REDUCE-SCATTER the gradient Ψ_u
    across the groups (R ranks)  ALL-REDUCE of the averaged slice, Ψ_u / S

So the parameters never leave the group, and of the gradients only each rank's 1/S slice
crosses: with S = 8 GPUs per node, the network carries 2(R-1)/R x Ψ/8 per GPU where flat
stage 3 sends 3(m-1)/m x Ψ/8 (projection.py prices both). The price is memory: 16Ψ/S
instead of 16Ψ/N. Stages 0-2 take the same layout (their gradients averaged level by level,
their parameters gathered inside the group).

Not ZeRO++'s hpZ: hpZ keeps the states sharded over all N ranks and adds a secondary copy of
the parameters, sharded inside each node, for backward's all-gathers; that is the int
`reshard_after_forward` of `shard()` (and FSDP2), not this module.

`shard(model, 3, ..., mesh=(R, S))` builds the two process groups here, once per layout
(every rank creates every group, in the same order, as `dist.new_group` requires), and
names them for the CommLedger, which then records each collective with its level ("shard"
or "replicate"). A torch DeviceMesh of two dimensions (replicate, shard) is taken too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from zero_lab.collectives.ledger import name_level


@dataclass(frozen=True)
class HybridMesh:
    """This rank's place in an R x S layout: its shard group (the S ranks of its row, which
    shard the model) and its replicate group (the R ranks of its column, which hold the same
    slices)."""

    replicas: int  # R, the groups
    shards: int  # S, the ranks in a group
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup
    shard_rank: int  # this rank's place in its group: which slice it holds
    replica: int  # which group it is in

    @property
    def shape(self) -> tuple[int, int]:
        return (self.replicas, self.shards)


_MADE: dict[tuple, HybridMesh] = {}  # one set of groups per layout and default group


def mesh_shape(mesh) -> tuple[int, int]:
    """(replicas, shards) of `mesh`, checked, without creating any process group: (R, S)
    with R x S = the world size, or a 2-D torch DeviceMesh (its shape)."""
    if hasattr(mesh, "get_group") and hasattr(mesh, "ndim"):
        if mesh.ndim != 2:
            raise ValueError(f"a DeviceMesh for hybrid sharding has 2 dimensions (replicate, "
                             f"shard); this one has {mesh.ndim}")
        return (mesh.size(0), mesh.size(1))
    if (not isinstance(mesh, (tuple, list)) or len(mesh) != 2
            or not all(type(x) is int and x >= 1 for x in mesh)):
        raise ValueError(f"mesh must be (replicas, shards), two positive ints, or a 2-D torch "
                         f"DeviceMesh; got {mesh!r}")
    replicas, shards = mesh
    if replicas * shards != dist.get_world_size():
        raise ValueError(f"mesh={tuple(mesh)} lays out {replicas} x {shards} = "
                         f"{replicas * shards} ranks; the world has {dist.get_world_size()}")
    return (replicas, shards)


def make_mesh(mesh) -> HybridMesh:
    """The HybridMesh of `mesh` (see `mesh_shape`): rank r sits in group r // S at place
    r % S, as init_device_mesh lays out a 2-D mesh; a DeviceMesh's dimension 0 replicates,
    dimension 1 shards. Call on every rank, with the same `mesh`."""
    replicas, shards = mesh_shape(mesh)
    if hasattr(mesh, "get_group"):
        return _from_device_mesh(mesh)
    rank = dist.get_rank()
    key = (id(dist.group.WORLD), replicas, shards)
    if key not in _MADE:
        # Every rank creates every group, rows first then columns, in the same order.
        rows = [dist.new_group([r * shards + s for s in range(shards)])
                for r in range(replicas)]
        columns = [dist.new_group([r * shards + s for r in range(replicas)])
                   for s in range(shards)]
        replica, place = divmod(rank, shards)
        _MADE[key] = HybridMesh(replicas, shards, rows[replica], columns[place], place, replica)
    made = _MADE[key]
    name_level(made.shard_group, "shard")
    name_level(made.replicate_group, "replicate")
    return made


def _from_device_mesh(mesh) -> HybridMesh:
    replicate_group, shard_group = mesh.get_group(0), mesh.get_group(1)
    name_level(shard_group, "shard")
    name_level(replicate_group, "replicate")
    return HybridMesh(mesh.size(0), mesh.size(1), shard_group, replicate_group,
                      mesh.get_local_rank(1), mesh.get_local_rank(0))
