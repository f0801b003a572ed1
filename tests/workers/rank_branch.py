"""Per-rank worker for tests/test_rank_branch.py: stage 3 with a branch that calls a unit on
some ranks only, the way learners write it (`if dist.get_rank() == 0: x = self.extra(x)`).

Stage 3 pairs the ranks' all-gathers by their order, so a unit called on rank 0 only pairs
its all-gather with the next unit's on the other ranks. While the default checked no
all-gather (the check before a gather, now unit_order.py's `UnitOrder.before_gather`, ran
with check_order=True only), that meant, for an `extra` unit called on rank 0 (the launch's
error in brackets):

    before layers.2, of its size  the gathers pair silently, each rank computing with the
                                  other unit's weights; rank 0's last all-gather then meets
                                  the others' end-of-forward check and waits [LaunchTimeout]
    smaller or bigger             gloo aborts the rank whose receive is too small ["died:
                                  killed by signal 6 (SIGABRT)"; its stderr: "Received data
                                  size doesn't match expected size"]
    after the last layer          rank 0's all-gather meets the others' end-of-forward
                                  check [LaunchTimeout]; with check_order=True its 8-byte
                                  check met that 24-byte one [SIGABRT]

Modes (the first argument):
    cases     every case below on every rank, each error caught and reported (the ranks
              raise together, in the same check, so the next case starts clean)
    learner   the first case's script as a learner writes it: nothing caught, so the launch
              fails with the error (test_rank_branch.py reads its LaunchError)
    one NAME  one case, uncaught (to see what a case does on its own)
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.launch import init_worker, report
from zero_lab.stages import shard

WIDTH = 8
STEPS = 3


class Scaled(nn.Module):
    """A layer with a learnt scale: one unit of 80 elements (a container such as
    nn.Sequential would make each of its children a unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def extra_unit(size: str) -> nn.Module:
    """A unit with as many elements as each layer (72), fewer (64) or more (80)."""
    if size == "same":
        return nn.Linear(WIDTH, WIDTH)
    if size == "smaller":
        return nn.Linear(WIDTH, WIDTH, bias=False)
    return Scaled()


class Branchy(nn.Module):
    """Four layers, and `extra`, which forward calls before layers[`at`] (after the last one
    for `at` = 4) on rank 0 only, from step `from_step` on (`step` is set by the loop)."""

    def __init__(self, size: str = "same", at: int = 2, from_step: int = 0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.extra = extra_unit(size)
        self.at, self.from_step, self.step = at, from_step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i == self.at and self.branch():
                x = self.extra(x)
            x = torch.tanh(layer(x))
        if self.at == len(self.layers) and self.branch():
            x = self.extra(x)
        return x

    def branch(self) -> bool:
        return dist.get_rank() == 0 and self.step >= self.from_step


class LearnerModel(nn.Module):
    """The `learner` mode's model, written as a learner would."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.extra = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i == 2 and dist.get_rank() == 0:  # a debugging print's layer, say
                x = self.extra(x)
            x = torch.tanh(layer(x))
        return x


# name: (extra's size, called before layers[at], from step, shard()'s check_order)
CASES = {
    "same_size": ("same", 2, 0, False),
    "smaller": ("smaller", 2, 0, False),
    "bigger": ("bigger", 2, 0, False),
    "after_the_last": ("same", 4, 0, False),
    # from step 1 on: the default checks the first forward only (it learns the order there);
    # check_order=True checks every all-gather of every forward
    "later_check_order": ("same", 2, 1, True),
    "after_the_last_check_order": ("same", 4, 0, True),
}


def sharded(name: str):
    size, at, from_step, check_order = CASES[name]
    torch.manual_seed(0)
    # A branch first taken at a later step leaves `extra` without a gradient before it
    return shard(Branchy(size, at, from_step), 3, check_order=check_order,
                 find_unused_parameters=from_step > 0)


def train(model: nn.Module, opt, rank: int) -> str:
    """STEPS steps on a rank-dependent batch; returns where it stood when it raised (the
    error propagates)."""
    for step in range(STEPS):
        if isinstance(model, Branchy):
            model.step = step
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return f"after {STEPS} steps"


def one_case(name: str, rank: int) -> dict:
    model, opt = sharded(name)
    where = "finished"
    try:
        for step in range(STEPS):
            model.step = step
            where = f"forward {step}"
            x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x).square().mean()
            where = f"backward {step}"
            loss.backward()
            opt.step()
            opt.zero_grad()
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    return {"name": name, "where": where, "error": error}


def first_step_ledger() -> dict:
    """The control messages of a model's first step and of its second (four layers, no
    branch), and the data messages of both."""
    torch.manual_seed(0)
    model, opt = shard(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]), 3)
    control, data = [], []
    for _ in range(2):
        with CommLedger() as ledger:
            model(torch.ones(4, WIDTH)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        control.append([(r.op, r.nbytes) for r in ledger.control])
        data.append(sorted((r.op, r.nbytes) for r in ledger.records))  # (prefetch reorders)
    return {"control": control, "data": data, "units": len(opt.sync.units)}


def main() -> None:
    info = init_worker()
    mode = sys.argv[1] if len(sys.argv) > 1 else "cases"
    if mode == "learner":
        torch.manual_seed(0)
        model, opt = shard(LearnerModel(), 3)
        train(model, opt, info.rank)
        report({})
        return
    if mode == "one":
        model, opt = sharded(sys.argv[2])
        report({"where": train(model, opt, info.rank)})
        return
    out = {"cases": []}
    for name in CASES:
        out["cases"].append(one_case(name, info.rank))
        gc.collect()  # the raised model and its optimizer go before the next shard()
    out["ledger"] = first_step_ledger()
    report(out)


if __name__ == "__main__":
    main()
