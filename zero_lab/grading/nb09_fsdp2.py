"""Notebook 09's graded exercises: two things FSDP2 (`torch.distributed.fsdp.fully_shard`)
leaves to the person who writes the training loop.

    check_global_grad_norm   fn(shard_norms, norm_type) -> the p-norm of the whole gradient,
                             given the p-norm of each rank's shard (one float per rank)
    check_fully_shard_plan   fn(model, block_type) -> the names of the modules to call
                             fully_shard on, in order: every block_type module, then "" (root)

Under FSDP2 `p.grad` is a DTensor holding one rank's shard, so a norm taken from
`p.grad.to_local()` on rank 0 is that shard's norm; `clip_grad_norm_` on DTensor gradients
reduces across ranks before the root. The wrong answers recognised are the ways to combine
shard norms that look right (rank 0's alone, a sum or a mean of norms, a mean of squares,
the 2-norm whatever p) and the wrapping orders that run but lose what FSDP2 is for (the
root first, no root, one group per Linear, per block child, per top-level child).
Each exercise's cases come from `<exercise>_cases(rng)`: rng None gives the notebook's, a
`random.Random` cases drawn from it (for the batch grader, grading/hidden.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from torch import nn

from zero_lab.course.workloads import Block, TinyGPT
from zero_lab.grading.framework import Case, run_cases, short_repr, typed

# ----------------------------------------------------------- exercise 1: global grad norm


def global_grad_norm(shard_norms: list[float], norm_type: float) -> float:
    """The p-norm of a gradient sharded over ranks, from each rank's shard p-norm: the
    shards are disjoint parts of one vector, so their n_i**p add up ((sum n_i**p)**(1/p));
    for p = inf, the largest shard norm."""
    if math.isinf(norm_type):
        return float(max(shard_norms))
    return math.fsum(n ** norm_type for n in shard_norms) ** (1.0 / norm_type)


def close_float(expected: float, got) -> bool:
    """check_global_grad_norm's comparison: a Python float (the batch grader refuses other
    number types too, so the notebook's ✓ and the grade agree) within 1e-9 relative."""
    return type(got) is float and math.isclose(got, expected, rel_tol=1e-9, abs_tol=0.0)


def _rank0_only(shard_norms, norm_type):
    return shard_norms[0]


def _sum_of_norms(shard_norms, norm_type):
    return float(sum(shard_norms))


def _mean_of_norms(shard_norms, norm_type):
    return sum(shard_norms) / len(shard_norms)


def _root_mean_square(shard_norms, norm_type):
    return math.sqrt(sum(n * n for n in shard_norms) / len(shard_norms))


def _always_two_norm(shard_norms, norm_type):
    return math.sqrt(sum(n * n for n in shard_norms))


GRAD_NORM_HINT = ("the shards are disjoint parts of one gradient: raise each rank's norm to p, "
                  "sum across ranks, take the 1/p root; for p = inf, the largest shard norm "
                  "(return a Python float)")
GRAD_NORM_WRONG = (
    (_rank0_only,
     "that is rank 0's shard norm only: under FSDP2 p.grad.to_local() holds one rank's "
     "shard, so a norm logged on rank 0 misses every other rank's part of the gradient"),
    (_sum_of_norms,
     "the norms were added: that is the rule for p = 1 only. For p = 2 the squares add, not "
     "the norms (shards of norms 3 and 4 make a gradient of norm 5, not 7)"),
    (_mean_of_norms,
     "a mean of the shard norms: the shards are disjoint parts of one gradient, so every "
     "rank's n_i**p adds to the total before the 1/p root; nothing is divided by the ranks"),
    (_root_mean_square,
     "averaged across ranks instead of summed: a mean of squares shrinks the norm by "
     "sqrt(world size). Each shard is a different part of the vector: sum n_i**2"),
    (_always_two_norm,
     "that is the 2-norm whatever norm_type says: for p, sum n_i**p and take the 1/p root "
     "(p = 1: the sum of the norms; p = inf: the largest shard norm)"),
)
GRAD_NORM_CASES = [  # (shard norms, one per rank; norm_type; what the case is)
    ([3.0, 4.0], 2.0, "2 ranks"),
    ([1.5, 2.0, 6.0], 2.0, "3 ranks of unequal norms"),
    ([0.5, 2.5, 1.25, 0.75], math.inf, "the max norm"),
    ([0.5, 1.5, 2.0], 1.0, "the 1-norm"),
    ([1.0, 2.0, 2.0], 3.0, "the 3-norm"),
    ([2.0, 1.0, 2.0, 0.0], 2.0, "rank 3's shard is padding only: norm 0"),
    ([7.25], 2.0, "one rank: its shard is the whole gradient"),
]
NORM_TYPES = (1.0, 2.0, 3.0, math.inf)


