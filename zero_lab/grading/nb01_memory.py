"""Notebook 01's checks: memory accounting, plain input -> output against `zero_lab.memory`.

The learner derives, for recipes the notebook has not tabulated (fp32 gradients, 8-bit Adam,
pure bf16 without a master copy, ...): the bytes a parameter costs, the bytes one rank holds
at each stage (padded partitions included), and the largest model a GPU holds once
activations have their share. The references are below; tests/test_grading.py ties them to
`memory.bytes_per_param`, `memory.model_state_bytes` and `memory.largest_model` on the
recipes those name. The wrong answers are the mistakes learners make with the ZeRO paper's
formulas (the master copy forgotten, every state taken as fp32, one stage off, every stage
treated alike, the padding or the reserve forgotten).

Each exercise's cases come from `<exercise>_cases(rng)`: rng None gives the notebook's, a
`random.Random` cases drawn from it (recipes, stages, sizes, world sizes), which the batch
grader (grading/hidden.py) draws from the instructor's seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from fractions import Fraction

from zero_lab import memory
from zero_lab.course import models
from zero_lab.grading.framework import Case, run_cases, same

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}  # the exercise's dtype names

# (params, grads, master, states, n_states) of recipes in use; master None: no copy
RECIPES = {
    "fp32 Adam": ("fp32", "fp32", None, "fp32", 2),
    "mixed-precision Adam, the paper's": ("bf16", "bf16", "fp32", "fp32", 2),
    "Megatron-LM's fp32 main grads, Adam": ("bf16", "fp32", "fp32", "fp32", 2),
    "fp32 grads, 8-bit Adam": ("bf16", "fp32", "fp32", "int8", 2),
    "pure bf16 Adam, no master copy": ("bf16", "bf16", None, "bf16", 2),
    "fp16 momentum SGD, fp32 master": ("fp16", "fp16", "fp32", "fp32", 1),
    "fp32 SGD": ("fp32", "fp32", None, "fp32", 0),
    "bf16 Adam states, fp32 master": ("bf16", "bf16", "fp32", "bf16", 2),
}


def recipe_bytes(params: str, grads: str, master: str | None, states: str,
                 n_states: int) -> dict[str, int]:
    """Bytes per parameter of a recipe named by its dtypes; "optimizer" is the paper's K
    (the master copy, if any, plus the states)."""
    p, g = DTYPE_BYTES[params], DTYPE_BYTES[grads]
    k = (DTYPE_BYTES[master] if master else 0) + n_states * DTYPE_BYTES[states]
    return {"params": p, "grads": g, "optimizer": k, "total": p + g + k}


def recipe(name: str) -> dict[str, int]:
    """{"params", "grads", "optimizer", "total"} bytes per parameter of RECIPES[name]."""
    return recipe_bytes(*RECIPES[name])


def draw_recipe(rng: random.Random, *, master: bool | None = None, small_states: bool = False,
                min_states: int = 0) -> tuple:
    """A recipe's dtypes drawn from `rng`, (params, grads, master, states, n_states), as
    recipe_bytes takes them. master=True forces an fp32 master copy (of 16-bit params),
    False none; small_states draws states of fewer than 4 bytes; min_states at least that
    many state tensors."""
    params = rng.choice(("bf16", "fp16") if master else ("fp32", "bf16", "fp16"))
    keep_master = master if master is not None else params != "fp32" and rng.random() < 0.75
    grads = rng.choice((params, "fp32"))
    states = rng.choice(("bf16", "fp16", "int8") if small_states
                        else ("fp32", "fp32", "bf16", "int8"))
    n_states = rng.choice([n for n in (0, 1, 2, 2, 2, 3) if n >= min_states])
    return params, grads, "fp32" if keep_master else None, states, n_states


# ------------------------------------------------------------ exercise 1: bytes per param

BYTES_PER_PARAM_HINT = ("bytes of each dtype: fp32 4, bf16 and fp16 2, int8 1; K = the master "
                        "copy (if any) + n_states x the state dtype; total = params + grads + K")


def _forgot_master(params, grads, master, states, n_states):
    return recipe_bytes(params, grads, None, states, n_states)


def _states_always_fp32(params, grads, master, states, n_states):
    return recipe_bytes(params, grads, master, "fp32", n_states)


def _one_state(params, grads, master, states, n_states):
    return recipe_bytes(params, grads, master, states, min(n_states, 1))


BYTES_PER_PARAM_WRONG = (
    (_forgot_master, "the fp32 master copy is part of K: the optimizer applies the "
                     "update to it and keeps it for the whole run"),
    (_states_always_fp32, "optimizer states take the size of their own dtype: 8-bit "
                          "Adam keeps m and v in 1 byte each, bf16 states in 2"),
    (_one_state, "n_states counts the state tensors per parameter: Adam keeps two "
                 "(m and v), each of the state dtype"),
)


def bytes_per_param_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's cases (rng None: every recipe of RECIPES), or 8 recipes drawn from
    `rng`; the first has a master copy, small states and two of them (every known mistake
    gives another value there), the next three one of those each."""
    if rng is None:
        named = list(RECIPES.items())
    else:
        musts = [dict(master=True, small_states=True, min_states=2), dict(master=True),
                 dict(small_states=True, min_states=1), dict(min_states=2)]
        named = [("a drawn recipe", draw_recipe(rng, **kw)) for kw in musts + [{}] * 4]
    return [Case(args=args, expected=recipe_bytes(*args), label=f"{name} {args}",
                 hint=BYTES_PER_PARAM_HINT) for name, args in named]


