"""Trace files as they come from elsewhere (issue 22, points 10-13): older kineto spellings,
kernels launched through the CUDA driver, gzip and the JSON-array Chrome format, broken
files refused by name, and an analysis that stays O(n log n) as a step grows to 10^5 events
(counted in operations, not seconds). Hand-made traces only: no launch."""

from __future__ import annotations

import gzip
import json
import math
import random
import sys

import pytest

from zero_lab.profiling import analysis
from zero_lab.profiling import intervals as iv
from zero_lab.profiling.analysis import (
    breakdown,
    collective_counts,
    collectives,
    mean_breakdown,
    memory_over_step,
    step_breakdowns,
)
from zero_lab.profiling.trace import Event, load_trace

# -------------------------------------------------------------------- hand-made traces


def _write(path, events, info=None):
    path.write_text(json.dumps({"traceEvents": events,
                                "distributedInfo": info or {"rank": 0, "world_size": 2}}))
    return path


def _gpu_events(op="cpu_op", annotation="user_annotation", launch=("cuda_runtime",
                "cudaLaunchKernel"), kernel="kernel"):
    """A CUDA step: compute kernels 0-40 and 50-60 (the latter launched inside the optimizer
    step), an NCCL kernel 30-55 on another stream; categories spelled as given."""
    cat, name = launch
    return [
        {"ph": "X", "name": "train step", "cat": annotation, "ts": 0, "dur": 100, "pid": 1,
         "tid": 1},
        {"ph": "X", "name": "aten::mm", "cat": op, "ts": 1, "dur": 3, "pid": 1, "tid": 1},
        {"ph": "X", "name": "Optimizer.step#Adam.step", "cat": annotation, "ts": 45, "dur": 5,
         "pid": 1, "tid": 1},
        {"ph": "X", "name": name, "cat": cat, "ts": 46, "dur": 1, "pid": 1, "tid": 1,
         "args": {"correlation": 9}},
        {"ph": "X", "name": "ampere_sgemm", "cat": kernel, "ts": 0, "dur": 40, "pid": 0,
         "tid": 7, "args": {"stream": 7, "correlation": 3}},
        {"ph": "X", "name": "multi_tensor_apply_kernel", "cat": kernel, "ts": 50, "dur": 10,
         "pid": 0, "tid": 7, "args": {"stream": 7, "correlation": 9}},
        {"ph": "X", "name": "ncclDevKernel_AllGather_RING_LL", "cat": kernel, "ts": 30,
         "dur": 25, "pid": 0, "tid": 20, "args": {"stream": 20, "correlation": 5}},
    ]


GPU_STEP = {"compute": 40, "optimizer": 10, "exposed_comm": 10, "idle": 40,
            "overlapped_comm": 15, "step": 100, "comm": 25}


def _cpu_events(op="cpu_op", annotation="user_annotation"):
    return [
        {"ph": "X", "name": "train step", "cat": annotation, "ts": 0, "dur": 100, "pid": 1,
         "tid": 1},
        {"ph": "X", "name": "aten::mm", "cat": op, "ts": 10, "dur": 30, "pid": 1, "tid": 1},
        {"ph": "X", "name": "gloo:all_reduce", "cat": annotation, "ts": 20, "dur": 40,
         "pid": 1, "tid": 2},
    ]


CPU_STEP = {"compute": 30, "optimizer": 0, "exposed_comm": 20, "idle": 50,
            "overlapped_comm": 20, "step": 100, "comm": 40}


def test_the_hand_made_traces_read_as_described(tmp_path):
    """The reference the other tests compare with: today's spellings, read today."""
    gpu = load_trace(_write(tmp_path / "gpu.json", _gpu_events()))
    assert gpu.timeline == "cuda" and step_breakdowns(gpu) == [GPU_STEP]
    cpu = load_trace(_write(tmp_path / "cpu.json", _cpu_events()))
    assert cpu.timeline == "cpu" and step_breakdowns(cpu) == [CPU_STEP]


# ------------------------------------------------------------- 10: older kineto spellings


def test_an_older_kineto_gpu_trace_is_read_on_the_device_timeline(tmp_path):
    """torch < 1.9 spelled kernels "Kernel", launches "Runtime", ops and marks "Operator"
    (failed before: read as a CPU trace, its kernels ignored)."""
    old = _gpu_events(op="Operator", annotation="Operator", launch=("Runtime",
                      "cudaLaunchKernel"), kernel="Kernel")
    trace = load_trace(_write(tmp_path / "rank0.json", old))
    assert trace.timeline == "cuda"
    assert step_breakdowns(trace) == [GPU_STEP]


