"""Notebook 08's graded exercises: the bytes two knobs send, checked against the formulas
the live runs were held to (`zero_lab.predict.knobs`, `zero_lab.predict.projection`).

    check_accumulation_bytes   fn(stage, psi_bytes, k, grad_accumulation) -> {op: bytes} of
                               one optimizer step of k micro-batches, the first k - 1 under
                               model.no_sync() (reshard_after_forward=True)
    check_hsdp_bytes           fn(unit_numels, replicas, shards, bytes_per_elem) ->
                               {"shard": {op: bytes}, "replicate": {op: bytes}} of one step
                               of stage 3 on an R x S hybrid layout

Bytes are full messages, as the ledger's `nbytes` and nccl-tests count them (the
reduce-scatter's input, the all-gather's output). The wrong answers recognised are the
shortcuts people take: k times the bytes where no_sync sends once, stage 3's backward
gather forgotten, the whole gradient all-reduced across groups, padding to N instead of S.
Each exercise's cases come from `<exercise>_cases(rng)`: rng None gives the notebook's, a
`random.Random` cases drawn from it (for the batch grader, grading/hidden.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from zero_lab.grading.framework import Case, run_cases
from zero_lab.predict.knobs import accumulation_messages
from zero_lab.predict.projection import hybrid_bytes_per_step

# ------------------------------------------------------------- exercise 1: accumulation


def reference_accumulation_bytes(stage: int, psi_bytes: int, k: int,
                                 grad_accumulation: str = "sharded") -> dict[str, int]:
    """{op: bytes} of one optimizer step: predict/knobs.py's messages, their sizes."""
    messages = accumulation_messages(stage, psi_bytes, k, 2,
                                     grad_accumulation=grad_accumulation)
    return {op: int(m["nbytes"]) for op, m in messages.items()}


def nonzero_ops_equal(expected: dict, got) -> bool:
    """The same ops with the same bytes; an op given with 0 bytes counts as absent (a learner
    may list every op), any other extra op is wrong."""
    if not isinstance(got, dict):
        return False
    try:
        sent = {op: b for op, b in got.items() if b != 0}
    except TypeError:
        return False
    return sent == expected


def _sends_every_backward(stage, psi_bytes, k, grad_accumulation="sharded"):
    """No no_sync: every stage reduces the gradient k times."""
    out = reference_accumulation_bytes(stage, psi_bytes, k, grad_accumulation)
    op = "all_reduce" if stage == 0 else "reduce_scatter"
    out[op] = k * psi_bytes
    return out


def _stage2_sends_once_anyway(stage, psi_bytes, k, grad_accumulation="sharded"):
    """Stage 2 "sharded" treated like stage 1: one reduce-scatter per optimizer step."""
    return reference_accumulation_bytes(stage, psi_bytes, k, "unsharded")


def _stage3_gathers_once(stage, psi_bytes, k, grad_accumulation="sharded"):
    """Stage 3 with one all-gather per unit per micro-batch: the backward gather forgotten."""
    out = reference_accumulation_bytes(stage, psi_bytes, k, grad_accumulation)
    if stage == 3:
        out["all_gather"] = k * psi_bytes
    return out


def _stage3_gathers_once_per_step(stage, psi_bytes, k, grad_accumulation="sharded"):
    """Stage 3's units treated as if no_sync kept them gathered: 2 gathers per step."""
    out = reference_accumulation_bytes(stage, psi_bytes, k, grad_accumulation)
    if stage == 3:
        out["all_gather"] = 2 * psi_bytes
    return out


def _stage1_all_gathers_every_micro_batch(stage, psi_bytes, k, grad_accumulation="sharded"):
    """Stages 1-2 all-gathering the parameters after every micro-batch, not after the step."""
    out = reference_accumulation_bytes(stage, psi_bytes, k, grad_accumulation)
    if stage in (1, 2):
        out["all_gather"] = k * psi_bytes
    return out


ACCUMULATION_CASES = [  # (stage, Ψ bytes, k, grad_accumulation)
    (0, 4_000, 8, "sharded"),
    (1, 4_000, 8, "sharded"),
    (2, 4_000, 8, "sharded"),
    (2, 4_000, 8, "unsharded"),
    (3, 4_000, 8, "sharded"),
    (3, 4_000, 8, "unsharded"),
    (1, 2 * 7_000_000_000, 16, "sharded"),  # 7B in bf16, 16 micro-batches
    (2, 2 * 7_000_000_000, 16, "sharded"),
    (0, 1_024, 1, "sharded"),  # k = 1: no accumulation at all
    (3, 1_024, 1, "unsharded"),
]
ACCUMULATION_HINTS = {
    0: "stage 0 holds the full gradient anyway: under no_sync it all-reduces once, at the last "
       "micro-batch",
    1: "stage 1 accumulates into its full gradient buffer and reduce-scatters it once; the "
       "updated slices are all-gathered once, after the optimizer step",
    2: "'sharded' keeps only this rank's slice, so every micro-batch's gradient must be "
       "reduce-scattered into it; 'unsharded' holds a full gradient (stage 1's memory) and "
       "sends once",
    3: "stage 3 gathers every unit in each forward AND again in each backward (2 all-gathers "
       "per micro-batch); the gradient goes like stage 2's",
}


