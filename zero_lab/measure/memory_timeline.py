"""One training step measured op by op: the memory timeline notebook 05 draws.

`measure_step` shards a model at a stage, trains it a few steps, then measures one more:
bytes alive after every op (`zero_lab.measure.memory.MemoryTimeline`), with marks where stage 3
gathers, releases or reduce-scatters a unit, the collectives it sent (`CommLedger`), what it
holds after backward, and what outlived the step. `activation_bytes` measures what forward
and backward need on top of the model in one process. Shared: the rank script
zero_lab/workers/zero3_lifecycle.py and the tests' workers call them on every rank.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.measure.memory import MemoryTimeline, baseline_bytes, held_bytes, storage_bytes
from zero_lab.stages import default_optimizer, shard


def _phase() -> str:
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


def _live(device: torch.device) -> int:
    gc.collect()
    return baseline_bytes() if device.type == "cpu" else torch.cuda.memory_allocated(device)


def measure_step(make_model: Callable[[], nn.Module],
                 batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 stage: int = 3, prefetch: bool = True, precision: str = "fp32",
                 walk_live_tensors: bool = True,
                 optimizer: Callable = default_optimizer) -> dict:
    """Shard `make_model()` at `stage`, train on batches[:-1], measure batches[-1].

    `optimizer`: shard()'s optimizer factory (its default: Adam, whose foreach implementation
    torch picks for CUDA tensors and the for-loop one on CPU).
    `walk_live_tensors`: also count every tensor alive before and after (a garbage-collector
    walk, about a second) to find what outlived the step ("leftover").
    """
    before = _live(device) if walk_live_tensors else 0  # all but the model: the batches, ...
    model, opt = shard(make_model().to(device), stage, optimizer, prefetch=prefetch,
                       precision=precision)
    sync = opt.sync
    for x, y in batches[:-1]:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    x, y = batches[-1]
    batch_bytes = storage_bytes(t for b in batches for t in b)
    # What the step starts from: the model states and the batch (every storage an op touches
    # inside the block joins the count as well).
    params = [*model.parameters(), *sync.step_params]
    states = [v for state in opt.optim.state.values() for v in state.values()
              if isinstance(v, torch.Tensor)]  # Adam's m and v, and its 0-d step counters
    start = [*params, *(p.grad for p in params if p.grad is not None), *states,
             *(opt.master_weights or []), x, y]
    def mark_unit(what: str, u: int) -> None:  # stage 3's gathers, releases and sends
        if what in ("gather", "release", "reduce_scatter"):
            timeline.mark(f"{_phase()} {what} {sync.units[u].name}")

    with CommLedger() as ledger, MemoryTimeline(device, start) as timeline:
        if stage == 3:
            sync.listeners.append(mark_unit)
        loss = F.mse_loss(model(x), y)
        timeline.mark("forward done")
        loss.backward()
        timeline.mark("backward done")
        held = held_bytes(model, opt)
        opt.step()
        opt.zero_grad()
        del loss
        timeline.mark("step done")
        if stage == 3:
            sync.listeners.remove(mark_unit)
    del x, y, start
    batches.clear()  # the caller's list too: `before` counted them
    after = _live(device) if walk_live_tensors else 0
    held_after_step = held_bytes(model, opt)
    n_scalars = sum(1 for s in opt.optim.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() == 0)
    samples = timeline.samples
    done = next(i for i, label in timeline.marks if label == "backward done")
    out = {
        "stage": stage,
        "prefetch": prefetch,
        "samples": samples,
        "marks": timeline.marks,
        "start_bytes": timeline.start_bytes,
        "peak_bytes": timeline.peak_bytes,
        # the two phases apart: forward and backward gather and release units; the optimizer's
        # step then works on the slices alone, with temporaries of its own
        "peak_forward_backward": max(samples[:done + 1]),
        "backward_done_bytes": samples[done],
        "peak_optimizer_step": max(samples[done:]),
        "held": held,
        "held_after_step": held_after_step,
        # what stays alive after the step beyond the model states (Adam's 0-d step counters
        # are bookkeeping, 4 bytes each, not model states)
        "leftover": (after - before - held_after_step["total"] - 4 * n_scalars + batch_bytes
                     if walk_live_tensors else None),
        "ledger": ledger.summary(),
        "padded_numel": sum(g.padded_numel for g in sync.groups),
        # the elements the optimizer steps and keeps state for: the slices without padding
        "stepped_numel": sum(piece.numel for piece in opt.pieces),
    }
    if stage == 3:
        element = sync.units[0].local.element_size()
        out.update({
            "units": sync.describe(),
            "unit_param_bytes": [u.group.padded_numel * element for u in sync.units],
            "element_bytes": element,
            "grad_shard_bytes": held["grads"],
            "gathered_after": sync.gathered_bytes(),
        })
    return out


def activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     device: torch.device) -> int:
    """Activation and transient-gradient bytes of forward + backward in one process.

    The parameters' gradients are allocated before the block (and accumulated into in
    place), so what the block adds on top of its start is what the computation itself
    needs: saved activations, their gradients, each parameter gradient before it is added.
    """
    model = model.to(device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with MemoryTimeline(device) as timeline:
        F.mse_loss(model(x), y).backward()
    return timeline.peak_bytes - timeline.start_bytes
