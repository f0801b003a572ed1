"""Read a Chrome-trace JSON (torch.profiler's export) into classified events, per rank.

Every event becomes an `Event` with one of these kinds:

    compute    a torch op on the training thread (CPU), or a GPU kernel that is not NCCL's
    comm       the training thread busy with communication: issuing a collective (c10d::*,
               zero_lab's "all-gather / unit 3" marks), blocked in its wait ("wait / ...",
               aten::wait_tensor), or a point-to-point message call
    in_flight  a collective in progress, whoever runs it: gloo's "gloo:*" spans (on gloo's
               worker threads they last exactly as long as the collective; an isend/irecv's
               span lasts from posting to the wait), every op on a gloo worker thread, and
               on GPUs the NCCL kernels (real device time)
    optimizer  a region in which compute is the optimizer's ("optimizer step", torch's
               "Optimizer.step#..."); on GPUs, the kernels that region launched
    mark       names only (phases such as "forward / unit 3", ProfilerStep#k, Python frames)

A trace with GPU kernels is read on the device timeline (compute and NCCL kernels); a CPU
trace on the training thread (the one that ran the "train step" marks) plus gloo's threads.
The same analysis functions then serve both.

What is read: the JSON object torch.profiler exports, or the Trace Event Format's JSON array
(its closing "]" optional, as the format allows), plain or gzipped (what
`tensorboard_trace_handler(use_gzip=True)` writes). Categories in today's kineto spelling or
in the older one of torch < 1.9 ("Kernel", "Runtime", ...), except where the older spelling
cannot be read without a guess: it files ops and record_function marks alike under
"Operator", and a CPU trace needs them apart (ops are compute, marks are not), so such a
trace is refused by name. A file with an event that has no name, time, duration or thread,
or a negative duration, is refused naming the file and the event.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

from zero_lab.profiling import intervals as iv
from zero_lab.profiling.capture import STEP
from zero_lab.profiling.marks import COLLECTIVES, OPTIMIZER_STEP, WAIT

KINDS = ("compute", "comm", "in_flight", "optimizer", "mark")
_COMM_OPS = ("c10d::", "_c10d_functional::", "aten::wait_tensor", "record_param_comms")
_IN_FLIGHT = ("gloo:", "nccl:")
_OPTIMIZER = (OPTIMIZER_STEP, "Optimizer.step#")

# Kineto's categories in the spelling this reader uses. Today's torch writes the keys on the
# left for itself; torch < 1.9 wrote the capitalised ones (the TensorBoard plugin reads both
# as the same: pytorch/kineto, tb_plugin/torch_tb_profiler/profiler/trace.py, EventTypeMap).
# A GPU kernel can be launched through the runtime (cudaLaunchKernel) or the driver
# (cuLaunchKernel: Triton kernels, compiled optimizers): both are launches.
_SPELLINGS = {
    "cuda_runtime": "launch", "cuda_driver": "launch", "Runtime": "launch",
    "Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset",
    "Python": "python_function",
}
# torch < 1.9's one category for torch ops and record_function marks alike
_OPS_AND_MARKS = "Operator"


@dataclass(frozen=True)
class Event:
    """One span of a trace: `name`, [start, end) in microseconds, its kind, where it ran."""

    name: str
    start: float
    end: float
    kind: str = "compute"
    track: str = "main"
    args: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    """One rank's trace: events, step windows (from the "train step" marks, else
    ProfilerStep#k), the allocator's memory samples (time, bytes allocated), and where the
    events were read (the "cpu" thread or the "cuda" device timeline)."""

    rank: int
    world_size: int
    events: list[Event]
    steps: list[tuple[float, float]]
    memory: list[tuple[float, int]]
    timeline: str
    path: Path | None = None


def is_collective_mark(name: str) -> bool:
    """A zero_lab mark that issues a collective: "all-gather / unit 3"."""
    return name.split(" / ", 1)[0] in COLLECTIVES and " / " in name


def classify_cpu(name: str, category: str) -> str:
    """The kind of a CPU event on the training thread (see the module docstring)."""
    if name.startswith(_IN_FLIGHT):
        return "in_flight"
    if name.startswith(_COMM_OPS) or name.startswith(WAIT) or is_collective_mark(name):
        return "comm"
    if name.startswith(_OPTIMIZER):
        return "optimizer"
    return "compute" if category == "cpu_op" else "mark"


def load_trace(path: Path | str) -> Trace:
    """Read one rank's trace file (no GUI, no network: the JSON only)."""
    path = Path(path)
    everything, info = _read(path)
    raw = _complete_events(path, everything)
    if not raw:
        raise ValueError(f"{path}: no complete ('X') events; is it a torch.profiler trace?")
    kernels = [e for e in raw if e["cat"] == "kernel"]
    _read_ops_and_marks(path, raw, on_gpu=bool(kernels))
    main = _training_thread(raw)
    if main is None and not kernels:
        raise ValueError(f"{path}: no torch ops ('cpu_op' events) and no step marks "
                         f"('{STEP}' or 'ProfilerStep#'): nothing says which thread trained")
    events = _gpu_events(raw, kernels, main) if kernels else _cpu_events(raw, main)
    step_marks = [e for e in raw if e["name"] == STEP and e["tid"] == main]
    if not step_marks:
        step_marks = [e for e in raw if e["name"].startswith("ProfilerStep#")]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in step_marks)
    memory = _memory(everything, device_type=1 if kernels else 0)
    return Trace(rank=int(info.get("rank", 0)), world_size=int(info.get("world_size", 1)),
                 events=events, steps=steps, memory=memory,
                 timeline="cuda" if kernels else "cpu", path=path)


