"""Measured memory: the bytes tensors really hold, on CPU and CUDA.

`zero_lab.memory` *predicts* bytes from formulas; this module *measures* them, so a notebook
can put the two side by side (one vocabulary: predicted vs measured):

    held_bytes(model, opt)      model states held now, by category, the keys of
                                memory.model_state_bytes: params, grads, optimizer, total
    PeakMemory / MemoryTimeline the peak of a block of code, or bytes alive after every op
    saved_activation_bytes      bytes autograd keeps for backward while a forward runs

Two tensors that are views of one storage (a parameter viewing a flat buffer, a tied
weight) share memory, so everything here counts *storages*, once each, never tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


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


def model_state_tensors(model: nn.Module, optimizer: object | None
                        ) -> dict[str, list[torch.Tensor]]:
    """This rank's tensors behind `held_bytes`: {"params", "grads", "optimizer"}.

    As `held_bytes` counts them (fp32 masters as optimizer state); a DTensor (torch FSDP2's
    parameters, gradients and Adam states) stands for its local shard.
    """
    params = list(model.parameters())
    sync = getattr(optimizer, "sync", None)
    if sync is not None:
        params += list(sync.step_params)
    inner = getattr(optimizer, "optim", optimizer)
    states = [v for state in (inner.state.values() if inner is not None else ())
              for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    states += list(getattr(optimizer, "master_weights", None) or [])
    grads = [p.grad for p in params if p.grad is not None]
    grads += list(getattr(sync, "grad_buffers", None) or [])  # held even with .grad None
    return {"params": [_local(p) for p in params],
            "grads": [_local(g) for g in grads],
            "optimizer": [_local(t) for t in states]}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor -> this rank's shard


def held_bytes(model: nn.Module, optimizer: object | None) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients and optimizer states, by category.

    Works for a plain model + torch optimizer and for `shard()`'s optimizer, whose slices
    and fp32 masters it adds (masters count as optimizer state, the ZeRO paper's K, which is
    how `zero_lab.memory.model_state_bytes` predicts them). Storages are counted once.
    Stages 0 and 1 keep a flat gradient buffer for the whole run: it counts as gradients
    even while no `.grad` points at it (after zero_grad(set_to_none=True)). torch FSDP2's
    DTensors count as their local shards.
    """
    if any(hasattr(p, "to_local") for p in model.parameters()):  # torch FSDP2
        return held_model_state_bytes([], None, model_state_tensors(model, optimizer))
    params = list(model.parameters())
    extra: dict[str, list[torch.Tensor]] = {}
    sync = getattr(optimizer, "sync", None)
    if sync is not None:  # zero_lab's ShardedOptimizer
        params += list(sync.step_params)  # views of the flat buffers, plus their gradients
    extra["master"] = list(getattr(optimizer, "master_weights", None) or [])
    extra["grad_buffers"] = list(getattr(sync, "grad_buffers", None) or [])
    counts = held_model_state_bytes(params, getattr(optimizer, "optim", optimizer), extra)
    counts["grads"] += counts.pop("grad_buffers")
    counts["optimizer"] += counts.pop("master", 0)
    return counts



class PeakMemory:
    """Peak bytes of tensor memory inside a `with` block, on CPU or CUDA.

        with PeakMemory(device) as peak:
            loss.backward()
        peak.peak_bytes      # the most bytes alive at once, counting what was held before

    CUDA: the caching allocator's own counters (`torch.cuda.max_memory_allocated`).
    CPU has no allocator statistics, so this counts storages: every storage an op creates
    inside the block is added when it appears and removed when it is freed (a weak reference
    on the storage tells), on top of the bytes alive when the block started. Those are the
    storages alive at entry as far as the garbage collector knows (`baseline_bytes()`), or the
    `baseline` you pass (e.g. `held_model_state_bytes(...)["total"]` plus the batch).
    Outputs that reuse an input's storage (in-place ops, views, collectives) are not new.
    A storage freed inside the block but created before it is not subtracted, so on CPU the
    figure can only err high, by at most what the block freed of its starting memory.
    """

    def __init__(self, device: torch.device | str = "cpu", baseline: int | None = None) -> None:
        self.device = torch.device(device)
        self._baseline = baseline
        self.start_bytes = 0
        self.peak_bytes = 0
        self._live = 0
        self._peak_new = 0
        self._mode = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.start_bytes = self._baseline if self._baseline is not None else baseline_bytes()
            self._mode = _StorageTracker(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = self.start_bytes + self._peak_new

    def _allocated(self, nbytes: int) -> None:
        self._live += nbytes
        self._peak_new = max(self._peak_new, self._live)

    def _freed(self, nbytes: int) -> None:
        self._live -= nbytes


def saved_activation_bytes(forward: Callable[[], object], exclude: Iterable[torch.Tensor] = ()
                           ) -> int:
    """Bytes of the distinct storages autograd saves for backward while `forward()` runs.

    `torch.autograd.graph.saved_tensors_hooks` sees every tensor an op keeps for its
    backward; each storage counts once (a view saved twice is one storage), and storages
    in `exclude` (pass the parameters: weights are model states, not activations) not at all.
    """
    skip = {_storage_key(t) for t in exclude}
    saved: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in skip:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())


