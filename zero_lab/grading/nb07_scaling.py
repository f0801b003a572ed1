"""Notebook 07's checks: the graded exercise (from how many GPUs each stage fits), and the
claims the notebook's cells assert, each a named function so that tests/test_nb07_checks.py
can feed it a mutant that must fail.

The exercise asks for the turning points behind the decision table, which no function of
the package hands out: for stages 0-3, the fewest GPUs N at which one rank's model states
(`memory.model_state_bytes`, bf16 + Adam) plus its activations fit in the GPU less its
reserve (RESERVE_FRACTION), None where no N does. The reference steps from the closed form
(N >= sharded bytes x Ψ / (room - whole bytes x Ψ)) to the exact answer of the package's
formula (ceil(Ψ/N) parameters a rank). The known wrong answers: no reserve, no activations,
every stage sharded like stage 3, the ratio rounded down.
`stage_choice_cases(rng)` draws other cases from a seed (for grading/hidden.py).

Why the checks hold on a busy laptop
------------------------------------
Every assertion is about bytes or counts, which a loaded machine cannot move; every time is
printed with its spread and never asserted. How each measurement is made:

Section 1, memory at N up to 1024. One process joins torch's fake process group as rank 0 of N
(`zero_lab/workers/memory_at_scale.py`): collectives move nothing, memory is real. For speed the
worker allocates parameters uninitialised, fills them with small values, and trains on a batch
of one row (activations are measured separately). Held bytes must equal
`memory.model_state_bytes` plus the flat buffers' padding, bounded by < N elements per flat
group at 16 bytes each (parameter, gradient, Adam's m and v), and the peak must not be lower
than what is held. The GPT, built on the meta device, is untied by `to_empty()` (V·h parameters
more): the worker ties it again and the check compares Ψ with the tied model's count. The peak's
floor at N = 1024 (peak - held) must be `projection.FLOOR_UNITS` units to half a unit, stage 0's
at least its Adam chunk's temporaries. Saved activations (`measure.memory.saved_activation_bytes`,
parameters excluded) must equal, to the byte, Korthikanti et al.'s formula with the CPU's 2-byte
dropout masks and LayerNorm statistics added (`memory.activation_bytes_saved_by_torch`,
attention written out with its s x s scores kept).

Section 2, the projection against measured steps. Asserted by construction: the projection
prices, per step and by kind, the collectives the stages' ledger counted, and its ring
formula's bytes equal the bytes the ledger counted (to the padding, 1e-3). Printed, not
asserted: the times.
  - The link. A sweep of notebook 02's worker at the sizes of the buckets and units measured
    (128 KiB to 8 MiB, doubling, 5 repeats, the fastest batch kept) times gloo's all-reduce
    and, on gloo, the direct exchange's reduce-scatter and all-gather that stages 1-3 really
    send (`collectives/exchange.py`: every message posted at once, one round whatever N is,
    (N-1)/N of the bytes). `links.fit_op_links` fits alpha and beta to each op alone:
    the all-reduce's alpha is per ring step, the exchange's per round
    (`links.latency_steps`). Stage 3 pays an exchange's latency three times per unit
    (two gathers, one reduce-scatter), stages 1-2 twice per bucket.
  - The compute. Each stage runs in the same launch as its twin, the same stage built with
    `shard(..., transport="none")`: every copy, hook, bucket and the 1/N optimizer update,
    nothing sent (its weights are meaningless; notebook 06 uses the same twins). The two are
    timed in interleaved rounds, a round of the twin beside each round of the stage, so
    whatever else the machine runs slows both alike. A compute time from a separate launch
    (one rank alone, say) carries the load of another moment, and on a busy machine that
    difference alone can outweigh everything the model prices.
  - The overlap. On two cores shared by gloo's threads and the training threads nothing
    runs beside compute, so the check projects with overlap = 0. `make bench`, timing steps
    back to back as training runs them, measured stages 1-2 the same with the parameter
    gather issued early as with it in the step (64.4 and 64.3 ms at stage 1, 61.0 and 62.3 at
    stage 2); the 7-11% it once reported came from its barrier between timed steps, where
    the early gather finished untimed (`zero_lab.measure.step_timing`). A trace's "hidden" time
    (notebook 06) is time a collective was in flight while compute ran: an upper bound on
    time saved, and on shared cores the two mostly take turns.
  - The lockstep check. Once a step the stages send one all-gather of 24 bytes a rank
    (`stages/lockstep.py`) whose answer the step waits for; the twin sends nothing, so the
    projection prices it too, at its latency on gloo's ring (`project_step(..., control=1)`).
  - Past the measured N. With more ranks than cores each rank gets cores/N of a core and the
    twin's compute stretches by N/cores (`projection.oversubscribed`). The published links'
    curves use stage 0's twin at the smallest measured N (one rank's forward, backward and
    whole Adam update) as every stage's compute, per-rank batch fixed (weak scaling).
  - Reading the error (`same_launch_error`). The error of the best rounds compares each
    side's least disturbed round, as the sweep keeps its fastest batch; the band compares
    round k of the stage with round k of its twin. What enters is what the model leaves out:
    gloo's bandwidth changes with the message size (notebook 02), and the sweep times
    collectives back to back with both ranks in step, while in training each rank reaches a
    collective after its own compute. When other programs share the cores the scheduler sets
    one rank aside now and then and the other waits for it at the next collective; the
    twin's ranks never wait for each other. So on a busy machine the measured step is longer
    than twin + collectives and the error goes negative; at N = 4 the ranks take turns on 2
    cores and it falls far below zero. One run's error can leave any band a check could
    state, which is why it is printed and not asserted.

Section 3 (`check_decision_table`): a choice that fits leaves `RESERVE_FRACTION` of the GPU free
above the peak floor; where nothing fits it says so, never advising checkpointing already on;
the figure is the table's `recommend` (`check_decision_figure`). Projected times are lower
bounds, unchecked; the compute is checked once against torchtitan's Llama 3.1 8B on 8 H100s
(`check_against_torchtitan`, within 25%, the value pinned in tests/test_projection.py): with 40%
MFU assumed, the band tests the FLOP count and that assumption together (28-46% passes).

Going further, checkpoints. A resumed run must match the uninterrupted one within 1e-6 on every
value (a different world size and stage reorder float sums); a resume with its extras must match
it exactly and one without them must not; a job killed while publishing must leave the name on
the last published checkpoint (`zero_lab/checkpoint/publication.py`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from zero_lab import memory
from zero_lab.grading.framework import Case, check_ledger_matches, run_cases
from zero_lab.predict.projection import FLOOR_UNITS, RESERVE_FRACTION, Recommendation

GiB = 2**30


WHOLE_BYTES = {0: 16, 1: 4, 2: 2, 3: 0}  # bf16 + Adam: bytes a parameter no N divides


def _fits(n_params, stage: int, world: int, room: float) -> bool:
    return memory.model_state_bytes(n_params, stage, world)["total"] <= room


def fewest_gpus_for(n_params, stage: int, room: float) -> int | None:
    """The fewest N at which `stage`'s states (memory.model_state_bytes, bf16 + Adam) take at
    most `room` bytes a rank, None if none: the closed form, then exact to the package's
    ceil(Ψ/N) parameters a rank."""
    left = room - WHOLE_BYTES[stage] * n_params
    if left <= 0:
        return None
    n = max(1, math.ceil((16 - WHOLE_BYTES[stage]) * n_params / left))
    while not _fits(n_params, stage, n, room):
        n += 1
    while n > 1 and _fits(n_params, stage, n - 1, room):
        n -= 1
    return n


def reference_fewest_gpus(n_params, gpu_bytes, activation_bytes) -> dict[int, int | None]:
    room = (1 - RESERVE_FRACTION) * gpu_bytes - activation_bytes
    return {stage: fewest_gpus_for(n_params, stage, room) for stage in range(4)}


def _no_reserve(n_params, gpu_bytes, activation_bytes):
    return reference_fewest_gpus(n_params, gpu_bytes / (1 - RESERVE_FRACTION), activation_bytes)


def _no_activations(n_params, gpu_bytes, activation_bytes):
    return reference_fewest_gpus(n_params, gpu_bytes, 0)


def _all_sharded(n_params, gpu_bytes, activation_bytes):
    room = (1 - RESERVE_FRACTION) * gpu_bytes - activation_bytes
    return {stage: fewest_gpus_for(n_params, 3, room) for stage in range(4)}


def _by_ratio(n_params, gpu_bytes, activation_bytes, rounding=math.ceil):
    """The closed form alone, N = sharded x Ψ / (room - whole x Ψ) rounded by `rounding`."""
    room = (1 - RESERVE_FRACTION) * gpu_bytes - activation_bytes
    return {stage: (None if room <= WHOLE_BYTES[stage] * n_params else max(1, rounding(
        (16 - WHOLE_BYTES[stage]) * n_params / (room - WHOLE_BYTES[stage] * n_params))))
        for stage in range(4)}


def _rounded_down(n_params, gpu_bytes, activation_bytes):
    return _by_ratio(n_params, gpu_bytes, activation_bytes, math.floor)


CASES = [  # (model, GPU, activations a rank): a spread of turning points, and the extremes
    dict(n_params=13e9, gpu_bytes=80 * GiB, activation_bytes=12 * GiB),   # 0: -, 13, 5, 4
    dict(n_params=7e9, gpu_bytes=40 * GiB, activation_bytes=8 * GiB),     # 0: -, 41, 7, 4
    dict(n_params=70e9, gpu_bytes=80 * GiB, activation_bytes=20 * GiB),   # only stage 3: 21
    dict(n_params=1.3e9, gpu_bytes=24 * GiB, activation_bytes=4 * GiB),   # 0: -, 2, 2, 2
    dict(n_params=0.35e9, gpu_bytes=24 * GiB, activation_bytes=6 * GiB),  # all fit on one
    dict(n_params=1e9, gpu_bytes=16 * GiB, activation_bytes=15 * GiB),    # activations alone
]
STAGE_CHOICE_HINT = ("whole bytes x Ψ + sharded bytes x Ψ / N + activations <= 0.9 x gpu_bytes:"
                     "\n  the smallest whole N, or None when the whole bytes leave no room")
STAGE_CHOICE_WRONG = (
    (_no_reserve, "keep the reserve free: states + activations must fit in 90% of gpu_bytes "
                  "(projection.RESERVE_FRACTION)"),
    (_no_activations, "the activations take room on every rank, whatever N is"),
    (_all_sharded, "only stage 3 divides all 16 bytes by N: stage 1 keeps parameters and "
                   "gradients whole (4 bytes), stage 2 the parameters (2), stage 0 everything, "
                   "so adding GPUs never makes it fit"),
    (_rounded_down, "N is the ratio rounded up: one GPU fewer leaves the states too big"),
)


def _drawn_kw(rng, kind: str) -> dict:
    """One case of `kind`; "pivot": activations take 60% of the GPU, stage 3 needs 4-64 GPUs,
    its ratio 0.2-0.8 below a whole N (every known mistake moves an answer)."""
    gpu = rng.choice((16, 24, 40, 48, 80, 94, 141, 192)) * GiB
    share = {"pivot": 0.6, "none fit": rng.uniform(0.92, 1.0)}.get(kind, rng.uniform(0.02, 0.4))
    room = (1 - RESERVE_FRACTION) * gpu - int(gpu * share)
    per_room = {"pivot": (rng.randint(4, 64) - rng.uniform(0.2, 0.8)) / 16,  # Ψ / room
                "spread": 1 / rng.uniform(4.5, 15), "stage 3 only": rng.uniform(0.55, 3),
                "one fits all": 1 / rng.uniform(17, 60), "none fit": rng.uniform(0.01, 1)}[kind]
    psi = per_room * (gpu if kind == "none fit" else room)
    return dict(n_params=float(round(psi / 1e6) * 1e6), gpu_bytes=gpu,
                activation_bytes=int(gpu * share))


def stage_choice_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's CASES (rng None), or 6 drawn from `rng`: a pivot case first, two
    spreads of turning points, one where only stage 3 fits, one where every stage fits on
    one GPU, one where the activations leave no room. A drawn case is kept only where the
    closed form, rounded up, gives the exact answer (as the notebook's solution does)."""
    chosen = list(CASES) if rng is None else []
    for kind in ([] if rng is None else
                 ["pivot", "spread", "spread", "stage 3 only", "one fits all", "none fit"]):
        drawn = (_drawn_kw(rng, kind) for _ in range(1000))
        chosen.append(next(kw for kw in drawn if _by_ratio(**kw) == reference_fewest_gpus(**kw)))
    return [Case(kwargs=kw, expected=reference_fewest_gpus(**kw), hint=STAGE_CHOICE_HINT,
                 label=f"({kw['n_params'] / 1e9:g}B params, {kw['gpu_bytes'] / GiB:g} GiB "
                       f"GPUs, {kw['activation_bytes'] / GiB:g} GiB of activations)")
            for kw in chosen]