def _draw_norms(rng: random.Random, ranks: int, padded: bool) -> list[float]:
    """`ranks` shard norms of 0.01-20; `padded`: the last 1-2 ranks (never rank 0) hold an
    empty shard, as when dim 0 has fewer rows than ranks. Rounded so that a label reads."""
    norms = [round(rng.uniform(0.01, 20.0), 4) for _ in range(ranks)]
    if padded and ranks > 1:
        empty = rng.randint(1, min(2, ranks - 1))
        norms[-empty:] = [0.0] * empty
    return norms


def global_grad_norm_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's GRAD_NORM_CASES (rng None), or 8 drawn from `rng`: first p = 2 on 2-8
    ranks of nonzero norms (rank 0 alone, a sum, a mean and a mean of squares each give
    another value), then p of 1, 3 or inf on 2-8 nonzero ranks (the 2-norm gives another
    value), then 6 of 1-8 ranks, any p, a quarter of them with padded (zero) shards."""
    if rng is None:
        configs = GRAD_NORM_CASES
    else:
        configs = [(_draw_norms(rng, rng.randint(2, 8), False), 2.0, ""),
                   (_draw_norms(rng, rng.randint(2, 8), False),
                    rng.choice((1.0, 3.0, math.inf)), "")]
        configs += [(_draw_norms(rng, rng.randint(1, 8), rng.random() < 0.25),
                     rng.choice(NORM_TYPES), "") for _ in range(6)]
    return [Case(args=(norms, p), expected=global_grad_norm(norms, p),
                 label=f"(shard_norms={norms}, norm_type={p})" + (f": {why}" if why else ""),
                 hint=GRAD_NORM_HINT)
            for norms, p, why in configs]


def float_type_problem(got) -> tuple[str, str] | None:
    """(what is wrong, hint) when `got` is not a Python float, else None."""
    if type(got) is float:
        return None
    return (f"returned a value of type {type(got).__name__}, {short_repr(got, 120)}, not a "
            "float", "return a Python float: float(x) of an int, a numpy number or a "
                     "one-element tensor")


def check_global_grad_norm(fn: Callable) -> None:
    """Notebook 09: fn(shard_norms, norm_type) -> the p-norm of the whole gradient (a float),
    from the p-norm of each rank's shard."""
    run_cases("check_global_grad_norm", typed(fn, float_type_problem),
              global_grad_norm_cases(None), compare=close_float, wrong_answers=GRAD_NORM_WRONG,
              shows="you can turn per-rank shard norms into the model's gradient norm, as "
                    "clip_grad_norm_ does")


# --------------------------------------------------------- exercise 2: the fully_shard plan


class SameArchitecture:
    """Mixed into the cases' models: equal when of one class and one module tree (its repr,
    taken once built). The batch grader's tests compare cases' inputs with == (one seed must
    draw the same inputs, pickled or not); an nn.Module alone compares by identity."""

    architecture: str = ""

    def _fix_architecture(self) -> None:
        self.architecture = repr(self)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.architecture == self.architecture

    def __hash__(self) -> int:  # nn.Module needs one (named_modules keeps a set of modules)
        return hash((type(self).__qualname__, self.architecture))


