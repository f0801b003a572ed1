"""Notebook 06's claims, each a check: a function that takes what the notebook measured and
raises AssertionError, saying what was expected and what was found, when the claim is false.

Every check states what holds by construction of the stages or of the analysis (an order of
events, counts, bytes, an identity of the categories) or, for the one check on timings
(`check_exposed_matches_removal`), compares with a margin calibrated to hold on a busy
2-core laptop: its docstring says how, and README's "Checks that hold on a busy machine" how
the notebook's timings are taken. tests/test_nb06_checks.py feeds each check a wrong input (a
mutant: communication moved under compute, prefetch off, a leaked unit, a collective missing
from the ledger...) that must fail it, so that none of them passes whatever it is given.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from zero_lab.profiling.analysis import CATEGORIES, breakdown, collective_counts, collectives
from zero_lab.profiling.marks import OPTIMIZER_STEP
from zero_lab.profiling.trace import Event, Trace


def _fail(claim: str, expected, found) -> None:
    raise AssertionError(f"{claim}: expected {expected}, found {found}")


# ------------------------------------------------------------------ the trace's marks


def check_units_marked(names: Iterable[str], depth: int) -> None:
    """A stage-3 step names every unit's forward ("forward / unit k", k < depth)."""
    missing = sorted({f"forward / unit {u}" for u in range(depth)} - set(names))
    if missing:
        _fail("every unit's forward is marked in the step", "none missing", missing)


def check_prefetch_ahead(trace: Trace, step: int, depth: int) -> list[int]:
    """With prefetch, unit k+1's all-gather is issued before unit k's forward begins (without
    it, in unit k+1's own pre-forward hook, after unit k's forward): an order of events on
    one thread, which no timing changes. Returns the units gathered ahead."""
    lo, hi = trace.steps[step]
    first: dict[str, float] = {}
    for e in sorted(trace.events, key=lambda e: e.start):
        if lo <= e.start < hi and e.track == "main" and e.name not in first:
            first[e.name] = e.start
    ahead = [u + 1 for u in range(depth - 1)
             if first.get(f"all-gather / unit {u + 1}", hi) < first.get(f"forward / unit {u}", lo)]
    if ahead != list(range(1, depth)):
        _fail("with prefetch, unit k+1's all-gather is issued before unit k's forward",
              f"units {list(range(1, depth))} gathered ahead", f"units {ahead}")
    return ahead


# ------------------------------------------------------------------ the time categories


def check_categories_sum_to_step(b: dict[str, float], system: str = "") -> None:
    """compute + optimizer + exposed comm + idle = the step window (the categories are a
    partition of the window: no time counted twice, none left out)."""
    parts = sum(b[k] for k in CATEGORIES)
    if abs(parts - b["step"]) > 1e-6 * b["step"]:
        _fail(f"{system}: the four categories sum to the step", f"{b['step']:.1f} us",
              f"{parts:.1f} us")


def check_example_breakdown(b: dict[str, float], expected: dict[str, float]) -> None:
    """A hand-made step gets the categories worked out by hand (exactly)."""
    found = {k: b[k] for k in expected}
    if found != expected:
        _fail("the example's categories", expected, found)


def check_no_communication(b: dict[str, float], system: str = "compute_only") -> None:
    """A system that sends nothing shows no communication in its trace."""
    if b["comm"] != 0:
        _fail(f"{system} has no communication", "0 us", f"{b['comm']:.1f} us")


def check_busy_exceeds_computing(b: dict[str, float], system: str = "") -> None:
    """The "utilisation" a tool reports (the step minus idle) exceeds the share computing by
    exactly the exposed communication: so it is larger whenever anything was exposed."""
    busy, computing = 1 - b["idle"] / b["step"], (b["compute"] + b["optimizer"]) / b["step"]
    if not busy > computing:
        _fail(f"{system}: 'busy' counts exposed communication as busy", "busy > computing",
              f"busy {busy:.1%}, computing {computing:.1%}")


