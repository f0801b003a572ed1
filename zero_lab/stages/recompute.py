"""Activation checkpointing per unit: keep a unit's input, recompute its inside in backward.

    model, opt = shard(model, stage, checkpoint_activations=True)      # every unit
    model, opt = shard(model, stage, checkpoint_activations=(Block,))  # modules of a class

A module whose forward is *recomputed* saves nothing for backward during the forward but its
input (and what it returns); when backward reaches it, torch.utils.checkpoint runs its
forward again under autograd and backward goes on through that fresh graph. Activation
memory per recomputed block drops from everything its ops keep (34·s·b·h bytes for a GPT
layer, zero_lab.memory.activation_bytes_per_layer) to its input (2·s·b·h), for one more
forward of it: training FLOPs go from 6Ψ to 8Ψ per token (forward 2Ψ, backward 4Ψ, the
recompute 2Ψ again).

How. torch's composable `checkpoint(module)` (torch.distributed._composable), FSDP2's
companion: a forward pre-hook opens a non-reentrant checkpoint region and a forward hook
closes it, so the module, its `forward`, its parameter names and tied weights stay as they
are (no wrapper module). At stage 3 the unit's gather and release (zero3.py) are hooks
registered before these, so they run outside the region and are not part of what is
recomputed; the recompute calls the module again, and its hooks see they are in backward.

Stage 3, and why the recompute costs no all-gather. A unit is released after its forward
and gathered again when backward reaches its outputs (the pre-backward hook): that second
all-gather exists with or without recompute. The recompute runs *after* it, inside the
unit's backward, so it finds the parameters gathered. Per step: 2 all-gathers per unit and
3Ψ, as without recompute; the ledger counts it (tests/test_recompute.py). torch's FSDP2 does
the same (its pre-forward hook skips the unshard while in backward). A recomputed region
that spans several units (checkpointing a parent of two units) recomputes them together at
the first unit's backward: still 2 all-gathers each, but they are all gathered at once.
With reshard_after_forward=False (units kept gathered from forward to backward), nothing
is gathered in backward at all, recompute or not: 2Ψ, with the parameters resident.

What is *not* recomputed: the root (the whole model), and a module inside another chosen
one (its parent's recompute runs it anyway). (Reentrant checkpointing is refused by
design: gradient_sync.py.)
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from zero_lab.stages.units import unit_modules

RECOMPUTED_ATTR = "_zero_lab_recomputed"  # set on a module whose forward is recomputed


def modules_to_recompute(model: nn.Module, value, unit_classes: Sequence[type] | None = None
                         ) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module `checkpoint_activations=value` recomputes, outermost
    only. True: the units, as stage 3 cuts them (`unit_classes`, or each child that owns
    parameters); classes: every module of those classes."""
    if value is False:
        return []
    chosen = (unit_modules(model, unit_classes) if value is True
              else [(n, m) for n, m in model.named_modules() if isinstance(m, tuple(value))])
    chosen = [(n, m) for n, m in chosen if m is not model]
    inside: set[int] = set()
    for _, module in chosen:
        inside.update(id(d) for d in module.modules() if d is not module)
    outermost, seen = [], set()
    for name, module in chosen:
        if id(module) not in inside and id(module) not in seen:
            seen.add(id(module))
            outermost.append((name, module))
    if not outermost:
        raise ValueError(f"checkpoint_activations={value!r} chose no module of this "
                         "model to recompute (the root is never recomputed)")
    return outermost


def recompute(module: nn.Module) -> None:
    """From now on `module`'s forward saves only its inputs and is recomputed in backward."""
    if getattr(module, RECOMPUTED_ATTR, False):
        return
    # (imported here: torch.distributed._composable loads DDP's replicate too, start-up time
    # that only a recomputing run pays)
    from torch.distributed._composable import checkpoint

    checkpoint(module)  # its hooks open and close the region; nothing of the module changes
    setattr(module, RECOMPUTED_ATTR, True)


def apply_recompute(model: nn.Module, value, unit_classes: Sequence[type] | None = None
                    ) -> list[str]:
    """Recompute every module `value` chooses (see `modules_to_recompute`); their names."""
    chosen = modules_to_recompute(model, value, unit_classes)
    for _, module in chosen:
        recompute(module)
    return [name for name, _ in chosen]
