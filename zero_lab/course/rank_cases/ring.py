"""The cases of notebook 02's ring reduce-scatter (see the package's docstring for the contract).

Each case is the output's shape (one rank's chunk) and its dtype; rank r's input is N chunks
of it, drawn from a generator seeded from the case. The chunk sizes are chosen against the
ring's mistakes: 1 (a chunk of one element), odd and prime sizes (a split that assumes an even
or round size), a large one, and a 2-D output (a ring that forgets to flatten); the dtypes are
int64 (exact sums), float32 and float64. A seeded case keeps those properties and derives its
generator's seed from the instructor's seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

# The rank fills the output with this before calling the learner's function: an output that
# still holds it everywhere was never written.
OUTPUT_FILL = -7
DTYPES = {"int64": torch.int64, "float32": torch.float32, "float64": torch.float64}
# What the values may differ by from the sum computed here: float32 sums in another order
# differ in their last bits; float64 ones by far less; int64 ones not at all.
TOLERANCE = {"int64": 0.0, "float32": 1e-5, "float64": 1e-9}


@dataclass(frozen=True)
class RingCase:
    shape: tuple[int, ...]  # the output: one rank's chunk of the sum
    dtype: str              # a key of DTYPES
    gen_seed: int           # rank r draws its input from the generator gen_seed + r

    def input_shape(self, world_size: int) -> tuple[int, ...]:
        return (world_size * self.shape[0], *self.shape[1:])

    def label(self, world_size: int) -> str:
        return f"output {self.shape} {self.dtype}, input {self.input_shape(world_size)}"

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


# (output shape, dtype): chunk sizes that are 1, odd, prime, large, and a 2-D output
NOTEBOOK_CASES = [((1,), "int64"), ((5,), "int64"), ((7,), "float64"), ((1001,), "float32"),
                  ((4, 3), "float64")]
# The notebook's cases all draw from one generator per rank, 100 + rank, one after the
# other (as they always did, so that the values the notebook prints stay the same).
NOTEBOOK_GEN_SEED = 100


def _odd(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randrange(lo | 1, hi + 1, 2)


def _prime(rng: random.Random, lo: int, hi: int) -> int:
    primes = [p for p in range(max(lo, 2), hi + 1) if all(p % d for d in range(2, p))]
    return rng.choice(primes)


def ring_reduce_scatter_cases(seed: int | None) -> list[RingCase]:
    """The output shapes and dtypes each rank reduce-scatters its input into, smallest first."""
    if seed is None:
        return [RingCase(shape, dtype, NOTEBOOK_GEN_SEED) for shape, dtype in NOTEBOOK_CASES]
    rng = random.Random(f"{seed}:ring_reduce_scatter")
    shapes = [(1,), (_odd(rng, 3, 15),), (_prime(rng, 17, 97),), (_odd(rng, 501, 1499),),
              (rng.randint(2, 6), rng.randint(2, 5))]
    # Every dtype at least once (int64 sums are exact, float32's are not), in a drawn order.
    dtypes = list(DTYPES) + [rng.choice(list(DTYPES)) for _ in range(2)]
    rng.shuffle(dtypes)
    return [RingCase(shape, dtype, rng.randrange(2**31))
            for shape, dtype in zip(shapes, dtypes, strict=True)]


def rank_inputs(cases: list[RingCase], rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank `rank`'s input of every case, in order. The cases that share a gen_seed draw from
    one generator (gen_seed + rank), one after the other: the notebook's do."""
    generators: dict[int, torch.Generator] = {}
    inputs = []
    for case in cases:
        if case.gen_seed not in generators:
            generators[case.gen_seed] = torch.Generator().manual_seed(case.gen_seed + rank)
        gen, dtype = generators[case.gen_seed], DTYPES[case.dtype]
        shape = case.input_shape(world_size)
        if dtype.is_floating_point:
            inputs.append(torch.randn(shape, generator=gen, dtype=dtype))
        else:
            inputs.append(torch.randint(-50, 50, shape, generator=gen, dtype=dtype))
    return inputs


def reduce_scatter_sum(inputs: list[torch.Tensor], rank: int) -> list[float]:
    """The reference: chunk `rank` of the sum of every rank's input, flat, in float64 (exact for
    the int64 cases' small sums)."""
    world_size = len(inputs)
    chunks = [x.double().reshape(world_size, -1)[rank] for x in inputs]
    return torch.stack(chunks).sum(0).tolist()
