"""`model.load_state_dict(W)` and `model.state_dict()` on a sharded model.

A trainable parameter can live in up to three places after `shard()`: the parameter the
model computes with (stages 0-2: a view of a flat buffer; stage 3: this rank's 1-D piece), in
mixed precision its 16-bit copy, and the fp32 *master* of the elements this rank updates,
which the optimizer steps and rounds back into the parameter. torch's `load_state_dict` only
knows the first: alone, it would write W into the 16-bit parameters, the masters would keep
the old weights, and the next `opt.step()` would put them back; at stage 3 W's full shapes
would not fit the 1-D pieces ("size mismatch").

So `shard()` puts a pre-hook on the model's `load_state_dict` that, for every trainable
parameter in W (under any of its names, a tied weight has several):
- checks W's tensor has the shape the model was written with (refused, named, if not);
- writes the elements of it that this rank's master holds into the master (mixed precision);
- at stage 3 hands torch this rank's piece of it instead of the whole, so torch's own copy
  fills the piece (and its checks on missing or unexpected keys still hold); the same for a
  frozen parameter stage 3 shards.
Every rank loads the same W, so the flat buffers of stages 0-2 stay identical on all ranks.

In mixed precision, `model.state_dict()` at stage 0 holds the fp32 masters (every rank has
them whole), as FSDP2's `state_dict()` holds its fp32 parameters under a
MixedPrecisionPolicy, so `model.load_state_dict(model.state_dict())` changes nothing. At
stages 1-2 a rank holds masters for its slice only: `state_dict()` holds the 16-bit
parameters (as DeepSpeed's ZeRO-1/2 module does; `full_state_dict(model)` gathers the fp32
masters), and loading a 16-bit value that is the rounding of the master leaves the master
as it is (it carries no more than the master's rounding), so the round trip is exact there
too; any other value, or an fp32 one, is written into the master as given.

`model.state_dict()` at stage 3 would return this rank's 1-D pieces under the parameters'
names: a file saved from it cannot be loaded anywhere else. FSDP2 returns DTensors that know
their global shape; here the weights are plain tensors, so it is refused with the two ways
that work: `full_state_dict(model)` on every rank (a collective: the full weights, identical
on every rank) or `zero_lab.checkpoint.save` (each rank its slices, any stage and world size
on load). `model.state_dict(keep_vars=True)` (the Parameter objects themselves, as the
package's own helpers use it) is allowed.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from zero_lab.stages.gradient_sync import GradientSync


def route_loading(model: nn.Module, sync: GradientSync,
                  masters: list[torch.Tensor] | None) -> None:
    """Install the hooks described above on a model `shard()` has just prepared."""
    # Per trainable parameter: its flat group, its index there, the group's number (its
    # master) and whether this rank holds a slice of it only.
    laid_out = {id(p): (group, i, g, sync.group_sharded(g)) for g, group in enumerate(sync.groups)
                for i, p in enumerate(group.params)}
    if sync.stage == 3:  # frozen parameters stage 3 shards (zero3.FrozenPart): no master
        laid_out |= {id(p): (unit.frozen.group, i, None, True) for unit in sync.units
                     if unit.frozen for i, p in enumerate(unit.frozen.group.params)}
    # Every state-dict name of each (a tied weight: several names).
    names = {name: laid_out[id(t)] for name, t in model.state_dict(keep_vars=True).items()
             if id(t) in laid_out}
    model.register_load_state_dict_pre_hook(partial(_load_into_every_copy, masters,
                                                    sync.stage == 3, names))
    if sync.stage == 3:
        for module in model.modules():  # a submodule's state_dict() too
            module.register_state_dict_post_hook(partial(_refuse_pieces, set(laid_out)))
    elif sync.stage == 0 and masters is not None:  # every rank holds the whole masters
        views = {id(p): view for g, group in enumerate(sync.groups)
                 for p, view in zip(group.params, group.views(masters[g]), strict=True)}
        for module in model.modules():
            module.register_state_dict_post_hook(partial(_masters_instead, views))


@torch.no_grad()
def _load_into_every_copy(masters: list[torch.Tensor] | None, pieces: bool, names: dict,
                          module: nn.Module, state_dict: dict, prefix: str, *_args) -> None:
    for name, (group, i, g, sharded) in names.items():
        key = prefix + name
        if key not in state_dict:
            continue  # torch reports it as missing (strict) or leaves it (strict=False)
        value = state_dict[key]
        if tuple(value.shape) != tuple(group.shapes[i]):
            raise ValueError(f"load_state_dict: {key} has shape {tuple(value.shape)} in the "
                             f"state dict, the model's is {tuple(group.shapes[i])}")
        flat = value.detach().reshape(-1)
        start, end = group.offsets[i], group.offsets[i] + group.numels[i]
        lo, hi = group.shard_range(group.rank) if sharded else (0, group.padded_numel)
        a, b = max(start, lo), min(end, hi)  # the elements of it this rank holds
        if masters is not None and g is not None and a < b:  # into the master
            master, src = masters[g][a - lo:b - lo], flat[a - start:b - start]
            if src.dtype != master.dtype:  # 16-bit values: the rounding of the master
                src = torch.where(master.to(src.dtype) == src, master, src.to(master.dtype))
            master.copy_(src)
        if pieces and sharded:  # stage 3: torch copies this rank's piece into the parameter
            state_dict[key] = flat[a - start:b - start] if a < b else flat[:0]


def _refuse_pieces(trainable: set[int], module: nn.Module, state_dict: dict, prefix: str,
                   _metadata) -> None:
    for name, p in module._parameters.items():
        key = prefix + name
        if p is not None and id(p) in trainable and key in state_dict and state_dict[key] is not p:
            raise RuntimeError(
                "model.state_dict() at stage 3 would hold this rank's 1-D pieces of the "
                f"parameters ({key}: {tuple(state_dict[key].shape)}), which cannot be loaded "
                "into the model anywhere else. For the full weights call "
                "zero_lab.stages.full_state_dict(model) on every rank (identical on all); to "
                "save and resume, zero_lab.checkpoint.save(model, opt, directory) on every rank")


def _masters_instead(views: dict[int, torch.Tensor], module: nn.Module, state_dict: dict,
                     prefix: str, _metadata) -> None:
    """Stage 0 in mixed precision: a trainable parameter's entry is its fp32 master (FSDP2's
    state_dict holds the fp32 parameters too), not the 16-bit copy the model computes with;
    keep_vars=True still gives the Parameter objects."""
    for name, p in module._parameters.items():
        key = prefix + name
        if p is not None and id(p) in views and key in state_dict and state_dict[key] is not p:
            state_dict[key] = views[id(p)].detach()