class TinyGPTCase(SameArchitecture, TinyGPT):
    """The course's TinyGPT (blocks at model.blocks.i, of class Block), comparable by value."""

    def __init__(self, **sizes) -> None:
        super().__init__(**sizes)
        self._fix_architecture()


class MLPBlock(nn.Module):
    """A residual MLP block with two nn.Linear of its own: x + down(gelu(up(norm(x))))."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, 2 * d_model)
        self.down = nn.Linear(2 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    """`n_layers` MLPBlocks in `layers`, then a LayerNorm no block holds."""

    def __init__(self, d_model: int, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(d_model) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class DeepMLP(SameArchitecture, nn.Module):
    """Tokens -> embed -> body (a Stack) -> head: the blocks sit at model.body.layers.i."""

    def __init__(self, vocab_size: int = 32, d_model: int = 16, n_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.body = Stack(d_model, n_layers)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self._fix_architecture()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(idx)))


class EncoderDecoder(SameArchitecture, nn.Module):
    """Two Stacks with a Linear between: blocks at encoder.layers.i, then decoder.layers.i."""

    def __init__(self, d_model: int = 16, n_encoder: int = 2, n_decoder: int = 2) -> None:
        super().__init__()
        self.encoder = Stack(d_model, n_encoder)
        self.bridge = nn.Linear(d_model, d_model)
        self.decoder = Stack(d_model, n_decoder)
        self.head = nn.Linear(d_model, d_model)
        self._fix_architecture()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(self.bridge(self.encoder(x))))


def fully_shard_plan(model: nn.Module, block_type: type) -> list[str]:
    """Where to call fully_shard, in order, bottom-up as torchtitan does: every block_type
    module (one all-gather and one reduce-scatter per block), then the root "" last, which
    takes the parameters no block holds."""
    return [name for name, m in model.named_modules() if isinstance(m, block_type)] + [""]


def plan_equal(expected: list[str], got) -> bool:
    """check_fully_shard_plan's comparison: exactly the same list of str."""
    return type(got) is list and all(type(n) is str for n in got) and got == expected


def _root_first(model, block_type):
    return [""] + fully_shard_plan(model, block_type)[:-1]


def _no_root(model, block_type):
    return fully_shard_plan(model, block_type)[:-1]


def _every_linear(model, block_type):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)] + [""]


def _blocks_children(model, block_type):
    return [f"{n}.{child}" for n, m in model.named_modules() if isinstance(m, block_type)
            for child, _ in m.named_children()] + [""]


def _top_level_only(model, block_type):
    return [n for n, _ in model.named_children()]


PLAN_HINT = ("return a list of str: the names (from model.named_modules()) of every block_type "
             "module, in that order, then '' (the root) last")
PLAN_WRONG = (
    (_root_first,
     "the root came first: fully_shard groups every parameter not yet in a group, so the root "
     "wrapped first takes them all. One group holds every parameter, the whole model is "
     "gathered at once: ZeRO-3's memory saving is gone. Wrap the blocks first, the root last"),
    (_no_root,
     "the root is missing: call fully_shard(model) last. It takes the parameters no block "
     "holds (embeddings, final norm, head); left out, they stay whole on every rank and their "
     "gradients are never reduced across ranks"),
    (_every_linear,
     "one group per nn.Linear: many small all-gathers and reduce-scatters, each paying its "
     "latency, and the blocks' LayerNorms left to the root. The unit is the block: wrap "
     "every block_type module"),
    (_blocks_children,
     "one level too deep: each block's children became groups, several small collectives "
     "per block instead of one all-gather and one reduce-scatter. Wrap the block_type "
     "modules themselves"),
    (_top_level_only,
     "model.named_children() stops at the top level: the container that holds every block "
     "becomes one group, gathered whole, and the root is missing. Pick the block_type "
     "modules from model.named_modules()"),
)


