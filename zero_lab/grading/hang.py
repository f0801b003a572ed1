"""Where the ranks of a graded launch were when it ran past its limit, and what that means.

Just before the limit, every rank still running writes its Python stacks
(`zero_lab.course.exercises.dump_stacks_at`, with faulthandler, which works even while a rank
is blocked inside gloo). A stack says one of two things, and they need different advice:

- the rank waits in a collective (`dist.recv`, `dist.all_reduce`, a `.wait()` on a request):
  the ranks' collectives do not pair up;
- the rank runs Python code of its own, in no collective: a loop that does not end, or far
  more work than the case needs.

A fixed "a collective mismatch" hint blamed the first for the second (issue 37).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from zero_lab.course.exercises import LEARNER_FILE

_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>\S+)')
# The functions of torch.distributed a rank can wait in for another rank. Only these count:
# dist.get_rank() and the properties behind it (GroupMember.WORLD) live in the same file and
# return at once, so a rank caught in them is running, not waiting.
COLLECTIVES = frozenset({
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast", "all_reduce",
    "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter",
    "barrier", "monitored_barrier", "all_gather_object", "gather_object",
    "broadcast_object_list", "scatter_object_list", "send_object_list", "recv_object_list",
    "all_reduce_coalesced", "all_gather_coalesced", "wait"})


@dataclass(frozen=True)
class Place:
    """Where one rank was: `waiting_in` a collective (None: running its own code), inside the
    learner's `function` (None: in the grading script's own code) at `code`."""

    rank: int
    waiting_in: str | None
    function: str | None
    code: str

    def says(self) -> str:
        at = (f"in your {self.function}()" + (f" at `{self.code}`" if self.code else "")
              if self.function else "in the grading script, outside your function")
        if self.waiting_in:
            return f"rank {self.rank} was waiting in {self.waiting_in} {at}"
        return f"rank {self.rank} was running {at}, in no collective"


def places(run_dir: Path | None, ranks: list[int], learner_source: str) -> list[Place]:
    """The place of each rank in `ranks` that wrote its stacks (the others are left out)."""
    if run_dir is None:
        return []
    lines = learner_source.splitlines()
    found = []
    for rank in ranks:
        try:
            text = (run_dir / f"rank{rank}.stacks").read_text(errors="replace")
        except OSError:
            continue
        place = _place(rank, text, lines)
        if place is not None:
            found.append(place)
    return found


def _place(rank: int, text: str, learner_lines: list[str]) -> Place | None:
    # faulthandler lists each thread's frames, most recent call first. The thread that runs
    # the exercise is the one whose frames reach the rank script; pick the first such.
    for block in text.split("\n\n"):
        frames = [m.groupdict() for m in map(_FRAME.match, block.splitlines()) if m]
        if not any("zero_lab" in f["file"] for f in frames):
            continue
        learner = next((i for i, f in enumerate(frames) if f["file"] == LEARNER_FILE), None)
        inner = frames[:learner] if learner is not None else frames
        waiting = next((f["func"] for f in reversed(inner)
                        if f["file"].replace("\\", "/").endswith("distributed_c10d.py")
                        and f["func"] in COLLECTIVES), None)
        if learner is None:
            return Place(rank, f"dist.{waiting}" if waiting else None, None, "")
        frame = frames[learner]
        number = int(frame["line"])
        code = learner_lines[number - 1].strip() if 0 < number <= len(learner_lines) else ""
        if waiting is None and re.search(r"\.wait\(\s*\)", code):
            waiting = "a request's .wait()"
        elif waiting is not None:
            waiting = f"dist.{waiting}"
        return Place(rank, waiting, frame["func"], code[:120])
    return None


def all_waiting(found: list[Place]) -> bool:
    """Did every rank that said where it was wait in a collective?"""
    return bool(found) and all(p.waiting_in for p in found)


def running_hint(found: list[Place]) -> str:
    """The advice when some rank was running its own code, not waiting."""
    busy = [p for p in found if not p.waiting_in]
    names = ", ".join(str(p.rank) for p in busy)
    return (f"rank {names} never reached its next collective: look for a loop that does not "
            "end, or work far beyond the case (the reference finishes each case in well under "
            "a second); the other ranks were waiting for it")
