"""Notebook 05's cases on ranks: the units materialize/release and post_backward run on.

A case is one stage-3 unit (a small module in float64, sharded over the ranks as one flat
group) with its input and, for post_backward, every rank's gradient of each backward call.
The rank script builds the unit from here; the judge builds the same module from here and
computes what the learner's functions must produce: the full parameters, the gradients of an
unsharded copy, each rank's slice of the averaged (accumulated) gradient.

The notebook's three units are sized on purpose: 40 elements (padded to 42 on 3 ranks), 36
that fill 3 ranks evenly, in a bias-free Linear and a LayerNorm, and 10 with a 0-d parameter
whose single element one rank owns while the others' pieces of it are empty. A seed draws one
unit of each kind again, with new sizes, values, inputs, gradients and 2 or 3 backward calls.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from zero_lab.course.rank_cases import seeded_init


@dataclass(frozen=True)
class UnitCase:
    label: str
    kind: str         # "linear": Linear(features, width); "linear_norm": Linear(features,
    #                   width, bias=False) + LayerNorm(width); "scaled": a width x width
    #                   weight and a 0-d scale
    features: int     # the input's features
    width: int
    param_seed: int   # torch.manual_seed before the module is built: its parameters' values
    input_seed: int   # the input's generator
    rows: int = 5     # the input's rows
    grad_seed: int = 0  # post_backward: rank r's gradient of call c is drawn from grad_seed+10c+r
    calls: int = 2    # post_backward: backward calls before the check (gradient accumulation)


class Scaled(nn.Module):
    """A k x k weight and a 0-d scale: k*k + 1 elements, never a multiple of 3 (padded)."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, k))
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t()) * self.scale


def _numel(kind: str, features: int, width: int) -> int:
    return {"linear": width * (features + 1), "linear_norm": width * (features + 2),
            "scaled": width * width + 1}[kind]


def _label(kind: str, features: int, width: int) -> str:
    n = _numel(kind, features, width)
    if kind == "linear":
        return f"Linear({features}, {width}): {n} elements"
    if kind == "linear_norm":
        return f"Linear({features}, {width}, bias=False) + LayerNorm({width}): {n} elements"
    return f"a {width}x{width} weight and a 0-d scale: {n} elements"


def _case(kind: str, features: int, width: int, **seeds) -> UnitCase:
    return UnitCase(_label(kind, features, width), kind, features, width, **seeds)


# The notebook's cases: the seeds the rank script used before the cases moved here, so every
# value the notebook prints stays the same.
NOTEBOOK = [
    _case("linear", 7, 5, param_seed=100, input_seed=7, grad_seed=0),
    _case("linear_norm", 4, 6, param_seed=101, input_seed=7, grad_seed=1000),
    _case("scaled", 3, 3, param_seed=102, input_seed=7, grad_seed=2000),
]


def _drawn(seed: int, exercise: str) -> list[UnitCase]:
    """One unit of each kind (in a drawn order), sizes and values drawn from the seed.
    The scaled unit keeps a 0-d parameter and a size that 3 ranks must pad; the others
    straddle the ranks' slices at drawn places."""
    rng = random.Random(f"{seed}:{exercise}")
    kinds = ["linear", "linear_norm", "scaled"]
    rng.shuffle(kinds)
    cases = []
    for kind in kinds:
        features, width = rng.randint(2, 9), rng.randint(2, 5 if kind == "scaled" else 8)
        if kind == "scaled":
            features = width  # x @ weight.t() with a square weight
        cases.append(_case(kind, features, width, param_seed=rng.randrange(2**31),
                           input_seed=rng.randrange(2**31), rows=rng.randint(2, 6),
                           grad_seed=rng.randrange(2**31), calls=rng.choice((2, 3))))
    return cases


def materialize_release_cases(seed: int | None) -> list[UnitCase]:
    """The units materialize/release run on: the notebook's (None) or drawn from `seed`."""
    return list(NOTEBOOK) if seed is None else _drawn(seed, "materialize_release")


def post_backward_cases(seed: int | None) -> list[UnitCase]:
    """The units post_backward runs on, with their gradients' seeds and backward calls."""
    return list(NOTEBOOK) if seed is None else _drawn(seed, "post_backward")


# ------------------------------------------------------------------ what both sides build


def build_module(case: UnitCase) -> nn.Module:
    """The case's module in float64, the same in every process and thread (built inside a
    fork of the global generator: the caller's random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        if case.kind == "linear":
            module = nn.Linear(case.features, case.width)
        elif case.kind == "linear_norm":
            module = nn.Sequential(nn.Linear(case.features, case.width, bias=False),
                                   nn.LayerNorm(case.width))
        else:
            module = Scaled(case.width)
    # The values are drawn from a generator of their own, the same as torch.manual_seed
    # (param_seed) then default init: the grader's threads never share one (seeded_init).
    if isinstance(module, Scaled):
        with torch.no_grad():
            gen = torch.Generator().manual_seed(case.param_seed)
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen))
    return seeded_init(module, case.param_seed).double()


def case_input(case: UnitCase) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.input_seed)
    return torch.randn(case.rows, case.features, generator=gen, dtype=torch.float64)


def shard_numel(case: UnitCase, world_size: int) -> int:
    """S = ceil(numel / N): the elements each rank owns (the flat buffer holds N·S)."""
    return -(-_numel(case.kind, case.features, case.width) // world_size)


def loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the rank's forward computes and backpropagates through the unit."""
    return module(x).square().sum()


def reference_gradients(case: UnitCase) -> list[torch.Tensor]:
    """The gradients of an unsharded copy of the unit: what backward must give."""
    module = build_module(case)
    loss(module, case_input(case)).backward()
    return [p.grad for p in module.parameters()]


def flat(case: UnitCase, tensors: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """The tensors as the unit's padded flat buffer (zeros after the last element)."""
    out = torch.zeros(shard_numel(case, world_size) * world_size, dtype=torch.float64)
    values = torch.cat([t.detach().reshape(-1) for t in tensors])
    out[:values.numel()] = values
    return out


def rank_full_grad(case: UnitCase, call: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s full flat gradient of the unit in backward call `call` (0-based), as
    `unit.full_grad` holds it before post_backward (the padding is 0)."""
    gen = torch.Generator().manual_seed(case.grad_seed + 10 * call + rank)
    numel = _numel(case.kind, case.features, case.width)
    full = torch.zeros(shard_numel(case, world_size) * world_size, dtype=torch.float64)
    full[:numel] = torch.randn(numel, generator=gen, dtype=torch.float64)
    return full


def reduced_slices(case: UnitCase, call: int, rank: int,
                   world_size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slice after backward call `call` (0-based): "mean", the right one (the
    average over ranks, accumulated over the calls so far), and two known mistakes: "summed"
    (the sum over ranks, accumulated) and "last" (this call's average only)."""
    def over_ranks(calls: range) -> torch.Tensor:
        return torch.stack([sum(rank_full_grad(case, c, r, world_size) for c in calls)
                            for r in range(world_size)])

    s = shard_numel(case, world_size)
    every = over_ranks(range(call + 1))
    mine = slice(rank * s, (rank + 1) * s)
    return {"mean": every.mean(0)[mine], "summed": every.sum(0)[mine],
            "last": over_ranks(range(call, call + 1)).mean(0)[mine]}
