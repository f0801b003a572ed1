"""Notebook 08's checks for two knobs: recompute (`checkpoint_activations`) and the precision
policy (`keep_fp32`, `reduce_dtype`). Each claim a cell asserts is a named function here, so
that tests/test_recompute.py and tests/test_precision_policy.py can feed it a mutant that
must fail. They read the numbers zero_lab/workers/knob_recompute_precision.py (or the test
worker tests/workers/recompute_cases.py) reports.

The formulas. A flat group (stages 0-2: a bucket; stage 3: a unit) of P padded elements,
its parameters b_p bytes an element (2 in bf16, 4 when kept in fp32) and its gradients
reduced at b_r bytes (2, or 4 with reduce_dtype=float32 or a kept group), sends per step:

    stage 0      one all-reduce of P·b_r                        (volume 2·P·b_r)
    stages 1-2   one reduce-scatter of P·b_r, one all-gather of P·b_p
    stage 3      two all-gathers of P·b_p, one reduce-scatter of P·b_r

Recompute adds nothing to it, at any stage: the recomputed forward of a stage-3 unit runs
inside its backward, after the all-gather backward does anyway (recompute.py).
"""

from __future__ import annotations

from collections import Counter


def _dtype(name: str) -> str:
    return name.removeprefix("torch.")


def expected_collectives(stage: int, groups: list[dict]) -> list[list]:
    """[op, dtype, elements] of every collective one step sends, by the formula above, from
    the groups' layout ({"padded", "dtype", "reduce_fp32", "replicated"} each), sorted."""
    out = []
    for g in groups:
        p = g["padded"]
        param = _dtype(g["dtype"])
        reduced = "float32" if g.get("reduce_fp32") else param
        if stage == 0 or (stage == 3 and g.get("replicated")):
            out.append(["all_reduce", reduced, p])
        elif stage in (1, 2):
            out += [["reduce_scatter", reduced, p], ["all_gather", param, p]]
        else:
            out += [["all_gather", param, p]] * 2 + [["reduce_scatter", reduced, p]]
    return sorted(out)


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def volume(collectives: list[list]) -> int:
    """The ZeRO paper's volume of [op, dtype, elements] records: an all-reduce counts twice."""
    return sum((2 if op == "all_reduce" else 1) * _ELEMENT_BYTES[_dtype(dt)] * n
               for op, dt, n in collectives)


def check_step_collectives(stage: int, groups: list[dict], ledger: list[list]) -> int:
    """A step's collectives, as the ledger counted them ([op, dtype, elements] each), are the
    formula's for these groups: the same ops, dtypes and sizes, none missing, none extra.
    Returns the step's volume in bytes."""
    expected = expected_collectives(stage, groups)
    got = sorted(list(r) for r in ledger)
    assert got == expected, (
        f"stage {stage}: the ledger counted {dict(Counter((o, d) for o, d, _ in got))}, the "
        f"formula says {dict(Counter((o, d) for o, d, _ in expected))}")
    return volume(got)


def check_recompute_sends_nothing_more(stage: int, without: list[list], with_: list[list],
                                       n_units: int | None = None) -> None:
    """Recompute changes no collective: the step with it sends exactly what the step without
    sends; at stage 3 that is 2 all-gathers and 1 reduce-scatter per unit (`n_units`)."""
    assert sorted(map(list, with_)) == sorted(map(list, without)), (
        f"stage {stage}: with recompute the step sent "
        f"{dict(Counter(r[0] for r in with_))}, without {dict(Counter(r[0] for r in without))}")
    if stage == 3 and n_units is not None:
        ops = Counter(r[0] for r in with_)
        assert ops["all_gather"] == 2 * n_units and ops["reduce_scatter"] == n_units, (
            f"stage 3: {dict(ops)} for {n_units} units; expected {2 * n_units} all-gathers "
            f"and {n_units} reduce-scatters")


