"""What `shard()` refuses before it changes anything, each refusal with its reason: arguments
out of range, and models that would otherwise train silently wrong (batch statistics, sparse
or renormalising embeddings, meta or non-fp32 parameters, parameters sharing memory, a
model holding one that shard() already returned or that torch's DDP or FSDP wrapped).
`check_settings` makes every check of shard()'s options, in one place.

Ranks that were given different things to shard refuse together, before any collective.
Ranks that disagree would still pair their collectives by size and order, and two models
with the same number of elements but other shapes, or two stages, would train wrong in
silence. So every rank describes what it was given (a dict of plain values: settings,
parameter names, shapes and dtypes, the optimizer's groups) and one all-gather compares the
descriptions: if they differ, every rank raises the same error, naming the first difference
(`check_ranks_agree`).
"""

from __future__ import annotations

import math
import sys
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from zero_lab.collectives.transports import TRANSPORTS
from zero_lab.memory import PRECISIONS
from zero_lab.stages.accumulation import check_accumulation_arguments, check_reshard_size
from zero_lab.stages.hybrid import mesh_shape
from zero_lab.stages.mixed_precision import check_policy

STAGES = (0, 1, 2, 3)
ZERO1_VARIANTS = ("reduce_scatter", "all_reduce")  # stage 1 sends 2Ψ, or the seed notes' 3Ψ
ROOT_PARAMS = ("shard", "replicate")  # stage 3: what becomes of parameters no unit claims
SHARDED_ATTR = "_zero_lab_sharded"  # set on a sharded model: the object behind full_state_dict
# shard()'s options that are True or False (overlap_grad_reduce may also be None: the stage's way)
FLAGS = ("find_unused_parameters", "broadcast_buffers", "check_lockstep", "check_order",
         "overlap_param_gather", "overlap_grad_reduce", "overlap_step")


def check_arguments(stage, bucket_mb, prefetch, precision, transport, zero1_variant,
                     unit_classes, check_order, root_params) -> None:
    if type(stage) is not int or stage not in STAGES:  # not True, not 1.0
        raise ValueError(f"stage must be one of the ints {STAGES}, got {stage!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float))
            or not math.isfinite(bucket_mb) or bucket_mb <= 0):
        raise ValueError(f"bucket_mb must be a positive number of megabytes, got {bucket_mb!r}")
    if not isinstance(prefetch, int):  # True, False or a depth k >= 1 (bool is an int)
        raise TypeError(f"prefetch must be True, False or an int k >= 1, got {prefetch!r}")
    if not isinstance(prefetch, bool) and (prefetch < 1 or stage != 3):
        raise ValueError(f"prefetch={prefetch!r}: a prefetch depth (how many units stage 3 "
                         "gathers ahead) is an int k >= 1, at stage 3 only; prefetch=False "
                         "gathers none ahead, True one")
    if zero1_variant not in ZERO1_VARIANTS:
        raise ValueError(f"zero1_variant must be one of {ZERO1_VARIANTS}, got {zero1_variant!r}")
    if zero1_variant != "reduce_scatter" and stage != 1:
        raise ValueError(f"zero1_variant applies to stage 1 only, not stage {stage}")
    if unit_classes is not None and stage != 3:
        raise ValueError(f"unit_classes applies to stage 3 only, not stage {stage}")
    if check_order and stage != 3:
        raise ValueError(f"check_order applies to stage 3 only, not stage {stage}")
    if root_params not in ROOT_PARAMS:
        raise ValueError(f"root_params must be one of {ROOT_PARAMS}, got {root_params!r}")
    if root_params != "shard" and stage != 3:
        raise ValueError(f"root_params applies to stage 3 only, not stage {stage}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {tuple(TRANSPORTS)}, got {transport!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard() needs torch.distributed initialised on every rank; run it "
                           "inside a torchrun worker after zero_lab.launch.init_worker()")


