"""Stage 3: a parameter read outside its unit's call is refused at the read.

Between its unit's forward and backward, a stage-3 parameter *rests*: its `.data` is this
rank's 1-D piece of it (units.py), which is what `model.parameters()` yields and what an
optimizer updates. Code that reads a weight elsewhere would compute with that piece:

    h / self.fc.weight.norm()                        # a parent's forward, fc is its own unit
    loss + c * sum(p.pow(2).sum() for p in model.parameters())   # an L2 term in the loss
    sum(p.norm() ** 2 for p in model.parameters())  # a weight norm logged under no_grad

Without gradients that is silently wrong (each rank reads its own piece); with them autograd
fails in backward ("PowBackward0 returned an invalid gradient"), far from the line at fault.
Here such a read is refused at the op, with the parameter, its unit and what to do instead
in the message (an old-style `torch.nn.utils.weight_norm`, whose forward pre-hook runs
before the unit is gathered, is refused the same way; the parametrization works).

How. While its unit rests, a parameter's class is `ParameterAtRest`, a subclass of
nn.Parameter (`p.__class__` is switched by units.py, back to nn.Parameter when the unit is
gathered: the unit's own forward and backward run with no check at all). Its
`__torch_function__`, which torch calls for every op that touches it, lets through only what
is right on a piece:
- looking at it: attributes (`.shape`, `.grad`, `.data`, `.requires_grad`, ...) and methods
  that read no values (`numel()`, `detach()`, hook registration, ...);
- updating it in place under no_grad (`p.copy_(...)`, `p.add_(...)`: `load_state_dict`, an
  initialiser): every rank writes its own piece of the same update;
- anything inside a torch optimizer's step (under no_grad, as torch's optimizers run): an
  element-wise optimizer on the pieces is exact, which is why stage 3 hands it
  `model.parameters()` (global optimizer-step hooks mark the step);
- `p.data` (or `p.detach()`) is the piece as a plain tensor, for code that means the piece.
Everything else (an out-of-place op, a reduction, a matmul, indexing) raises.

torch's FSDP2 keeps its parameters at rest as DTensors, whose ops know they are sharded
(torch 2.13, measured on gloo with the models of tests/workers/stage3_reads.py): the
parent's read and the L2 term fail there too, with DTensor's "got mixed torch.Tensor and
DTensor"; a norm computed from the parameters alone is right there (the DTensor ops reduce
over the ranks), and refused here.

Why not the other ways. A TorchFunctionMode active during the sharded model's forward would
check every op of every forward (a Python call each), and would not see an L2 term computed
after forward. Making the reads right, as DTensor does for ops on parameters alone, would
hide a collective inside `p.norm()` (every rank must then read the same weights in the same
order) and need a path for the gradient back into the piece: DTensor's machinery, not a
lesson's. The ways the message offers are exact today: `unit_classes` that keep the read
weight inside the reading module's unit, `opt.clip_grad_norm_` for gradient norms, the
optimizer's `weight_decay` for an L2 penalty (torch's SGD and Adam add weight_decay·p to the
gradient: exactly the gradient of weight_decay/2·||p||² in the loss; AdamW's decoupled decay
is the usual choice), and `full_state_dict(model)` for weights read without gradients.

Cost: nothing inside a unit's call (its parameters are plain nn.Parameters then). At rest,
each look the stage itself takes at `.grad` (3 per parameter and step, in zero3.py) pays one
Python call, and every gather and release switches each parameter's class. On the bench
model (6 x Linear(1024), stage 3, 2 CPU ranks) that is 36 calls x 8.7-9.4 us + 48 switches
x 0.4 us = 0.33-0.36 ms per step of 300 ms (0.11-0.12%), measured on a 2-core machine
under load; a wall-clock A/B of the whole step there is noise (-13%..+34%, median +3.6%).
A parameter of a class of one's own (a subclass of nn.Parameter) is not guarded.
"""

from __future__ import annotations

import math
import weakref
from types import MethodWrapperType

import torch
from torch import nn
from torch._C import _disabled_torch_function_impl
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

LABEL_ATTR = "_zero_lab_at_rest"  # on a stage-3 parameter: (name, unit, full shape, slice)

# Attributes that are views of the values: reading one is a read of the parameter.
VALUE_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
# Methods that read no values and hand none out: shape and autograd bookkeeping (a parameter
# in flight, param_gather.py, lets these pass too).
SHAPE_LOOKS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset",
    "is_contiguous", "is_floating_point", "is_complex", "data_ptr", "get_device",
    "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook",
})
# At rest also the storage, a detached alias and printing: they show the piece as it is.
LOOKS = SHAPE_LOOKS | {"untyped_storage", "detach", "__repr__"}


