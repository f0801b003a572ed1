"""Stage 3: a parameter read outside its unit's call is refused at the read.

Between its unit's forward and backward, a stage-3 parameter *rests*: its `.data` is this
rank's 1-D piece of it (units.py), which is what `model.parameters()` yields and what an
optimizer updates. Code that reads a weight elsewhere would compute with that piece:

    h / self.fc.weight.norm()                        # a parent's forward, fc is its own unit
    loss + c * sum(p.pow(2).sum() for p in model.parameters())   # an L2 term in the loss
    sum(p.norm() ** 2 for p in model.parameters())  # a weight norm logged under no_grad

Without gradients that is silently wrong (each rank reads its own piece); with them autograd
fails in backward ("PowBackward0 returned an invalid gradient"), far from the line at fault.
Here it is refused at the op, naming the parameter, its unit and what to do instead (an
old-style `torch.nn.utils.weight_norm`, whose pre-hook runs before the unit is gathered, too).

How. shard() registers, in place of each parameter it guards (stage 3: each of type
nn.Parameter; stages 1-2 with overlap_param_gather: each trainable one), a new
`GuardedParameter`, a subclass of nn.Parameter chosen once, as FSDP2 registers DTensors. Its
state is a flag, `p.zero_lab_state`: "whole", "at rest" (`rest`, when units.py releases its
unit; `wake` makes it whole) or "in flight" (param_gather.py). Its `__torch_function__`, which
torch calls for every op that touches it, passes an op whose parameters are all whole (one
look at each flag), waits for a parameter in flight, and lets through, for one at rest, only
what is right on a piece:
- looking at it: attributes (`.shape`, `.grad`, `.data`, ...) and methods that read no
  values (`numel()`, `detach()`, hook registration, ...);
- updating it in place under no_grad (`p.copy_(...)`: `load_state_dict`, an initialiser);
- anything inside a torch optimizer's step (element-wise on the pieces: exact, which is why
  stage 3 hands it `model.parameters()`; global optimizer-step hooks mark the step);
- `p.data` (or `p.detach()`): the piece as a plain tensor, for code that means the piece.
Everything else (an out-of-place op, a reduction, a matmul, indexing) raises.

A new object, not the old one re-classed: a reference taken before shard() is the old one,
stale as FSDP2's are (not trained, not guarded). The new one keeps its requires_grad,
attributes and `.grad`; a tied weight is one new object under each name. A tensor hook put on
a parameter before shard() is refused, naming it (carried, its handle's remove() would miss
it; left, it would never run). A class of one's own (a subclass of nn.Parameter) stays as is.

With FSDP2's DTensors (torch 2.13, tests/workers/stage3_reads.py's models) the parent's
read and the L2 term fail too ("mixed torch.Tensor and DTensor"); a norm of the parameters
alone is right there (DTensor reduces over the ranks), refused here: making reads right would
hide a collective in `p.norm()` and need DTensor's path for the gradient into the piece. The
message's ways are exact (the optimizer's `weight_decay`: torch's SGD and Adam add
weight_decay·p to the gradient, the gradient of weight_decay/2·||p||²).

Cost: every op on a guarded parameter pays one Python call, whole ones too (inside the
unit's forward and backward, and stages 1-2's forward): 1.2-1.8 us whole, 1.5 us for a look
at rest, 5.3-5.6 us for an op in an optimizer step (over a plain nn.Parameter). On the bench
model (6 x Linear(1024), 2 CPU ranks, idle) a step makes 78 calls on whole parameters and 36
at rest at stage 3 (0.15-0.19 ms of 56 ms, 0.3%; the class swaps cost 0.04 ms), 30 at stage
2 with overlap_param_gather (0.04-0.05 ms of 39 ms, 0.1%; the class swaps 2 us).
"""

from __future__ import annotations

import math
import weakref
from types import MethodWrapperType

import torch
from torch import nn
from torch.compiler import is_compiling
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

LABEL_ATTR = "_zero_lab_at_rest"  # on a stage-3 parameter: (name, unit, full shape, slice)
BUCKET_ATTR = "_zero_lab_in_flight"  # on a parameter of stages 1-2: (its ParamGather, bucket)
WHOLE, AT_REST, IN_FLIGHT = "whole", "at rest", "in flight"  # a GuardedParameter's state

# Attributes that are views of the values: reading one is a read of the parameter.
VALUE_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
# Methods that read no values: shape and autograd bookkeeping (pass at rest and in flight).
SHAPE_LOOKS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset",
    "is_contiguous", "is_floating_point", "is_complex", "data_ptr", "get_device",
    "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook",
})
# At rest also the storage, a detached alias and printing: they show the piece as it is.
LOOKS = SHAPE_LOOKS | {"untyped_storage", "detach", "__repr__"}
# In flight, `.data` is a read too: it is the tensor the all-gather is still writing.
IN_FLIGHT_VALUES = VALUE_ATTRIBUTES | {"data"}
NESTED = (list, tuple)  # an op's arguments that hold tensors (torch.cat, torch._foreach_*)