def check_overlap(stage, zero1_variant, overlap_param_gather, overlap_grad_reduce,
                  overlap_step) -> tuple[bool, bool]:
    """shard()'s options that hide communication (param_gather.py, partition.py's InFlight):
    where each applies. Stage 0 has no all-gather and stages 0, 2 and 3 always reduce during
    backward; stage 3 gathers before each unit's forward (its prefetch) and steps at rest. Returns
    (overlap_param_gather, overlap_grad_reduce) resolved, None meaning the stage's way.
    Stages 1-2 all-gather in `opt.step()` unless overlap_param_gather=True (DeepSpeed's
    order, Megatron-LM's default: issuing them early measured no faster on 2 CPU ranks with
    one bucket, see course/bench_systems.py; it hides them where bytes move beside compute,
    as on GPUs); stage 1 reduces when backward ends (reducing during backward measured no
    faster on 2 CPU cores either)."""
    if overlap_grad_reduce is None:
        overlap_grad_reduce = stage != 1
    if overlap_param_gather and stage not in (1, 2):
        raise ValueError(f"overlap_param_gather applies to stages 1 and 2, not stage {stage} "
                         "(stage 0 sends no all-gather; stage 3 gathers before each unit's "
                         "forward, with prefetch)")
    if not overlap_grad_reduce and stage != 1:
        raise ValueError(f"overlap_grad_reduce=False applies to stage 1 only, not stage "
                         f"{stage}: stages 0, 2 and 3 always reduce during backward")
    if overlap_grad_reduce and stage == 1 and zero1_variant != "reduce_scatter":
        raise ValueError("overlap_grad_reduce reduce-scatters during backward: not with "
                         f"zero1_variant={zero1_variant!r}")
    if overlap_step and stage not in (1, 2):
        raise ValueError(f"overlap_step applies to stages 1 and 2, not stage {stage}")
    if overlap_step and stage == 1 and not overlap_grad_reduce:
        raise ValueError("overlap_step at stage 1 needs overlap_grad_reduce=True: the "
                         "optimizer steps each bucket as its reduce-scatter lands, which "
                         "only happens when they are sent during backward")
    return overlap_param_gather, overlap_grad_reduce


def refuse_batch_statistics(name: str, module: nn.Module, _args) -> None:
    """A BatchNorm that normalises by the statistics of the batch it sees would use each
    rank's local batch, not the global one: refused at its forward. In eval mode with running
    statistics (fine-tuning a pretrained model) it is a fixed affine map: exact, accepted."""
    if module.training or module.running_mean is None:
        how = "in training mode" if module.training else "without running statistics"
        raise RuntimeError(
            f"{name} is a {type(module).__name__} {how}: it normalises by the statistics of "
            "each rank's local batch, so training would not match one process on the global "
            "batch. Fine-tuning with pretrained statistics: keep it in eval mode (call "
            f"{name}.eval() after every model.train()), which is exact. Training it: use "
            "nn.GroupNorm or nn.LayerNorm, which work on CPU (gloo) and GPU; nn.SyncBatchNorm "
            "works only on CUDA with NCCL")


def refuse_torch_wrapper(name: str, module: nn.Module) -> None:
    """Refuse a module torch already made data parallel. DDP all-reduces the gradients in
    hooks of its own, beside the stage's collectives on the same gradients (issue 47: a DDP
    given to shard() at stage 0 trained 0.037 off one process, silently); FSDP1 and FSDP2
    have sharded the parameters already, so what shard() would lay out are pieces, not the
    model's weights."""
    if isinstance(module, DistributedDataParallel):
        raise ValueError(
            f"{name} is torch's DistributedDataParallel (DDP), which averages the gradients "
            "itself: with shard()'s own reduction as well, both would handle every gradient. "
            "shard() does data parallelism itself (stage 0 is DDP's all-reduce): pass the "
            "module DDP wraps, shard(ddp.module, stage)")
    # FSDP's classes exist only once torch.distributed.fsdp is imported (0.5 s, which
    # shard() need not pay): a module cannot be one before that.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return
    if isinstance(module, fsdp.FullyShardedDataParallel):
        raise ValueError(
            f"{name} is torch's FullyShardedDataParallel (FSDP1), which has flattened and "
            "sharded its parameters already. shard() does the sharding itself (stage 3 is "
            "FSDP's): build the model again without FSDP and pass it to shard()")
    fsdp2 = getattr(fsdp, "FSDPModule", None)  # torch >= 2.6 names fully_shard's modules
    if fsdp2 is not None and isinstance(module, fsdp2):
        raise ValueError(
            f"{name} was sharded by torch's fully_shard (FSDP2): its parameters are "
            "DTensors, sharded already. shard() does the sharding itself (stage 3 is "
            "FSDP's): build the model again without fully_shard and pass it to shard()")


