"""zero_lab.profiling: interval arithmetic and the time breakdown on hand-made events with
known answers, then real traces of every system on 2 gloo ranks (one launch), checked
against the CommLedger of the same step."""

from __future__ import annotations

import json
import timeit
from collections import Counter

import pytest
import torch

from zero_lab.launch import torchrun
from zero_lab.launch.paths import WORKERS
from zero_lab.profiling import checks, marks
from zero_lab.profiling import intervals as iv
from zero_lab.profiling.analysis import (
    blocking_time,
    breakdown,
    collective_counts,
    collectives,
    fsdp_marks,
    mean_breakdown,
    memory_over_step,
    step_breakdowns,
    top_ops,
)
from zero_lab.profiling.capture import capture
from zero_lab.profiling.trace import Event, classify_cpu, load_trace

# ----------------------------------------------------------------------------- intervals


def test_union_merges_overlapping_nested_and_touching_intervals():
    assert iv.union([(5, 6), (0, 2), (1, 3), (3, 4), (0.5, 1), (7, 7)]) == [(0, 4), (5, 6)]
    assert iv.total([(0, 10), (2, 3), (9, 12)]) == 12


def test_intersect_and_subtract():
    a, b = [(0, 10), (20, 30)], [(5, 25), (28, 40)]
    assert iv.intersect(a, b) == [(5, 10), (20, 25), (28, 30)]
    assert iv.subtract(a, b) == [(0, 5), (25, 28)]
    assert iv.subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert iv.clip([(0, 10), (15, 20)], (5, 16)) == [(5, 10), (15, 16)]


def test_an_interval_ending_before_it_starts_is_refused():
    with pytest.raises(ValueError, match=r"must not end before it starts: \(3, 1\)"):
        iv.union([(3, 1)])


# ----------------------------------------------------------------------------- breakdown


def _ev(name, start, end, kind, track="main"):
    return Event(name, start, end, kind, track)


def test_breakdown_nesting_overlap_and_blocking_precedence():
    """Step [0, 100): forward ops nested in each other (0-30), a bucket in flight 20-60 on
    gloo's thread (overlapping compute 20-30), a wait 30-40 whose sum (an aten op inside
    the wait, 35-40) is communication, backward compute 40-55, the optimizer region 60-90
    with ops 62-88, nothing 90-100."""
    events = [
        _ev("aten::linear", 0, 30, "compute"), _ev("aten::addmm", 2, 28, "compute"),
        _ev("forward / unit 0", 0, 30, "mark"),
        _ev("gloo:all_reduce", 20, 60, "in_flight", "thread 7"),
        _ev("wait / all-reduce / bucket 0", 30, 40, "comm"),
        _ev("aten::add_", 35, 40, "compute"),
        _ev("aten::mm", 40, 55, "compute"),
        _ev("optimizer step", 60, 90, "optimizer"), _ev("aten::sqrt", 62, 88, "compute"),
    ]
    b = breakdown(events, (0, 100))
    assert b == {"compute": 45, "optimizer": 26, "exposed_comm": 15, "idle": 14,
                 "overlapped_comm": 25, "step": 100, "comm": 40}
    assert b["compute"] + b["optimizer"] + b["exposed_comm"] + b["idle"] == b["step"]


def test_breakdown_clips_to_the_window_and_two_ranks_are_independent():
    rank0 = [_ev("aten::mm", -10, 10, "compute"), _ev("gloo:send", 5, 30, "in_flight")]
    rank1 = [_ev("aten::mm", 0, 25, "compute"), _ev("gloo:send", 5, 30, "in_flight")]
    assert breakdown(rank0, (0, 20))["compute"] == 10
    assert breakdown(rank0, (0, 20))["exposed_comm"] == 10
    assert breakdown(rank1, (0, 20))["exposed_comm"] == 0
    assert breakdown(rank1, (0, 20))["overlapped_comm"] == 15


def test_blocking_time_adds_issue_and_wait_per_collective():
    events = [_ev("all-gather / unit 2", 0, 1, "comm"),
              _ev("wait / all-gather / unit 2", 5, 9, "comm"),
              _ev("all-gather / unit 2", 20, 21, "comm"),
              _ev("wait / all-gather / unit 2", 30, 32, "comm"),
              _ev("reduce-scatter / unit 1", 40, 43, "comm")]
    assert blocking_time(events) == {"all-gather / unit 2": 8, "reduce-scatter / unit 1": 3}
    assert blocking_time(events, (0, 10)) == {"all-gather / unit 2": 5}


