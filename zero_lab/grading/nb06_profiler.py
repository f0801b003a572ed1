"""Notebook 06's checks: reading a trace. Plain input -> output on hand-made event lists,
against `zero_lab.profiling` (the analysis the notebook runs on real traces).

The wrong answers are the shortcuts that give plausible numbers: adding durations instead of
uniting intervals (nested ops counted twice, two buckets in flight counted twice), forgetting
the step window, taking all communication as exposed; for the unit, the single longest wait,
waits without the issuing call, or the longest span in flight.

Each exercise's cases come from `<exercise>_cases(rng)`: rng None gives the notebook's, a
`random.Random` event lists drawn from it with the same builders (for the batch grader,
grading/hidden.py).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

from zero_lab.grading.framework import Case, run_cases
from zero_lab.profiling import intervals as iv
from zero_lab.profiling.analysis import blocking_time, unit_of
from zero_lab.profiling.marks import WAIT
from zero_lab.profiling.trace import Event


def _spans(events, kind):
    return [(e.start, e.end) for e in events if e.kind == kind]


# ----------------------------------------------------------------------------- exercise 1


def reference_exposed(events: list[Event], window: tuple[float, float]) -> float:
    """Microseconds inside `window` when communication was in flight and no compute ran."""
    comm = iv.clip(_spans(events, "comm"), window)
    return iv.total(iv.subtract(comm, _spans(events, "compute")))


def _summed_durations(events, window):
    """Durations added up: nested ops and simultaneous buckets counted more than once."""
    lo, hi = window

    def inside(e):
        return max(0.0, min(e.end, hi) - max(e.start, lo))

    comm = sum(inside(e) for e in events if e.kind == "comm")
    hidden = sum(max(0.0, min(c.end, k.end, hi) - max(c.start, k.start, lo))
                 for c in events if c.kind == "comm" for k in events if k.kind == "compute")
    return comm - hidden


def _no_window(events, window):
    return iv.total(iv.subtract(_spans(events, "comm"), _spans(events, "compute")))


def _all_comm(events, window):
    return iv.total(iv.clip(_spans(events, "comm"), window))


def _step_minus_compute(events, window):
    return (window[1] - window[0]) - iv.total(iv.clip(_spans(events, "compute"), window))


def _exposed_case(seed: int) -> tuple[list[Event], tuple[float, float]]:
    """The notebook's step of seed `seed` (see _exposed_step)."""
    return _exposed_step(random.Random(seed))


def _exposed_step(rng: random.Random, layers: int = 4, buckets: int = 3
                  ) -> tuple[list[Event], tuple[float, float]]:
    """A step of 1000 us: forward ops with nested children, buckets in flight that overlap
    each other and backward compute, one collective that starts before the window."""
    events, t = [], 0.0
    for _ in range(layers):  # forward: aten::linear > aten::addmm, then a relu
        d = rng.uniform(40, 80)
        events += [Event("aten::linear", t, t + d, "compute"),
                   Event("aten::addmm", t + 2, t + d - 2, "compute"),
                   Event("aten::relu", t + d, t + d + 5, "compute")]
        t += d + 5 + rng.uniform(0, 10)
    for b in range(buckets):  # backward: compute, and a bucket sent while the next one computes
        d = rng.uniform(60, 120)
        events.append(Event("aten::mm", t, t + d, "compute"))
        start = t + d
        events.append(Event(f"all-reduce / bucket {b}", start, start + rng.uniform(80, 200),
                            "comm"))
        t = start + rng.uniform(5, 20)
    events.append(Event("optimizer step", t + 60, t + 160, "compute"))
    events.append(Event("all-gather / bucket 0", -50, 30, "comm"))  # began last step
    return events, (0.0, 1000.0)


def _hand_events() -> list[Event]:
    """The notebook's hand-made case (a new list each time: a learner may sort it in place)."""
    return [Event("aten::linear", 0, 50, "compute"), Event("aten::addmm", 5, 45, "compute"),
            Event("all-reduce / bucket 0", 30, 90, "comm"),
            Event("all-reduce / bucket 1", 60, 100, "comm"), Event("aten::mm", 80, 95, "compute")]


UNITE_HINT = ("unite the intervals of each kind first: nested ops and buckets in flight at the "
              "same time must count once")
EXPOSED_HINT = "exposed = (union of communication) minus (union of compute), inside the window"


