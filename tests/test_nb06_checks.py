"""Negative controls for notebook 06's checks (zero_lab.profiling.checks): each check passes
on a right input and fails on a mutant, a deliberately wrong one (communication moved under
compute, prefetch off, a leaked unit, a collective missing from the ledger, ...). Hand-made
traces only: no launch, so these run in a blink. The same checks on real traces are in
tests/test_profiling.py."""

from __future__ import annotations

import ast
import json
import re

import pytest

from zero_lab.grading import nb06_profiler as nb06
from zero_lab.launch.paths import NOTEBOOKS
from zero_lab.profiling import checks
from zero_lab.profiling.analysis import breakdown
from zero_lab.profiling.marks import OPTIMIZER_STEP
from zero_lab.profiling.trace import Event, Trace

NB06 = NOTEBOOKS / "06_profiler_analysis.ipynb"


def _trace(events, steps=((0.0, 1000.0),), world_size=2) -> Trace:
    return Trace(rank=0, world_size=world_size, events=list(events), steps=list(steps),
                 memory=[], timeline="cpu")


def _fails(check, *args, match: str | None = None, **kwargs) -> None:
    with pytest.raises(AssertionError, match=match):
        check(*args, **kwargs)


# ----------------------------------------------------------------------- the notebook itself


def _code_cells() -> list[str]:
    cells = json.loads(NB06.read_text())["cells"]
    return [c["source"] if isinstance(c["source"], str) else "".join(c["source"])
            for c in cells if c["cell_type"] == "code"]


def test_the_notebook_asserts_only_through_named_checks():
    """No bare `assert` in notebook 06 (so none compares two timings unseen): every claim
    goes through a function of zero_lab.profiling.checks, which this file feeds a mutant."""
    for source in _code_cells():
        tree = ast.parse(source)
        bare = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
        assert not bare, f"a bare assert in notebook 06:\n{source}"


def test_every_check_the_notebook_calls_has_a_mutant_here():
    called = {m for source in _code_cells() for m in re.findall(r"checks\.(check_\w+)", source)}
    assert len(called) >= 10
    here = open(__file__).read()
    for name in sorted(called):
        assert re.search(rf"def test_{name.removeprefix('check_')}\w*mutant", here) or \
            re.search(rf"_fails\(checks\.{name}\b", here), f"{name} has no negative control"


# ----------------------------------------------------------------------- marks and prefetch


def test_units_marked_mutant_with_a_unit_missing():
    names = [f"forward / unit {u}" for u in range(6)] + ["optimizer step"]
    checks.check_units_marked(names, 6)
    _fails(checks.check_units_marked, [n for n in names if n != "forward / unit 2"], 6,
           match="forward / unit 2")


def _stage3_step(prefetch: bool, depth: int = 4) -> Trace:
    """Forward of a stage-3 step: each unit gathered then computed; with prefetch, unit
    u+1's all-gather is issued before unit u's forward."""
    events, t = [Event("all-gather / unit 0", 0, 2, "comm")], 3.0
    for u in range(depth):
        if prefetch and u + 1 < depth:
            events.append(Event(f"all-gather / unit {u + 1}", t, t + 2, "comm"))
            t += 3
        events.append(Event(f"forward / unit {u}", t, t + 10, "mark"))
        t += 11
        if not prefetch and u + 1 < depth:
            events.append(Event(f"all-gather / unit {u + 1}", t, t + 2, "comm"))
            t += 3
    return _trace(events, steps=[(0, t + 1)])


def test_prefetch_ahead_mutant_with_prefetch_off():
    assert checks.check_prefetch_ahead(_stage3_step(prefetch=True), 0, 4) == [1, 2, 3]
    _fails(checks.check_prefetch_ahead, _stage3_step(prefetch=False), 0, 4,
           match=r"found units \[\]")


def test_prefetch_ahead_mutant_with_one_unit_gathered_late():
    trace = _stage3_step(prefetch=True)
    late = [e for e in trace.events if e.name != "all-gather / unit 2"]
    late.append(Event("all-gather / unit 2", 200, 201, "comm"))
    _fails(checks.check_prefetch_ahead, _trace(late, trace.steps), 0, 4, match=r"units \[1, 3\]")


# ----------------------------------------------------------------------- categories

