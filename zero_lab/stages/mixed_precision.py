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

A precision *policy* refines the recipe in two ways, as torch FSDP2's MixedPrecisionPolicy:

- `keep_fp32=(nn.LayerNorm,)`: modules of these classes (and everything inside them) keep
  their parameters in fp32 and compute in fp32, while the rest computes in 16 bits. A kept
  module casts its floating inputs to fp32 on the way in and its outputs back to the compute
  dtype on the way out (FSDP2: `fully_shard(norm, mp_policy=MixedPrecisionPolicy(
  param_dtype=torch.float32, output_dtype=torch.bfloat16))`, whose default
  cast_forward_inputs=True casts the inputs), so its neighbours see what they saw before. A
  kept parameter is its own master: 4 (param) + 4 (grad) + 8 (Adam) = 16 bytes, as a 16-bit
  one's 2 + 2 + 12; only its collectives carry 4 bytes an element instead of 2. The flat
  buffers hold one dtype, so kept parameters get buffers (stages 0-2) or units (stage 3, as
  FSDP2's separate fully_shard call on the norm) of their own. The policy changes a dtype,
  not where a parameter lives: with root_params="replicate", a kept module the root holds
  is a unit kept whole on every rank, as the root (units.make_units). The policy is per
  module, not per parameter: one op mixing a 16-bit weight with an fp32 bias of the same
  module would fail.
- `reduce_dtype=torch.float32`: gradients are reduced in fp32 (FSDP2's reduce_dtype): the
  16-bit gradient buffer is widened before the collective (4 bytes an element on the wire,
  the ledger's count) and the fp32 average is kept as the master's gradient, what the
  optimizer steps on (`sync.main_grads`; FSDP2 casts the reduce-scatter's output to its
  fp32 sharded parameter's dtype). The 16-bit `.grad` beside it shows its rounding; the
  fp32 average adds 4 bytes an element of what the rank steps (its slice; at stage 0 the
  whole) from backward to zero_grad, which `measure.memory.held_bytes` does not count.
  Summing N 16-bit gradients on the way rounds at every partial sum and the 16-bit average
  once more; in fp32 the step sees the average unrounded, at every N (N = 2 included). Accumulating
  backwards add their fp32 averages in fp32 at every stage (stages 0-1 clear their 16-bit
  buffer's rounding before the next backward adds into it: install_fresh_start).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.stages.gradient_sync import clear_grads
from zero_lab.stages.partition import FlatParamGroup

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


def check_policy(precision: str, keep_fp32, reduce_dtype) -> None:
    """Refuse a policy that does not apply: both knobs refine 16-bit training only."""
    if not (isinstance(keep_fp32, (tuple, list)) and all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in keep_fp32)):
        raise TypeError(f"keep_fp32 must be a tuple of nn.Module classes (e.g. "
                        f"(nn.LayerNorm,)), got {keep_fp32!r}")
    if reduce_dtype is not None and not isinstance(reduce_dtype, torch.dtype):
        raise TypeError(f"reduce_dtype must be None or a torch dtype, got {reduce_dtype!r}")
    compute = COMPUTE_DTYPES.get(precision)
    if compute is None and (keep_fp32 or reduce_dtype is not None):
        raise ValueError("keep_fp32 and reduce_dtype refine mixed precision (precision='bf16' "
                         f"or 'fp16'); with precision={precision!r} everything is fp32 already")
    if reduce_dtype not in (None, torch.float32, compute):
        raise ValueError(f"reduce_dtype must be None (the compute dtype, {compute}) or "
                         f"torch.float32, got {reduce_dtype}")


def kept_modules(model: nn.Module, keep_fp32) -> list[nn.Module]:
    """The outermost modules of the classes in `keep_fp32` (the root included)."""
    classes = tuple(keep_fp32)
    if not classes:
        return []
    chosen = [m for m in model.modules() if isinstance(m, classes)]
    inside = {id(d) for m in chosen for d in m.modules() if d is not m}
    return [m for m in chosen if id(m) not in inside]


def kept_parameter_ids(model: nn.Module, keep_fp32) -> set[int]:
    """ids of the parameters `keep_fp32` keeps in fp32: every parameter of a kept module.

    A parameter shared by a kept module and one that is not (a tied weight) is refused: it
    would have to be fp32 and 16-bit at once."""
    kept = {id(p) for m in kept_modules(model, keep_fp32) for p in m.parameters()}
    if kept:
        inside = {id(d) for m in kept_modules(model, keep_fp32) for d in m.modules()}
        for name, module in model.named_modules():
            if id(module) in inside:
                continue
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in kept:
                    raise ValueError(
                        f"{name + '.' if name else ''}{pname} is used by a module kept in fp32 "
                        "(keep_fp32) and by one that computes in 16 bits: a parameter has one "
                        "dtype. Keep both modules in fp32, or untie the weight")
    return kept


def to_compute_dtype(model: nn.Module, dtype: torch.dtype,
                     skip: frozenset[int] | set[int] = frozenset(), keep_fp32=()) -> None:
    """Make `model` compute in `dtype`: floating parameters and buffers are cast to it (except
    the parameters whose id is in `skip`), inputs too, and outputs back to fp32. Modules of
    the classes in `keep_fp32` stay fp32, parameters and buffers: they cast their inputs to
    fp32 and their outputs back to `dtype`."""
    kept = kept_modules(model, keep_fp32)
    kept_ids = kept_parameter_ids(model, keep_fp32)
    in_kept = {id(d) for m in kept for d in m.modules()}
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in skip and id(p) not in kept_ids and p.is_floating_point():
                p.data = p.data.to(dtype)
        for module in model.modules():
            if id(module) in in_kept:
                continue
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(module, name, buf.to(dtype))
    for module in kept:
        if module is not model:
            cast_around(module, torch.float32, dtype)
    if model not in kept:
        cast_around(model, dtype, torch.float32)


def cast_around(module: nn.Module, inputs: torch.dtype, outputs: torch.dtype) -> None:
    """`module` casts its floating inputs to `inputs` and its floating outputs to `outputs`."""
    module.register_forward_pre_hook(
        lambda _m, args, kwargs: (cast_floats(args, inputs), cast_floats(kwargs, inputs)),
        with_kwargs=True)
    module.register_forward_hook(lambda _m, _args, out: cast_floats(out, outputs))


def group_layout(sync) -> list[dict]:
    """What a precision policy built, group by group (`opt.sync.groups`): elements, padded
    elements, dtype, whether its gradient is reduced in fp32, whether it is replicated."""
    return [{"padded": g.padded_numel, "numel": g.numel, "dtype": str(g.dtype),
             "reduce_fp32": isinstance(g, ReducedInFp32), "replicated": sync.replicated[i]}
            for i, g in enumerate(sync.groups)]


class ReducedInFp32(FlatParamGroup):
    """A flat group whose gradient reductions run in fp32 (FSDP2's reduce_dtype=float32).

    The 16-bit full buffer is widened to fp32 and reduced. Given an fp32 output (what the
    stages pass: the reduced slice is the master's gradient, kept in fp32 as FSDP2 keeps
    it) the result stays fp32; given a 16-bit one, it is rounded once into it when the
    collective completes. All-gathers (of parameters) are untouched. shard() lays out its
    groups as ReducedInFp32 when reduce_dtype=torch.float32 (make_flat_groups' group_type).
    """

    @property
    def reduces_wide(self) -> bool:  # a 16-bit group (an fp32 one is reduced in fp32 anyway)
        return self.dtype != torch.float32

    def new_shard(self, dtype: torch.dtype | None = None, zeroed: bool = True) -> torch.Tensor:
        return super().new_shard(dtype or torch.float32, zeroed)  # the averaged gradient: fp32

    def reduce_scatter(self, shard_out: torch.Tensor, full_in: torch.Tensor,
                       op=dist.ReduceOp.AVG, async_op: bool = False):
        if full_in.dtype == torch.float32:
            return super().reduce_scatter(shard_out, full_in, op, async_op)
        wide_in = full_in.float()
        if shard_out.dtype == torch.float32:  # kept in fp32: nothing rounded
            work = super().reduce_scatter(shard_out, wide_in, op, async_op)
            return None if work is None else _RoundedInto(work, None, None, keep=wide_in)
        wide_out = torch.empty_like(shard_out, dtype=torch.float32)
        work = super().reduce_scatter(wide_out, wide_in, op, async_op)
        return _rounded_into(work, wide_out, shard_out, keep=wide_in)

    def all_reduce(self, buffer: torch.Tensor, op=dist.ReduceOp.AVG, async_op: bool = False):
        if buffer.dtype == torch.float32:
            return super().all_reduce(buffer, op, async_op)
        wide = buffer.float()
        work = super().all_reduce(wide, op, async_op)
        return _rounded_into(work, wide, buffer)


def step_grad(sync, g: int) -> torch.Tensor | None:
    """The gradient the step (and clipping) uses for group g of a stage: the fp32 average when
    reduced in fp32 (`sync.main_grads[g]`), else the slice's `.grad`; None without one."""
    grad = sync.step_params[g].grad
    main = sync.main_grads[g]
    return None if grad is None else main if main is not None else grad


def land_wide(sync, g: int, wide: torch.Tensor, rounded: torch.Tensor) -> None:
    """Stages 0-1: group g's gradient reduced in fp32 (`wide`) becomes the master's gradient
    (`sync.main_grads[g]`), or is added to it when an earlier backward of this step left one
    (accumulation, in fp32 as FSDP2's); its rounding goes into the 16-bit gradient `rounded`
    that `.grad` shows (and the next backward clears first: fresh_start)."""
    main = sync.main_grads[g]
    sync.main_grads[g] = wide if main is None else main.add_(wide)
    rounded.copy_(sync.main_grads[g])
    sync.rounding_held[g] = True


def install_fresh_start(sync) -> None:
    """Stages 0-1 keep a full 16-bit gradient buffer that autograd accumulates into; after a
    reduction in fp32 it holds the rounding of the average. Before the next backward adds to
    it (a tensor hook runs before autograd accumulates), every `.grad` of such a group is set
    to None, so the buffer receives this backward's local gradients alone, and land_wide adds
    their fp32 average to the fp32 one kept: accumulation in fp32, not in the 16-bit buffer."""
    sync.rounding_held = [False] * len(sync.groups)
    ref = weakref.ref(sync)
    for group in sync.groups:
        if group.reduces_wide:
            for p in group.params:
                p.register_hook(partial(_fresh_start, ref))


def _fresh_start(ref, _grad: torch.Tensor) -> None:
    sync = ref()
    if sync is None:
        return
    if not sync._callback_queued:  # this backward's first: what overlap_step left lands
        sync.land_reductions()
    if not any(sync.rounding_held):
        return
    for g, held in enumerate(sync.rounding_held):
        if held:  # (each parameter's view is given back when its gradient is adopted)
            for p in sync.groups[g].params:
                p.grad = None
            sync.rounding_held[g] = False


class _RoundedInto:
    """An fp32 collective in flight whose result is rounded into a 16-bit tensor on wait()
    (`wide` None: nothing to round; `keep` holds its fp32 input alive until then)."""

    def __init__(self, work, wide: torch.Tensor | None, out: torch.Tensor | None,
                 keep=None) -> None:
        self.work, self.wide, self.out, self.keep = work, wide, out, keep
        self.done = False

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        if not self.done:
            self.work.wait()
            if self.wide is not None:
                self.out.copy_(self.wide)
            self.done = True
            self.wide = self.keep = None  # the fp32 buffers are freed here
        return True


def _rounded_into(work, wide: torch.Tensor, out: torch.Tensor, keep=None):
    if work is None:  # a synchronous collective: done already
        out.copy_(wide)
        return None
    return _RoundedInto(work, wide, out, keep)


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
    keep_fp32=(),
) -> tuple[nn.Module, MasterWeightOptimizer]:
    """Turn a float32 `model` (in place) into single-process training in `dtype` (bf16 or
    fp16) with fp32 masters; modules of the classes in `keep_fp32` stay fp32 (their masters
    hold the same values as they do)."""
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().clone() for p in params]  # fp32 values before any rounding
    to_compute_dtype(model, dtype, keep_fp32=keep_fp32)
    return model, MasterWeightOptimizer(params, masters, optimizer)