def check_settings(model: nn.Module, options: dict) -> tuple[bool, bool]:
    """Every refusal of shard()'s options (`options`: them by name, as given), before anything
    changes; returns (overlap_param_gather, overlap_grad_reduce) resolved."""
    o, stage = options, options["stage"]
    for name in FLAGS:
        if not (isinstance(o[name], bool) or name == "overlap_grad_reduce" and o[name] is None):
            raise TypeError(f"{name} must be True or False, got {o[name]!r}")
    check_arguments(stage, o["bucket_mb"], o["prefetch"], o["precision"], o["transport"],
                    o["zero1_variant"], o["unit_classes"], o["check_order"], o["root_params"])
    check_accumulation_arguments(stage, o["grad_accumulation"], o["reshard_after_forward"])
    check_reshard_size(o["reshard_after_forward"], dist.get_world_size(), o["mesh"])
    overlap = check_overlap(stage, o["zero1_variant"], o["overlap_param_gather"],
                            o["overlap_grad_reduce"], o["overlap_step"])
    check_checkpoint_activations(o["checkpoint_activations"])
    check_policy(o["precision"], o["keep_fp32"], o["reduce_dtype"])
    if o["mesh"] is not None and o["find_unused_parameters"]:
        raise ValueError("find_unused_parameters=True is not supported with a mesh yet: the "
                         "ranks would agree on which parameters have gradients inside their "
                         "group only")
    check_model(model)
    if o["mesh"] is not None:
        mesh_shape(o["mesh"])  # checked before any process group is made
    return overlap


def check_checkpoint_activations(value) -> None:
    """False, True, or a non-empty tuple/list of nn.Module subclasses."""
    if isinstance(value, bool):
        return
    if (isinstance(value, (tuple, list)) and value
            and all(isinstance(c, type) and issubclass(c, nn.Module) for c in value)):
        return
    raise TypeError("checkpoint_activations must be True, False or a tuple of nn.Module "
                    f"classes (e.g. (Block,)), got {value!r}")


def check_shard_call_agrees(model: nn.Module, plan: torch.optim.Optimizer,
                            options: dict) -> None:
    """shard(): every rank describes what it was given (its options, every parameter's and
    buffer's name, shape and dtype, the optimizer's groups); they refuse together if any
    rank's differs."""
    mesh = options["mesh"]  # a DeviceMesh, or (R, S): by its shape (hybrid.py)
    said = {**options, "mesh": None if mesh is None else mesh_shape(mesh)}
    check_ranks_agree("shard()", {
        **{name: comparable(value) for name, value in said.items()},
        "parameters": [(n, tuple(p.shape), str(p.dtype), p.requires_grad)
                       for n, p in model.named_parameters()],
        "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
        "optimizer": [type(plan).__name__] + [len(g["params"]) for g in plan.param_groups]})