def baseline_bytes() -> int:
    """Bytes of the distinct CPU storages behind every tensor the garbage collector tracks."""
    import gc

    # type(o), not isinstance(o, ...): isinstance would touch deprecated module attributes
    tensors = (o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    return storage_bytes(t for t in tensors if t.device.type == "cpu")


def _storage_tracker_base():
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


class _StorageTracker(_storage_tracker_base()):
    """Dispatch mode behind PeakMemory on CPU: sees every op and the storages it creates."""

    def __init__(self, owner: PeakMemory) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if storage.data_ptr() in inputs or nbytes == 0:
                continue
            inputs.add(storage.data_ptr())
            self.owner._allocated(nbytes)
            weakref.finalize(storage, self.owner._freed, nbytes)
        return out


class MemoryTimeline(_storage_tracker_base()):
    """Bytes of tensor memory alive after every op inside a `with` block: a timeline and its
    peak, on CPU or CUDA, with labelled marks (e.g. where a ZeRO-3 unit is gathered).

        with MemoryTimeline() as timeline:
            loss = model(x).sum(); loss.backward()
            timeline.mark("halfway")           # a labelled point on the timeline
        timeline.samples      # bytes alive after each op (the first: at entry)
        timeline.marks        # [(sample index, label)]
        timeline.peak_bytes   # max(samples); timeline.start_bytes = samples[0]

    CPU: counts distinct storages, and re-reads the size of every one it knows at each
    sample, so memory freed or regrown *in place* (`untyped_storage().resize_()`, what ZeRO
    stage 3 and FSDP do with gathered parameters) is seen; PeakMemory, which notes a storage
    when an op creates it, misses those. The storages known are those behind every tensor
    the garbage collector tracks at entry (or behind `tensors`, if given), plus every storage
    an op inside the block reads or writes. Memory that only autograd holds and that was
    created before the block is not seen: open the block before the forward pass.
    Each sample costs a pass over the known storages: fine for a training step of a small
    model, not for a timing loop. CUDA: `torch.cuda.memory_allocated` after every op.
    """

    def __init__(self, device: torch.device | str = "cpu",
                 tensors: Iterable[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self._initial = tensors
        self._storages: dict[int, object] = {}  # StorageImpl address -> weak reference
        self.samples: list[int] = []
        self.marks: list[tuple[int, str]] = []

    @property
    def start_bytes(self) -> int:
        return self.samples[0] if self.samples else 0

    @property
    def peak_bytes(self) -> int:
        return max(self.samples, default=0)

    def live_bytes(self) -> int:
        """Bytes alive now (CPU: the known storages, each at its current size)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        total = 0
        for ref in list(self._storages.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    def mark(self, label: str) -> None:
        """Take a sample now and label it."""
        self.samples.append(self.live_bytes())
        self.marks.append((len(self.samples) - 1, label))

    def _watch(self, t: object) -> None:
        import weakref

        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        try:
            storage = t.untyped_storage()
            storage.data_ptr()  # a wrapper subclass (DTensor) has no valid storage of its own
        except (RuntimeError, NotImplementedError):  # sparse tensors, DTensors: skip
            return
        key = storage._cdata
        if key not in self._storages:
            self._storages[key] = weakref.ref(storage, lambda _, k=key: self._storages.pop(k, 0))

    def __enter__(self) -> MemoryTimeline:
        if self.device.type != "cuda":
            if self._initial is None:
                import gc

                # type(o), not isinstance: isinstance would touch deprecated module attributes
                initial = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
            else:
                initial = list(self._initial)
            self._initial = None  # hold no tensor: a storage's weak-reference callback holds us
            for t in initial:
                self._watch(t)
        self.samples = [self.live_bytes()]
        self.marks = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        if self.device.type != "cuda":
            for t in tree_leaves((args, kwargs, out)):
                self._watch(t)
        self.samples.append(self.live_bytes())
        return out
