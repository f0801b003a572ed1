"""Why a launch failed, in the words the learner needs: which rank, what it raised or how it died.

`zero_lab.launch.torchrun()` raises the `LaunchError` built here. The rank that failed first
is the one whose exception was recorded first (the rank side writes rank{r}.error.json with a
timestamp), unless a rank died without one: killed by a signal (the out-of-memory killer's
SIGKILL, a native abort) or ended by a nonzero os._exit. Then the survivors' exceptions
("Connection reset by peer") came after and because of it, and torchrun's own log, which
lists each failed rank's exit code, names the culprit (`_silent_death`). A rank killed by
SIGKILL was most likely ended by the out-of-memory killer; where the killer's count
(`capacity.oom_kills`, read as the launch started) rose during the launch, the error says so
as a fact.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

from zero_lab.launch import capacity


class LaunchError(RuntimeError):
    """A launch failed: a rank raised or died. The message holds its traceback and log paths.

    `rank` is the rank that failed first (None if unknown), `cause` the message's first line
    ("rank 1 of 3 died: killed by signal 9 (SIGKILL)...") and `tail` the last lines of that
    rank's traceback or stderr: what a learner-facing message shows.
    """

    def __init__(self, message: str, run_dir: Path | None = None, rank: int | None = None,
                 cause: str = "", tail: str = ""):
        super().__init__(message)
        self.run_dir = run_dir
        self.rank = rank
        self.cause = cause or message.split("\n", 1)[0]
        self.tail = tail

    def remove_logs(self) -> None:
        """Delete the launch's log folder (a failed launch keeps it for reading): for a failure
        shown on purpose, as notebook 00's are, whose logs nobody will open."""
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing a traceback: the frames inside torchrun()
        # say nothing about the learner's script, and the message already holds the failing
        # rank's own traceback and where its logs are.
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {self}"]


class LaunchTimeout(LaunchError):
    """A launch ran past its timeout (a hang, often a collective some rank never joined)."""