EXAMPLE = [Event("aten::linear (forward)", 0, 30, "compute"),
           Event("aten::mm (backward)", 30, 60, "compute"),
           Event("all-reduce in flight", 40, 75, "in_flight", "gloo thread"),
           Event("wait / all-reduce", 60, 75, "comm"),
           Event("optimizer step", 78, 95, "optimizer"), Event("aten::add_", 79, 94, "compute")]
EXPECTED = {"compute": 60, "optimizer": 15, "exposed_comm": 15, "idle": 10, "overlapped_comm": 20}


def _comm_moved_under_compute(events):
    """The mutant trace: the collective runs entirely under backward and nobody waits."""
    return [e for e in events if e.kind not in ("in_flight", "comm")] + \
        [Event("all-reduce in flight", 35, 55, "in_flight", "gloo thread")]


def test_example_breakdown_mutant_with_communication_under_compute():
    checks.check_example_breakdown(breakdown(EXAMPLE, (0, 100)), EXPECTED)
    _fails(checks.check_example_breakdown, breakdown(_comm_moved_under_compute(EXAMPLE),
                                                     (0, 100)), EXPECTED)


def test_example_breakdown_mutant_analysis_counting_hidden_as_exposed():
    b = breakdown(EXAMPLE, (0, 100))
    wrong = {**b, "exposed_comm": b["exposed_comm"] + b["overlapped_comm"]}
    _fails(checks.check_example_breakdown, wrong, EXPECTED, match="exposed_comm")


def test_categories_sum_to_step_mutant_counting_hidden_twice():
    b = breakdown(EXAMPLE, (0, 100))
    checks.check_categories_sum_to_step(b)
    _fails(checks.check_categories_sum_to_step,
           {**b, "exposed_comm": b["exposed_comm"] + b["overlapped_comm"]}, "stage0",
           match="stage0: the four categories sum to the step")


def test_no_communication_mutant_with_a_collective():
    alone = [e for e in EXAMPLE if e.kind not in ("in_flight", "comm")]
    checks.check_no_communication(breakdown(alone, (0, 100)))
    _fails(checks.check_no_communication, breakdown(EXAMPLE, (0, 100)), match="compute_only")


def test_busy_exceeds_computing_mutant_with_all_communication_hidden():
    checks.check_busy_exceeds_computing(breakdown(EXAMPLE, (0, 100)))
    hidden = breakdown(_comm_moved_under_compute(EXAMPLE), (0, 100))
    assert hidden["exposed_comm"] == 0 and hidden["overlapped_comm"] == 20
    _fails(checks.check_busy_exceeds_computing, hidden, "stage3", match="busy > computing")


# ----------------------------------------------------------------------- the A/B check

# One run of notebook 06's section 3 on 2 cores beside other work (load average 15; ms, each
# a median over 7 steps taken in turn, averaged over the ranks): per stage, what removing
# the communication saved, and the exposed and hidden communication the trace reports.
MEASURED = {"stage0": (72.7, 60.8, 41.6), "stage1": (71.8, 103.4, 10.4),
            "stage2": (19.2, 68.4, 193.0), "stage3": (106.0, 153.5, 150.7)}


def _ab(exposed_of, hidden_of=lambda exposed, hidden: hidden):
    """(exposed, removed, hidden) in microseconds, as an analysis `exposed_of` would report
    them from MEASURED."""
    removed = {s: v[0] * 1e3 for s, v in MEASURED.items()}
    exposed = {s: exposed_of(v[1], v[2]) * 1e3 for s, v in MEASURED.items()}
    hidden = {s: hidden_of(v[1], v[2]) * 1e3 for s, v in MEASURED.items()}
    return exposed, removed, hidden


def test_exposed_matches_removal_accepts_the_measurement():
    ratio = checks.check_exposed_matches_removal(*_ab(lambda exposed, hidden: exposed))
    assert ratio == pytest.approx(386.1 / 269.7, abs=0.005)


# A run of this session's calibration with two busy processes beside it (2.0 per core; ms:
# removed, exposed, hidden per stage; stages 1-2 gathering under the next forward).
UNDER_LOAD = {"stage0": (28.5, 24.2, 19.1), "stage1": (17.1, 23.1, 12.8),
              "stage2": (14.7, 22.1, 36.0), "stage3": (28.6, 59.7, 31.9)}