def test_an_older_kineto_cpu_trace_is_refused_naming_the_file_and_the_spelling(tmp_path):
    """On a CPU trace ops are compute and marks are not; "Operator" spells both, so the
    reader cannot tell a step mark from an op: refused, never guessed (failed before: read,
    its "train step" counted as one long op or its ops as marks)."""
    path = _write(tmp_path / "rank0.json", _cpu_events(op="Operator", annotation="Operator"))
    with pytest.raises(ValueError, match=r"rank0\.json: .*'Operator'"):
        load_trace(path)


# ------------------------------------------------- 11: launches through the CUDA driver


def test_a_kernel_launched_through_the_driver_in_the_optimizer_counts_as_optimizer(tmp_path):
    """Triton kernels and compiled optimizers launch with cuLaunchKernel ("cuda_driver")
    (failed before: counted as compute, optimizer 0)."""
    events = _gpu_events(launch=("cuda_driver", "cuLaunchKernel"))
    assert step_breakdowns(load_trace(_write(tmp_path / "rank0.json", events))) == [GPU_STEP]


# ------------------------------------------------------------ 12: how files come, and break


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path):
    """tensorboard_trace_handler(use_gzip=True) writes .pt.trace.json.gz (failed before:
    'not a readable Chrome-trace JSON')."""
    plain = _write(tmp_path / "rank0.json", _gpu_events())
    zipped = tmp_path / "host_1.1.pt.trace.json.gz"
    zipped.write_bytes(gzip.compress(plain.read_bytes()))
    trace = load_trace(zipped)
    assert trace.events == load_trace(plain).events and trace.path == zipped
    assert (trace.rank, trace.world_size) == (0, 2)
    zipped.write_bytes(zipped.read_bytes()[:40])  # cut short: refused by name, not a crash
    with pytest.raises(ValueError, match=r"host_1\.1\.pt\.trace\.json\.gz: not a readable"):
        load_trace(zipped)
    zipped.write_bytes(zipped.read_bytes()[:10] + b"\xff" * 30)  # corrupt deflate data
    with pytest.raises(ValueError, match=r"host_1\.1\.pt\.trace\.json\.gz: not a readable"):
        load_trace(zipped)


def test_the_json_array_chrome_format_reads_with_or_without_its_closing_bracket(tmp_path):
    """The Trace Event Format's array form: the events alone, the closing ']' optional
    (failed before: 'list' object has no attribute 'get')."""
    text = json.dumps(_cpu_events())
    for body in (text, text[:-1], text[:-1] + ",\n"):
        path = tmp_path / "array.json"
        path.write_text(body)
        trace = load_trace(path)
        assert step_breakdowns(trace) == [CPU_STEP] and (trace.rank, trace.world_size) == (0, 1)


def _broken(tmp_path, edit):
    events = _cpu_events()
    edit(events)
    return _write(tmp_path / "rank0.json", events)


@pytest.mark.parametrize("edit, message", [
    (lambda ev: ev[1].pop("tid"), r"rank0\.json: event 1 \('aten::mm'\) has no 'tid'"),
    (lambda ev: ev[1].update(dur=-5), r"rank0\.json: event 1 \('aten::mm'\) has dur -5"),
    (lambda ev: ev[1].update(dur="5"), r"rank0\.json: event 1 \('aten::mm'\) has dur '5'"),
    (lambda ev: ev[1].pop("ts"), r"rank0\.json: event 1 \('aten::mm'\) has no 'ts'"),
    (lambda ev: ev[1].pop("name"), r"rank0\.json: event 1 has no 'name'"),
    (lambda ev: ev.__setitem__(slice(None), [{**ev[2], "cat": "python_function"}]),
     r"rank0\.json: no torch ops .* and no step marks"),
])
def test_a_broken_trace_is_refused_naming_the_file_and_what_is_wrong(tmp_path, edit, message):
    """(failed before: KeyError 'tid', a negative duration read as is, "max() arg is an empty
    sequence" for a trace without ops or steps)."""
    with pytest.raises(ValueError, match=message):
        load_trace(_broken(tmp_path, edit))


def test_a_trace_without_steps_loads_but_what_needs_a_step_says_so(tmp_path):
    """A profile taken without a schedule or "train step" marks has events but no step
    windows: reading it works; asking for a step names the file (failed before: collectives
    [] and counts {} silently, memory_over_step an IndexError)."""
    events = [e for e in _cpu_events() if e["name"] != "train step"]
    trace = load_trace(_write(tmp_path / "rank0.json", events))
    assert trace.steps == [] and len(trace.events) == 2
    for ask in (step_breakdowns, collectives, collective_counts, memory_over_step,
                lambda t: mean_breakdown([t])):
        with pytest.raises(ValueError, match=r"rank0\.json: no recorded step"):
            ask(trace)


