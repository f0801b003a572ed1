"""One exercise's child, run: in its sandbox (jail.py), within its limit, ended with all it
started, its answers and the start of what it printed brought back (batch.py judges them).

Every child running is known here, so that an interrupted grader (Ctrl-C, SIGTERM) ends them
all at once (`stop_children`) instead of leaving each to its limit; a grader killed outright
takes them too (bwrap's --die-with-parent).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from zero_lab.grading import jail, sandbox, wire
from zero_lab.grading.offline import offline_prefix
from zero_lab.grading.sandbox import ANSWERS, JOB
from zero_lab.launch.paths import NOTEBOOKS

PRINTED_BYTES = 4096  # of a child's output, kept for the feedback

# Children running now, so that an interrupted grader ends them at once (`stop_children`).
_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()
_STOPPING = threading.Event()


def run_child(job: dict, timeout_s: float, sandboxed: bool = True
              ) -> tuple[list[dict], str, str, float, int | None]:
    """Run sandbox.py on `job` in a sandbox of its own (jail.py; `sandboxed=False`: only a
    new session and a network namespace where unshare allows one); returns (answers, how it
    ended, printed, s, bytes sent). How it ended: "done", "timeout" or "crash: <why>". At the
    limit the whole sandbox is killed, so nothing it started is left. The bytes are those sent
    on the sandbox's loopback from its start to its end, counted outside it (wire.py; None:
    not sandboxed, or its namespace was never found)."""
    with tempfile.TemporaryDirectory(prefix="zero_lab_grade_") as tmp:
        folder = Path(tmp)
        job = dict(job)
        uid = jail.child_uid() if sandboxed else None
        if sandboxed:
            job.update(uid=uid, tasks=jail.TASKS)
            jail.own(folder, uid)
        (folder / JOB).write_bytes(pickle.dumps(job))
        printed = folder / "printed.txt"
        argv = [sys.executable, sandbox.__file__, str(folder)]
        cgroups = jail.make_cgroup() if sandboxed else []
        argv = (jail.joined(cgroups, [*jail.command(folder, uid), *argv]) if sandboxed
                else [*offline_prefix()[0], *argv])
        start = time.monotonic()
        try:
            with open(printed, "wb") as out:
                ended, sent = _run(argv, out, folder, timeout_s, sandboxed)
        finally:
            jail.remove(cgroups)
        seconds = time.monotonic() - start
        try:
            answers = json.loads((folder / ANSWERS).read_text())
        except (OSError, ValueError, RecursionError):
            answers = []
        if not isinstance(answers, list):
            answers = []
        with open(printed, "rb") as f:
            text = f.read(PRINTED_BYTES).decode("utf-8", "replace")
    return answers, ended, text, seconds, sent


def _run(argv: list[str], out, folder: Path, timeout_s: float, sandboxed: bool
         ) -> tuple[str, int | None]:
    """(how the child ended, the bytes sent on its sandbox's loopback: counted from its
    start to after everything it started has ended)."""
    with _LIVE_LOCK:
        if _STOPPING.is_set():
            return "crash: the grader was interrupted", None
        start = time.monotonic()
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True, cwd=folder,
                                 env=_child_env(folder))
        _LIVE.add(child)
    count = wire.Wire(child.pid)
    try:
        try:
            if sandboxed:  # its namespace held open before any learner code runs
                count.watch(lambda: child.poll() is None, timeout_s)
            code = child.wait(timeout=max(0.0, timeout_s - (time.monotonic() - start)))
            ended = "done" if code == 0 else f"crash: {_exit_reason(code)}"
        except subprocess.TimeoutExpired:
            ended = "timeout"
        finally:
            _kill_session(child)
            with _LIVE_LOCK:
                _LIVE.discard(child)
        return ended, count.sent()  # everything in the namespace has ended: its final count
    finally:
        count.close()


def allow_children() -> None:
    """A new run may start children again (after `stop_children`)."""
    _STOPPING.clear()


def stop_children() -> None:
    """End every child now and start no other (Ctrl-C, SIGTERM): each one's session, and with
    it its sandbox, whose PID namespace takes everything it started."""
    with _LIVE_LOCK:
        _STOPPING.set()
        live = list(_LIVE)
    for child in live:
        _kill_session(child)


def _child_env(folder: Path) -> dict:
    # Only what Python and the launch need: the grader's own environment can hold the seed
    # (make passes SEED=... in MAKEFLAGS) or an instructor's tokens.
    env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
           if k in os.environ}
    env.update(PYTHONPATH=str(NOTEBOOKS.parent), HOME=str(folder), TMPDIR="/tmp",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               ZERO_LAB_RUNS_DIR=str(folder / "runs"))
    return env


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _kill_session(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()