def check_stage_choice(fn: Callable) -> None:
    """Notebook 07: fn(n_params, gpu_bytes, activation_bytes) -> {stage: the fewest GPUs at
    which its states + activations fit in the GPU less its reserve, or None}, stages 0-3."""
    run_cases("check_stage_choice", fn, stage_choice_cases(None),
              wrong_answers=STAGE_CHOICE_WRONG,
              shows="you can find from which N each stage fits, and so which stage wins at which N")


# ------------------------------------------------------------------ the notebook's claims
# Each raises AssertionError naming what broke; each holds by construction (bytes, counts),
# never by the machine's speed.


def check_held_is_formula_plus_padding(rows: list[dict], psi: int | None = None) -> int:
    """Section 1: at every (N, stage), rank 0 held `memory.model_state_bytes` (fp32 + Adam)
    plus at most the padding of its flat groups (< N elements per group, 16 bytes each:
    parameter, gradient, Adam's m and v), and peaked no lower; with `psi`, the worker counted
    that many parameters (a tied head once). Returns the largest padding seen, in bytes."""
    largest = 0
    for r in rows:
        n, stage = r["world_size"], r["stage"]
        if psi is not None:
            assert r["psi"] == psi, f"Ψ = {r['psi']:,}, expected {psi:,} (an untied head?)"
        formula = memory.model_state_bytes(r["psi"], stage, n, "fp32", "adam")["total"]
        assert r["predicted"] == formula, (r, formula)
        pad = r["held"]["total"] - formula
        assert 0 <= pad <= 16 * n * r["groups"], f"N = {n}, stage {stage}: {pad:,} B over"
        assert r["peak"] >= r["held"]["total"], r
        largest = max(largest, pad)
    return largest