def test_exposed_matches_removal_holds_where_the_first_band_failed():
    """The soak run that left the first band (0.7-1.6): 125.7 ms exposed for 75.4 ms saved,
    the right analysis with stages 1-2's gather in flight into the next step. It failed
    before (AB_HIGH was 1.6)."""
    assert checks.AB_LOW <= 125.7 / 75.4 <= checks.AB_HIGH
    assert checks.AB_LOW <= 181.2 / 80.5 <= checks.AB_HIGH  # 2.25, another notebook beside
    removed, exposed, hidden = ({s: v[i] * 1e3 for s, v in UNDER_LOAD.items()} for i in range(3))
    ratio = checks.check_exposed_matches_removal(exposed, removed, hidden, load_per_core=2.0)
    assert ratio == pytest.approx(1.45, abs=0.005)
    _fails(checks.check_exposed_matches_removal,  # its mutant: the hidden part counted
           {s: exposed[s] + hidden[s] for s in exposed}, removed, dict.fromkeys(exposed, 0.0),
           load_per_core=2.0, match=r"\|log 2\.57\|")


def test_exposed_matches_removal_mutant_counting_hidden_as_exposed():
    # that analysis has nothing left hidden
    _fails(checks.check_exposed_matches_removal,
           *_ab(lambda exposed, hidden: exposed + hidden, lambda exposed, hidden: 0.0),
           match="removing the communication")


def test_exposed_matches_removal_mutant_dropping_exposed():
    _fails(checks.check_exposed_matches_removal, *_ab(lambda exposed, hidden: 0.0),
           match=r"0\.0 ms exposed")


def test_exposed_matches_removal_mutant_losing_half_the_exposed():
    _fails(checks.check_exposed_matches_removal, *_ab(lambda exposed, hidden: exposed / 2.5),
           match=r"\(0\.57\)")


def test_exposed_matches_removal_mutant_booking_exposed_time_as_hidden():
    """Inside the band, but the part the analysis calls hidden is what the step lost: an
    analysis that moved exposed communication under compute (0.75 -> 0.95 with it)."""
    exposed, removed, hidden = {"stage2": 75.0}, {"stage2": 100.0}, {"stage2": 20.0}
    _fails(checks.check_exposed_matches_removal, exposed, removed, hidden,
           match=r"closer than counting the hidden communication too: expected \|log 0\.75\| "
                 r"< \|log 0\.95\|")
    assert checks.check_exposed_matches_removal(exposed, removed, {"stage2": 60.0}) == 0.75


def test_exposed_matches_removal_mutant_adding_nested_durations():
    """An analysis that adds the durations of nested events (a wait holding gloo's ops)
    instead of taking their union counts the exposed time over: here 2.2 x, 3.19."""
    removed, exposed, hidden = ({s: v[i] * 1e3 for s, v in UNDER_LOAD.items()} for i in range(3))
    _fails(checks.check_exposed_matches_removal, {s: 2.2 * exposed[s] for s in exposed},
           removed, hidden, load_per_core=2.0, match=r"\(3\.19\)")


def test_exposed_matches_removal_judges_only_the_loads_its_band_was_measured_for():
    """A wrong analysis (MEASURED with the hidden part counted, 2.90): judged at the soak's
    load it fails; above AB_LOAD_PER_CORE it is not judged."""
    outside = _ab(lambda exposed, hidden: exposed + hidden, lambda exposed, hidden: 0.0)
    assert checks.check_exposed_matches_removal(*outside, load_per_core=8.0) is None
    _fails(checks.check_exposed_matches_removal, *outside, load_per_core=2.0,
           match=r"\|log 2\.90\|")
    assert checks.check_exposed_matches_removal(*_ab(lambda e, h: e), load_per_core=3.9) > 1