def check_bytes_per_param(fn: Callable) -> None:
    """Notebook 01: fn(params, grads, master, states, n_states) -> {"params", "grads",
    "optimizer", "total"} bytes per parameter, for dtype names of DTYPE_BYTES."""
    run_cases("check_bytes_per_param", fn, bytes_per_param_cases(None),
              wrong_answers=BYTES_PER_PARAM_WRONG,
              shows="you can price any training recipe in bytes per parameter, master copy "
                    "included")


def _split(stage: int, r: dict) -> tuple[int, int]:
    """(bytes per parameter every rank keeps whole, bytes per parameter divided by N_d)."""
    whole = {0: r["params"] + r["grads"] + r["optimizer"], 1: r["params"] + r["grads"],
             2: r["params"], 3: 0}[stage]
    return whole, r["params"] + r["grads"] + r["optimizer"] - whole


def per_rank_bytes(psi: int, stage: int, n_d: int, r: dict) -> int:
    """Model-state bytes one rank holds under ZeRO `stage` for recipe `r` (bytes per
    parameter): what the stage shards costs one partition, ceil(Ψ/N_d) elements, per rank."""
    whole, sharded = _split(stage, r)
    return whole * psi + sharded * memory.partition_elements(psi, n_d)


def largest_model(gpu_bytes: float, n_d: int, stage: int, r: dict, reserve: float = 0) -> float:
    """The largest Ψ whose per-rank model states fit beside `reserve` bytes (activations,
    buffers) on a GPU of `gpu_bytes`: (gpu - reserve) / (whole + sharded/N_d), the paper's
    formula solved for Ψ (partitions taken as Ψ/N_d)."""
    whole, sharded = _split(stage, r)
    return float((Fraction(gpu_bytes) - Fraction(reserve)) / (whole + Fraction(sharded, n_d)))


# ------------------------------------------------------------ exercise 2: per-rank bytes

STAGE_HINTS = {
    0: "plain data parallelism: every rank holds every state of every parameter",
    1: "stage 1 shards K only (master copy and states); params and grads stay whole",
    2: "stage 2 shards the gradients and K; the params stay whole",
    3: "stage 3 shards all three",
}
WORLD_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256, 1024)  # N_d drawn from these


def _one_stage_more(psi, stage, n_d, r):
    return per_rank_bytes(psi, min(stage + 1, 3), n_d, r)


def _one_stage_fewer(psi, stage, n_d, r):
    return per_rank_bytes(psi, max(stage - 1, 0), n_d, r)


def _no_padding(psi, stage, n_d, r):
    whole, sharded = _split(stage, r)
    return whole * psi + sharded * psi / n_d


PER_RANK_WRONG = (
    (_one_stage_more, "you sharded one state too many: this is the next stage's count. Stage "
                      "1 shards K only; stage 2 adds the gradients; stage 3 adds the parameters"),
    (_one_stage_fewer, "you sharded one state too few: this is the previous stage's count"),
    (_no_padding, "every rank owns the same number of elements, ceil(Ψ/N_d): the flat buffer "
                  "is padded at its end, so use -(-psi // n_d), not psi / n_d"),
)