# The A/B check's band for exposed / removed, summed over stages 0-3. On gloo the trace's
# exposed time is an upper bound (analysis.py: gloo's work in flight while the main thread
# runs Python counts as exposed), so the ratio sits above 1. Measured with notebook 06's
# model and recording (medians of 7 steps in turn per rank) on 2 cores, stages 1-2 gathering
# under the next forward (their default from issue 24 to 51): the right analysis gave 1.14 to
# 1.21 idle (3 runs) and 1.12 to 1.49 with two to four busy processes beside it (24 runs,
# 1.5 to 3.0 per core), 1.67 once in 11 soak runs (outside the first band, 0.7-1.6,
# measured when stages 1-2 gathered after the step), and 2.25 once with another notebook's
# two ranks running beside the two busy processes (3 per core). An analysis that counts the
# hidden communication as exposed gave 2.14 to 2.57 in the same runs and 1.79 on the
# quietest run of the older stages: no band separates it from the right one on a busy
# machine, so the check's second condition is what fails it, at any load. The band fails an
# analysis that drops the exposed part (0) or loses most of it, and one that adds nested
# events' durations instead of taking their union (several times the saving).
# Notebook 06 takes stages 1-2 with overlap_param_gather=True even since it is off by default
# (issue 51): gathering in the step they hide next to nothing (stage 1: 2% of its
# communication), the sum's hidden part shrinks, and the two conditions lose their margin. In
# a 25-run soak beside two busy processes, with stages 1-2 gathering in the step, one run gave
# 0.75 with counting hidden closer to 1 (condition 2 failed); the runs above had them hidden.
AB_LOW, AB_HIGH = 0.7, 3.0
# ... and for how busy a machine. At 7-9 per core (other programs' tests beside the
# recording) the right analysis reached 1.61, 1.68 and 1.97 (stages 1-2 gathering after the
# step): there a core runs four programs in turn, a collective's thread waits its turn after
# every message, and that wait is counted exposed, while the twin sends nothing and never
# waits. Two busy processes beside a 2-rank run make about 3 per core with the notebook's
# kernel and nbval. Above AB_LOAD_PER_CORE the check says the machine was too busy to judge,
# and does not.
AB_LOAD_PER_CORE = 4.0
# The load average lags and counts every runnable thread alike. In CI, pytest's multi-rank
# launches run beside the notebook, starting and stopping within seconds; there one run
# gave 0.67 (258 ms exposed for 386 ms saved) at about 2 per core, and the band's second
# condition is weak below 1. So the check also asks the ranks how long their threads waited
# for a core while each stage's A/B steps were recorded (profiling/run_queue.py), and takes
# the most any rank waited in any stage's recording (`most_waiting`, seconds per second).
# Measured on 2 cores, notebook 06's 2 ranks: idle 0.26-0.30 (the A/B alone); beside two busy
# processes 0.49-0.63 in a 50-run soak of the notebook (every run judged: ratios 0.87-1.15,
# counting hidden 1.38-2.14) and 0.52-0.61 in 6 runs of the A/B alone; beside pytest's
# launches in a loop (tests/test_stages.py, test_partition.py) 0.74-0.80 in 4 notebook runs
# (ratios 0.84-1.19; at 0.84 closer to 1 than counting hidden, 1.28, by only 0.07 in log) and
# 0.72-0.86 in 6 runs of the A/B alone, at 2.1-3.0 per core.
AB_WAITING = 0.65


def most_waiting(ranks: list[dict], systems: Iterable[str]) -> float | None:
    """The longest any rank's threads waited for a core, per second, while the A/B steps of
    `systems` were recorded (each rank's report: systems -> name -> "waiting_for_cores");
    None where the ranks could not tell (not Linux)."""
    shares = [r["systems"][s]["waiting_for_cores"] for r in ranks for s in systems]
    return None if None in shares else max(shares)


def exposed_removed_ratio(exposed: dict[str, float], removed: dict[str, float]) -> float:
    """Summed exposed communication / summed time removing it saved, over the systems of
    `exposed` (see check_exposed_matches_removal)."""
    return sum(exposed.values()) / sum(removed[s] for s in exposed)