class ParameterAtRest(nn.Parameter):
    """A stage-3 parameter between its unit's calls: this rank's 1-D piece, guarded."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _allowed(func, args):
            p = _piece_in(args)
            if p is None:
                p = _piece_in(kwargs)
            if p is not None:
                raise RuntimeError(_refusal(func, p))
        return _disabled_torch_function_impl(func, types, args, kwargs)


def label(p: nn.Parameter, name: str, unit: str, shape: torch.Size,
          local: torch.Tensor) -> None:
    """Remember what the refusal names (the parameter, its unit, its full shape) and the
    unit's slice `local`, whose storage a parameter at rest is a piece of."""
    setattr(p, LABEL_ATTR, (name, unit, tuple(shape), local))
    _install_step_hooks()


def rest(p: nn.Parameter) -> None:
    """From now on `p` is its piece: guard it. (A parameter of a class of one's own, a
    subclass of nn.Parameter, is left as it is.)"""
    if type(p) is nn.Parameter:
        p.__class__ = ParameterAtRest


def wake(p: nn.Parameter) -> None:
    """`p` is about to be the full parameter again: a plain nn.Parameter."""
    if type(p) is ParameterAtRest:
        p.__class__ = nn.Parameter


# ------------------------------------------------------------------ what passes
# The torch optimizers whose step has begun and not ended. A set, not a count: a step that
# raises never reaches its post-hook, and a count would stay up for good (every later read
# under no_grad passing, on that rank only); in the set, that optimizer's next step that ends
# closes it, and a weak set forgets an optimizer that is gone.
_stepping: weakref.WeakSet = weakref.WeakSet()


def is_look(func, looks: frozenset, value_attributes: frozenset) -> bool:
    """`func`, as `__torch_function__` receives it, only looks: an attribute (p.grad, p.shape,
    p.grad = g) other than `value_attributes`, or a method named in `looks`."""
    if type(func) is MethodWrapperType:
        return func.__self__.__name__ not in value_attributes
    return func.__name__ in looks


def instances_in(obj, cls):
    """Every `cls` in an op's arguments, lists, tuples and dicts looked into."""
    if isinstance(obj, cls):
        yield obj
        return
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        yield from instances_in(item, cls)


def _allowed(func, args) -> bool:
    if is_look(func, LOOKS, VALUE_ATTRIBUTES):
        return True
    if torch.is_grad_enabled():  # autograd would record a read of the piece
        return False
    return bool(_stepping) or _writes_in_place(func, args)


def _writes_in_place(func, args) -> bool:
    """`p.add_(...)`, `p.copy_(...)`, `torch._foreach_mul_([p, ...], ...)`: p is written."""
    name = func.__name__
    if not name.endswith("_") or name.startswith("__") or not args:
        return False
    target = args[0]
    if isinstance(target, (list, tuple)):
        return any(isinstance(t, ParameterAtRest) for t in target)
    return isinstance(target, ParameterAtRest)


def _step_begins(optimizer, *_args) -> None:
    _stepping.add(optimizer)


def _step_ends(optimizer, *_args) -> None:
    _stepping.discard(optimizer)


_HOOKS: list = []


def _install_step_hooks() -> None:
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_step_begins))
        _HOOKS.append(register_optimizer_step_post_hook(_step_ends))


# ------------------------------------------------------------------ what is said
def _piece_in(obj) -> ParameterAtRest | None:
    """The first guarded parameter in an op's arguments (lists and dicts looked into) that is
    its piece. (Code that re-points `.data` itself, as notebook 05's exercises do with a
    bare unit, makes the parameter whole without the stage's `wake`: then it passes.)"""
    for p in instances_in(obj, ParameterAtRest):
        local = getattr(p, LABEL_ATTR)[3]
        with torch._C.DisableTorchFunctionSubclass():
            if p.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                return p
    return None


def _refusal(func, p: ParameterAtRest) -> str:
    name, unit, shape, _ = getattr(p, LABEL_ATTR)
    what = func.__self__.__name__ if type(func) is MethodWrapperType else func.__name__
    with torch._C.DisableTorchFunctionSubclass():
        numel = p.numel()
    return (
        f"{name} is read outside its unit's call ({what}): at stage 3 it holds only this "
        f"rank's 1-D piece of itself outside the forward and backward of its unit '{unit}' "
        f"({numel} of its {math.prod(shape)} elements, full shape {shape}), so this would "
        "compute with the piece: silently wrong without gradients, a wrong-shaped gradient "
        "with them. Read a weight inside its unit's call (call the module that owns it), or "
        "keep that module inside the unit of the module that reads it: shard(..., "
        "unit_classes=(TheReadingModule,)); a forward pre-hook added before shard() runs "
        "before the unit is gathered (torch.nn.utils.weight_norm: use "
        "torch.nn.utils.parametrizations.weight_norm). Instead of a norm of the gradients: "
        "opt.clip_grad_norm_(max_norm) (torch's clip_grad_norm_(model.parameters(), c) is "
        "routed to it); of an L2 penalty in the loss: the optimizer's weight_decay; of weights "
        "read without gradients: full_state_dict(model), on every rank. Code that means this "
        "rank's piece (element-wise, as an optimizer) can use p.data")