@pytest.mark.parametrize("call", [
    lambda nan: iv.union([(0, 1), (nan, 3)]),
    lambda nan: iv.subtract([(0, 10)], [(2, nan)]),
    lambda nan: iv.intersect([(0, nan)], [(0, 10)]),
    lambda nan: breakdown([Event("aten::mm", 0, nan, "compute")], (0, 10)),
])
def test_an_interval_that_is_not_a_number_is_refused(call):
    """(failed before: dropped silently, as if it covered nothing)."""
    with pytest.raises(ValueError, match=r"an interval's ends must be numbers: \(.*nan.*\)"):
        call(math.nan)


def test_intervals_name_the_argument_that_holds_a_bad_interval():
    with pytest.raises(ValueError, match=r"^b: an interval must not end before it starts"):
        iv.subtract([(0, 10)], [(3, 1)])
    with pytest.raises(ValueError, match=r"^a: an interval's ends must be numbers"):
        iv.intersect([(math.nan, 1)], [(0, 10)])


# ---------------------------------------------------------------- 13: O(n log n) analysis


def _old_subtract(a, b):
    """intervals.subtract before issue 22 (each interval of `a` scanned every one of `b`):
    the quadratic mutant for the growth check."""
    out, b = [], iv.union(b)
    for start, end in iv.union(a):
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
        if start < end:
            out.append((start, end))
    return out


def test_subtract_equals_the_interval_by_interval_definition():
    rng = random.Random(22)
    for _ in range(300):
        a = [(s, s + rng.randint(0, 9)) for s in (rng.randint(0, 60) for _ in range(8))]
        b = [(s, s + rng.randint(0, 9)) for s in (rng.randint(0, 60) for _ in range(8))]
        assert iv.subtract(a, b) == _old_subtract(a, b)
        points = [p / 2 for p in range(0, 150)]  # the definition, point by point
        covered = {p for p in points if any(s <= p < e for s, e in iv.subtract(a, b))}
        assert covered == {p for p in points if any(s <= p < e for s, e in a)
                           and not any(s <= p < e for s, e in b)}


UNIT = 100  # microseconds of one unit of the synthetic step below


def synthetic_step_events(units: int, step: int = 0, tid_main=1, tid_gloo=2) -> list[dict]:
    """One "train step" of `units` units, 12 events each, as a stage writes them: nested ops,
    an all-gather mark around torch's op and its re-dispatch, its wait with an op inside, a
    lockstep check with its own op (control), an all-reduce issued without a mark, gloo's
    span, and the optimizer at the end. ~10^5 events per step at units=8_334."""
    base = step * (units + 1) * UNIT

    def x(name, ts, dur, cat="cpu_op", tid=tid_main, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": base + ts, "dur": dur, "pid": 1,
                "tid": tid, "args": args}

    ann = "user_annotation"
    events = [x("train step", 0, (units + 1) * UNIT - 1, ann)]
    for u in range(units):
        t = u * UNIT
        gather = f"all-gather / unit {u}"
        events += [
            x("aten::linear", t, 30), x("aten::addmm", t + 2, 26),
            x(gather, t + 30, 10, ann),
            x("c10d::_allgather_base_", t + 31, 8, **{"Input Dims": [[64], [32]]}),
            x("c10d::_allgather_base_", t + 32, 6, **{"Input Dims": [[64], [32]]}),
            x("wait / " + gather, t + 40, 10, ann), x("aten::add_", t + 45, 5),
            x("check / lockstep", t + 50, 5, ann),
            x("c10d::_allgather_base_", t + 51, 3, **{"Input Dims": [[6], [3]]}),
            x("c10d::allreduce_", t + 60, 10, **{"Input Dims": [[[16]]]}),
            x("aten::mm", t + 70, 25),
            x("gloo:all_gather", t + 35, 25, ann, tid=tid_gloo),
        ]
    t = units * UNIT
    events += [x("optimizer step", t, 60, ann), x("aten::sqrt", t + 5, 50)]
    return events


def synthetic_trace_file(path, units: int, steps: int = 1):
    return _write(path, [e for k in range(steps) for e in synthetic_step_events(units, k)])