def check_exposed_matches_removal(exposed: dict[str, float], removed: dict[str, float],
                                  hidden: dict[str, float], load_per_core: float = 0.0,
                                  waiting: float | None = None, low: float = AB_LOW,
                                  high: float = AB_HIGH) -> float | None:
    """The analysis's exposed communication accounts for what the step loses to its
    communication. Per system s (microseconds): `exposed[s]` and `hidden[s]` (communication
    in flight under compute) from the trace, `removed[s]` = step(s) - step(s with
    transport="none"), each a median over steps taken in turn. Summed over the systems:

    1. exposed / removed lies in [low, high]. The two need not be equal, in either direction:
       hidden communication is not free (gloo's threads take the cores the compute needs), so
       removing it can save more than the exposed time; and exposed time includes waiting for
       the slowest rank, which removing communication does not save, and on gloo the trace can
       over-count it (a direct exchange's message counts as in flight until its wait; see
       analysis.py), so it can also exceed the saving. Only the projection at ideal overlap is
       a lower bound; a measured exposed time is not.
    2. exposed explains the removal better than exposed + hidden would: |log(exposed /
       removed)| < |log((exposed + hidden) / removed)|. The hidden part may cost something,
       but if the saving were closer to all of it counted as exposed, the analysis would have
       called hidden what the step in fact waited for.

    Returns the ratio; None, judging nothing, when the machine was busier than the band was
    measured for: `load_per_core`, the load average per core while the steps were recorded,
    above AB_LOAD_PER_CORE, or `waiting` (`most_waiting`: the longest any rank's threads
    waited for a core, per second of the recording) above AB_WAITING.

    It fails an analysis that counts communication hidden under compute as exposed (too
    much, and then nothing is left hidden: 2 cannot hold), one that loses exposed
    communication (too little), or counts far too much. It cannot see how the rest of the
    step is divided between compute, optimizer and idle, nor any one system's number.

    How it was calibrated to hold on a busy 2-core laptop (notebook 06's model; the measured
    ratios are in the comments above AB_LOW and AB_LOAD_PER_CORE):

    - Summed over stages 0-3: one stage's difference on two busy cores is too noisy alone.
      Stages 1-2 with overlap_param_gather=True: condition 2 needs communication hidden at
      every stage, and gathering in the step they hide next to none (see above AB_LOW).
    - Medians, not minima: `removed` subtracts two steps, and the difference of two fastest
      steps is one lucky step on either side (an earlier version used minima and left its
      band in one soak run in five). Each side is the median of 7 steps per rank, a step of
      the stage and a step of its twin in turn, so load falls on both alike.
    - Both sides profiled: the profiler slows gloo's communication more than compute, so the
      trace's exposed time is the profiled program's (the notebook prints the unprofiled
      saving beside it).
    - The band [0.7, 3.0]: the right analysis gave 1.14-1.21 idle and 1.12-1.49 with two to
      four busy processes beside it, 1.67 once in a soak and 2.25 once with another notebook
      running too; counting the hidden part as exposed gave 2.14-2.57, inside the band, so
      condition 2, not the band, is what fails that analysis at any load.
    - The load limit, 4 per core: at 7-9 per core the right analysis reached 1.61-1.97 (a
      collective's thread waits its turn on a crowded core after every message, which the
      trace counts as exposed, while the twin never waits).
    - The waiting limit, 0.65 s a second: beside two busy processes a rank's threads waited
      for a core at most 0.49-0.63 s a second of a stage's recording (50-run soak, all
      judged); beside other programs' multi-rank launches (CI's pytest) 0.72-0.86, where the
      ratio fell to 0.67 once.
    - Soaked: it must pass 50 runs in a row beside two busy processes (`make soak NB=06
      RUNS=50 LOAD=2`); tests/test_nb06_checks.py feeds it the wrong analyses on recorded
      numbers.
    """
    total, saved = sum(exposed.values()), sum(removed[s] for s in exposed)
    ratio = total / saved if saved > 0 else float("inf")
    if load_per_core > AB_LOAD_PER_CORE or (waiting is not None and waiting > AB_WAITING):
        return None
    claim = ("exposed communication = what removing the communication saves, summed over "
             f"{', '.join(exposed)}")
    if not low <= ratio <= high:
        _fail(f"{claim} (exposed / saved from {low} to {high})", f"{saved / 1e3:.1f} ms saved",
              f"{total / 1e3:.1f} ms exposed ({ratio:.2f})")
    counted = (total + sum(hidden[s] for s in exposed)) / saved
    if not abs(math.log(ratio)) < abs(math.log(counted)):
        _fail(f"{claim}, closer than counting the hidden communication too",
              f"|log {ratio:.2f}| < |log {counted:.2f}|", "not closer")
    return ratio


