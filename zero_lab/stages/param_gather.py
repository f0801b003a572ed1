"""Stages 1-2, `overlap_param_gather=True` (shard()'s option; off by default): the updated
parameters come back under the next forward, bucket by bucket (Megatron-LM's distributed
optimizer does the same under this name, off by default there too).

Without it, `opt.step()` all-gathers every updated slice and waits. With it, `opt.step()`
only *issues* one asynchronous all-gather per bucket, the last bucket (the first layers)
first, and returns; a forward pre-hook on each module that owns parameters waits for their
buckets only, so the first layers compute while the later layers' parameters are on the wire.

The contract: nothing ever reads a stale parameter. Until its bucket's all-gather lands (in
place), a parameter's elements outside this rank's slice hold the values from before the
step. Meanwhile its flag says so, `p.zero_lab_state == "in flight"` (a GuardedParameter,
at_rest.py), and an op on it waits for its bucket first: a raw read (`print(w)`, `w.sum()`,
`w.clone()`, `torch.equal`, `w.detach()`, `w.data`, an EMA copy) reads the updated values,
on any rank (the step posted every message: the wait needs nothing from the other ranks).
Only looks pass without waiting (`.shape`, `.grad`, `p.grad = None`, `numel()`: at_rest.py's
SHAPE_LOOKS). A bucket waited for, by whatever, is "whole" again: the forward pre-hook makes
it so before the module computes, so forward and backward pay only the guard's look.

Readers that touch every parameter wait for every bucket: `full_state_dict`,
`model.state_dict()` and `load_state_dict()` (pre-hooks), `zero_lab.checkpoint.save` /
`load`, `opt.clip_grad_norm_`, the next `opt.step()` when no forward came, and, explicitly,
`model.wait_for_params()`. FSDP2 and Megatron-LM leave a raw read stale (call their wait
first); so does a parameter of a class of one's own here (not guarded). Bytes sent are
unchanged: the same all-gathers, only later.
"""

from __future__ import annotations

from torch import nn

from zero_lab.stages.at_rest import BUCKET_ATTR, IN_FLIGHT, WHOLE, GuardedParameter
from zero_lab.stages.partition import FlatParamGroup


class ParamGather:
    """The all-gathers of updated parameters in flight, one handle per bucket (or None)."""

    def __init__(self, groups: list[FlatParamGroup]) -> None:
        self.groups = groups
        self.pending: list = [None] * len(groups)
        self.gathers_waited = 0  # for learners: how many waits found their bucket in flight
        for g, group in enumerate(groups):
            for p in group.params:
                setattr(p, BUCKET_ATTR, (self, g))
        # each bucket's GuardedParameters (shard() made them; a class of one's own is not one)
        self.guarded = [[p for p in group.params if type(p) is GuardedParameter]
                        for group in groups]

    def issue(self, gs: list[int] | None = None) -> None:
        """After the optimizer step: issue the all-gather of each bucket (of `gs`, default all),
        the last bucket (the first layers) first; its parameters are in flight until
        `wait(g)`. The all-gather is the stage's own (`FlatParamGroup.all_gather`), only
        asynchronous."""
        for g in reversed(range(len(self.groups)) if gs is None else gs):
            self.wait(g)  # one all-gather per bucket in flight (no forward came since)
            group = self.groups[g]
            self.pending[g] = group.all_gather(group.flat, group.shard(group.flat), async_op=True)
            for p in self.guarded[g]:
                p.zero_lab_state = IN_FLIGHT

    def wait(self, g: int) -> None:
        """Bucket g's parameters are whole once this returns."""
        work, self.pending[g] = self.pending[g], None
        if work is not None:
            for p in self.guarded[g]:  # before the wait: its own ops read plainly
                p.zero_lab_state = WHOLE
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