def _shifted(events: list[Event], by: float) -> list[Event]:
    return [Event(e.name, e.start + by, e.end + by, e.kind) for e in events]


def _drawn_hand_case(rng: random.Random) -> tuple[list[Event], tuple[float, float]]:
    """The hand-made case's shape with drawn times: addmm nested in linear, bucket 0 issued under
    linear, bucket 1 overlapping it, an mm under both; the window ends after them."""
    a = rng.uniform(40, 60)
    b0 = (a - rng.uniform(10, 25), a + rng.uniform(30, 50))
    b1 = (b0[1] - rng.uniform(15, 25), b0[1] + rng.uniform(5, 20))
    mm = b1[0] + rng.uniform(1, 5)
    events = [Event("aten::linear", 0, a, "compute"),
              Event("aten::addmm", rng.uniform(2, 8), a - rng.uniform(2, 8), "compute"),
              Event("all-reduce / bucket 0", *b0, "comm"),
              Event("all-reduce / bucket 1", *b1, "comm"),
              Event("aten::mm", mm, mm + rng.uniform(5, 12), "compute")]
    off = rng.uniform(0, 5e6)
    return _shifted(events, off), (off, off + b1[1] + rng.uniform(5, 30))


def _drawn_step(rng: random.Random) -> tuple[list[Event], tuple[float, float]]:
    """_exposed_step with 3-6 layers and 2-4 buckets, at a drawn time, in a window that ends
    at 85-110% of the step's last event."""
    events, _ = _exposed_step(rng, rng.randint(3, 6), rng.randint(2, 4))
    end = max(e.end for e in events) * rng.uniform(0.85, 1.1)
    off = rng.uniform(0, 5e6)
    return _shifted(events, off), (off, off + end)


def exposed_communication_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's 6 cases (rng None: the hand-made one, the steps of seeds 0-4), or 6
    drawn from `rng`: the hand-made shape with drawn times, then 5 drawn steps."""
    if rng is None:
        hand, hand_window = _hand_events(), (0, 120)
        steps = [(f"seed {seed}", *_exposed_case(seed)) for seed in range(5)]
    else:
        hand, hand_window = _drawn_hand_case(rng)
        steps = [("drawn", *_drawn_step(rng)) for _ in range(5)]
    lo, hi = hand_window
    cases = [Case(args=(hand, hand_window), expected=reference_exposed(hand, hand_window),
                  label=f"(5 events: nested compute, two buckets overlapping, window "
                        f"{lo:.0f}-{hi:.0f})", hint=UNITE_HINT)]
    cases += [Case(args=(events, window), expected=reference_exposed(events, window),
                   label=f"(a {len(events)}-event step, {what})", hint=EXPOSED_HINT)
              for what, events, window in steps]
    return cases


EXPOSED_WRONG = (
    (_summed_durations, "you added durations: a nested op (addmm inside linear) or two "
                        "buckets in flight together were counted twice; unite intervals"),
    (_no_window, "count only what lies inside the step's window: a collective that began "
                 "in the previous step is partly outside it"),
    (_all_comm, "that is all the communication; subtract the time compute was running "
                "beside it (that part is hidden, not exposed)"),
    (_step_minus_compute, "that is everything that is not compute, idle time included; "
                          "exposed time must have communication in flight"),
)


def check_exposed_communication(fn: Callable) -> None:
    """Notebook 06: fn(events, window) -> microseconds of exposed communication in window."""
    run_cases("check_exposed_communication", fn, exposed_communication_cases(None),
              wrong_answers=EXPOSED_WRONG,
              shows="you can read from a trace how long communication held the step up")


# ----------------------------------------------------------------------------- exercise 2


def reference_most_exposed_unit(events: list[Event]) -> str:
    """The unit whose all-gathers held the training thread longest (issue + waits, summed
    over forward and backward)."""
    held = {name: t for name, t in blocking_time(events).items()
            if name.startswith("all-gather / ")}
    return unit_of(max(held, key=held.get))


def _longest_single_wait(events):
    waits = [e for e in events if e.name.startswith(WAIT + "all-gather")]
    return unit_of(max(waits, key=lambda e: e.duration).name)


def _waits_only(events):
    held: dict[str, float] = defaultdict(float)
    for e in events:
        if e.name.startswith(WAIT + "all-gather"):
            held[unit_of(e.name)] += e.duration
    return max(held, key=held.get)


def _longest_in_flight(events):
    """Issue to end of wait: the time in flight, most of it possibly hidden."""
    held: dict[str, float] = defaultdict(float)
    open_at: dict[str, float] = {}
    for e in sorted(events, key=lambda e: e.start):
        if e.name.startswith("all-gather / "):
            open_at[e.name] = e.start
        elif e.name.startswith(WAIT + "all-gather"):
            name = e.name[len(WAIT):]
            held[unit_of(name)] += e.end - open_at.pop(name, e.start)
    return max(held, key=held.get)


def _any_collective(events):
    held = blocking_time(events)
    totals: dict[str, float] = defaultdict(float)
    for name, t in held.items():
        totals[unit_of(name)] += t
    return max(totals, key=totals.get)


def _unit_case(seed: int, units: int = 6) -> list[Event]:
    """The notebook's stage-3 step of seed `seed` (see _unit_step)."""
    return _unit_step(random.Random(seed), units)


