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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from zero_lab.profiling.capture import STEP
from zero_lab.profiling.marks import COLLECTIVES, OPTIMIZER_STEP, WAIT

KINDS = ("compute", "comm", "in_flight", "optimizer", "mark")
_COMM_OPS = ("c10d::", "_c10d_functional::", "aten::wait_tensor", "record_param_comms")
_IN_FLIGHT = ("gloo:", "nccl:")
_OPTIMIZER = (OPTIMIZER_STEP, "Optimizer.step#")


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
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable Chrome-trace JSON ({exc})") from None
    raw = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if not raw:
        raise ValueError(f"{path}: no complete ('X') events; is it a torch.profiler trace?")
    info = data.get("distributedInfo", {})
    main = _training_thread(raw)
    kernels = [e for e in raw if e.get("cat") == "kernel"]
    events = _gpu_events(raw, kernels, main) if kernels else _cpu_events(raw, main)
    step_marks = [e for e in raw if e["name"] == STEP and e["tid"] == main]
    if not step_marks:
        step_marks = [e for e in raw if e["name"].startswith("ProfilerStep#")]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in step_marks)
    device_type = 1 if kernels else 0
    memory = sorted((e["ts"], int(e["args"]["Total Allocated"])) for e in
                    data["traceEvents"] if e.get("name") == "[memory]"
                    and e.get("args", {}).get("Device Type") == device_type)
    return Trace(rank=int(info.get("rank", 0)), world_size=int(info.get("world_size", 1)),
                 events=events, steps=steps, memory=memory,
                 timeline="cuda" if kernels else "cpu", path=path)


def _training_thread(raw: list[dict]):
    """The thread that ran the steps: the one with the "train step" (or ProfilerStep) marks,
    else the one with the most op time."""
    for name in (STEP, "ProfilerStep#"):
        tids = {e["tid"] for e in raw if e["name"].startswith(name)}
        if len(tids) == 1:
            return tids.pop()
    busy: dict = {}
    for e in raw:
        if e.get("cat") == "cpu_op":
            busy[e["tid"]] = busy.get(e["tid"], 0) + e["dur"]
    return max(busy, key=busy.get)


def _event(e: dict, kind: str, track: str) -> Event:
    return Event(e["name"], float(e["ts"]), float(e["ts"] + e["dur"]), kind, track,
                 e.get("args", {}))


def _cpu_events(raw: list[dict], main) -> list[Event]:
    # Threads that run gloo's collectives: everything on them is a collective in flight.
    gloo_threads = {e["tid"] for e in raw if e["tid"] != main and e["name"].startswith("gloo:")}
    events = []
    for e in raw:
        if e["tid"] == main:
            events.append(_event(e, classify_cpu(e["name"], e.get("cat", "")), "main"))
        elif e["tid"] in gloo_threads:
            events.append(_event(e, "in_flight", f"thread {e['tid']}"))
        elif e.get("cat") in ("cpu_op", "user_annotation"):
            events.append(_event(e, "mark", f"thread {e['tid']}"))  # not on the step's path
    return events


def _gpu_events(raw: list[dict], kernels: list[dict], main) -> list[Event]:
    """Device timeline: kernels are compute or (NCCL) communication; a kernel launched from
    inside an optimizer region is also an optimizer region. CPU events stay, as marks, for
    the tables that read names (collectives, waits)."""
    optimizer = [(e["ts"], e["ts"] + e["dur"]) for e in raw
                 if e["name"].startswith(_OPTIMIZER)]
    launched_at = {e["args"].get("correlation"): e["ts"] for e in raw
                   if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    events = []
    for e in kernels:
        stream = f"stream {e['args'].get('stream', e['tid'])}"
        if "nccl" in e["name"].lower():
            events.append(_event(e, "in_flight", stream))
            continue
        events.append(_event(e, "compute", stream))
        t = launched_at.get(e["args"].get("correlation"))
        if t is not None and any(lo <= t <= hi for lo, hi in optimizer):
            events.append(_event(e, "optimizer", stream))
    for e in raw:  # (backward runs on autograd's own thread per GPU: keep every thread)
        if e.get("cat") in ("cpu_op", "user_annotation"):
            events.append(_event(e, "mark", "main" if e["tid"] == main else f"thread {e['tid']}"))
    return events
