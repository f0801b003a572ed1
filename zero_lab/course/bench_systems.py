"""What the benchmark trains and how: the systems it races, each built on every rank.

Shared by `zero_lab.course.bench` (the command, on the parent side: names, labels, the config it
sends) and `zero_lab/workers/bench_worker.py` (the rank side: builds and trains each system).

Every system trains the same model (the seed blog's deep MLP scaled to `depth` blocks of
Linear(width, width) + ReLU), with Adam, `batch` rows per rank. A system is a name, labels and
a builder `build(model, config, device) -> Trainer`, called inside the worker after the
process group is up; builders import torch inside, so that the parent side stays light.
To add a system, write a builder and list it in SYSTEMS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

PHASES = ("forward", "backward", "optimizer.step", "zero_grad")  # how a step is timed


@dataclass
class BenchConfig:
    """What every system trains: the same model, data, optimizer and bucket size."""

    width: int = 1024
    depth: int = 6
    batch: int = 32  # rows per rank; the global batch is batch x N
    lr: float = 1e-3
    bucket_mb: float = 25.0  # zero_lab's buckets (DDP keeps its own defaults: see _ddp)
    rounds: int = 8
    steps: int = 10  # timed steps per system per round
    warmup: int = 3  # untimed steps per system first (>= 2: DDP rebuilds its buckets on step 2)
    seed: int = 0


@dataclass
class Trainer:
    """A system ready to train: call `model`, then `optimizer.step()` / `.zero_grad()`.

    `full_weights()` returns {original parameter name: full tensor} on every rank.
    """

    model: object
    optimizer: object
    full_weights: Callable[[], dict]


@dataclass(frozen=True)
class System:
    """A named way of training the model. `build(model, config, device)` -> Trainer runs
    inside the worker, on every rank, after the process group is up."""

    name: str
    label: str
    build: Callable = field(repr=False)
    short: str = ""  # a two-line label for figures


# ----------------------------------------------------------------------------- builders


def _adam(params, config: BenchConfig):
    import torch

    return torch.optim.Adam(params, lr=config.lr)


def _unwrapped_weights(ddp) -> Callable[[], dict]:
    return lambda: {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}


def _ddp(model, config: BenchConfig, device):
    """DDP as torch ships it. No `bucket_cap_mb`: in torch 2.13 any explicit cap, even 25,
    also caps the first bucket (`_BucketCapacityConfig.create`), which by default is 1 MiB so
    that the gradients ready first leave at once. With defaults the bench's 6 x 4 MiB model
    rebuilds into two buckets (the last Linear's 4.2 MB, then 21 MB); with the cap, one."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def build_ddp(model, config: BenchConfig, device) -> Trainer:
    """torch's DistributedDataParallel (default settings) + Adam on every parameter."""
    ddp = _ddp(model, config, device)
    return Trainer(ddp, _adam(ddp.parameters(), config), _unwrapped_weights(ddp))


def build_zero_redundancy(model, config: BenchConfig, device) -> Trainer:
    """torch's ZeroRedundancyOptimizer (whole parameters per rank, broadcast after the step)
    over DDP's all-reduced gradients: torch's own ZeRO stage 1."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ddp = _ddp(model, config, device)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                  lr=config.lr)
    return Trainer(ddp, opt, _unwrapped_weights(ddp))


def build_zero_lab(model, config: BenchConfig, device, stage: int,
                   prefetch: bool = True, transport: str = "auto",
                   **options) -> Trainer:
    """zero_lab's `shard(model, stage)`: flat buffers, buckets of `bucket_mb` (stage 3: one
    flat buffer per unit, each Linear here; `prefetch` gathers the next unit ahead).
    `transport="torch"` sends through torch's collectives even on gloo; `options` go to
    shard() as they are (e.g. check_order=True)."""
    from zero_lab.stages import full_state_dict, shard

    model, opt = shard(model, stage, optimizer=lambda params: _adam(params, config),
                       bucket_mb=config.bucket_mb, prefetch=prefetch, transport=transport,
                       **options)
    return Trainer(model, opt, lambda: full_state_dict(model))


def build_fsdp2(model, config: BenchConfig, device) -> Trainer:
    """torch's FSDP2: `fully_shard` on every block (each Linear), then on the root; Adam on
    the local shards (DTensors), as torch documents it."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)

    def full_weights() -> dict:
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
                for k, v in model.state_dict().items()}

    return Trainer(model, _adam(model.parameters(), config), full_weights)


