"""torch's `clip_grad_norm_(model.parameters(), c)` on a model sharded at stages 1-3.

In one process and at stage 0 every parameter's `.grad` is the whole averaged gradient, so
torch's function computes the global norm. At stages 1-3 a rank holds the final gradient of
its own slices only (stage 1: the rest of `.grad` is zeros, stage 2: `.grad` is None,
stage 3: `.grad` is this rank's piece), so torch's function alone would compute each rank's
partial norm, a different one on every rank, and clip by it in silence. FSDP2 makes the
function right by giving each parameter a sharded gradient (a DTensor) whose norm torch
reduces over the ranks.

Here `shard()` wraps torch's function (`torch.nn.utils.clip_grad_norm_`, installed once):
given the parameters of a model sharded at stages 1-3, it calls that model's
`opt.clip_grad_norm_`, the global norm from per-slice sums (one all-reduce), when it was given
all the model's trainable parameters (`model.parameters()`), and refuses a part of them,
whose norm alone the slices cannot give. Everything else goes to torch's own function
unchanged. A reference taken before `shard()` ran (`from torch.nn.utils import
clip_grad_norm_` at the top of a script) is torch's own: call `opt.clip_grad_norm_(c)`,
which is right at every stage.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.utils.clip_grad

OWNER_ATTR = "_zero_lab_optimizer"  # on parameters of a model sharded at stages 1-3: a weakref

_torch_clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_


def route_torch_clipping(params: list[torch.nn.Parameter], optimizer) -> None:
    """Make torch.nn.utils.clip_grad_norm_ on these parameters use `optimizer`'s global norm."""
    ref = weakref.ref(optimizer)
    for p in params:
        setattr(p, OWNER_ATTR, ref)
    if torch.nn.utils.clip_grad_norm_ is not clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


@functools.wraps(_torch_clip_grad_norm_)
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None
                    ) -> torch.Tensor:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {getattr(p, OWNER_ATTR, lambda: None)() for p in params} - {None}
    if not owners:  # nothing sharded at stages 1-3: torch's function is right
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    opt = owners.pop()
    mine = {id(p) for group in opt.sync.groups for p in group.params}
    given = {id(p) for p in params if id(p) in mine}
    if owners or given != mine:
        raise RuntimeError(
            f"torch.nn.utils.clip_grad_norm_ was given {len(given)} of the {len(mine)} "
            f"trainable parameters of a model sharded at stage {opt.sync.stage}"
            f"{' (and parameters of another sharded model)' if owners else ''}: each rank "
            "holds the gradients of its own slices only, so the norm of a part of the model "
            "cannot be computed from them. Clip all of them by their global norm with "
            "opt.clip_grad_norm_(max_norm) (or torch.nn.utils.clip_grad_norm_("
            "model.parameters(), max_norm))")
    return opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