def test_exposed_matches_removal_is_not_judged_while_the_ranks_wait_for_cores():
    """CI's failing run (a clean clone at c2c4b3e, pytest's multi-rank launches beside the
    notebook): 258.0 ms exposed for 386.0 ms saved, 0.67, at about 2 per core. Judged, it
    fails; it failed CI. Beside such launches a rank's threads waited 0.72-0.86 s a second
    for a core (two busy processes: at most 0.61): there it is not judged. Just under the
    limit it is judged (mutant: the waiting ignored, or the limit read the wrong way)."""
    ci = {"all": 258.0e3}, {"all": 386.0e3}, {"all": 0.0}
    _fails(checks.check_exposed_matches_removal, *ci, load_per_core=2.0, match=r"\(0\.67\)")
    assert checks.check_exposed_matches_removal(*ci, load_per_core=2.0, waiting=0.74) is None
    _fails(checks.check_exposed_matches_removal, *ci, load_per_core=2.0,
           waiting=checks.AB_WAITING - 0.01, match=r"\(0\.67\)")
    assert checks.check_exposed_matches_removal(*_ab(lambda e, h: e), waiting=0.61) > 1


def test_most_waiting_is_the_longest_any_rank_waited():
    """The most any rank waited in any stage's recording; None where one rank could not tell
    (mutants: rank 0's alone, or a mean, would miss rank 1's 0.8)."""
    ranks = [{"systems": {s: {"waiting_for_cores": w} for s, w in (("stage0", a), ("stage1", b))}}
             for a, b in ((0.5, 0.4), (0.3, 0.8))]
    assert checks.most_waiting(ranks, ["stage0", "stage1"]) == 0.8
    assert checks.most_waiting(ranks, ["stage0"]) == 0.5
    ranks[1]["systems"]["stage0"]["waiting_for_cores"] = None
    assert checks.most_waiting(ranks, ["stage0", "stage1"]) is None


def test_exposed_matches_removal_on_a_quiet_run_fails_hidden_counted_as_exposed():
    """The quietest recorded run (2.1 per core; ms: removed, exposed, hidden per stage; stages
    1-2 gathering after the step), where the hidden part is smallest: right 1.07, counting
    hidden as exposed 1.79, inside the band: the second condition fails it."""
    quiet = {"stage0": (26.4, 26.1, 21.5), "stage1": (39.7, 36.9, 7.3),
             "stage2": (26.5, 29.2, 29.8), "stage3": (52.3, 62.3, 45.6)}
    removed = {s: v[0] * 1e3 for s, v in quiet.items()}
    ratio = checks.check_exposed_matches_removal({s: v[1] * 1e3 for s, v in quiet.items()},
                                                 removed, {s: v[2] * 1e3 for s, v in quiet.items()},
                                                 load_per_core=2.1)
    assert ratio == pytest.approx(1.07, abs=0.005)
    _fails(checks.check_exposed_matches_removal,
           {s: (v[1] + v[2]) * 1e3 for s, v in quiet.items()}, removed,
           dict.fromkeys(quiet, 0.0), load_per_core=2.1,
           match=r"closer than counting the hidden communication too: expected \|log 1\.79\|")


def test_exposed_matches_removal_mutant_from_a_trace():
    """The mutant analysis run on a trace: a stage whose communication is half hidden,
    measured as costing only its exposed half."""
    events = [Event("aten::mm", 0, 600, "compute"),
              Event("gloo:all_reduce", 300, 900, "in_flight", "thread 2"),
              Event("wait / all-reduce / bucket 0", 600, 900, "comm")]
    b = breakdown(events, (0, 1000))
    removed = {"stage2": 300.0}
    checks.check_exposed_matches_removal({"stage2": b["exposed_comm"]}, removed,
                                         {"stage2": b["overlapped_comm"]})
    _fails(checks.check_exposed_matches_removal, {"stage2": b["comm"]}, removed,
           {"stage2": 0.0})


# ----------------------------------------------------------------------- collectives


def _sends(name, start, numel, step_end=1000.0):
    """A zero_lab collective mark with the direct exchange's send inside it (2 ranks)."""
    return [Event(name, start, start + 5, "comm"),
            Event("c10d::send", start + 1, start + 4, "comm", args={"Input Dims": [[numel]]})]


def _gathers(depth=3):
    events = []
    for u in range(depth):
        events += _sends(f"all-gather / unit {u}", 10 * u, 50)
        events += _sends(f"all-gather / unit {u}", 300 + 10 * u, 50)
        events += _sends(f"reduce-scatter / unit {u}", 600 + 10 * u, 50)
    return _trace(events)