SYSTEMS: dict[str, System] = {s.name: s for s in [
    System("ddp", "torch DDP", build_ddp, "torch\nDDP"),
    System("zero_redundancy", "torch ZeroRedundancyOptimizer + DDP", build_zero_redundancy,
           "torch\nZeroRedundancyOpt."),
    System("stage0", "zero_lab stage 0", partial(build_zero_lab, stage=0), "zero_lab\nstage 0"),
    # Stages 1-2 as shard() makes them by default (the all-gather in opt.step()), and with
    # it issued by the step and waited for by the next forward (overlap_param_gather).
    System("stage1", "zero_lab stage 1", partial(build_zero_lab, stage=1), "zero_lab\nstage 1"),
    System("stage2", "zero_lab stage 2", partial(build_zero_lab, stage=2), "zero_lab\nstage 2"),
    System("stage1_param_gather", "zero_lab stage 1, overlap_param_gather",
           partial(build_zero_lab, stage=1, overlap_param_gather=True),
           "zero_lab st. 1\ngather in fwd"),
    System("stage2_param_gather", "zero_lab stage 2, overlap_param_gather",
           partial(build_zero_lab, stage=2, overlap_param_gather=True),
           "zero_lab st. 2\ngather in fwd"),
    System("stage3", "zero_lab stage 3 (prefetch)", partial(build_zero_lab, stage=3),
           "zero_lab\nstage 3"),
    System("stage3_noprefetch", "zero_lab stage 3, no prefetch",
           partial(build_zero_lab, stage=3, prefetch=False), "zero_lab st. 3\nno prefetch"),
    # Stage 3's limit on all-gathers in flight (issue 24): k units gathered ahead, k + 1 in
    # flight at most (the default, prefetch=True, is k = 1: FSDP2's two in flight); 5 is
    # every other unit of the bench's 6, i.e. no limit.
    *[System(f"stage3_prefetch{k}", f"zero_lab stage 3, prefetch={k}",
             partial(build_zero_lab, stage=3, prefetch=k), f"zero_lab st. 3\nprefetch={k}")
      for k in (2, 5)],
    System("stage3_checked", "zero_lab stage 3, check_order=True",
           partial(build_zero_lab, stage=3, check_order=True), "zero_lab st. 3\ncheck_order"),
    System("stage3_unchecked", "zero_lab stage 3, check_lockstep=False",
           partial(build_zero_lab, stage=3, check_lockstep=False),
           "zero_lab st. 3\nno lockstep check"),
    System("fsdp2", "torch FSDP2 (fully_shard)", build_fsdp2, "torch\nFSDP2"),
    # Hiding the communication (stages/param_gather.py, InFlight in stages/partition.py): the
    # same bytes, sent under the next forward (the all-gather, "_param_gather" above) and
    # during backward (stage 1's reduce-scatter); "_step" also updates each bucket as soon
    # as its gradient lands.
    System("stage1_grad_reduce", "zero_lab stage 1, overlap_grad_reduce",
           partial(build_zero_lab, stage=1, overlap_grad_reduce=True),
           "zero_lab st. 1\nreduce in bwd"),
    System("stage1_overlap", "zero_lab stage 1, overlap_param_gather + overlap_grad_reduce",
           partial(build_zero_lab, stage=1, overlap_param_gather=True,
                   overlap_grad_reduce=True), "zero_lab st. 1\noverlapped"),
    System("stage1_overlap_step", "zero_lab stage 1, overlapped + overlap_step",
           partial(build_zero_lab, stage=1, overlap_param_gather=True,
                   overlap_grad_reduce=True, overlap_step=True),
           "zero_lab st. 1\noverlap + step"),
    System("stage2_overlap_step", "zero_lab stage 2, overlapped + overlap_step",
           partial(build_zero_lab, stage=2, overlap_param_gather=True, overlap_step=True),
           "zero_lab st. 2\noverlap + step"),
    # The same stages sending through torch's collectives (on gloo: its reduce-scatter is an
    # all-reduce in disguise; see collectives/exchange.py): what the direct exchange buys.
    *[System(f"stage{s}_torch", f"zero_lab stage {s}, torch's collectives",
             partial(build_zero_lab, stage=s, transport="torch"),
             f"zero_lab st. {s}\ntorch coll.") for s in (1, 2, 3)],
]}


