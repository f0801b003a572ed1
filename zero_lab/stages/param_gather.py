"""Stages 1-2, `overlap_param_gather=True` (shard()'s default there): the updated parameters
come back under the next forward, bucket by bucket (Megatron-LM's distributed optimizer does
the same under this name).

Without it, `opt.step()` all-gathers every rank's updated slice and waits: nothing else runs
meanwhile. With it, `opt.step()` only *issues* one asynchronous all-gather per bucket, in the
order the next forward needs them (buckets are built last layer first, so the last bucket
goes first), and returns. A forward pre-hook on every module that owns parameters of a
bucket waits for that bucket only, so the forward of the first layers runs while the later
layers' parameters are still on the wire.

The contract: nothing ever reads a stale parameter. Between `opt.step()` and the module's
forward, a parameter's elements outside this rank's slice hold the values from before the
step until its bucket's all-gather lands (it writes them in place). So while its bucket is
in flight, a parameter's class is `ParameterInFlight` (a subclass of nn.Parameter, switched
by `issue`), whose `__torch_function__`, which torch calls for every op that touches it,
waits for its bucket first: a raw read (`print(model[0].weight)`, `w.sum()`, `w.clone()`,
`torch.equal`, `w.detach()`, `w.data`, an EMA copy, a metric on the weights) reads the
updated values, on any rank that reads (the messages were all posted by the step: the wait
needs nothing from the other ranks). Only looks pass without waiting: `.shape`, `.grad`,
`p.grad = None`, `numel()`, hook registration (at_rest.py's SHAPE_LOOKS). Once a bucket is
waited for, by whatever, its parameters are plain nn.Parameters again: the forward pre-hook
does it before the module computes, so the forward and backward pay nothing for the guard.

Readers that touch every parameter wait for every bucket at once: `full_state_dict`,
`model.state_dict()` (a state_dict pre-hook on every module), `model.load_state_dict()`,
`zero_lab.checkpoint.save` / `load`, `opt.clip_grad_norm_`, the next `opt.step()` when no
forward came; `model.wait_for_params()` does the same, explicitly. Torch's FSDP2 and
Megatron-LM leave such a raw read stale (their contract: call their wait first). A
parameter of a class of one's own (a subclass of nn.Parameter) is not switched: it reads
stale unless `model.wait_for_params()` comes first. Bytes sent are unchanged: the same
all-gathers, only later.
"""

from __future__ import annotations

from torch import nn
from torch._C import _disabled_torch_function_impl

from zero_lab.stages.at_rest import SHAPE_LOOKS, VALUE_ATTRIBUTES, instances_in, is_look
from zero_lab.stages.partition import FlatParamGroup

BUCKET_ATTR = "_zero_lab_in_flight"  # on a parameter of stages 1-2: (its ParamGather, bucket)
# In flight, `.data` is a read too: it is the tensor the all-gather is still writing.
VALUES = VALUE_ATTRIBUTES | {"data"}


class ParameterInFlight(nn.Parameter):
    """A parameter whose bucket's all-gather is in flight: any op but a look waits for it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_look(func, SHAPE_LOOKS, VALUES):
            for p in list(instances_in((args, kwargs), ParameterInFlight)):
                gather, g = getattr(p, BUCKET_ATTR, (None, None))
                if gather is not None:
                    gather.wait(g)  # turns the bucket's parameters back into nn.Parameter
        return _disabled_torch_function_impl(func, types, args, kwargs)


class ParamGather:
    """The all-gathers of updated parameters in flight, one handle per bucket (or None)."""

    def __init__(self, groups: list[FlatParamGroup]) -> None:
        self.groups = groups
        self.pending: list = [None] * len(groups)
        self.gathers_waited = 0  # for learners: how many waits found their bucket in flight
        for g, group in enumerate(groups):
            for p in group.params:
                setattr(p, BUCKET_ATTR, (self, g))

    def issue(self, gs: list[int] | None = None) -> None:
        """Start the all-gathers of groups `gs` (all, by default), the last group first: it
        holds the first layers, which the next forward needs first."""
        for g in sorted(range(len(self.groups)) if gs is None else gs, reverse=True):
            self.wait(g)  # one gather per bucket in flight (a step with no forward between)
            group = self.groups[g]
            self.pending[g] = group.all_gather(group.flat, group.shard(group.flat),
                                               async_op=True)
            for p in group.params:
                if type(p) is nn.Parameter:  # (a class of one's own is left as it is)
                    p.__class__ = ParameterInFlight

    def wait(self, g: int) -> None:
        """Bucket g's parameters are whole once this returns."""
        work, self.pending[g] = self.pending[g], None
        if work is not None:
            for p in self.groups[g].params:  # before the wait: its own ops read plainly
                if type(p) is ParameterInFlight:
                    p.__class__ = nn.Parameter
            work.wait()
            self.gathers_waited += 1

    def wait_all(self) -> None:
        """Every bucket whole, in the order they were issued."""
        for g in reversed(range(len(self.groups))):
            self.wait(g)

    def in_flight(self) -> list[int]:
        return [g for g, work in enumerate(self.pending) if work is not None]

    def install(self, model: nn.Module) -> None:
        """Forward pre-hooks (a module waits for the buckets holding its own parameters) and
        state_dict pre-hooks (every module waits for all) on `model`'s modules."""
        group_of = {id(p): g for g, group in enumerate(self.groups) for p in group.params}
        for module in model.modules():
            mine = sorted({group_of[id(p)] for p in module.parameters(recurse=False)
                           if id(p) in group_of}, reverse=True)
            if mine:
                module.register_forward_pre_hook(
                    lambda _module, _args, gs=tuple(mine): self._wait_for(gs))
            module.register_state_dict_pre_hook(lambda *_args: self.wait_all())
        model.register_load_state_dict_pre_hook(lambda *_args: self.wait_all())

    def _wait_for(self, gs: tuple[int, ...]) -> None:
        for g in gs:
            self.wait(g)