# ------------------------------------------------------------------ collectives


def check_collectives_match_ledger(trace: Trace, ledger: list[dict], system: str = "") -> None:
    """The trace's collectives are the ledger's, op by op and element by element."""
    found = sorted((c["op"], c["numel"]) for c in collectives(trace))
    expected = sorted((x["op"], x["numel"]) for x in ledger)
    if found != expected:
        _fail(f"{system}: the trace's collectives are the ledger's",
              dict(Counter(op for op, _ in expected)), dict(Counter(op for op, _ in found)))


def check_collective_counts(trace: Trace, expected: dict[str, int], system: str = "",
                            step: int = 0) -> None:
    """The collectives of one step, counted per op, are `expected`."""
    counts = collective_counts(trace, step=step)
    if counts != expected:
        _fail(f"{system}: collectives in one step", expected, counts)


# ------------------------------------------------------------------ the seed blog's timer


def step_window_share(trace: Trace, step: int) -> tuple[float, float, float]:
    """(exposed share inside the step's optimizer-step call, exposed share of the whole
    step, the call's length in us): the seed blog's measurement and the right one."""
    lo, hi = trace.steps[step]
    call = next(e for e in trace.events if e.name == OPTIMIZER_STEP and lo <= e.start < hi)
    inside, whole = breakdown(trace.events, (call.start, call.end)), breakdown(trace.events,
                                                                               (lo, hi))
    return inside["exposed_comm"] / inside["step"], whole["exposed_comm"] / whole["step"], \
        call.duration


def check_window_inflates_share(trace: Trace, system: str = "blog_zero1") -> None:
    """When every collective of a step sits inside its optimizer-step call, the share of
    communication in that call exceeds its share of the whole step, step by step: the call
    holds all the communication and only part of the compute (forward and backward are
    outside it)."""
    for k in range(len(trace.steps)):
        inside, whole, _ = step_window_share(trace, k)
        if not inside > whole:
            _fail(f"{system} step {k}: communication's share of step() exceeds its share of "
                  "the step", f"> {whole:.1%}", f"{inside:.1%}")


# ------------------------------------------------------------------ memory


def absolute_curve(held: int, curve: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """A memory curve in bytes this rank holds: the model states held when the step began
    plus what was allocated since (the profiler counts only what it saw allocated)."""
    return [(t, held + b) for t, b in curve]


def check_memory_ordering(curves: dict[str, list[tuple[float, int]]], held_order: list[str],
                          peak_orders: list[list[str]]) -> dict[str, tuple[int, int]]:
    """Memory over one step (absolute curves): no system in `held_order` ends the step
    holding more than at its start (whatever a step gathers or allocates, it frees; it may
    end a little lower, having freed a tensor of the step before, such as its batch), and
    each holds less at the start than the one before it; along each list of `peak_orders`,
    each peaks lower than the one before it. Returns {system: (start, peak)} in bytes."""
    seen = {s: (c[0][1], max(b for _, b in c)) for s, c in curves.items()}
    for s in held_order:
        if curves[s][-1][1] > curves[s][0][1]:
            _fail(f"{s} frees what its step allocated",
                  f"<= {curves[s][0][1]:,} bytes at the end", f"{curves[s][-1][1]:,}")
    chains = [(held_order, 0, "holds less at the step's start")]
    chains += [(order, 1, "peaks lower") for order in peak_orders]
    for order, i, what in chains:
        for a, b in zip(order, order[1:], strict=False):
            if not seen[b][i] < seen[a][i]:
                _fail(f"{b} {what} than {a}", f"< {seen[a][i]:,} bytes", f"{seen[b][i]:,}")
    return seen


# ------------------------------------------------------------------ exercise 1 on a trace


def check_same_exposed(mine: float, events: list[Event], window: tuple[float, float]) -> None:
    """The learner's exposed communication on a real step equals the analysis's."""
    expected = breakdown(events, window)["exposed_comm"]
    if abs(mine - expected) > 1e-6 * (window[1] - window[0]):
        _fail("your exposed communication on this step equals the analysis's",
              f"{expected:.1f} us", f"{mine:.1f} us")