@pytest.mark.parametrize("name, category, kind", [
    ("aten::mm", "cpu_op", "compute"),
    ("c10d::allreduce_", "cpu_op", "comm"),
    ("wait / reduce-scatter / bucket 1", "user_annotation", "comm"),
    ("all-gather / unit 3", "user_annotation", "comm"),
    ("gloo:all_reduce", "user_annotation", "in_flight"),
    ("optimizer step", "user_annotation", "optimizer"),
    ("Optimizer.step#Adam.step", "user_annotation", "optimizer"),
    ("forward / unit 3", "user_annotation", "mark"),
    ("ProfilerStep#3", "user_annotation", "mark"),
])
def test_classify_cpu(name, category, kind):
    assert classify_cpu(name, category) == kind


def test_a_file_that_is_not_a_trace_is_refused_with_its_name(tmp_path):
    bad = tmp_path / "rank0.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="rank0.json: not a readable Chrome-trace JSON"):
        load_trace(bad)
    bad.write_text(json.dumps({"traceEvents": [{"ph": "i", "name": "x", "ts": 1}]}))
    with pytest.raises(ValueError, match="no complete"):
        load_trace(bad)


def _cuda_like_trace(tmp_path):
    """A hand-made CUDA trace: compute kernels 0-40 and 50-60 (the latter launched inside
    the optimizer step), an NCCL kernel 30-55 on another stream."""
    ev = [
        {"ph": "X", "name": "train step", "cat": "user_annotation", "ts": 0, "dur": 100,
         "pid": 1, "tid": 1},
        {"ph": "X", "name": "Optimizer.step#Adam.step", "cat": "user_annotation", "ts": 45,
         "dur": 5, "pid": 1, "tid": 1},
        {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": 46, "dur": 1,
         "pid": 1, "tid": 1, "args": {"correlation": 9}},
        {"ph": "X", "name": "ampere_sgemm", "cat": "kernel", "ts": 0, "dur": 40, "pid": 0,
         "tid": 7, "args": {"stream": 7, "correlation": 3}},
        {"ph": "X", "name": "multi_tensor_apply_kernel", "cat": "kernel", "ts": 50, "dur": 10,
         "pid": 0, "tid": 7, "args": {"stream": 7, "correlation": 9}},
        {"ph": "X", "name": "ncclDevKernel_AllGather_RING_LL", "cat": "kernel", "ts": 30,
         "dur": 25, "pid": 0, "tid": 20, "args": {"stream": 20, "correlation": 5}},
    ]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": ev, "distributedInfo": {"rank": 0,
                                                                       "world_size": 2}}))
    return load_trace(path)


def test_a_cuda_trace_is_read_on_the_device_timeline(tmp_path):
    trace = _cuda_like_trace(tmp_path)
    assert trace.timeline == "cuda" and trace.steps == [(0, 100)]
    assert step_breakdowns(trace) == [{"compute": 40, "optimizer": 10, "exposed_comm": 10,
                                       "idle": 40, "overlapped_comm": 15, "step": 100,
                                       "comm": 25}]


# ----------------------------------------------------------------------------- marks


def _one_mark():
    with marks.mark("all-gather / unit 3"):
        pass


def test_marks_cost_next_to_nothing_without_a_profiler():
    assert not marks.profiling()
    assert marks.mark("x") is marks.mark("y")  # the shared do-nothing context
    # Best of 25 batches: another process on the machine can only add time to a batch, and a
    # batch of 1,000 marks (~0.2 ms) usually runs inside one scheduler time slice, so the best
    # batch is the mark's own cost even beside busy processes (under the soak's load it failed
    # with one 20,000-mark batch).
    per_mark = min(timeit.repeat(_one_mark, number=1_000, repeat=25)) / 1_000
    assert per_mark < 2e-6, f"{per_mark * 1e6:.2f} us per mark without a profiler"


def test_marks_and_spans_show_in_a_trace(tmp_path):
    from torch.profiler import profile

    with profile() as prof:
        with marks.mark("all-gather / unit 1"):
            torch.ones(3).sum()
        spans = marks.UnitSpans()  # what stage 3 calls at a unit's forward and backward
        spans("forward", 1)
        torch.ones(3).sum()
        spans("forward done", 1)
        spans("backward", 1)
        spans("backward", 1)  # one left open by a backward that raised: closed, opened anew
        spans("backward done", 1)
        spans("gather", 1)  # no mark of its own (the collective's mark names it)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = load_trace(tmp_path / "t.json").events
    names = [e.name for e in events]
    assert {"all-gather / unit 1", "forward / unit 1"} <= set(names)
    assert names.count("backward / unit 1") == 2 and "gather / unit 1" not in names
    assert not spans._open  # every mark it opened was closed