def test_the_synthetic_step_reads_as_built(tmp_path):
    """Per unit: compute 0-30, 45-50 (in the wait: communication), 51-54 (in the check: its
    op is a torch collective, communication), 70-95; one all-gather (64 elements, its
    re-dispatch and the check's op not counted) and one all-reduce (16)."""
    trace = load_trace(synthetic_trace_file(tmp_path / "rank0.json", units=3, steps=2))
    assert len(trace.steps) == 2
    assert collective_counts(trace, step=1) == {"all_gather": 3, "all_reduce": 3}
    assert [(c["op"], c["numel"], c["label"]) for c in collectives(trace)[:2]] == [
        ("all_gather", 64, "unit 0"), ("all_reduce", 16, "c10d::allreduce_")]
    b = step_breakdowns(trace)[1]
    assert b["compute"] == 3 * (30 + 25) and b["optimizer"] == 50
    assert b["compute"] + b["optimizer"] + b["exposed_comm"] + b["idle"] == b["step"]


def _operations(fn) -> int:
    """Python lines executed while `fn()` runs, in every frame: an operation count that does
    not depend on the machine's speed or load."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def growth(run, prepare=lambda n: n, small: int = 25, factor: int = 4) -> float:
    """How much more work `run(prepare(units))` does on `factor` times the units (what
    `prepare` does is not counted): ~4 for O(n) and O(n log n) at these sizes, ~16 for
    O(n^2)."""
    few, many = prepare(small), prepare(small * factor)
    return _operations(lambda: run(many)) / _operations(lambda: run(few))


QUADRATIC = 6.0  # above O(n log n)'s 4.x at these sizes, well under O(n^2)'s 16


def _trace_of(units: int, tmp_path):
    return load_trace(synthetic_trace_file(tmp_path / f"rank0_{units}.json", units))


def test_subtract_grows_as_n_log_n_and_the_quadratic_mutant_is_caught():
    def inputs(n):
        return [(10 * k, 10 * k + 6) for k in range(n)], [(10 * k + 5, 10 * k + 12)
                                                          for k in range(n)]
    assert growth(lambda ab: iv.subtract(*ab), inputs) < QUADRATIC
    assert growth(lambda ab: _old_subtract(*ab), inputs) > QUADRATIC  # the mutant


def test_breakdown_grows_as_n_log_n_and_with_the_old_subtract_it_fails(monkeypatch,
                                                                       tmp_path):
    def run(trace):
        breakdown(trace.events, trace.steps[0])

    def prepare(units):
        return _trace_of(units, tmp_path)
    assert growth(run, prepare) < QUADRATIC
    monkeypatch.setattr(iv, "subtract", _old_subtract)
    assert growth(run, prepare) > QUADRATIC  # the mutant: breakdown on the old subtract


def _containers_by_pairs(events, outers):
    """analysis._containers by comparing every pair: the quadratic mutant, and the
    definition the fast one is held to."""
    return [[o for o in outers if o is not e and o.track == e.track
             and o.start <= e.start and e.end <= o.end] for e in events]


def test_collectives_grow_as_n_log_n_and_pairwise_containment_is_caught(monkeypatch,
                                                                         tmp_path):
    def prepare(units):
        return _trace_of(units, tmp_path)
    assert growth(collectives, prepare) < QUADRATIC
    monkeypatch.setattr(analysis, "_containers", _containers_by_pairs)
    assert growth(collectives, prepare) > QUADRATIC  # the mutant: every op against every mark


def test_containers_equal_the_pairwise_definition():
    rng = random.Random(13)
    for _ in range(200):
        def span(name):
            s = rng.randint(0, 40)
            return Event(name, s, s + rng.randint(0, 12), "mark", rng.choice(["main", "t2"]))
        events = [span(f"e{i}") for i in range(10)]
        outers = [span(f"o{i}") for i in range(6)] + events[:2]
        position = {id(o): i for i, o in enumerate(outers)}

        def which(found, position=position):  # containers, as positions in `outers`
            return [sorted(position[id(o)] for o in held) for held in found]
        assert which(analysis._containers(events, outers)) == \
            which(_containers_by_pairs(events, outers))
        kept = analysis._outermost(events)
        assert all(not any(o is not e and o.track == e.track and o.start <= e.start
                           and e.end <= o.end for o in kept) for e in kept)
        assert all(any(o.track == e.track and o.start <= e.start and e.end <= o.end
                       for o in kept) for e in events)


def test_reading_a_trace_grows_linearly(tmp_path):
    assert growth(load_trace, lambda units: synthetic_trace_file(
        tmp_path / f"rank{units}.json", units)) < QUADRATIC