# What FSDP2's times mean on gloo, printed wherever the bench shows them (bench.py, nb 06).
FSDP2_ON_GLOO = (
    "torch FSDP2 on gloo (CPU) is no guide to GPUs: gloo's reduce-scatter is a clone of the "
    "whole input, an all-reduce and a copy of one chunk (torch 2.13's ProcessGroupGloo), and "
    "FSDP2's DTensor and copy-in/copy-out overheads weigh heavily on a small CPU model; on "
    "NCCL it sends a real reduce-scatter.")


def caveats(systems, backend: str) -> list[str]:
    """What a reader of the bench's results must know about these systems on this backend,
    as lines of at most 100 characters."""
    from textwrap import wrap

    return wrap(FSDP2_ON_GLOO, 100) if "fsdp2" in systems and backend == "gloo" else []


# ---------------------------------------------- a stage's twin that sends nothing (06, 07)
# Notebooks 06 and 07 time each stage beside its twin, in the same launch and the same rounds:
# step(stage) - step(twin) is what the stage's communication costs, and the twin's step is
# the stage's compute, measured under whatever load the stage itself ran under.

NO_COMM = "_no_comm"  # suffix of a stage's twin: "stage2_no_comm"


def no_comm_twin(name: str) -> System:
    """zero_lab's system `name` with `transport="none"`: every copy, hook, bucket and the 1/N
    update, nothing sent (its weights are meaningless: no rank sees another's data)."""
    system = SYSTEMS[name]
    return System(f"{name}{NO_COMM}", f"{system.label}, sending nothing",
                  partial(system.build, transport="none"), f"{name}\nsends nothing")


# Stages 0-3 as shard() makes them (notebook 07), and stages 1-2 with their all-gathers under
# the next forward: notebook 06's A/B check needs communication hidden under compute at every
# stage, and by default stages 1-2 hide next to none of theirs (profiling/checks.py).
TWINS: dict[str, System] = {s.name: s for s in map(no_comm_twin, (
    "stage0", "stage1", "stage2", "stage3", "stage1_param_gather", "stage2_param_gather"))}
# What the bench worker can build: the systems `make bench` races by default, and the twins,
# run only when named (their weights differ from every other system's by design).
BENCH_SYSTEMS: dict[str, System] = {**SYSTEMS, **TWINS}


# ------------------------------------------------ systems the profiler notebook adds (06)


class _BlogStep:
    """The seed blog's ZeRO-1 (`zero_lab.course.seed_blog.BlogZero`) with its step marked as an
    optimizer step, as torch optimizers mark theirs: its timer covered exactly that call."""

    def __init__(self, blog) -> None:
        self.blog = blog

    def step(self) -> None:
        from zero_lab.profiling.marks import OPTIMIZER_STEP, mark

        with mark(OPTIMIZER_STEP):
            self.blog.step()

    def zero_grad(self) -> None:
        self.blog.zero_grad()


def build_compute_only(model, config: BenchConfig, device) -> Trainer:
    """The same model, per-rank batch and Adam with no communication at all: each rank
    trains alone (a world of one), while the other ranks load the machine the same way."""
    return Trainer(model, _adam(model.parameters(), config),
                   lambda: {k: v.detach().clone() for k, v in model.state_dict().items()})


def build_blog_zero1(model, config: BenchConfig, device) -> Trainer:
    """The seed blog's ZeRO-1: all-reduce every gradient in step(), update the whole
    tensors this rank owns, broadcast every parameter from its owner."""
    from zero_lab.course.seed_blog import BlogZero

    return Trainer(model, _BlogStep(BlogZero(model, stage=1, lr=config.lr)),
                   lambda: {k: v.detach().clone() for k, v in model.state_dict().items()})


PROFILE_SYSTEMS: dict[str, System] = {**SYSTEMS, **TWINS, **{s.name: s for s in [
    System("compute_only", "compute only (no communication)", build_compute_only,
           "compute\nonly"),
    System("blog_zero1", "the seed blog's ZeRO-1", build_blog_zero1, "seed blog\nZeRO-1"),
]}}