def settle_order(tmp_path, late: bool) -> list[tuple[str, bool]]:
    """What capture calls, in order, and whether the profiler records then (`late`: the
    mutant, settling once the recording has ended)."""
    calls: list[tuple[str, bool]] = []

    def note(what: str) -> None:
        calls.append((what, torch.autograd.profiler._is_profiler_enabled))

    capture(lambda: note("step"), tmp_path, steps=2, warmup=1, profile_memory=False,
            settle=None if late else lambda: note("settle"))
    if late:
        note("settle")
    return calls


def test_capture_settles_after_each_step_while_the_profiler_records(tmp_path):
    right = settle_order(tmp_path / "right", late=False)
    assert [what for what, _ in right] == ["step", "settle"] * 3  # 1 warm-up, 2 recorded
    assert right[-2] == ("step", True) and right[-1] == ("settle", True)
    assert settle_order(tmp_path / "late", late=True)[-1] == ("settle", False)  # the mutant


def test_capture_primes_each_step_outside_its_window(tmp_path):
    """Each step follows a priming step of the same system with nothing between them, and
    the priming step's ops lie outside every step window (measure/step_timing.py says why)."""
    calls: list[str] = []

    def prime() -> None:
        calls.append("prime")
        with marks.mark("priming step"):
            torch.ones(3).sum()

    capture(lambda: calls.append("step"), tmp_path, steps=2, warmup=1, profile_memory=False,
            prime=prime, settle=lambda: calls.append("settle"))
    assert calls == ["prime", "step", "settle"] * 3
    trace = load_trace(tmp_path / "rank0.json")
    assert len(trace.steps) == 2
    priming = [e for e in trace.events if e.name == "priming step"]
    assert len(priming) == 2  # the recorded ones' primes
    for e in priming:
        assert all(e.end <= start or e.start >= end for start, end in trace.steps)


# ----------------------------------------------------------------------------- real traces

# stage2_param_gather (first: there, without capture's settle, 1 launch of 2 aborted; alone, 7 of
# 7): its step leaves the all-gathers in flight for the next forward; a gloo work issued
# under the profiler and finished after it stopped corrupted the heap (capture.py).
SYSTEMS = ["stage2_param_gather", "compute_only", "stage0", "stage1", "stage2", "stage3",
           "stage3_noprefetch", "ddp", "fsdp2", "blog_zero1"]
