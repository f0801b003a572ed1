"""The bytes an exercise's ranks really sent, counted where their code cannot reach.

Every report of a graded exercise on ranks comes from the processes the learner's code runs
in, so that code can rewrite any of it: the values, and the record of the collectives it
issued (issue 49: a ledger rewritten on every rank, a report file written with no collective
at all). One number it cannot lower: the kernel's count of the bytes sent on its sandbox's
loopback. Each child runs in a network namespace of its own (jail.py), its ranks meet on
that namespace's `lo`, and the kernel counts every byte sent there, headers and handshakes
included; code inside can add to the count, never take from it.

`Wire(pid)` watches the child started as `pid` (bwrap) from outside: it finds the first
process bwrap starts in the new namespace and opens that process's /proc/<pid>/net/dev
before any learner code runs. The open file holds the namespace (the kernel keeps it while
the file is open), so once the child and everything it started have ended, reading it again
gives the namespace's final count (`sent`). No setns, no privilege beyond reading the
child's /proc, which the grader has (root, or the sandbox's owner).

`floor(reports)`: the fewest bytes the ranks must have put on the wire for what they report,
summed over ranks and cases: each collective they record at the least any algorithm sends
for it (a reduce-scatter or an all-gather of `nbytes` on N ranks: (N-1)/N x nbytes from each
rank's record, an all-reduce twice that, a send its message), the ring's reported bytes, and
the all-gather the rank script itself runs for notebook 03's owned slices. A correct run puts
all of that and more on `lo` (TCP/IP headers, gloo's handshakes, the rendezvous), so a count
below the floor means the reports claim collectives that never ran (`disagreement`, `gate`).
Notebook 03's sharded step, seed 49: the reference sent 576,132 bytes for a floor of 498,528;
ranks that wrote their report and sent nothing, 1,320.

`ceiling(reports)`: the most they may send for it, UP x the floor plus SLACK bytes of
headers, handshakes and the runner's own small messages. On gloo the rank runner sends the
learner's reduce-scatters as real ones (course/exercises.py, send_reduce_scatters_directly:
torch 2.13's is an all-reduce on the wire), so a step that all-reduces the gradient and
rewrites its ledger to read as a reduce-scatter sends 1.5x its claim and is over. Notebook
03's sharded step, seed 49: floor 498,528 bytes, ceiling 698,233; the reference sent 576,132,
the relabelled step 874,636. Seed 121, the smallest floor of seeds 0-299 (366,432; ceiling
539,718): 416,304 and 639,272. Where the cases move less than the overhead (notebook 04's hook,
05's: 1-60 KB against 14-47 KB of overhead) a relabelled collective stays under the ceiling:
the count backs every claim there, but cannot say which collective carried the bytes. Nor
does it see bytes moved another way (files in the sandbox's /tmp).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOPBACK = "lo"
POLL_S = 0.002  # how often the watcher looks for the namespace's first process


def _netns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
    return found


class Wire:
    """The loopback of the network namespace the process `pid` starts its children in."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd: int | None = None
        self._ours = _netns("self")

    def watch(self, alive, deadline_s: float = 30.0) -> bool:
        """Look for the namespace until found, `alive()` is False or the deadline passes;
        True once its counters are held open."""
        end = time.monotonic() + deadline_s
        while self.fd is None and alive() and time.monotonic() < end:
            for child in _children(self.pid):
                ns = _netns(child)
                if ns is not None and ns != self._ours:
                    with contextlib.suppress(OSError):
                        self.fd = os.open(f"/proc/{child}/net/dev", os.O_RDONLY)
                        # The child may have become another process between the two reads.
                        if _netns(child) != ns:
                            os.close(self.fd)
                            self.fd = None
                    if self.fd is not None:
                        break
            else:
                time.sleep(POLL_S)
        return self.fd is not None

    def sent(self) -> int | None:
        """Bytes sent on the namespace's loopback since it was made (None: never found)."""
        if self.fd is None:
            return None
        os.lseek(self.fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(self.fd, 65536):
            chunks.append(chunk)
        return lo_sent(b"".join(chunks).decode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def lo_sent(net_dev: str) -> int | None:
    """The loopback's transmitted bytes in the text of /proc/net/dev."""
    for line in net_dev.splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == LOOPBACK and counters:
            fields = counters.split()
            return int(fields[8])  # 8 receive counters, then transmit: bytes first
    return None


# ------------------------------------------------------------------------- the floor


# The share of a recorded collective of `nbytes` on N ranks that must cross the wire, per
# rank that records it: an all-gather's output and a reduce-scatter's input hold N chunks, of
# which each rank must receive (or contribute) N-1; an all-reduce is both; a broadcast or a
# reduce moves N-1 copies in all, recorded by N ranks; gather and scatter record N chunks on
# every rank and move N-1 of them in all. A recv or a barrier moves no payload of its own.
def _least(op: str, nbytes: int, n: int) -> float:
    if n < 2 or nbytes <= 0:
        return 0.0
    share = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
             "all_gather": (n - 1) / n, "all_to_all": (n - 1) / n, "broadcast": (n - 1) / n,
             "reduce": (n - 1) / n, "gather": (n - 1) / n**2, "scatter": (n - 1) / n**2,
             "send": 1.0}
    return share.get(op, 0.0) * nbytes


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return 0.0
    return max(0.0, min(float(value), 2.0**62))


def _claimed(value, n: int, depth: int = 0) -> float:
    """What a rank's record of one case claims was sent: its collectives ("comm", "*_comm")
    and the bytes the ring reports ("sent_bytes"), wherever they sit in the record."""
    if depth > 8:
        return 0.0
    total = 0.0
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "sent_bytes":
                total += _number(item)
            elif isinstance(key, str) and (key == "comm" or key.endswith("_comm")) \
                    and isinstance(item, list):
                total += sum(_least(c["op"], int(_number(c.get("nbytes"))), n)
                             for c in item if isinstance(c, dict) and isinstance(c.get("op"), str))
            else:
                total += _claimed(item, n, depth + 1)
    elif isinstance(value, list):
        total += sum(_claimed(item, n, depth + 1) for item in value)
    return total


def _owned_range_gathers(reports: list, n: int) -> float:
    """The rank script's own all-gather of each case whose slices all have one size: every
    rank receives the N-1 slices it does not own, 8 bytes an element (float64)."""
    total = 0.0
    by_case: dict = {}
    for report in reports:
        results = report.get("results") if isinstance(report, dict) else None
        for record in results if isinstance(results, list) else []:
            if isinstance(record, dict) and isinstance(record.get("case"), int):
                by_case.setdefault(record["case"], []).append(record.get("got"))
    for got in by_case.values():
        if len(got) == n and all(isinstance(g, list) and len(g) == 2
                                 and all(isinstance(v, int) for v in g) for g in got):
            sizes = {g[1] - g[0] for g in got}
            if len(sizes) == 1 and (size := sizes.pop()) > 0:
                total += (n - 1) * n * min(size, 2**40) * 8
    return total


def floor(check: str, reports: list) -> int:
    """The fewest bytes the ranks of `check` must have sent on `lo` for what they report."""
    n = len(reports)
    total = sum(_claimed(r.get("results"), n) for r in reports if isinstance(r, dict))
    if check == "check_owned_range":
        total += _owned_range_gathers(reports, n)
    return int(total)


UP = 1.2  # the reference: 1.16x its floor at seed 49 (1.37x only where SLACK covers it)
SLACK = 100_000  # headers, handshakes, the runner's gathers of answers: 14-118 KB a launch


def ceiling(check: str, reports: list) -> int:
    """The most bytes the ranks of `check` may send on `lo` for what they report."""
    return int(UP * floor(check, reports)) + SLACK


def disagreement(check: str, reports: list, sent: int) -> str | None:
    """Why `sent` bytes on the wire cannot be what the ranks report (None: they can)."""
    least, most = floor(check, reports), ceiling(check, reports)
    if sent < least:
        return (f"the ranks' bytes on the wire disagree with their reports: they report "
                f"collectives that send at least {least:,} bytes between them, and the kernel "
                f"counted {sent:,} bytes on their loopback, headers included. A report the "
                "function's own code wrote or changed is not graded")
    if sent > most:
        return (f"the ranks' bytes on the wire disagree with their reports: the kernel counted "
                f"{sent:,} bytes on their loopback, more than the {most:,} that the collectives "
                f"they report send, headers included ({least:,} at the least). A collective "
                "recorded as one that sends less (an all-reduce as a reduce-scatter) is not "
                "graded")
    return None


def gate(check: str, reports, sent: int | None, sandboxed: bool) -> str | None:
    """Why the reports of a sandboxed child's ranks are not graded (None: they may be).
    Without a sandbox, or where this machine cannot count (`works`), nothing is checked."""
    if not sandboxed or not works():
        return None
    if sent is None:
        return ("the grader could not count the bytes the ranks sent (their sandbox's network "
                "namespace was not found in time); grade this exercise again")
    return disagreement(check, reports if isinstance(reports, list) else [], sent)


def note(sandboxed: bool) -> str:
    """What the count held on this machine, for the start of a run and summary.md."""
    if sandboxed and works():
        return ("The bytes each exercise's ranks sent on their loopback were counted by the "
                "kernel outside their reach; reports claiming collectives those bytes cannot "
                "carry, or far fewer than they carry, scored 0.")
    why = "no sandbox" if not sandboxed else "this machine could not count a sandbox's loopback"
    return (f"The bytes the ranks sent were not counted ({why}): their reports of their own "
            "collectives were taken as given.")


PROBE_BYTES = 100_000


@functools.lru_cache(maxsize=1)
def works() -> bool:
    """Can this machine count a sandbox's loopback? Tried once: a child sends PROBE_BYTES to
    itself over 127.0.0.1 in a sandbox (jail.py), and the count must hold them."""
    from zero_lab.grading import jail

    if not jail.available()[0]:
        return False
    probe = ("import socket; a = socket.create_server(('127.0.0.1', 0)); "
             "b = socket.create_connection(a.getsockname()); c, _ = a.accept(); "
             f"b.sendall(bytes({PROBE_BYTES})); n = 0\n"
             f"while n < {PROBE_BYTES}: n += len(c.recv(1 << 16))")
    with tempfile.TemporaryDirectory(prefix="zero_lab_wire_") as tmp:
        uid = jail.child_uid()
        jail.own(Path(tmp), uid)
        try:
            child = subprocess.Popen([*jail.command(Path(tmp), uid), sys.executable, "-c",
                                      probe], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        except OSError:
            return False
        count = Wire(child.pid)
        try:
            count.watch(lambda: child.poll() is None, 20.0)
            child.wait(timeout=30)
            sent = count.sent()
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            sent = None
        finally:
            count.close()
    return sent is not None and sent >= PROBE_BYTES