def _recorded_errors(run_dir: Path, nproc: int) -> list[dict]:
    """The exceptions the ranks recorded. A rank stopped (torchrun's SIGTERM, a kill) while it
    wrote its record leaves the file empty or cut short: that rank recorded nothing."""
    errors = []
    for r in range(nproc):
        try:
            errors.append(json.loads((run_dir / f"rank{r}.error.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            continue
    return errors


def log_listing(run_dir: Path, nproc: int) -> str:
    files = [f"  rank {r}: {run_dir / f'rank{r}.out'}  {run_dir / f'rank{r}.err'}"
             for r in range(nproc)]
    return "Logs:\n" + "\n".join(files + [f"  torchrun: {run_dir / 'launcher.log'}"])


def failure(script: Path, nproc: int, run_dir: Path, returncode: int,
            oom_before: capacity.OomKills | None = None) -> LaunchError:
    """Build the error for a failed launch from the rank that failed first.

    That is the rank whose exception was recorded first, unless a rank died without one (see
    `_silent_death`): then it is that rank, with its signal or exit code and its stderr.
    `oom_before`: the out-of-memory killer's count read as the launch started; where it
    rose since, a rank killed by SIGKILL is said to be its victim as a fact.
    """
    errors = sorted(_recorded_errors(run_dir, nproc), key=lambda e: e["time"])
    death = _silent_death(errors, *_rank_exits(run_dir))
    if death is not None:
        rank = death.rank
        head = f"rank {rank} of {nproc} died: {death.describe(script.name, oom_before)}"
        tail = _tail(run_dir / f"rank{rank}.err", 12, skip=_CRASH_REPORT_NOISE)
        body = (f"--- rank{rank}.err (last lines) ---\n{tail}" if tail
                else f"(rank{rank}.err is empty)")
        if errors:
            body += "\nThe other ranks failed after losing it:\n" + "\n".join(
                f"  rank {e['rank']}: {_first_line(e['error'])}" for e in errors)
    elif errors:
        first = errors[0]
        rank = first["rank"]
        body = first["traceback"].rstrip()
        lines = body.splitlines()
        if len(lines) > 40:
            body = "\n".join(["  ..."] + lines[-40:])
        tail = "\n".join(lines[-6:])
        head = f"rank {rank} of {nproc} failed in {script.name}: {first['error']}"
        early = _finished_early(run_dir, nproc, errors)
        if early is not None:
            waiting = ", ".join(str(e["rank"]) for e in errors)
            head = (f"rank {early} of {nproc} finished {script.name} while rank(s) {waiting} "
                    "still waited for it in a collective: every rank must make the same "
                    "collective calls in the same order (shard() on every rank, the same "
                    "number of steps, no rank-only training). Then " + head)
            rank = early
    else:
        # No rank recorded an exception and torchrun named no rank that died: torchrun itself
        # failed (or its log changed form). The stderr tails say what happened.
        rank, tail = None, ""
        head = f"{script.name} on {nproc} ranks failed (torchrun exit code {returncode})"
        killed = oom_before.since() if oom_before is not None else 0
        if killed > 0:  # torchrun itself, say, whose death names no rank
            head += (f"; the out-of-memory killer ended {killed} process(es) meanwhile "
                     f"(oom_kill in {oom_before.file}; {_FEWER})")
        body = "\n".join(
            f"--- {p.name} (last lines) ---\n{_tail(p)}"
            for p in [*(run_dir / f"rank{r}.err" for r in range(nproc)),
                      run_dir / "launcher.log"]
            if p.exists() and p.stat().st_size
        )
    return LaunchError(f"{head}\n{body}\n{log_listing(run_dir, nproc)}", run_dir, rank,
                       cause=head.split("\n", 1)[0], tail=tail)


@dataclass(frozen=True)
class _RankExit:
    """How torchrun saw one rank end: its exit code (negative: killed by signal -code)."""

    rank: int
    code: int
    pid: int

    def describe(self, script: str, oom_before: capacity.OomKills | None = None) -> str:
        """How it ended, in one line, e.g. "killed by signal 9 (SIGKILL) in train.py, most
        likely by the out-of-memory killer (...)"; a fact where the killer's count rose since
        `oom_before` was read."""
        if self.code >= 0:
            return (f"exited with code {self.code} in {script}, without a Python exception "
                    "(os._exit, or native code)")
        try:
            name = signal.Signals(-self.code).name
        except ValueError:
            name = "unknown signal"
        how = f"killed by signal {-self.code} ({name}) in {script}"
        killed = oom_before.since() if oom_before is not None else 0
        if name == "SIGKILL" and killed > 0:
            return (f"{how}: the out-of-memory killer ended it (oom_kill in {oom_before.file} "
                    f"rose by {killed} during the launch; {_FEWER})")
        return how + _SIGNAL_MEANINGS.get(name, "")


# SIGKILL is what the out-of-memory killer sends; little else sends it to one rank alone.
_FEWER = "fewer ranks or a smaller model fit"
_SIGNAL_MEANINGS = {
    "SIGKILL": (", most likely by the out-of-memory killer (the machine or this user's memory "
                f"limit ran out: {_FEWER})"),
    "SIGABRT": ", a native abort (a C++ exception nobody caught, a failed assertion)",
    "SIGSEGV": ", a crash in native code",
    "SIGBUS": ", a crash in native code",
}

# torchrun's failures table in launcher.log ("rank : 1 (local_rank: 1)" then
# "exitcode : -9 (pid: 4242) (SIGKILL)"), and its line for each rank it stops itself.
_TABLE_ENTRY = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:[^)]*\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_STOPPED_BY_TORCHRUN = re.compile(r"Sending process (\d+) closing signal")
# What an exception says when it comes from a peer that went away mid-collective.
_LOST_PEER = re.compile(
    r"Connection (reset|closed|refused)|Broken pipe|by peer|Socket closed|DistNetworkError"
    r"|DistBackendError|remote process exited", re.IGNORECASE)


def _rank_exits(run_dir: Path) -> tuple[dict[int, _RankExit], set[int]]:
    """Each failed rank's exit, from torchrun's log, and the pids torchrun stopped itself."""
    log = run_dir / "launcher.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    exits = {int(r): _RankExit(int(r), int(code), int(pid))
             for r, code, pid in _TABLE_ENTRY.findall(text)}
    return exits, {int(pid) for pid in _STOPPED_BY_TORCHRUN.findall(text)}


def _silent_death(errors: list[dict], exits: dict[int, _RankExit],
                  stopped: set[int]) -> _RankExit | None:
    """The rank that died without a Python exception and so brought the launch down, if any.

    A rank killed by a signal (SIGKILL from the out-of-memory killer, SIGABRT from native
    code) or ended by a nonzero os._exit records no exception. The ranks waiting for it in a
    collective then fail with exceptions of their own ("Connection reset by peer"), and record
    them before torchrun even notices the death, so the earliest record does not name the
    culprit. The rule: a rank that died with no record and was not stopped by torchrun is the
    root cause when every recorded exception is one a lost peer causes, or there is none.
    (A rank that raised first, e.g. the learner's ValueError, stays the root cause.)
    """
    recorded = {e["rank"] for e in errors}
    silent = [x for r, x in sorted(exits.items())
              if x.code != 0 and r not in recorded and x.pid not in stopped]
    if silent and all(_LOST_PEER.search(e["error"]) for e in errors):
        return silent[0]
    return None


def _finished_early(run_dir: Path, nproc: int, errors: list[dict]) -> int | None:
    """A rank that finished its script while the others failed only because a peer went away
    (it skipped a collective they were waiting in, e.g. it never called shard()), if any."""
    recorded = {e["rank"] for e in errors}
    finished = [r for r in range(nproc)
                if r not in recorded and (run_dir / f"rank{r}.finished").exists()]
    if finished and all(_LOST_PEER.search(e["error"]) for e in errors):
        return finished[0]
    return None


def _first_line(text: str) -> str:
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= 200 else line[:197] + "..."


# Lines of faulthandler's crash report that say nothing about the worker script: the frames
# of this entry point and runpy, and the list of extension modules loaded.
_CRASH_REPORT_NOISE = re.compile(
    r'^Extension modules: |^  File "(<frozen runpy>|.*zero_lab/launch/rank_side.py)"')


def _tail(path: Path, n: int = 20, skip: re.Pattern | None = None) -> str:
    """The last `n` lines of a log file ("" if there is none), without those `skip` matches."""
    if not path.exists():
        return ""
    lines = path.read_text(errors="replace").rstrip().splitlines()
    if skip is not None:
        lines = [ln for ln in lines if not skip.search(ln)]
    return "\n".join(lines[-n:])