ACCUMULATION_WRONG = (
    (_sends_every_backward,
     "that is the loop without no_sync: k reductions per optimizer step. Under no_sync the "
     "gradient accumulates locally and is sent once (stages 0-1, stage 2-3 'unsharded')"),
    (_stage2_sends_once_anyway,
     "stage 2 'sharded' cannot wait: it keeps only its slice, so each micro-batch's "
     "gradient is reduce-scattered into it, k reduce-scatters per optimizer step"),
    (_stage3_gathers_once,
     "stage 3 frees each unit after its forward and gathers it again for its backward: "
     "two all-gathers per micro-batch, 2kΨ"),
    (_stage3_gathers_once_per_step,
     "that is reshard_after_forward=False under no_sync (units kept gathered); with the "
     "default each micro-batch gathers every unit twice"),
    (_stage1_all_gathers_every_micro_batch,
     "the parameters change only at the optimizer step: stages 1-2 all-gather the updated "
     "slices once per optimizer step"),
)
MODES = ("sharded", "unsharded")


def accumulation_bytes_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's ACCUMULATION_CASES (rng None), or 10 drawn from `rng`: stages 0 and 1,
    stages 2 and 3 in both modes, two of any stage, all with k = 2-64 micro-batches, then
    two with k = 1; Ψ of 1 KB to 140 GB (2 or 4 bytes a parameter)."""
    if rng is None:
        configs = ACCUMULATION_CASES
    else:
        stages = [(0, rng.choice(MODES)), (1, rng.choice(MODES)), (2, "sharded"),
                  (2, "unsharded"), (3, "sharded"), (3, "unsharded")]
        stages += [(rng.randrange(4), rng.choice(MODES)) for _ in range(4)]
        configs = [(stage, rng.choice((2, 4)) * rng.randrange(500, 35 * 10**9),
                    rng.randint(2, 64) if i < 8 else 1, mode)
                   for i, (stage, mode) in enumerate(stages)]
    return [Case(args=(stage, psi, k, mode),
                 expected=reference_accumulation_bytes(stage, psi, k, mode),
                 hint=ACCUMULATION_HINTS[stage])
            for stage, psi, k, mode in configs]


def check_accumulation_bytes(fn: Callable) -> None:
    """Notebook 08: fn(stage, psi_bytes, k, grad_accumulation) -> {op: bytes} of one optimizer
    step of k micro-batches, the first k - 1 under model.no_sync()."""
    run_cases("check_accumulation_bytes", fn, accumulation_bytes_cases(None),
              compare=nonzero_ops_equal, wrong_answers=ACCUMULATION_WRONG,
              shows="you can price accumulation at each stage: what no_sync saves and what it "
                    "costs")


# ------------------------------------------------------------------ exercise 2: HSDP


def reference_hsdp_bytes(unit_numels: list[int], replicas: int, shards: int,
                         bytes_per_elem: int = 4) -> dict[str, dict[str, int]]:
    """projection.hybrid_bytes_per_step at stage 3."""
    return hybrid_bytes_per_step(unit_numels, 3, replicas, shards, bytes_per_elem)


def _padded(unit_numels, multiple):
    return [multiple * -(-n // multiple) for n in unit_numels]


def _full_gradient_across(unit_numels, replicas, shards, bytes_per_elem=4):
    """The whole gradient all-reduced across the groups, not the averaged 1/S slice."""
    out = reference_hsdp_bytes(unit_numels, replicas, shards, bytes_per_elem)
    out["replicate"]["all_reduce"] = sum(_padded(unit_numels, shards)) * bytes_per_elem
    return out


def _one_gather_per_unit(unit_numels, replicas, shards, bytes_per_elem=4):
    """One all-gather per unit per step: the backward's second gather forgotten."""
    out = reference_hsdp_bytes(unit_numels, replicas, shards, bytes_per_elem)
    out["shard"]["all_gather"] //= 2
    return out


