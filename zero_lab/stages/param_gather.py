"""Stages 1-2, `overlap_param_gather=True`: the updated parameters come back under the next
forward, bucket by bucket (Megatron-LM's distributed optimizer does the same under this name).

Without it, `opt.step()` all-gathers every rank's updated slice and waits: nothing else runs
meanwhile. With it, `opt.step()` only *issues* one asynchronous all-gather per bucket, in the
order the next forward needs them (buckets are built last layer first, so the last bucket
goes first), and returns. A forward pre-hook on every module that owns parameters of a
bucket waits for that bucket only, so the forward of the first layers runs while the later
layers' parameters are still on the wire.

The contract (FSDP2's and Megatron-LM's too): between `opt.step()` and the module's forward,
a parameter's elements outside this rank's slice may still hold the values from before the
step, because the all-gather writes them in place when it lands. Everything in zero_lab that
reads parameters outside a forward waits for every bucket first: `full_state_dict`,
`model.state_dict()` (a state_dict pre-hook on every module), `model.load_state_dict()`,
`zero_lab.checkpoint.save` / `load`, `opt.clip_grad_norm_`, the next `opt.step()` when no
forward came. A read of your own (`model[0].weight` for a plot, an evaluation that calls a
submodule's weights without its forward) calls `model.wait_for_params()` first; a module
whose forward uses another module's parameters directly needs the same. Bytes sent are
unchanged: the same all-gathers, only later.
"""

from __future__ import annotations

from torch import nn

from zero_lab.partition import FlatParamGroup


class ParamGather:
    """The all-gathers of updated parameters in flight, one handle per bucket (or None)."""

    def __init__(self, groups: list[FlatParamGroup]) -> None:
        self.groups = groups
        self.pending: list = [None] * len(groups)
        self.gathers_waited = 0  # for learners: how many waits found their bucket in flight

    def issue(self, gs: list[int] | None = None) -> None:
        """Start the all-gathers of groups `gs` (all, by default), the last group first: it
        holds the first layers, which the next forward needs first."""
        for g in sorted(range(len(self.groups)) if gs is None else gs, reverse=True):
            self.wait(g)  # one gather per bucket in flight (a step with no forward between)
            group = self.groups[g]
            self.pending[g] = group.all_gather(group.flat, group.shard(group.flat),
                                               async_op=True)

    def wait(self, g: int) -> None:
        """Bucket g's parameters are whole once this returns."""
        work, self.pending[g] = self.pending[g], None
        if work is not None:
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