def check_peak_floor(floor: dict, unit_bytes: int, optimizer_bytes: int = 0) -> dict[int, float]:
    """Section 1: what a step holds above its states at N = 1024 (`floor`, {stage: bytes}) is
    `projection.FLOOR_UNITS[stage]` units, to half a unit: the floor `recommend` keeps free;
    stage 0's at least `optimizer_bytes`, Adam's two temporaries (square root, quotient) of an
    OPTIMIZER_CHUNK (4 MiB: a course-MLP unit) of its whole parameters. In units, measured."""
    expected = {**FLOOR_UNITS, 0: max(FLOOR_UNITS[0], optimizer_bytes / unit_bytes)}
    units = {stage: nbytes / unit_bytes for stage, nbytes in floor.items()}
    for stage, u in units.items():
        assert abs(u - expected[stage]) < 0.5, (
            f"stage {stage}: {u:.2f} units above its states, expected {expected[stage]:.2f} "
            f"(FLOOR_UNITS{' or Adam chunk temporaries' if stage == 0 else ''})")
    return units


def check_saved_equals_formula(one_layer: int, formula: int) -> None:
    """Section 1: a layer's saved activations, measured, are the formula's bytes exactly."""
    assert one_layer == formula, f"measured {one_layer:,} B, formula {formula:,} B"