def _read(path: Path) -> tuple[list, dict]:
    """The file's events and its distributedInfo ({} without): a JSON object with
    "traceEvents" or a JSON array of events, plain or gzipped."""
    try:
        data = path.read_bytes()
        if data[:2] == b"\x1f\x8b":  # gzip's magic number, whatever the file is called
            data = gzip.decompress(data)
        data = _json(data.decode("utf-8"))
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable Chrome-trace JSON ({exc})") from None
    if isinstance(data, list):
        return data, {}
    if isinstance(data, dict) and isinstance(data.get("traceEvents", []), list):
        return data.get("traceEvents", []), data.get("distributedInfo", {})
    raise ValueError(f"{path}: not a Chrome trace: a JSON object with a 'traceEvents' list "
                     f"or a JSON array of events was expected")


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        # The Trace Event Format lets the array form end without its "]" (a tracer stopped
        # mid-write still leaves a readable file): close it and try once more.
        body = text.rstrip().rstrip(",")
        if body.lstrip().startswith("[") and not body.endswith("]"):
            return json.loads(body + "]")
        raise


def _complete_events(path: Path, events: list) -> list[dict]:
    """The complete ("X") events, checked (a name, a time, a duration >= 0, a thread) and
    their categories in this reader's spelling; the first broken one is refused by name."""
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        if not isinstance(e.get("name"), str):
            raise ValueError(f"{path}: event {i} has no 'name'")
        event = f"{path}: event {i} ({e['name']!r})"
        for key in ("ts", "dur", "tid"):
            if key not in e:
                raise ValueError(f"{event} has no {key!r}")
        for key in ("ts", "dur"):
            value = e[key]
            # JSON gives int or float (True is a bool, not a number here); NaN is refused
            if type(value) not in (int, float) or not math.isfinite(value) or (
                    key == "dur" and value < 0):
                raise ValueError(f"{event} has {key} {value!r}: a time must be a finite "
                                 f"number of microseconds, a duration >= 0")
        category = e.get("cat", "")
        e["cat"] = _SPELLINGS.get(category, category)
        out.append(e)
    return out