def per_rank_bytes_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's 8 cases (rng None), or 8 drawn from `rng`: each stage twice, once on a
    model of 0.1-200B parameters and once on a small one that is not a multiple of N_d (so
    the padding shows), recipes with a nonzero K, N_d >= 2, in a shuffled order."""
    if rng is None:
        configs = [
            # the course's models (zero_lab/course/models.py): Llama 3.1 8B, Llama 3 70B and
            # the course MLP; 48 and 24 ranks (6 and 3 nodes of 8) leave a padded partition
            (models.PSI_8B, 1, 64, "Megatron-LM's fp32 main grads, Adam"),
            (models.PSI_8B, 2, 48, "fp32 grads, 8-bit Adam"),
            (models.PSI_70B, 3, 1024, "fp32 grads, 8-bit Adam"),
            (models.PSI_MLP, 0, 8, "pure bf16 Adam, no master copy"),
            (models.PSI_70B, 2, 24, "fp16 momentum SGD, fp32 master"),
            (126, 3, 4, "fp32 Adam"),  # notebook 03's toy MLP: 4 slices of 32, two padding
            (1001, 2, 8, "mixed-precision Adam, the paper's"),
            (10, 1, 16, "bf16 Adam states, fp32 master"),  # fewer elements than ranks
        ]
        drawn = [(psi, stage, n_d, recipe(name), name) for psi, stage, n_d, name in configs]
    else:
        drawn = []
        for i in range(8):
            n_d = rng.choice(WORLD_SIZES)
            psi = (rng.randrange(10**8, 2 * 10**11) if i < 4
                   else n_d * rng.randrange(0, 200) + rng.randrange(1, n_d))
            dtypes = draw_recipe(rng, min_states=1)
            drawn.append((psi, i % 4, n_d, recipe_bytes(*dtypes), str(dtypes)))
        rng.shuffle(drawn)
    return [Case(args=(psi, stage, n_d, r), expected=per_rank_bytes(psi, stage, n_d, r),
                 label=f"(Ψ={psi:,}, stage {stage}, N_d={n_d}, {name})",
                 hint=STAGE_HINTS[stage])
            for psi, stage, n_d, r, name in drawn]


def check_per_rank_bytes(fn: Callable) -> None:
    """Notebook 01: fn(psi, stage, n_d, recipe) -> the model-state bytes one rank holds (an
    int), sharded states padded to ceil(Ψ/N_d) elements."""
    run_cases("check_per_rank_bytes", fn, per_rank_bytes_cases(None),
              wrong_answers=PER_RANK_WRONG,
              shows="you can say what each stage divides by N_d and keeps whole, for any recipe")


# ------------------------------------------------------------ exercise 3: the largest model

GIB = 2**30
LARGEST_MODEL_HINT = ("per-rank bytes are (whole + sharded / N_d) x Ψ; solve "
                      "per-rank bytes + reserve = gpu_bytes for Ψ")


def _same_for_all_stages(gpu, n_d, stage, r, reserve=0):
    return largest_model(gpu, n_d, 0, r, reserve)


def _everything_sharded(gpu, n_d, stage, r, reserve=0):
    return largest_model(gpu, n_d, 3, r, reserve)


def _forgot_reserve(gpu, n_d, stage, r, reserve=0):
    return largest_model(gpu, n_d, stage, r, 0)


def close(expected, got) -> bool:
    """check_largest_model's comparison: the paper's formula takes partitions as Ψ/N_d."""
    return same(expected, got, rel=1e-6)


LARGEST_MODEL_WRONG = (
    (_same_for_all_stages, "this is plain data parallelism's limit for every stage; ZeRO "
                           "shards part of the bytes over N_d ranks"),
    (_everything_sharded, "only stage 3 divides every byte by N_d; stages 1 and 2 keep a full "
                          "copy of the params (and stage 1 of the grads)"),
    (_forgot_reserve, "the reserve (activations, buffers) comes off the GPU first: the states "
                      "get gpu_bytes - reserve"),
)


def largest_model_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's 7 cases (rng None), or 8 drawn from `rng`: each stage twice, GPUs of
    16-192 GB or GiB, N_d >= 2, recipes with a nonzero K, a reserve of 5-50% of the GPU
    (none in one case), in a shuffled order."""
    if rng is None:
        configs = [
            (80 * GIB, 8, 3, "mixed-precision Adam, the paper's", 0),
            (80 * GIB, 8, 1, "Megatron-LM's fp32 main grads, Adam", 10 * GIB),
            (80 * GIB, 64, 2, "fp32 grads, 8-bit Adam", 20 * GIB),
            (24 * GIB, 1, 0, "pure bf16 Adam, no master copy", 4 * GIB),
            (32e9, 64, 1, "mixed-precision Adam, the paper's", 0),  # the paper's Table 2, MP 1
            (141e9, 1024, 3, "fp32 Adam", 40e9),
            (40e9, 16, 2, "fp16 momentum SGD, fp32 master", 8e9),
        ]
        drawn = [(gpu, n_d, stage, recipe(name), name, reserve)
                 for gpu, n_d, stage, name, reserve in configs]
    else:
        drawn = []
        for i in range(8):
            gpu = rng.choice((16, 24, 32, 40, 48, 80, 94, 141, 192)) * rng.choice((GIB, 10**9))
            reserve = 0 if i == 4 else int(gpu * rng.uniform(0.05, 0.5))
            dtypes = draw_recipe(rng, min_states=1)
            drawn.append((gpu, rng.choice(WORLD_SIZES), i % 4, recipe_bytes(*dtypes),
                          str(dtypes), reserve))
        rng.shuffle(drawn)
    return [Case(args=(gpu, n_d, stage, r), kwargs={"reserve": reserve},
                 expected=largest_model(gpu, n_d, stage, r, reserve),
                 label=f"(GPU {gpu / 1e9:g} GB, N_d={n_d}, stage {stage}, {name}, "
                       f"reserve {reserve / 1e9:g} GB)", hint=LARGEST_MODEL_HINT)
            for gpu, n_d, stage, r, name, reserve in drawn]


def check_largest_model(fn: Callable) -> None:
    """Notebook 01: fn(gpu_bytes, n_d, stage, recipe, reserve=0) -> the largest Ψ whose
    model states fit beside `reserve` bytes."""
    run_cases("check_largest_model", fn, largest_model_cases(None), compare=close,
              wrong_answers=LARGEST_MODEL_WRONG,
              shows="you can size the largest model a GPU holds at a stage, activations set "
                    "aside")