def check_activations_outgrow_states(stage3_held: dict[int, int], activations: int) -> None:
    """Section 1: stage 3's states per rank outweigh a micro-batch's activations on one
    rank and fall below them at N = 64."""
    assert stage3_held[1] > activations, "at N = 1 the model states should dominate"
    assert stage3_held[64] < activations, "at N = 64 the activations should dominate"


def check_projected_bytes(projected: dict, measured: dict, rel: float = 1e-3) -> float:
    """Section 2: the bytes one rank sends per step, projected ({(N, stage): bytes}, ring
    formula) and counted by the bench's ledger on the real collectives, agree to `rel` (the
    flat buffers' padding). Returns the largest relative difference."""
    worst = 0.0
    for key, p in projected.items():
        diff = abs(measured[key] / p - 1) if p else abs(measured[key])
        assert diff <= rel, (f"N = {key[0]}, stage {key[1]}: projected {p:,.0f} B, "
                             f"sent {measured[key]:,} B")
        worst = max(worst, diff)
    return worst


def check_projected_collectives(projected: dict, measured: dict) -> None:
    """Section 2: the projection prices, per step and by kind, the collectives the bench's
    ledger counted on the real stages ({(N, stage): {op: count}} both): as many all-gathers,
    reduce-scatters and all-reduces, none missing, none extra."""
    check_ledger_matches(list(projected), lambda key: dict(measured[key]),
                         lambda key: dict(projected[key]),
                         lambda key: f"N = {key[0]}, stage {key[1]} (the collectives projected)")