def check_recompute_is_exact(digests: dict[tuple[int, bool], str]) -> None:
    """At every stage, the weights trained with recompute are bit for bit those without: the
    recomputed forward repeats the same ops on the same inputs ({(stage, recompute): digest})."""
    for stage in sorted({s for s, _ in digests}):
        assert digests[stage, True] == digests[stage, False], (
            f"stage {stage}: recompute changed the weights")


def check_recompute_lowers_the_peak(peaks: dict[tuple[int, bool], int]) -> dict[int, float]:
    """At every stage the step's peak is lower with recompute (the blocks keep their inputs
    only). Returns {stage: peak with / peak without}."""
    ratios = {}
    for stage in sorted({s for s, _ in peaks}):
        on, off = peaks[stage, True], peaks[stage, False]
        assert on < off, f"stage {stage}: peak {on:,} B with recompute, {off:,} B without"
        ratios[stage] = on / off
    return ratios


def check_recompute_runs(runs: list[dict]) -> None:
    """One rank's recompute runs (stages 0-3, off and on): each step's collectives are the
    formula's, recompute sends nothing more, and the weights are bit for bit the same."""
    cases = {(r["stage"], r["recompute"]): r for r in runs}
    for stage in sorted({s for s, _ in cases}):
        on, off = cases[stage, True], cases[stage, False]
        check_step_collectives(stage, on["groups"], on["ledger"])
        check_recompute_sends_nothing_more(stage, off["ledger"], on["ledger"],
                                           len(on["groups"]) if stage == 3 else None)
    check_recompute_is_exact({key: r["digest"] for key, r in cases.items()})


def check_precision_runs(runs: list[dict], kept_names: tuple[str, ...]) -> None:
    """One rank's precision recipes: collectives per group and dtype as the formula says, the
    modules named `kept_names` in fp32 where the recipe keeps them (everything else in 16
    bits), and the distance from one process within the recipe's own bound."""
    for run in runs:
        check_step_collectives(run["stage"], run["groups"], run["ledger"])
        check_kept_in_fp32(run["seen"], kept_names if "keep_ln" in run["recipe"] else ())
        check_recipe_distance(run["recipe"], run["from_reference"], run["reference_from_fp32"])


def check_recipe_distance(name: str, from_reference: float, from_fp32: float) -> None:
    """A sharded mixed-precision run stays within twice the distance the recipe itself puts
    between one process and fp32 training (the existing tests' bound: the ranks' 16-bit
    gradients of their rows round differently from those of the whole batch), and that
    distance is real but small (0 < it < 0.1)."""
    assert 0 < from_fp32 < 0.1, f"{name}: the recipe is {from_fp32:.3g} from fp32 training"
    assert from_reference <= 2 * from_fp32, (
        f"{name}: {from_reference:.3g} from one process with the same recipe, more than twice "
        f"the recipe's own distance from fp32 ({from_fp32:.3g})")


def check_kept_in_fp32(seen: dict[str, list[str]], kept: tuple[str, ...]) -> None:
    """Modules whose names end in one of `kept` computed with fp32 weights on fp32 inputs;
    every other module with 16-bit weights on 16-bit inputs (the kept ones cast back)."""
    for name, (weight, inputs) in seen.items():
        want = "torch.float32" if name.split(".")[-1] in kept or name in kept else None
        if want:
            assert weight == inputs == want, f"{name}: {weight} weights on {inputs} inputs"
        else:
            assert weight == inputs != "torch.float32", (
                f"{name}: {weight} weights on {inputs} inputs, expected 16-bit both")


def check_tradeoff(decision: dict[int, str | None]) -> None:
    """The trade-off decides: stage 1 fits only with recompute, stage 3 fits without it."""
    assert decision[1] == "on" and decision[3] == "off", (
        f"stage 1 -> {decision[1]!r}, stage 3 -> {decision[3]!r}; expected 'on' and 'off'")
