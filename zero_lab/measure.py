"""Memory and time measurement that works the same on CPU and CUDA.

The course's memory claims are checked by counting the bytes that tensors really hold.
Two tensors that are views of one storage (a parameter viewing a flat buffer, a tied
weight) share memory, so everything here counts *storages*, once each, never tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set | None = None) -> int:
    """Bytes held by the distinct storages behind `tensors` (None entries are skipped).

    Pass the same `seen` set to several calls to count a storage only in the first
    category that holds it (e.g. a gradient that is a view of a parameter buffer).
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        key = _storage_key(t)
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's per-parameter state (Adam's exp_avg, exp_avg_sq, ...).

    Scalar bookkeeping such as Adam's `step` counter (a 0-d tensor) is left out: it is
    not a per-parameter model state and the ZeRO paper's accounting ignores it.
    """
    inner = getattr(optimizer, "optim", optimizer)  # sharded optimizers wrap a torch one
    out = []
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out.append(value)
    return out


def held_model_state_bytes(
    parameters: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Iterable[torch.Tensor]] | None = None,
) -> dict[str, int]:
    """Bytes this process holds in parameters, gradients and optimizer states.

    Returns {"params", "grads", "optimizer", "total"} (plus any `extra` categories), the
    same keys as `zero_lab.memory.model_state_bytes`, so prediction and measurement can
    be compared key by key.
    """
    params = list(parameters)
    seen: set = set()
    counts = {
        "params": storage_bytes(params, seen),
        "grads": storage_bytes((p.grad for p in params), seen),
        "optimizer": storage_bytes(optimizer_state_tensors(optimizer), seen) if optimizer else 0,
    }
    for name, tensors in (extra or {}).items():
        counts[name] = storage_bytes(tensors, seen)
    counts["total"] = sum(counts.values())
    return counts