def same_launch_error(stage_rounds: list[float], twin_rounds: list[float],
                      comm_s: float) -> tuple[float, tuple[float, float]]:
    """Section 2: how far the projection lands from the measured step, for one stage at one N.

    `stage_rounds` and `twin_rounds` are the median step of each round (seconds) of the stage
    and of its twin that sends nothing, timed in the same launch, round k of one beside round
    k of the other: whatever else loads the machine loads both. projected = the twin's step
    (the stage's compute) + `comm_s` (the priced collectives that do not hide). Returns the
    error of the best rounds, (min(twin) + comm_s) / min(stage) - 1 (the least disturbed of
    each, as the link sweep keeps its fastest batch), and the band of the rounds' errors,
    (twin_k + comm_s) / stage_k - 1, from the lowest to the highest."""
    assert len(stage_rounds) == len(twin_rounds) > 0, (
        f"{len(stage_rounds)} rounds of the stage, {len(twin_rounds)} of its twin: the twin "
        "must be timed in the same rounds")
    each = [(twin + comm_s) / stage - 1 for stage, twin in
            zip(stage_rounds, twin_rounds, strict=True)]
    return (min(twin_rounds) + comm_s) / min(stage_rounds) - 1, (min(each), max(each))


def check_overlap_step_saving(plain_s: float, stepped_s: float, most: float = 0.001) -> float:
    """Going further: stepping bucket by bucket (`overlap_step`) saves time, and no more than
    `most` of the projected step (it can hide only the last reduction, under the other
    buckets' optimizer steps). Returns the share saved."""
    saved = 1 - stepped_s / plain_s
    assert 0 < saved <= most, (f"overlap_step saves {saved:.3%} of a {plain_s:.3f} s step: "
                               f"expected more than nothing and at most {most:.1%}")
    return saved


def check_decision_table(table: dict, gpu_bytes: float) -> None:
    """Section 3: every recommendation that fits leaves the reserve (RESERVE_FRACTION of the
    GPU) free, on top of the peak floor counted in per_rank_bytes; one that does not fit is
    stage 3 with a reason, and never advises checkpointing activations already checkpointed."""
    for key, rec in table.items():
        assert isinstance(rec, Recommendation), (key, rec)
        if rec.fits:
            assert rec.headroom_bytes >= RESERVE_FRACTION * gpu_bytes, (
                f"{key}: stage {rec.stage} leaves {rec.headroom_bytes / GiB:.1f} GiB free")
        else:
            assert rec.stage == 3 and rec.reason.startswith("nothing fits"), (key, rec.reason)
            assert "checkpointing" not in rec.reason, (key, rec.reason)


