"""The cases of notebooks 03 and 04's exercises on ranks: the owned slice, stage 1's sharded
step, stage 2's bucketed gradient hook (see the package's docstring for the contract).

Run on 3 ranks, so the sizes are chosen against 3: most do not divide by it (the padding, a
slice that holds padding only, a bucket cut across two owners), a few do (no padding at all).
A seeded case keeps those properties and derives every tensor generator's seed from the
instructor's seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from zero_lab.course.rank_cases import seeded_init

RANKS = 3  # the launches' size (zero_lab.grading.remote.RANKS): what the sizes are chosen against


def _rng(seed: int, exercise: str) -> random.Random:
    return random.Random(f"{seed}:{exercise}")


def _not_divisible(rng: random.Random, lo: int, hi: int) -> int:
    """A size in [lo, hi] that N does not divide (the buffer needs padding)."""
    while (numel := rng.randint(lo, hi)) % RANKS == 0:
        pass
    return numel


# --------------------------------------------------------------------------- owned range


@dataclass(frozen=True)
class OwnedRangeCase:
    numel: int

    def label(self, world_size: int) -> str:
        return f"numel={self.numel}, world_size={world_size}"


# 1: one element, two ranks own padding only; 3, 9: no padding; 1_048_577: 2^20 + 1.
OWNED_RANGE_NUMELS = [1, 2, 3, 7, 9, 10, 1000, 1001, 1_048_577]


def owned_range_cases(seed: int | None) -> list[OwnedRangeCase]:
    """The buffer sizes whose slices each rank asks for."""
    if seed is None:
        return [OwnedRangeCase(numel) for numel in OWNED_RANGE_NUMELS]
    rng = _rng(seed, "owned_range")
    # Nine different sizes: where two ranges overlap, N divides one draw and not the other.
    numels = [1, rng.choice([2, 4]),  # the smallest buffers: the last slice is padding only
              RANKS * rng.randint(2, 10),  # N divides: no padding at all
              _not_divisible(rng, 6, 30), _not_divisible(rng, 31, 99),
              _not_divisible(rng, 100, 999), RANKS * rng.randint(34, 3333),
              _not_divisible(rng, 1000, 9999),
              _not_divisible(rng, 100_000, 2_000_000)]  # large, as 2^20 + 1 is
    return [OwnedRangeCase(numel) for numel in sorted(numels)]


# The ranks report the all-gathered buffer rebuilt from their slices up to this size (a list
# of a million floats would make the report megabytes, for nothing the ranges do not show).
GATHERED_REPORTED = 10_000


def owned_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """The reference: [r·S, (r+1)·S), S = ceil(numel / N); the buffer is padded to N·S."""
    shard = -(-numel // world_size)
    return rank * shard, (rank + 1) * shard


# --------------------------------------------------------------------------- sharded step


@dataclass(frozen=True)
class ShardedStepCase:
    numel: int
    optimizer: str  # "adam", "adamw" or "sgd_momentum"
    steps: int
    init_seed: int  # the parameters' generator
    grad_seed: int  # rank r's gradient at step s: generator grad_seed + 10·s + r

    def label(self, world_size: int) -> str:
        padded = -(-self.numel // world_size) * world_size
        return f"numel={self.numel} (padded to {padded}), {self.optimizer}, {self.steps} steps"

    def init(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.init_seed)
        return torch.randn(self.numel, generator=gen, dtype=torch.float64)

    def local_grad(self, step: int, rank: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.grad_seed + 10 * step + rank)
        return torch.randn(self.numel, generator=gen, dtype=torch.float64)


OPTIMIZERS = ("adam", "sgd_momentum", "adamw")


def sharded_step_cases(seed: int | None) -> list[ShardedStepCase]:
    """Three sizes that N does not divide, each with one of the three optimizers."""
    if seed is None:
        return [ShardedStepCase(numel, opt, 3, c, 1000 * c)
                for c, (numel, opt) in enumerate([(10, "adam"), (1001, "sgd_momentum"),
                                                  (4099, "adamw")])]
    rng = _rng(seed, "sharded_step")
    numels = [_not_divisible(rng, 4, 40), _not_divisible(rng, 100, 2000),
              _not_divisible(rng, 2000, 5000)]
    # Every optimizer each time: SGD is where summing instead of averaging shows (Adam divides
    # by the gradient's size), Adam and AdamW where state and decay must stay per slice.
    optimizers = rng.sample(OPTIMIZERS, len(OPTIMIZERS))
    return [ShardedStepCase(numel, opt, rng.randint(2, 4), rng.randrange(2**31),
                            rng.randrange(2**31))
            for numel, opt in zip(numels, optimizers, strict=True)]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def one_process_steps(case: ShardedStepCase, world_size: int,
                      average: bool = True) -> list[torch.Tensor]:
    """The parameters after each step of one process stepping the whole (unpadded) parameter
    on the average of every rank's gradient (`average=False`: their sum, the known mistake).
    Element-wise optimizers make it comparable with the sharded step slice by slice."""
    param = nn.Parameter(case.init())
    optimizer = make_optimizer(case.optimizer, [param])
    after = []
    for step in range(case.steps):
        grads = torch.stack([case.local_grad(step, r) for r in range(world_size)])
        param.grad = grads.mean(0) if average else grads.sum(0)
        optimizer.step()
        after.append(param.detach().clone())
    return after


# --------------------------------------------------------------------------- bucket hook


class OddModel(nn.Module):
    """Odd sizes, a bias-free layer and a nested block: buckets that do not divide by N."""

    def __init__(self, sizes: tuple[int, int, int, int] = (7, 32, 16, 5)) -> None:
        super().__init__()
        features, hidden, inner, classes = sizes
        self.inp = nn.Linear(features, hidden)  # 7·32 + 32 elements in the notebook's
        self.block = nn.Sequential(nn.Tanh(), nn.Linear(hidden, inner, bias=False),
                                   nn.Tanh())  # 512
        self.out = nn.Linear(inner, classes)  # 80 + 5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


@dataclass(frozen=True)
class BucketHookCase:
    bucket_bytes: int
    sizes: tuple[int, int, int, int] = (7, 32, 16, 5)  # OddModel's
    init_seed: int = 0  # the model's values: torch's default init after manual_seed(init_seed)
    batch_seed: int = 0  # rank r's batch of backward call k: generator batch_seed + 50·k + r
    rows: int = 6  # of each rank's batch
    backwards: int = 2  # backward calls before the check: gradient accumulation

    def label(self, buckets: int) -> str:
        return (f"{buckets} bucket(s) of at most {self.bucket_bytes} bytes, "
                f"{self.backwards} backward calls")

    def model(self) -> OddModel:
        with torch.random.fork_rng(devices=[]):  # leaves the caller's global generator alone
            model = OddModel(self.sizes)
        return seeded_init(model, self.init_seed).double()  # thread-safe: its own generator

    def batch(self, rank: int, backward: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.batch_seed + 50 * backward + rank)
        return (torch.randn(self.rows, self.sizes[0], generator=gen, dtype=torch.float64),
                torch.randn(self.rows, self.sizes[3], generator=gen, dtype=torch.float64))


def _bucket_numels(numels: list[int], cap: int) -> list[int]:
    """The bucket sizes zero_lab.stages.partition.bucket_parameters makes of these parameter
    sizes (in the order given), with at most `cap` elements each; only to pick a case."""
    buckets: list[int] = []
    for numel in numels:
        if buckets and buckets[-1] + numel <= cap:
            buckets[-1] += numel
        else:
            buckets.append(numel)
    return buckets


def bucket_hook_cases(seed: int | None) -> list[BucketHookCase]:
    """Several buckets, then one: in each layout, a bucket that N does not divide."""
    if seed is None:  # 3 buckets of 85, 512 and 256 elements; then one of 853
        return [BucketHookCase(500 * 8), BucketHookCase(10**9)]
    rng = _rng(seed, "bucket_hook")
    while True:
        sizes = (rng.randint(3, 9), rng.randint(12, 40), rng.randint(6, 20), rng.randint(2, 7))
        model = OddModel(sizes)
        numels = [p.numel() for p in model.parameters()][::-1]  # backward's order
        if sum(numels) % RANKS:
            break
    while True:  # at least 2 buckets: every parameter fits one, all of them do not
        cap = rng.randint(max(numels), sum(numels) - 1)
        if any(b % RANKS for b in _bucket_numels(numels, cap)):
            break
    init_seed, batch_seed, rows = rng.randrange(2**31), rng.randrange(2**31), rng.randint(3, 8)
    return [BucketHookCase(bucket_bytes, sizes, init_seed, batch_seed, rows)
            for bucket_bytes in (cap * 8, 10**9)]


def global_batch_grads(case: BucketHookCase, world_size: int) -> dict[str, torch.Tensor]:
    """Each parameter's gradient in one process on the global batch (every rank's rows) of
    each backward call, summed over the calls: what the ranks' averaged slices add up to
    (the average of N equal-sized batches' mean losses is the global batch's mean loss)."""
    model = case.model()
    for k in range(case.backwards):
        xs, ys = zip(*(case.batch(r, k) for r in range(world_size)), strict=True)
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    return {name: p.grad for name, p in model.named_parameters()}