def _read_ops_and_marks(path: Path, raw: list[dict], on_gpu: bool) -> None:
    """torch < 1.9's "Operator" category holds ops and marks alike. On the device timeline
    every CPU event is a mark anyway, so it reads as "cpu_op"; a CPU trace would need to
    tell them apart (ops are compute, a "train step" mark is not), so it is refused."""
    old = [e for e in raw if e["cat"] == _OPS_AND_MARKS]
    if old and not on_gpu:
        raise ValueError(
            f"{path}: a CPU trace in an older kineto spelling: category '{_OPS_AND_MARKS}' "
            f"(torch < 1.9) holds torch ops (compute) and record_function marks (not "
            f"compute) alike, and nothing else in the file tells them apart; record it "
            f"again with a torch that writes 'cpu_op' and 'user_annotation'")
    for e in old:
        e["cat"] = "cpu_op"


def _memory(events: list, device_type: int) -> list[tuple[float, int]]:
    """The allocator's samples on the timeline's device: (time, bytes allocated)."""
    samples = []
    for e in events:
        args = e.get("args") if isinstance(e, dict) and e.get("name") == "[memory]" else None
        if args and args.get("Device Type") == device_type and "Total Allocated" in args:
            samples.append((e["ts"], int(args["Total Allocated"])))
    return sorted(samples)


def _training_thread(raw: list[dict]):
    """The thread that ran the steps: the one with the "train step" (or ProfilerStep) marks,
    else the one with the most op time (None if there are no ops)."""
    for name in (STEP, "ProfilerStep#"):
        tids = {e["tid"] for e in raw if e["name"].startswith(name)}
        if len(tids) == 1:
            return tids.pop()
    busy: dict = {}
    for e in raw:
        if e["cat"] == "cpu_op":
            busy[e["tid"]] = busy.get(e["tid"], 0) + e["dur"]
    return max(busy, key=busy.get) if busy else None


def _event(e: dict, kind: str, track: str) -> Event:
    return Event(e["name"], float(e["ts"]), float(e["ts"] + e["dur"]), kind, track,
                 e.get("args", {}))


def _cpu_events(raw: list[dict], main) -> list[Event]:
    # Threads that run gloo's collectives: everything on them is a collective in flight.
    gloo_threads = {e["tid"] for e in raw if e["tid"] != main and e["name"].startswith("gloo:")}
    events = []
    for e in raw:
        if e["tid"] == main:
            events.append(_event(e, classify_cpu(e["name"], e["cat"]), "main"))
        elif e["tid"] in gloo_threads:
            events.append(_event(e, "in_flight", f"thread {e['tid']}"))
        elif e["cat"] in ("cpu_op", "user_annotation"):
            events.append(_event(e, "mark", f"thread {e['tid']}"))  # not on the step's path
    return events


def _gpu_events(raw: list[dict], kernels: list[dict], main) -> list[Event]:
    """Device timeline: kernels are compute or (NCCL) communication; a kernel launched from
    inside an optimizer region is also an optimizer region. CPU events stay, as marks, for
    the tables that read names (collectives, waits)."""
    optimizer = iv.union((e["ts"], e["ts"] + e["dur"]) for e in raw
                         if e["name"].startswith(_OPTIMIZER))
    starts = [lo for lo, _ in optimizer]

    def in_optimizer(t: float) -> bool:  # a binary search: kernels x regions would be O(n^2)
        k = bisect_right(starts, t) - 1
        return k >= 0 and t <= optimizer[k][1]

    launched_at = {e["args"].get("correlation"): e["ts"] for e in raw
                   if e["cat"] == "launch" and "correlation" in e.get("args", {})}
    events = []
    for e in kernels:
        stream = f"stream {e.get('args', {}).get('stream', e['tid'])}"
        if "nccl" in e["name"].lower():
            events.append(_event(e, "in_flight", stream))
            continue
        events.append(_event(e, "compute", stream))
        t = launched_at.get(e.get("args", {}).get("correlation"))
        if t is not None and in_optimizer(t):
            events.append(_event(e, "optimizer", stream))
    for e in raw:  # (backward runs on autograd's own thread per GPU: keep every thread)
        if e["cat"] in ("cpu_op", "user_annotation"):
            events.append(_event(e, "mark", "main" if e["tid"] == main else f"thread {e['tid']}"))
    return events