def check_decision_figure(grid: dict, table: dict) -> None:
    """Section 3's figure: its k = 1 cells are the table's answers where the two meet; at k > 1
    stage 2 only where stage 1 does not fit (stage 2 sends (k+1)Ψ to stage 1's 2Ψ)."""
    for (k, n, gpus), rec in grid.items():
        assert k > 1 or (n, gpus) not in table or rec == table[n, gpus], f"{n:g} on {gpus}"
        if k > 1 and rec.fits and rec.stage == 2:
            assert "stage 1 needs" in rec.reason, f"{n:g} on {gpus}, k = {k}: stage 2"


# torchtitan's llama3_h100_202412 benchmark, Table 1: Llama 3.1 8B, FSDP2, 96 GB H100s at 500 W
TORCHTITAN_8B_TOKENS_PER_S = 5762
PUBLISHED_BAND = 0.25  # the projection must land within 25% of the measurement


def check_against_torchtitan(projected: float, measured: float = TORCHTITAN_8B_TOKENS_PER_S,
                             band: float = PUBLISHED_BAND) -> float:
    """Section 3: the projected tokens/s per GPU of torchtitan's Table 1 configuration lies
    within `band` of its measurement: the FLOP count and the assumed MFU together. Returns
    projected / measured - 1; without attention's FLOPs +37% (tests/test_projection.py)."""
    gap = projected / measured - 1
    assert abs(gap) <= band, (f"projected {projected:,.0f} tokens/s per GPU, measured "
                              f"{measured:,.0f}: {gap:+.0%}, outside ±{band:.0%}")
    return gap


def check_resumed_run(uninterrupted: dict, resumed: dict, tol: float = 1e-6) -> float:
    """Going further: the run saved at stage 3 on 2 ranks and resumed at stage 2 on 3 ranks ends
    where the uninterrupted run ends (same names, every value within `tol`). Returns the
    largest difference."""
    assert set(resumed) == set(uninterrupted), set(resumed) ^ set(uninterrupted)
    worst = 0.0
    for name, values in uninterrupted.items():
        assert len(resumed[name]) == len(values), name
        worst = max([worst, *(abs(a - b) for a, b in zip(values, resumed[name], strict=True))])
    assert worst < tol, f"resumed run differs by {worst:.2e}"
    return worst


def check_consolidated(weights: dict, at_save: dict) -> None:
    """Going further: the consolidated checkpoint equals, tensor for tensor, the full state dict
    the ranks saw at the save."""
    import torch

    assert set(weights) == set(at_save), set(weights) ^ set(at_save)
    for name, values in at_save.items():
        assert torch.equal(weights[name].flatten(), torch.tensor(values)), name


def check_resume_with_extras(with_extras: dict, without_extras: dict,
                             uninterrupted: dict) -> dict:
    """Going further: a run resumed with its extras (scheduler, random state, data position)
    ends equal, value for value, to the run that was never interrupted; resumed without
    them it must differ, or the demonstration shows nothing the extras do."""
    same = {"with": with_extras == uninterrupted, "without": without_extras == uninterrupted}
    assert set(with_extras) == set(uninterrupted), set(with_extras) ^ set(uninterrupted)
    assert same["with"], "resumed with its extras, the run differs from the uninterrupted one"
    assert not same["without"], "resumed without its extras, the run should differ"
    return same


def check_killed_resume(published_step: int, resumed_from: int, published_before_kill: int = 2
                        ) -> None:
    """Going further: a job saving every step was killed while publishing its next save (the new
    step directory complete, its `latest` written, not yet in place). The name must
    still hold the last checkpoint published before the kill, complete, and the new job
    must resume from exactly that step."""
    assert published_step == published_before_kill, (
        f"the name holds step {published_step}, not step {published_before_kill}, the last "
        "one published before the kill")
    assert resumed_from == published_step, (resumed_from, published_step)