def _unit_step(rng: random.Random, units: int = 6, t: float = 0.0) -> list[Event]:
    """A stage-3 step from time `t`: each unit gathered in forward and backward (an issuing
    call, compute that may hide part of it, then its wait), and reduce-scattered in backward.
    Four decoy units are built so that each shortcut above points at one of them, not at
    the answer."""
    target, one_long_wait, long_waits, long_flight, big_rs = rng.sample(range(units), 5)
    events = []
    for phase in ("forward", "backward"):
        for u in (range(units) if phase == "forward" else reversed(range(units))):
            issue, wait, hidden = rng.uniform(2, 6), rng.uniform(5, 15), rng.uniform(20, 40)
            if u == target:  # slow to issue and to arrive, twice: the most in total
                issue, wait = 40 + rng.uniform(0, 5), 40 + rng.uniform(0, 5)
            elif u == one_long_wait:
                issue, wait = 1, (110 if phase == "forward" else 5)
            elif u == long_waits:
                issue, wait = 1, 60 + rng.uniform(0, 3)
            elif u == long_flight and phase == "backward":
                hidden = 500
            events.append(Event(f"all-gather / unit {u}", t, t + issue, "comm"))
            events.append(Event("aten::mm", t + issue, t + issue + hidden, "compute"))
            t += issue + hidden
            events.append(Event(f"{WAIT}all-gather / unit {u}", t, t + wait, "comm"))
            t += wait
            events.append(Event(f"{phase} / unit {u}", t, t + 30, "mark"))
            t += 30
            if phase == "backward":
                rs = 220 if u == big_rs else rng.uniform(5, 10)
                events.append(Event(f"reduce-scatter / unit {u}", t, t + rs, "comm"))
                t += rs
    return events


UNIT_HINT = ("add up, per unit, the time of its all-gather marks and of their 'wait / ' marks, "
             "in forward and backward")
UNIT_WRONG = (
    (_longest_single_wait, "that unit has the single longest wait; a unit is gathered twice "
                           "(forward and backward): add its times up"),
    (_waits_only, "issuing the all-gather holds the thread too (gloo's isend may write the "
                  "bytes right there): count the all-gather marks, not only the waits"),
    (_longest_in_flight, "from issue to the end of the wait is the time in flight; the compute "
                         "in between hid part of it. Count only the marks"),
    (_any_collective, "count the all-gathers only: a unit's reduce-scatter is another "
                      "collective"),
)


def most_exposed_unit_cases(rng: random.Random | None = None) -> list[Case]:
    """The notebook's 6 cases (rng None: the steps of seeds 0-5, 6 units), or 6 steps drawn
    from `rng`, of 5-12 units each, starting at a drawn time."""
    if rng is None:
        steps = [(f"seed {seed}", _unit_case(seed)) for seed in range(6)]
    else:
        steps = [("drawn", _unit_step(rng, rng.randint(5, 12), rng.uniform(0, 5e6)))
                 for _ in range(6)]
    return [Case(args=(events,), expected=reference_most_exposed_unit(events),
                 label=f"(a stage-3 step of {len(events)} events, {what})", hint=UNIT_HINT)
            for what, events in steps]


def check_most_exposed_unit(fn: Callable) -> None:
    """Notebook 06: fn(events) -> "unit k", the unit whose all-gathers held the training
    thread longest in the step (issuing + waiting, forward and backward together)."""
    run_cases("check_most_exposed_unit", fn, most_exposed_unit_cases(None),
              wrong_answers=UNIT_WRONG,
              shows="you can find in a trace the unit whose gathers cost the step the most")