class GuardedParameter(nn.Parameter):
    """A parameter shard() guards: `zero_lab_state` says whether it is whole (every op passes),
    at rest (what is right on a piece passes) or in flight (a read waits for its bucket)."""

    zero_lab_state = WHOLE

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if not is_compiling() and (_flagged(args) or kwargs and _flagged(kwargs.values())):
            _guard(func, args, kwargs or {})
        with torch._C.DisableTorchFunctionSubclass():  # compiled: pre-hooks have waited
            return func(*args, **(kwargs or {}))


def guard_parameters(model: nn.Module, frozen_too: bool) -> None:
    """Register a GuardedParameter in place of each trainable parameter of `model` whose type
    is nn.Parameter (with `frozen_too`, each frozen one too), under each of its names."""
    made: dict[int, GuardedParameter] = {}
    for name, p in model.named_parameters():
        if type(p) is nn.Parameter and (p.requires_grad or frozen_too):
            if p._backward_hooks or p._post_accumulate_grad_hooks:
                raise ValueError(f"parameter {name} has a tensor hook put on it before shard(), "
                                 "which registers a new object in its place (as FSDP2 does): "
                                 "put the hook on the model's parameter after shard()")
            made[id(p)] = new = GuardedParameter(p.data, p.requires_grad)
            for key, value in vars(p).items():  # read from the old object, set on the new
                setattr(new, key, value)
            new.grad = p.grad
    for module in model.modules():
        for key, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(p) in made:
                module.register_parameter(key, made[id(p)])


def label(p: nn.Parameter, name: str, unit: str, shape: torch.Size,
          local: torch.Tensor) -> None:
    """Keep what the refusal names (parameter, unit, full shape) and the unit's slice."""
    setattr(p, LABEL_ATTR, (name, unit, tuple(shape), local))
    _install_step_hooks()


def rest(p: nn.Parameter) -> None:
    """From now on `p` is its piece: guard it (a GuardedParameter; any other stays as is)."""
    if type(p) is GuardedParameter:
        p.zero_lab_state = AT_REST


def wake(p: nn.Parameter) -> None:
    """`p` is about to be the full parameter again: whole."""
    if type(p) is GuardedParameter:
        p.zero_lab_state = WHOLE


# ------------------------------------------------------------------ what passes
def _flagged(items) -> bool:
    """A GuardedParameter in `items` (lists and tuples looked into) is not whole."""
    return any(getattr(a, "zero_lab_state", WHOLE) != WHOLE or type(a) in NESTED and _flagged(a)
               for a in items)


def _guard(func, args, kwargs) -> None:
    """A look passes; an op on a parameter in flight waits for its bucket; one on a parameter
    at rest is refused unless it is right on a piece."""
    if not is_look(func, SHAPE_LOOKS, IN_FLIGHT_VALUES):  # a look passes in either state
        for p in list(instances_in((args, kwargs), GuardedParameter)):
            if p.zero_lab_state == IN_FLIGHT:
                gather, g = getattr(p, BUCKET_ATTR)
                gather.wait(g)  # its bucket's parameters whole (param_gather.py)
            elif p.zero_lab_state == AT_REST and not _allowed(func, args) and _is_piece(p):
                raise RuntimeError(_refusal(func, p))


# The torch optimizers whose step has begun and not ended: a set, not a count (a step that
# raises never reaches its post-hook), weak (an optimizer that is gone is forgotten).
_stepping: weakref.WeakSet = weakref.WeakSet()


def is_look(func, looks: frozenset, value_attributes: frozenset) -> bool:
    """`func`, as `__torch_function__` receives it, only looks: an attribute (p.grad, p.shape,
    p.grad = g) other than `value_attributes`, or a method named in `looks`."""
    if type(func) is MethodWrapperType:
        return func.__self__.__name__ not in value_attributes
    return func.__name__ in looks


def instances_in(obj, cls):
    """Every `cls` in an op's arguments, lists and tuples looked into (dicts: kwargs)."""
    if isinstance(obj, cls):
        yield obj
    for item in obj.values() if isinstance(obj, dict) else obj if type(obj) in NESTED else ():
        yield from instances_in(item, cls)


def _allowed(func, args) -> bool:
    """A look; under no_grad (else autograd records a read), a step or a write in place."""
    return is_look(func, LOOKS, VALUE_ATTRIBUTES) or not torch.is_grad_enabled() and (
        bool(_stepping) or _writes_in_place(func, args))


def _writes_in_place(func, args) -> bool:
    """`p.add_(...)`, `p.copy_(...)`, `torch._foreach_mul_([p, ...], ...)`: p is written."""
    name, target = func.__name__, args[0] if args else None
    return name.endswith("_") and not name.startswith("__") and any(
        getattr(t, "zero_lab_state", None) == AT_REST for t in (
            target if type(target) in NESTED else [target]))


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
def _is_piece(p: GuardedParameter) -> bool:
    """`p` at rest is its piece. (Code that re-points `.data` itself, as notebook 05's
    exercises do with a bare unit, makes it whole without the stage's `wake`: it passes.)"""
    local = getattr(p, LABEL_ATTR)[3]
    with torch._C.DisableTorchFunctionSubclass():
        return p.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()


def _refusal(func, p: GuardedParameter) -> str:
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