def comparable(value):
    """A setting as the ranks compare it: classes by name, sequences as lists, anything else
    not plain (a dtype) as text."""
    if isinstance(value, type):
        return getattr(value, "__qualname__", repr(value))
    if isinstance(value, (list, tuple)):
        return [comparable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def check_ranks_agree(call: str, mine: dict) -> None:
    """Raise ValueError on every rank if any rank's description differs from rank 0's."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        for key in mine:
            ours, other = first[key], theirs[key]
            if ours == other:
                continue
            if isinstance(ours, list) and isinstance(other, list):  # the first entry apart
                pairs = zip(ours, other, strict=False)  # lengths may differ too
                i = next((i for i, (a, b) in enumerate(pairs) if a != b),
                         min(len(ours), len(other)))
                ours = ours[i] if i < len(ours) else "nothing more"
                other = other[i] if i < len(other) else "nothing more"
                key = f"{key}[{i}]"
            raise ValueError(
                f"the ranks called {call} differently: rank {rank} has {key} = {other!r} "
                f"where rank 0 has {ours!r}. Every rank must shard the same model (same "
                "parameter names and shapes) with the same settings")


def check_model(model: nn.Module) -> None:
    """Refuse, with the reason, every case that would otherwise train silently wrong."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(model).__name__}")
    if getattr(model, SHARDED_ATTR, None) is not None:
        raise ValueError("this model is already sharded; shard() a fresh model")
    for name, module in model.named_modules():
        owner = getattr(module, SHARDED_ATTR, None)  # its parameters are in flat buffers
        if owner is not None:
            raise ValueError(
                f"model.{name} is already sharded (stage {owner.sync.stage}): shard() the "
                "outer model once, built from modules no shard() call has changed (shard() "
                "moved that part's parameters into its own flat buffers and hooks)")
        refuse_torch_wrapper(f"model.{name}" if name else "model", module)
    for name, module in model.named_modules():
        if (isinstance(module, nn.modules.batchnorm._BatchNorm)
                and not isinstance(module, nn.SyncBatchNorm)):
            module.register_forward_pre_hook(partial(refuse_batch_statistics, name or "model"))
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ValueError(f"{name} produces sparse gradients (sparse=True), which flat "
                             "gradient buffers cannot hold; use sparse=False")
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            raise ValueError(
                f"{name} is an {type(module).__name__} with max_norm={module.max_norm}: it "
                "renormalises rows of its weight in place during forward, outside the "
                "optimizer, which a sharded weight cannot follow (stage 3 holds a gathered "
                "copy, stages 1-2 would not all-gather the change); use max_norm=None")
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters (all requires_grad=False)")
    for name, p in model.named_parameters():
        if p.is_meta:
            raise ValueError(f"parameter {name} is on the meta device (no data yet): "
                             "materialise the model first (model.to_empty(device=...) and "
                             "initialise it), then shard() it")
    for name, p in trainable:
        if p.numel() == 0:
            raise ValueError(f"parameter {name} has no elements (shape {tuple(p.shape)}); "
                             "freeze it (requires_grad=False) or remove it before shard()")
        if p.dtype != torch.float32:
            raise ValueError(f"parameter {name} is {p.dtype}; shard() takes a float32 model "
                             "(precision='mixed' makes the bf16 copies itself)")
    devices = {p.device for _, p in trainable}
    if len(devices) > 1:
        raise ValueError(f"trainable parameters are on several devices {sorted(map(str, devices))}"
                         "; move the model to one device first")
    # Two distinct Parameters over the same memory would be updated twice per step.
    spans = sorted((p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size(),
                    p.numel() * p.element_size(), name)
                   for name, p in model.named_parameters() if p.numel() > 0)
    for (start, size, name), (next_start, _, next_name) in zip(spans, spans[1:], strict=False):
        if next_start < start + size:
            raise ValueError(
                f"parameters {name} and {next_name} are different Parameter objects sharing "
                "memory; tie weights by assigning the same nn.Parameter to both modules")


def refuse_compile() -> None:
    """Stage 3 under torch.compile: refused (called from its forward hook while tracing)."""
    # Run outside the traced graph, so the error reaches the caller. Disabled here, not with
    # a decorator: the decorator imports torch._dynamo, 1.5 s of every rank's start-up, and
    # this runs only while torch.compile traces (dynamo is loaded by then).
    torch.compiler.disable(_compile_refused)()


def _compile_refused() -> None:
    raise RuntimeError(
        "torch.compile of a model sharded at stage 3 is not supported: stage 3 gathers and "
        "frees each unit's parameters in module hooks (all-gathers into a buffer whose memory "
        "is freed and given back, parameters re-pointed with .data), which a compiled graph "
        "cannot follow (autograd would find the weights it saved modified in place). Train "
        "the stage-3 model uncompiled, or compile at stages 0-2, which compile and match one "
        "process")
