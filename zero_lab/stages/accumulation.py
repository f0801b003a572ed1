"""Gradient accumulation without waste: `model.no_sync()`, and what each stage does under it.

    for step in range(steps):                       # k micro-batches per optimizer step
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                (loss_fn(model, micro) / k).backward()
        opt.step(); opt.zero_grad()

(`accumulate(model, micro_batches, loss_fn)` below is that inner loop.) Without `no_sync()`
every backward communicates: k micro-batches cost k times the bytes of one optimizer step,
for gradients that are only needed once, summed, when the step comes. Inside `no_sync()` a
backward keeps its gradient on this rank; the next backward outside it communicates the sum.

One name, torch DDP's: `DDP.no_sync()` is a context manager, and it is what most training
loops already call (Hugging Face Accelerate's `accumulate`, nanoGPT's
`require_backward_grad_sync` flag is the same switch). FSDP2 spells the same switch as a
setter, `model.set_requires_gradient_sync(False)` ... `(True)`; a context manager cannot forget
to switch it back (an exception inside restores it), so `shard()`'s model offers only that.
The switch is read when a backward starts (as FSDP2 reads it; DDP reads it at forward): run
each non-final micro-batch's forward and backward inside it, which suits both.

What each stage can save (the bytes per optimizer step are `zero_lab.predict.knobs.
accumulation_messages`; Ψ the padded flat parameters in bytes, k micro-batches):

- stages 0 and 1 keep a full gradient buffer anyway (g·Ψ): the backwards under `no_sync()`
  add into it, and the last backward sends it once: all-reduce 2Ψ (stage 0), reduce-scatter
  Ψ + the step's all-gather Ψ (stage 1), whatever k is. Without no_sync: 2kΨ, (k + 1)Ψ.
- stage 2 shards its gradients to save g·Ψ(N-1)/N of memory, and under accumulation it must
  choose, so `shard(..., grad_accumulation=...)` names the choice:
  "sharded" (the default, DeepSpeed ZeRO-2's behaviour, which refuses no_sync): every
  backward reduce-scatters its gradient into this rank's slice, even under no_sync, so the
  full gradient never outlives its bucket: (k + 1)Ψ per step, k times the gradient bytes;
  "unsharded" (FSDP2's under set_requires_gradient_sync(False) with
  set_reshard_after_backward(False); without the second, FSDP2 re-gathers the parameters every
  micro-batch: (k + 1)Ψ): under no_sync the
  full gradient is kept (a flat buffer per bucket: stage 1's gradient memory while the
  micro-batches run; FSDP2 holds it in `reduce_dtype`: with fp32, 4 bytes a parameter, twice
  bf16's) and reduce-scattered once, then freed: 2Ψ per step.
  Stage 2's memory saving costs k times the communication; that is why Megatron-LM's
  distributed optimizer, built for large accumulation counts, is ZeRO-1 (stage 1: the
  gradient buffer is kept, the optimizer states sharded, 2Ψ per optimizer step).
- stage 3 has the same two modes for its gradients, and parameters to gather as well: every
  micro-batch gathers every unit twice (forward, backward) unless `reshard_after_forward=
  False` (zero3.py) keeps them gathered from forward to backward, and, under no_sync, from one
  micro-batch to the next (FSDP2 needs `set_reshard_after_backward(False)` for that second
  part): then a unit is gathered once per optimizer step, and stage 3 with "unsharded"
  accumulation sends 2Ψ per optimizer step, DDP's bytes with DDP's memory while it runs.

`opt.step()` after a backward under `no_sync()` with nothing sent since is refused: every rank
holds only its own gradient, and the ranks would step apart (torch's DDP steps on them in
silence). `opt.zero_grad()` drops what was accumulated, as in one process.

The lockstep check (lockstep.py) counts optimizer steps as before and adds, in its
fingerprint, the backwards each rank ran since its last step (stage 3: and whether this
forward is under no_sync). A rank that accumulates a different number of micro-batches than
the others then fails together with them, named, at the first check where they differ:
stages 0 and 1, and stage 2 with "unsharded", check before the step's first collective (the
last micro-batch's backward); stage 3 at the end of every forward. Stage 2 with "sharded"
sends every micro-batch: as with plain accumulation, its ranks are checked only at their first
backward of a step, and a rank that steps early meets another's reduce-scatter with its
all-gather. Neither do models with buffers get the extra safety (buffers.py's all-reduce
before every forward comes first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch import nn

GRAD_ACCUMULATION = ("sharded", "unsharded")  # what stages 2 and 3 keep under no_sync
NO_SYNC_ATTR = "no_sync"  # the method shard() puts on the model
# What the lockstep check says when only the fingerprint differs (lockstep.py).
MICRO_BATCHES_DIFFER = (
    "the ranks ran different numbers of backwards (micro-batches) since their last optimizer "
    "step: every rank must accumulate the same number of micro-batches, the same ones under "
    "model.no_sync()")
FORWARDS_DIFFER = (
    "the ranks ran the units of this forward in different orders, or " + MICRO_BATCHES_DIFFER
    + ". At stage 3 each unit's all-gather meets the same-numbered all-gather on the other "
    "ranks, so every rank must call the same units in the same order (no rank-dependent "
    "control flow around units)")


@contextmanager
def no_sync(sync) -> Iterator[None]:
    """Backwards started inside keep their gradients on this rank (see the module text)."""
    before = sync.requires_sync
    sync.requires_sync = False
    try:
        yield
    finally:
        sync.requires_sync = before


def install_no_sync(model: nn.Module, sync) -> None:
    """Give the sharded model its `model.no_sync()`, bound to its stage's gradient sync."""
    setattr(model, NO_SYNC_ATTR, partial(no_sync, sync))