def _build(kind: str, sizes: dict) -> tuple[nn.Module, type, str]:
    """(model, block_type, label) of a model kind. Its weights come from a fixed seed inside a
    forked generator: building a model must not move the learner's torch seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "gpt":
            where = f"{sizes['n_layers']} x Block at model.blocks"
            return TinyGPTCase(**sizes), Block, f"(TinyGPT, {where}, Block)"
        if kind == "deep":
            where = f"{sizes['n_layers']} x MLPBlock at model.body.layers"
            return DeepMLP(**sizes), MLPBlock, f"(DeepMLP, {where}, MLPBlock)"
        where = (f"{sizes['n_encoder']} x MLPBlock at model.encoder.layers, "
                 f"{sizes['n_decoder']} at model.decoder.layers")
        return EncoderDecoder(**sizes), MLPBlock, f"(EncoderDecoder, {where}, MLPBlock)"


PLAN_CASES = [  # (model kind, its sizes)
    ("gpt", dict(n_layers=2)),
    ("gpt", dict(n_layers=1, d_model=16)),
    ("gpt", dict(n_layers=4, d_model=16, n_heads=4, bias=False)),
    ("deep", dict(n_layers=3)),
    ("encdec", dict(n_encoder=2, n_decoder=1)),
]
KINDS = ("gpt", "deep", "encdec")


def _draw_sizes(rng: random.Random, kind: str) -> dict:
    """A model's sizes drawn from `rng`: 1-4 blocks a stack, d_model of 8-32."""
    d = rng.choice((8, 16, 24, 32))
    if kind == "gpt":
        return dict(vocab_size=rng.randrange(16, 65), seq_len=rng.choice((8, 16)), d_model=d,
                    n_heads=rng.choice([h for h in (1, 2, 4) if d % h == 0]),
                    n_layers=rng.randint(1, 4), bias=rng.random() < 0.5)
    if kind == "deep":
        return dict(vocab_size=rng.randrange(16, 65), d_model=d, n_layers=rng.randint(1, 4))
    return dict(d_model=d, n_encoder=rng.randint(1, 4), n_decoder=rng.randint(1, 4))


def fully_shard_plan_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's PLAN_CASES (rng None), or 6 drawn from `rng`: one of each model kind,
    then three of any kind, in a shuffled order. Every known mistake gives another value on
    every case (every model has a block, blocks hold Linears and children, the root has
    children that are not blocks)."""
    if rng is None:
        configs = PLAN_CASES
    else:
        kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(3)]
        rng.shuffle(kinds)
        configs = [(kind, _draw_sizes(rng, kind)) for kind in kinds]
    cases = []
    for kind, sizes in configs:
        model, block_type, label = _build(kind, sizes)
        cases.append(Case(args=(model, block_type), expected=fully_shard_plan(model, block_type),
                          label=label, hint=PLAN_HINT))
    return cases


def plan_type_problem(got) -> tuple[str, str] | None:
    """(what is wrong, hint) when `got` is not a list of str, else None."""
    if type(got) is not list:
        return (f"returned a value of type {type(got).__name__}, {short_repr(got, 120)}, "
                "not a list of str",
                "return a list (list(...) of a tuple or a generator) of the modules' names")
    for item in got:
        if type(item) is not str:
            hint = ("give each module's name from model.named_modules(), not the module"
                    if isinstance(item, nn.Module) else PLAN_HINT)
            return (f"returned a list holding a value of type {type(item).__name__}, "
                    f"{short_repr(item, 120)}, not only str", hint)
    return None


def check_fully_shard_plan(fn: Callable) -> None:
    """Notebook 09: fn(model, block_type) -> the names of the modules to call fully_shard on,
    in the order to call them (a list of str, "" for the root)."""
    run_cases("check_fully_shard_plan", typed(fn, plan_type_problem),
              fully_shard_plan_cases(None), compare=plan_equal, wrong_answers=PLAN_WRONG,
              shows="you can wrap a model for FSDP2 bottom-up: one communication group per "
                    "block, the root last")
