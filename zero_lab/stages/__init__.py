"""`shard()`: data parallelism and ZeRO stages 1, 2 and 3 on the flat-buffer partition.

    model, opt = shard(model, stage=2)          # inside a torchrun worker
    for x, y in batches:                        # the ordinary loop, unchanged
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
    weights = full_state_dict(model)            # same dict on every rank

What each stage shards and when it communicates is told in its own module, top to bottom:
`ddp.py` (stage 0), `zero1.py`, `zero2.py`, `zero3.py`; each opens with what it adds to its
plain stage and where, and the package guide (zero_lab/README.md) names every module.

`shard()` changes the model in place and returns it, in the three steps its numbered comments
name. Build the optimizer through `shard(..., optimizer=...)`, never on `model.parameters()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.stages.accumulation import install_no_sync
from zero_lab.stages.at_rest import guard_parameters
from zero_lab.stages.buffers import BufferSync
from zero_lab.stages.ddp import DataParallel
from zero_lab.stages.gradient_sync import GradientSync
from zero_lab.stages.hybrid import make_mesh
from zero_lab.stages.lockstep import Lockstep
from zero_lab.stages.mixed_precision import (
    COMPUTE_DTYPES,
    ReducedInFp32,
    kept_parameter_ids,
    to_compute_dtype,
)
from zero_lab.stages.param_gather import ParamGather
from zero_lab.stages.partition import FlatParamGroup, make_flat_groups
from zero_lab.stages.recompute import apply_recompute
from zero_lab.stages.refusals import SHARDED_ATTR, check_settings, check_shard_call_agrees
from zero_lab.stages.sharded_optimizer import (
    ShardedOptimizer,
    make_plan,
    refuse_outside_optimizers,
)
from zero_lab.stages.state_dicts import route_loading
from zero_lab.stages.torch_clipping import route_torch_clipping
from zero_lab.stages.units import attach_post_forward_groups, make_units
from zero_lab.stages.zero1 import Zero1, ZeroRedundancyOptimizer
from zero_lab.stages.zero2 import Zero2
from zero_lab.stages.zero3 import Zero3

__all__ = ["shard", "full_state_dict", "ShardedOptimizer", "ZeroRedundancyOptimizer",
           "DataParallel", "Zero1", "Zero2", "Zero3"]

BUFFERS_ATTR = "_zero_lab_buffer_sync"  # its BufferSync, with broadcast_buffers=True
FIRST_BUCKET_MB = 1.0  # as torch's DDP: a small first bucket starts communicating early


def default_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def shard(
    model: nn.Module,
    stage: int,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = default_optimizer,
    bucket_mb: float = 25.0,
    prefetch: bool | int = True,
    precision: str = "fp32",
    *,
    # layout: how the parameters are cut and where they live (and bucket_mb above)
    unit_classes: Sequence[type] | None = None,
    root_params: str = "shard",
    reshard_after_forward: bool | int = True,
    mesh=None,
    # precision (FSDP2's MixedPrecisionPolicy, with precision above)
    keep_fp32: Sequence[type] = (),
    reduce_dtype: torch.dtype | None = None,
    # overlap: the same bytes, sent earlier (and prefetch above)
    overlap_param_gather: bool = False,
    overlap_grad_reduce: bool | None = None,
    overlap_step: bool = False,
    # accumulation (the runtime switch is model.no_sync()) and activation memory
    grad_accumulation: str = "sharded",
    checkpoint_activations: bool | Sequence[type] = False,
    # torch's contract, and the checks that keep ranks together
    find_unused_parameters: bool = False,
    broadcast_buffers: bool = True,
    check_lockstep: bool = True,
    check_order: bool = False,
    # variants the course measures
    transport: str = "auto",
    zero1_variant: str = "reduce_scatter",
) -> tuple[nn.Module, ShardedOptimizer]:
    """Prepare `model` for data-parallel training at ZeRO `stage`; return (model, optimizer).

    stage 0: plain data parallelism (bucketed all-reduce overlapped with backward); 1:
    optimizer states sharded; 2: optimizer states and gradients; 3: parameters too, gathered
    unit by unit (zero3.py). `optimizer` builds a torch optimizer from a list of parameters
    (an element-wise one: SGD, Adam, AdamW, ...); it is called once on the trainable
    parameters, full-shaped, and its groups and settings are applied to this rank's pieces.
    Needs an initialised default process group; call it on every rank: the ranks first check
    they were all given the same model and settings (one small all-gather), and refuse
    together if not. `bucket_mb`, `prefetch` and `precision` may be passed by position (the
    public API's order, which outside checks use); every other option is keyword-only, each
    named as DDP, FSDP2 or Megatron-LM name it (the guide, zero_lab/README.md, says why no
    policy objects):

    layout
      bucket_mb          stages 0-2: flat groups of about this many MB (their collectives)
      unit_classes       stage 3: modules of these classes are units (FSDP's wrapping
                         policy); default: each called child that owns parameters
      root_params        stage 3: parameters no unit claims are one more unit, "shard"
                         (FSDP2's fully_shard on the root) or "replicate" (whole on every rank)
      reshard_after_forward  stage 3, FSDP2's: True frees after forward; False keeps each
                         unit gathered to its backward (2Ψ a step, not 3Ψ); an int d
                         (1 < d < N, divides N) keeps 1/d, so backward gathers over d ranks
      mesh               (R, S) or a 2-D DeviceMesh (replicate, shard): hybrid sharding
                         (hybrid.py), sharded inside a group of S, replicated across R
    precision (mixed_precision.py)
      precision          "fp32", or compute in "bf16" ("mixed") or "fp16" with fp32 masters
      keep_fp32          module classes kept in fp32, e.g. (nn.LayerNorm,)
      reduce_dtype       torch.float32: gradients reduced in fp32 and kept so for the step
    overlap (the bytes are the same)
      prefetch           stage 3: True gathers the next unit while one computes, False none,
                         an int k the next k
      overlap_param_gather  stages 1-2: the step only issues its all-gathers and the next
                         forward waits for them; a raw read waits for its bucket
                         (param_gather.py)
      overlap_grad_reduce   stage 1: reduce-scatter each bucket during backward (stages 0, 2,
                         3 always do)
      overlap_step       stages 1-2: each bucket stepped as its gradient lands; a reader
                         waits (`opt.wait_for_grads()`)
    accumulation and memory
      grad_accumulation  stages 2-3 under model.no_sync(): "sharded" (reduce-scatter every
                         backward) or "unsharded" (one full gradient held; one a step)
      checkpoint_activations  True recomputes every unit in backward, or a tuple of classes
                         (recompute.py; no extra collective)
    torch's contract and the ranks kept together
      find_unused_parameters  DDP's: False refuses a backward that leaves a trainable
                         parameter without a gradient; True lets it go unused
      broadcast_buffers  DDP's: rank 0's buffers go to every rank before a training forward
      check_lockstep     once a step, 24 bytes a rank: same step count and unit order, else
                         every rank raises, naming the ranks (lockstep.py); at stage 3 also
                         before each unit's all-gather of the first forward (the unit named)
      check_order        stage 3 debug aid: every all-gather of every forward checked to be
                         the same unit
    variants the course measures
      transport          "auto" (direct exchange on gloo, torch's collectives elsewhere),
                         "torch" or "direct" (collectives/exchange.py)
      zero1_variant      "all_reduce": the seed notes' stage 1 (3Ψ a step, not 2Ψ)

    The model gets `model.no_sync()` (DDP's; FSDP2's set_requires_gradient_sync(False)),
    `model.wait_for_params()`, and `model.zero_grad()` routed to the optimizer. At stage 3,
    and at stages 1-2 with overlap_param_gather, its parameters are new objects (as FSDP2's
    fully_shard makes them; at_rest.py): take references after shard(), and put tensor hooks
    on them after it too (one put on before is refused).
    """
    # Every option as given (the parameters above, before anything else is named here):
    # what the refusals check and what the ranks compare (refusals.py).
    options = {name: value for name, value in locals().items()
               if name not in ("model", "optimizer")}
    overlap_param_gather, overlap_grad_reduce = check_settings(model, options)
    if stage == 3 or overlap_param_gather:  # new objects, once, before anything holds them
        guard_parameters(model, frozen_too=stage == 3)  # (at_rest.py)
    # The optimizer function sees the parameters as the learner wrote the model (full shapes,
    # names' order), before anything changes: its groups are the plan (sharded_optimizer.py).
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = make_plan(optimizer, [p for _, p in trainable], list(model.parameters()))
    check_shard_call_agrees(model, plan, options)
    # The ranks agree on the layout: every rank makes the same process groups, in order.
    layout = make_mesh(mesh) if mesh is not None else None
    compute_dtype = COMPUTE_DTYPES.get(precision)  # None: fp32
    kept = kept_parameter_ids(model, keep_fp32)  # parameters the policy keeps in fp32
    # reduce_dtype=float32: groups whose gradient reductions run in fp32 (mixed_precision.py)
    group_type = ReducedInFp32 if reduce_dtype == torch.float32 else FlatParamGroup

    # 1. Trainable parameters, each once (a tied weight is one Parameter), into flat groups;
    #    every rank starts from rank 0's values. Stages 0-2: buckets of about bucket_mb, the
    #    last layers first (the order backward produces their gradients). Stage 3: one group
    #    per unit, of which this rank keeps only its slice (zero3.py).
    if stage == 3:
        units, masters = make_units(model, unit_classes, transport, compute_dtype,
                                    replicate_root=root_params == "replicate",
                                    keep_fp32=keep_fp32, mesh=layout, group_type=group_type)
        if not isinstance(reshard_after_forward, bool):  # backward gathers over d ranks
            attach_post_forward_groups(units, reshard_after_forward)
        groups = [unit.group for unit in units]
    else:
        element_size = compute_dtype.itemsize if compute_dtype else 4  # of the gradients
        # Parameters a precision policy keeps in fp32 get buckets of their own (one dtype
        # per flat buffer, as torch's DDP buckets per dtype).
        groups = [group for params, size in (
                      ([(n, p) for n, p in trainable if id(p) not in kept], element_size),
                      ([(n, p) for n, p in trainable if id(p) in kept], 4)) if params
                  for group in make_flat_groups(params[::-1], bucket_mb * 2**20,
                                                element_size=size, transport=transport,
                                                first_bucket_bytes=FIRST_BUCKET_MB * 2**20,
                                                group_type=group_type, **_levels(layout))]
        masters = []
        if compute_dtype:
            # fp32 masters of what this rank updates, taken before anything is rounded; a
            # group kept in fp32 is its own master.
            for group in groups:
                mine = group.shard(group.flat) if stage > 0 else group.flat
                if id(group.params[0]) in kept:
                    masters.append(mine)
                else:
                    masters.append(mine.clone())
                    group.bind(group.flat.to(compute_dtype))

    # 2. What is not in a flat group (frozen parameters, buffers) stays whole on every rank,
    #    also from rank 0; stage 3 shards the frozen parameters of its units (units.py).
    laid_out = {id(p) for group in groups for p in group.params}
    if stage == 3:
        laid_out |= {id(p) for unit in units if unit.frozen for p in unit.frozen.group.params}
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and id(p) not in laid_out:
                dist.broadcast(p.data, src=0)
        for buf in model.buffers():
            dist.broadcast(buf, src=0)
    if compute_dtype:
        to_compute_dtype(model, compute_dtype, skip=laid_out, keep_fp32=keep_fp32)

    # 3. The stage's gradient path (hooks, collectives), and the optimizer on what it updates.
    sync: GradientSync
    unused = find_unused_parameters
    if stage == 3:
        sync = Zero3(model, units, prefetch=prefetch, find_unused_parameters=unused,
                     check_order=check_order, reshard_after_forward=reshard_after_forward,
                     grad_accumulation=grad_accumulation)
    elif stage == 2:
        sync = Zero2(groups, find_unused_parameters=unused, grad_accumulation=grad_accumulation)
    elif stage == 1:
        sync = Zero1(groups, variant=zero1_variant, find_unused_parameters=unused,
                     overlap_grad_reduce=overlap_grad_reduce)
    else:
        sync = DataParallel(groups, find_unused_parameters=unused)
    sync.frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    # Nothing is sent with transport="none" (a compute-only twin), so nothing to check. The
    # whole world checks (with a mesh, the groups' process groups hold only some ranks).
    sync.lockstep = Lockstep(None, groups[0].device,
                             enabled=check_lockstep and transport != "none")
    opt = ShardedOptimizer(sync, plan, masters or None)
    setattr(model, SHARDED_ATTR, opt)
    sync.overlap_step = overlap_step
    if overlap_param_gather:  # the step's all-gathers waited for by the next forward
        sync.param_gather = ParamGather(groups)
        sync.param_gather.install(model)
    model.wait_for_params = sync.wait_for_params  # every stage: a no-op when nothing waits
    install_no_sync(model, sync)
    if broadcast_buffers and any(True for _ in model.buffers()):
        setattr(model, BUFFERS_ATTR,
                BufferSync(model, before_send=partial(sync.before_first_collective, "buffers")))
    # model.load_state_dict(W) reaches the fp32 masters and stage 3's pieces; stage 3's
    # model.state_dict() (this rank's pieces) is refused with what to use instead.
    route_loading(model, sync, opt.master_weights)
    if stage > 0:  # torch's clip_grad_norm_ on model.parameters(): the global norm
        route_torch_clipping([p for group in groups for p in group.params], opt)
    if stage in (1, 2):
        refuse_outside_optimizers([p for group in groups for p in group.params], stage)
    # Stages 2 and 3 keep gradients where model.zero_grad() cannot see them (the owned
    # slices): route it to the optimizer, so a loop that calls model.zero_grad() stays right.
    model.zero_grad = opt.zero_grad
    if checkpoint_activations:  # last: recompute.py wraps forwards, their hooks untouched
        apply_recompute(model, checkpoint_activations, unit_classes)
    return model, opt


def _levels(layout) -> dict:
    """make_flat_groups' process groups for a hybrid layout (none for the 1-D world)."""
    if layout is None:
        return {}
    return {"process_group": layout.shard_group, "replicate_group": layout.replicate_group}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full tensor} for every entry of `model.state_dict()`, identical on every rank.

    Names are the original model's (a tied weight appears under each of its names). In
    mixed precision, trainable parameters come from the fp32 masters; buffers are rank 0's
    (with broadcast_buffers=True). Call it on every rank: for sharded states it is a
    collective. On a model that was never sharded it
    returns a copy of its state dict.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"full_state_dict takes the model shard() returned (an nn.Module), "
                        f"got {type(model).__name__}")
    owner = getattr(model, SHARDED_ATTR, None)
    if owner is None:
        return {name: t.detach().clone() for name, t in model.state_dict().items()}
    owner.sync.lockstep.check("state")  # a rank that stepped once more would differ
    buffers = getattr(model, BUFFERS_ATTR, None)
    if buffers is not None:
        buffers.sync()  # rank 0's buffers, as the next training forward would see them
    return owner.full_state_dict(model)