def accumulate(model: nn.Module, micro_batches: Sequence,
               loss_fn: Callable[[nn.Module, object], torch.Tensor]) -> float:
    """Forward and backward every micro-batch, each loss divided by their number k, all but
    the last under `model.no_sync()`; returns the sum of the divided losses (this rank's mean)."""
    k = len(micro_batches)
    total = 0.0
    for i, micro in enumerate(micro_batches):
        with nullcontext() if i == k - 1 else model.no_sync():
            loss = loss_fn(model, micro) / k
            loss.backward()
        total += loss.item()
    return total


def forward_fingerprint(gathers: list[int], backwards: int, syncs: bool) -> int:
    """Stage 3's lockstep fingerprint of a forward: the units it gathered in order, the
    backwards since the last step, and whether this micro-batch is under no_sync (so ranks
    accumulating differently fail at the forward, before a backward that sends meets one
    that does not). One integer: Python's hash of a tuple of ints is the same in every
    process (only str and bytes hashes are salted)."""
    return hash((*gathers, -1, backwards, int(syncs)))


def describe_forward(names: list[str], backwards: int, syncs: bool) -> str:
    """The same in words, for the lockstep error (the accumulation part only when there is
    some)."""
    return (f"gathering {', '.join(names) or 'no unit'}"
            + (f"; {backwards} backward(s) since its last step" if backwards else "")
            + ("" if syncs else "; under no_sync"))


def refuse_unsynced_step() -> None:
    raise RuntimeError(
        "opt.step() after a backward under model.no_sync() with no backward outside it since: "
        "each rank holds only its own accumulated gradient, so the ranks would step apart. "
        "Run the last micro-batch's forward and backward outside no_sync() (it sends the "
        "accumulated gradient once), or opt.zero_grad() to drop what was accumulated")


def check_accumulation_arguments(stage: int, grad_accumulation: str,
                                 reshard_after_forward: bool | int) -> None:
    """shard()'s refusals for the two settings (stage is already checked)."""
    if grad_accumulation not in GRAD_ACCUMULATION:
        raise ValueError(f"grad_accumulation must be one of {GRAD_ACCUMULATION}, got "
                         f"{grad_accumulation!r}")
    if grad_accumulation != "sharded" and stage < 2:
        raise ValueError(
            f"grad_accumulation applies to stages 2 and 3 only, not stage {stage}: stages 0 "
            "and 1 keep a full gradient buffer anyway, so under model.no_sync() they always "
            "accumulate into it and communicate once")
    if not isinstance(reshard_after_forward, int):
        raise TypeError(
            f"reshard_after_forward must be True, False or an int (FSDP2's: the size of the "
            f"group to reshard to after forward), got {reshard_after_forward!r}")
    if not isinstance(reshard_after_forward, bool):
        if stage != 3:
            raise ValueError(f"reshard_after_forward={reshard_after_forward} applies to "
                             f"stage 3 only, not stage {stage}")
        if reshard_after_forward < 2:
            raise ValueError(f"reshard_after_forward as an int is the size of the group to "
                             f"reshard to after forward, at least 2; got {reshard_after_forward}")
    if not reshard_after_forward and stage != 3:
        raise ValueError(
            f"reshard_after_forward applies to stage 3 only, not stage {stage}: stages 0-2 "
            "keep full parameters on every rank, there is nothing to reshard")


def check_reshard_size(reshard_after_forward: bool | int, world: int, mesh) -> None:
    """The int form of reshard_after_forward (zero3.py): a divisor of the world size, strictly
    between 1 and it (FSDP2's rule), on a 1-D world."""
    if isinstance(reshard_after_forward, bool):
        return
    d = reshard_after_forward
    if not 1 < d < world or world % d:
        raise ValueError(f"reshard_after_forward={d} must divide the world size {world} and "
                         f"lie strictly between 1 and {world} (FSDP2's rule): after forward "
                         "each unit is resharded over groups of that many consecutive ranks")
    if mesh is not None:
        raise ValueError("reshard_after_forward as an int is not supported with a mesh: the "
                         "post-forward groups would have to lie inside the shard groups")