def _padded_to_world(unit_numels, replicas, shards, bytes_per_elem=4):
    """Each unit padded to a multiple of N = R x S, the flat layout's, instead of S."""
    n = replicas * shards
    total = sum(_padded(unit_numels, n)) * bytes_per_elem
    return {"shard": {"all_gather": 2 * total, "reduce_scatter": total},
            "replicate": {"all_reduce": total // shards}}


def _not_padded(unit_numels, replicas, shards, bytes_per_elem=4):
    """No padding: a rank's slice must be S-th of a buffer that S ranks split evenly."""
    total = sum(unit_numels) * bytes_per_elem
    return {"shard": {"all_gather": 2 * total, "reduce_scatter": total},
            "replicate": {"all_reduce": total // shards}}


def _flat_stage3(unit_numels, replicas, shards, bytes_per_elem=4):
    """Flat stage 3 on all N ranks: everything inside one group of N, nothing across."""
    return {"shard": reference_hsdp_bytes(unit_numels, 1, replicas * shards,
                                          bytes_per_elem)["shard"], "replicate": {}}


HSDP_CASES = [  # (unit sizes, R, S, bytes per element)
    ([65_792] * 4, 2, 2, 4),  # the live run: deep_mlp(256, 4) on 2 x 2
    ([1_001, 37, 4_096], 2, 4, 4),  # odd sizes: padding to a multiple of S
    ([1_001, 37, 4_096], 4, 2, 2),  # bf16
    ([218_112_000] * 32, 8, 8, 2),  # a 7B-like model's 32 blocks on 8 nodes of 8 GPUs
    ([10, 10], 3, 1, 4),  # S = 1: DDP with every rank its own group
]


def hsdp_compare(expected: dict, got) -> bool:
    """check_hsdp_bytes' comparison: both levels, each with nonzero_ops_equal."""
    return (isinstance(got, dict) and set(got) == set(expected)
            and all(nonzero_ops_equal(expected[level], got[level]) for level in expected))


HSDP_HINT = ("each unit is padded to a multiple of S and sharded over its group: inside, it is "
             "all-gathered twice (forward, backward) and its gradient reduce-scattered once; "
             "across, only the averaged slice (1/S of the unit) is all-reduced")
HSDP_WRONG = (
    (_full_gradient_across,
     "the whole gradient all-reduced across groups: after the reduce-scatter inside, each "
     "rank only holds (and needs) its averaged 1/S slice, so only Ψ/S crosses the groups"),
    (_one_gather_per_unit,
     "one all-gather per unit: stage 3 frees the unit after its forward and gathers it "
     "again for its backward (2 all-gathers per unit per step)"),
    (_padded_to_world,
     "padded to a multiple of N: a unit is sharded over the S ranks of a group, so it is "
     "padded to a multiple of S"),
    (_not_padded,
     "not padded: the flat buffer is padded to a multiple of S so every rank holds an "
     "equal slice"),
    (_flat_stage3,
     "that is flat stage 3 on all N ranks; HSDP shards inside a group of S and all-reduces "
     "the slices across the R groups"),
)
MESH_SIDES = (2, 3, 4, 8, 16)  # R and S drawn from these


def _odd_units(rng: random.Random, replicas: int, shards: int) -> list[int]:
    """2-6 unit sizes that S does not divide and whose S-padding N = R x S does not divide:
    padding to S, to N and not at all give three different sizes."""
    units = []
    for _ in range(rng.randint(2, 6)):
        q = rng.randrange(1, 50_000)
        q += q % replicas == replicas - 1  # the padded size, S x (q + 1), not a multiple of N
        units.append(shards * q + rng.randrange(1, shards))
    return units


def hsdp_bytes_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's HSDP_CASES (rng None), or 5 drawn from `rng`: first odd unit sizes on
    an R x S mesh with R, S >= 2 (every known mistake gives another value), then two of any
    sizes, one S = 1 mesh (DDP), one model of 8-64 equal blocks of 0.1-0.3B in bf16."""
    if rng is None:
        configs = HSDP_CASES
    else:
        r, s = rng.choice(MESH_SIDES), rng.choice(MESH_SIDES)
        configs = [(_odd_units(rng, r, s), r, s, rng.choice((2, 4)))]
        for _ in range(2):
            units = [rng.randrange(1, 2_000_000) for _ in range(rng.randint(1, 8))]
            configs.append((units, rng.choice(MESH_SIDES), rng.choice(MESH_SIDES),
                            rng.choice((2, 4))))
        configs.append(([rng.randrange(1, 100_000) for _ in range(rng.randint(1, 4))],
                        rng.choice(MESH_SIDES), 1, 4))
        configs.append(([rng.randrange(10**8, 3 * 10**8)] * rng.randint(8, 64),
                        rng.choice(MESH_SIDES), rng.choice(MESH_SIDES), 2))
    return [Case(args=(units, r, s, b), expected=reference_hsdp_bytes(units, r, s, b),
                 hint=HSDP_HINT)
            for units, r, s, b in configs]


def check_hsdp_bytes(fn: Callable) -> None:
    """Notebook 08: fn(unit_numels, replicas, shards, bytes_per_elem) -> {"shard": {op: bytes},
    "replicate": {op: bytes}} that one rank's collectives carry in one stage-3 step."""
    run_cases("check_hsdp_bytes", fn, hsdp_bytes_cases(None), compare=hsdp_compare,
              wrong_answers=HSDP_WRONG,
              shows="you can split HSDP's traffic into what stays in a group and what crosses "
                    "groups")