def test_collectives_match_ledger_mutant_ledgers():
    ledger = [{"op": "all_gather", "numel": 100}] * 6 + [{"op": "reduce_scatter", "numel": 100}] * 3
    checks.check_collectives_match_ledger(_gathers(), ledger)
    _fails(checks.check_collectives_match_ledger, _gathers(), ledger[1:], "stage3",
           match="stage3")
    bigger = ledger[:-1] + [{"op": "reduce_scatter", "numel": 200}]
    _fails(checks.check_collectives_match_ledger, _gathers(), bigger)


def test_collective_counts_mutant_with_a_unit_gathered_once():
    checks.check_collective_counts(_gathers(), {"all_gather": 6, "reduce_scatter": 3})
    once = _trace([e for e in _gathers().events if e.start < 300 or e.start >= 310])
    _fails(checks.check_collective_counts, once, {"all_gather": 6, "reduce_scatter": 3},
           "stage3", match="'all_gather': 5")


# ----------------------------------------------------------------------- the blog's timer


def _blog_step(comm_inside: bool) -> Trace:
    comm = (70, 90) if comm_inside else (40, 55)
    events = [Event("aten::mm", 0, 40, "compute"), Event("aten::mm", 55, 60, "compute"),
              Event(OPTIMIZER_STEP, 60, 100, "optimizer"),
              Event("aten::add_", 61, 69, "compute"), Event("aten::add_", 91, 99, "compute"),
              Event("all-reduce / bucket 0", *comm, "comm")]
    return _trace(events, steps=[(0, 100)])


def test_window_inflates_share_mutant_with_communication_outside_the_window():
    inside, whole, call = checks.step_window_share(_blog_step(True), 0)
    assert (inside, whole, call) == (0.5, 0.2, 40)
    checks.check_window_inflates_share(_blog_step(True))
    _fails(checks.check_window_inflates_share, _blog_step(False), match="step 0")


# ----------------------------------------------------------------------- memory

MIB = 2**20


def _curve(start, peak, end=None):
    return [(0.0, start), (10.0, peak), (20.0, start if end is None else end)]


CURVES = {"stage0": _curve(96 * MIB, 105 * MIB), "stage1": _curve(72 * MIB, 85 * MIB),
          "stage2": _curve(60 * MIB, 97 * MIB), "stage3": _curve(48 * MIB, 77 * MIB)}
ORDER = ["stage0", "stage1", "stage2", "stage3"]
PEAKS = [["stage0", "stage1", "stage3"], ["stage0", "stage2", "stage3"]]


def test_memory_ordering_mutant_with_a_leaked_unit():
    assert checks.check_memory_ordering(CURVES, ORDER, PEAKS)["stage2"] == (60 * MIB, 97 * MIB)
    leaked = {**CURVES, "stage3": _curve(48 * MIB, 77 * MIB, end=52 * MIB)}  # a unit kept
    _fails(checks.check_memory_ordering, leaked, ORDER, PEAKS, match="stage3 frees")


def test_memory_ordering_mutant_with_curves_above_the_start():
    """The old figure's curves (bytes above the step's start): stage 2 rises most, and the
    ordering the stages promise is gone."""
    relative = {s: [(t, b - c[0][1]) for t, b in c] for s, c in CURVES.items()}
    _fails(checks.check_memory_ordering, relative, ORDER, PEAKS, match="holds less")


def test_memory_ordering_mutant_with_swapped_stages():
    swapped = {**CURVES, "stage1": CURVES["stage3"], "stage3": CURVES["stage1"]}
    _fails(checks.check_memory_ordering, swapped, ORDER, PEAKS)


def test_absolute_curve_adds_what_was_held():
    assert checks.absolute_curve(100, [(0.0, 0), (1.0, 30), (2.0, 0)]) == \
        [(0.0, 100), (1.0, 130), (2.0, 100)]


# ----------------------------------------------------------------------- exercise 1 on a trace


def test_same_exposed_mutant_with_a_wrong_function():
    trace = [Event("aten::mm", 0, 60, "compute"),
             Event("gloo:all_reduce", 40, 75, "in_flight", "thread 2")]
    simple = [Event("aten::mm", 0, 60, "compute"), Event("all-reduce", 40, 75, "comm")]
    checks.check_same_exposed(nb06.reference_exposed(simple, (0, 100)), trace, (0, 100))
    _fails(checks.check_same_exposed, nb06._all_comm(simple, (0, 100)), trace, (0, 100),
           match="expected 15.0 us, found 35.0 us")