DEPTH = 4
NO_COMM = ["stage0", "stage1", "stage2", "stage3"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiles")
    config = {"width": 128, "depth": DEPTH, "batch": 8, "warmup": 2, "bucket_mb": 0.1}
    result = torchrun(WORKERS / "profile_systems.py", nproc=2, backend="gloo", timeout=300,
                      stream=False, args=["--systems", *SYSTEMS, "--config", json.dumps(config),
                                          "--out", str(out), "--steps", "2", "--timed", "2",
                                          "--no-comm", *NO_COMM])
    return out, result.ranks


def test_every_system_wrote_a_trace_per_rank_with_its_steps(profiled):
    out, ranks = profiled
    for system in SYSTEMS:
        for rank in (0, 1):
            trace = load_trace(out / system / f"rank{rank}.json")
            assert (trace.rank, trace.world_size, trace.timeline) == (rank, 2, "cpu")
            assert len(trace.steps) == 2
            for b in step_breakdowns(trace):
                parts = b["compute"] + b["optimizer"] + b["exposed_comm"] + b["idle"]
                assert parts == pytest.approx(b["step"])
                assert min(b.values()) >= 0 and b["compute"] > 0 and b["optimizer"] > 0
    assert mean_breakdown([load_trace(out / "compute_only" / "rank0.json")])["comm"] == 0


@pytest.mark.parametrize("system", [s for s in SYSTEMS if s != "compute_only"])
def test_collectives_in_the_trace_equal_the_ledgers(profiled, system):
    out, ranks = profiled
    for rank in (0, 1):
        trace = load_trace(out / system / "ledger" / f"rank{rank}.json")
        ledger = ranks[rank]["systems"][system]["ledger"]
        assert collective_counts(trace) == dict(Counter(r["op"] for r in ledger))
        assert sorted((c["op"], c["numel"]) for c in collectives(trace)) == \
            sorted((r["op"], r["numel"]) for r in ledger)


def test_what_each_stage_sends_reads_like_the_lesson(profiled):
    out, _ = profiled
    counts = {s: collective_counts(load_trace(out / s / "rank0.json"), step=0) for s in SYSTEMS}
    assert counts["stage3"] == {"all_gather": 2 * DEPTH, "reduce_scatter": DEPTH}
    assert counts["stage3_noprefetch"] == counts["stage3"]
    assert counts["fsdp2"] == counts["stage3"]
    assert set(counts["stage1"]) == set(counts["stage2"]) == {"reduce_scatter", "all_gather"}
    assert set(counts["stage0"]) == set(counts["ddp"]) == {"all_reduce"}
    # the seed blog's ZeRO-1: one all-reduce and one broadcast per parameter tensor
    assert counts["blog_zero1"] == {"all_reduce": 2 * DEPTH, "broadcast": 2 * DEPTH}
    names = {e.name for e in load_trace(out / "stage3" / "rank0.json").events}
    for u in range(DEPTH):
        assert {f"forward / unit {u}", f"backward / unit {u}", f"all-gather / unit {u}",
                f"wait / all-gather / unit {u}", f"reduce-scatter / unit {u}"} <= names
    assert {"optimizer step", "zero_grad", "all-gather / bucket 0"} <= \
        {e.name for e in load_trace(out / "stage2" / "rank0.json").events}


def test_waits_top_ops_and_memory_are_read_from_the_trace(profiled):
    out, _ = profiled
    trace = load_trace(out / "stage3_noprefetch" / "rank0.json")
    waits = blocking_time(trace.events, trace.steps[0])
    assert {f"all-gather / unit {u}" for u in range(DEPTH)} <= set(waits)
    ops = top_ops(trace, 5, trace.steps[0])
    assert len(ops) == 5 and all(t > 0 and calls >= 1 for _, t, calls in ops)
    memory = memory_over_step(load_trace(out / "stage3_noprefetch" / "ledger" / "rank0.json"))
    assert memory and max(b for _, b in memory) > 0  # a unit's full parameters, at least
    assert trace.memory == []  # timing recordings leave allocator events out


def _sent(trace, window) -> list[str]:
    """What left this rank inside `window`: torch's collective calls and gloo's spans."""
    return [e.name for e in trace.events if window[0] <= e.start < window[1]
            and e.name.startswith(("c10d::", "gloo:"))]


@pytest.mark.parametrize("stage", NO_COMM)
def test_a_stage_and_its_twin_that_sends_nothing_recorded_in_turn(profiled, stage):
    """transport="none" keeps a stage's steps (its marks, hooks, waits) but sends nothing:
    in the recording made in turn, the stage's windows send, its twin's never do."""
    out, ranks = profiled
    for rank in (0, 1):
        trace = load_trace(out / f"{stage}_ab" / f"rank{rank}.json")
        assert len(trace.steps) == 4  # 2 steps each, in turn
        assert all(_sent(trace, w) for w in trace.steps[0::2])
        assert not any(_sent(trace, w) for w in trace.steps[1::2])
        assert collective_counts(trace, step=1) == collective_counts(trace, step=0)  # marks
        assert len(ranks[rank]["systems"][stage]["no_comm_step_times"]) == 2


def test_prefetch_is_seen_in_the_order_of_events(profiled):
    out, _ = profiled
    with_prefetch = load_trace(out / "stage3" / "rank0.json")
    for k in range(len(with_prefetch.steps)):
        assert checks.check_prefetch_ahead(with_prefetch, k, DEPTH) == list(range(1, DEPTH))
    with pytest.raises(AssertionError, match="found units"):
        checks.check_prefetch_ahead(load_trace(out / "stage3_noprefetch" / "rank0.json"), 0,
                                    DEPTH)


def test_memory_curves_start_from_what_each_stage_holds(profiled):
    """The worker reports the model states held when the memory step began; on top of the
    allocator's events they give curves in which stage 0 holds the most and every stage ends
    its step where it started."""
    out, ranks = profiled
    curves = {s: checks.absolute_curve(
        ranks[0]["systems"][s]["held_bytes"],
        memory_over_step(load_trace(out / s / "ledger" / "rank0.json"))) for s in NO_COMM}
    held = checks.check_memory_ordering(curves, NO_COMM, [["stage0", "stage3"]])
    assert held["stage0"][0] > 2 * held["stage3"][0]


def test_fsdp2_marks_its_own_collectives(profiled):
    out, _ = profiled
    trace = load_trace(out / "fsdp2" / "rank0.json")
    own = fsdp_marks(trace, trace.steps[0])
    assert own["FSDP::all_gather"] == 2 * DEPTH
    assert own["FSDP::post_backward_reduce"] == DEPTH
    assert fsdp_marks(load_trace(out / "stage3" / "rank0.json")) == {}
