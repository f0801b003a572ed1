"""Mixed precision, the recipe the ZeRO paper's 16 bytes per parameter assume.

The model computes in a 16-bit dtype, bf16 or fp16 (the user's choice, as FSDP2's
`MixedPrecisionPolicy(param_dtype=...)`): its parameters (and floating buffers) are in it, so
are the gradients autograd produces and the collectives that carry them (2 + 2 bytes per
parameter). Inputs are cast on the way in and outputs back to fp32 on the way out, so the
loss is computed in fp32. The update is applied to an fp32 *master* copy of the weights with
fp32 optimizer states (4 + 4 + 4 bytes with Adam) and rounded back into the 16-bit
parameters; without the master, small updates would vanish in the rounding.

bf16 keeps fp32's range with 8 significant bits; fp16 has 11 significant bits (closer to
fp32 training) but a range that ends at 65504 and, below 6e-8, flushes gradients to zero.
Large models use a loss scaler with fp16 (torch's GradScaler); this course's models do not
need one, and neither does its one-process reference.

`shard(..., precision="bf16" | "fp16")` ("mixed" means bf16) keeps masters and states only
for the slice a rank owns. `mixed_precision_reference()` is the same recipe in one process,
without any sharding: the reference that sharded mixed-precision training is checked against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zero_lab.stages.gradient_sync import clear_grads

# precision (shard()'s argument) -> the dtype the model computes in
COMPUTE_DTYPES = {"mixed": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}


def cast_floats(obj, dtype: torch.dtype):
    """`obj` with every floating-point tensor inside (tuples, lists, dicts) cast to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        cast = [cast_floats(x, dtype) for x in obj]
        return type(obj)(*cast) if hasattr(obj, "_fields") else type(obj)(cast)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def to_compute_dtype(model: nn.Module, dtype: torch.dtype,
                     skip: frozenset[int] | set[int] = frozenset()) -> None:
    """Make `model` compute in `dtype`: floating parameters and buffers are cast to it (except
    the parameters whose id is in `skip`), inputs too, and outputs back to fp32."""
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in skip and p.is_floating_point():
                p.data = p.data.to(dtype)
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(module, name, buf.to(dtype))
    model.register_forward_pre_hook(
        lambda _m, args, kwargs: (cast_floats(args, dtype), cast_floats(kwargs, dtype)),
        with_kwargs=True)
    model.register_forward_hook(lambda _m, _args, out: cast_floats(out, torch.float32))


class MasterWeightOptimizer:
    """Single-process mixed precision: fp32 masters per parameter, the torch optimizer on them.

    The reference for sharded mixed precision: same steps, no flat buffers, no collectives.
    """

    def __init__(self, params: list[nn.Parameter], masters: list[torch.Tensor],
                 make_optimizer: Callable) -> None:
        self.params = params
        self.master_weights = [nn.Parameter(m.detach().clone().float(), requires_grad=False)
                               for m in masters]
        self.optim = make_optimizer(self.master_weights)

    @torch.no_grad()
    def step(self) -> None:
        for p, master in zip(self.params, self.master_weights, strict=True):
            master.grad = None if p.grad is None else p.grad.float()
        self.optim.step()
        for p, master in zip(self.params, self.master_weights, strict=True):
            p.copy_(master)
            master.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        clear_grads(self.params, set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch's formula, with the norm accumulated in fp32 (bf16 would lose digits)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        total = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads]))
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(clip_coef.to(g.dtype))
        return total

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Like zero_lab.stages.full_state_dict: masters for the trainable parameters."""
        by_id = {id(p): m for p, m in zip(self.params, self.master_weights, strict=True)}
        return {name: by_id.get(id(t), t).detach().clone()
                for name, t in model.state_dict(keep_vars=True).items()}


def mixed_precision_reference(
    model: nn.Module,
    optimizer: Callable = lambda params: torch.optim.Adam(params, lr=1e-3),
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[nn.Module, MasterWeightOptimizer]:
    """Turn a float32 `model` (in place) into single-process training in `dtype` (bf16 or
    fp16) with fp32 masters."""
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().clone() for p in params]  # fp32 values before any rounding
    to_compute_dtype(model, dtype)
    return model, MasterWeightOptimizer(params, masters, optimizer)
