"""The ranks move in lockstep, or every rank says which one did not.

Data parallelism pairs the ranks' collectives by their order: the k-th collective of rank 0
meets the k-th of rank 1. A training loop that lets the ranks drift apart breaks the pairing
without a word:

- one rank calls `opt.step()` once more than the others (a condition on rank-local data,
  a retry): at stages 1-2 its all-gather meets the others' next reduce-scatter and everyone
  hangs; at stages 0 and 3 the step sends nothing, so the ranks train on, apart, in silence;
- at stage 3, a forward whose units run in a rank-dependent order: each unit's all-gather
  meets another unit's on the other rank (of the same size, it succeeds), every rank computes
  with a mix of two layers' weights, and the next collective of another size hangs.

So once per step the ranks compare where they are, with one all-gather of three integers
(24 bytes a rank): what they are about to do (`PHASES`), how many optimizer steps they have
taken, and, at stage 3, a fingerprint of the order this forward ran its units in. If any
rank differs, every rank raises the same error naming the ranks and what each was doing,
in the step where it happened, before the next collective could pair wrongly.

Where the check goes, so that a rank that drifted still meets the others' check:
- stages 0-2: before the first collective of each step (each send of a gradient bucket
  asks, the first one checks; or a broadcast of changed buffers before forward, or, in an
  `opt.step()` with no backward since the last step, the step's all-gather). A rank stepping once
  more checks in that extra step; the others check at their next backward: the two checks
  meet, and the phases differ.
- stage 3: at the end of every forward, after its units were gathered in its order (the
  steps send nothing, so an extra step is seen at the next forward by its count).

It costs one small blocking all-gather a step (about the latency of one collective; `make
bench` measures it against stage 3 with `check_lockstep=False`). A CommLedger keeps it apart
from the data (`ledger.control`), so volumes stay the ZeRO paper's; a profiler trace names it
"check / lockstep". torch's DDP and FSDP2 do not check this (they hang, or train apart);
`shard(..., check_lockstep=False)` turns it off.

Stage 3 also checks before a unit's all-gather ("gather": the unit's index in place of the
fingerprint), in the first forward, which has no learnt order yet, and, with
`check_order=True`, in every forward. A forward-end check is the same message, so a rank about
to gather one unit more than the others meets their forward-end check and every rank raises,
naming the unit: a branch that calls a unit on some ranks only is named at that unit
("the ranks' forwards differ: rank 0 gathers unit 'extra' while the ranks gather
{0: 'extra', 1: 'layers.2'} ..."), before its all-gather pairs with another unit's (units of
one size silently, of different sizes with gloo aborting a rank) or waits for ever.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from zero_lab.collectives.ledger import control_message
from zero_lab.profiling.marks import LOCKSTEP_CHECK, mark

# What a rank is about to do when it checks (the first integer it sends).
PHASES = {"forward": 1, "backward": 2, "step": 3, "buffers": 4, "state": 5, "gather": 6}
_DOING = {
    "forward": "ended a forward",
    "backward": "started a backward",
    "step": "is in an opt.step() with no backward since its last step",
    "buffers": "started a training forward",
    "state": "is in full_state_dict()",
    "gather": "is about to all-gather a unit",
}
# What the "gather" check says when the ranks would gather different units (or one would
# gather a unit and the others have ended their forward): the likely cause and its fixes.
GATHERS_DIFFER = (
    "Stage 3 pairs each unit's all-gather with the same-numbered all-gather of the other "
    "ranks, so every rank must call the same units in the same order. Look for a branch "
    "around a unit's call that depends on the rank (`if dist.get_rank() == 0:`) or on this "
    "rank's data (`if x.abs().max() > 1:`): call the unit on every rank (and drop its output "
    "where it is not wanted), or take the branch on every rank alike (decide it from an "
    "all-reduced value)")


class Lockstep:
    """Compare (phase, steps taken, fingerprint) across the ranks of one process group."""

    def __init__(self, process_group, device: torch.device, enabled: bool = True) -> None:
        self.process_group = process_group
        self.device = device
        self.world_size = dist.get_world_size(process_group) if enabled else 1
        self.enabled = self.world_size > 1
        # What a rank counts, checked or not: optimizer steps taken, backwards since the last
        # one (micro-batches under no_sync), and whether this step was checked already.
        self.steps = 0
        self.backwards = 0
        self.checked_this_step = False

    def once_a_step(self, phase: str, why: str | None = None) -> None:
        """Stages 0-2: the first collective of this step is about to go out (a backward's
        first bucket, changed buffers, or a step's all-gather when no backward came since
        the last step): check once a step. A rank that drifted meets the others' check with
        its own, so the check cannot pair wrongly. The fingerprint is the number of
        backwards since the last step: under no_sync the first collective is the last
        micro-batch's, so ranks that accumulated different numbers of micro-batches differ
        here (`why` says so)."""
        if not self.checked_this_step:
            self.checked_this_step = True
            n = self.backwards
            self.check(phase, n, why=why,
                       detail=(lambda: f"{n} backward(s) since its last step") if n else None)

    def step_taken(self) -> None:
        self.steps += 1
        self.backwards = 0
        self.checked_this_step = False

    def check(self, phase: str, fingerprint: int = 0,
              detail: Callable[[], str | dict] | None = None, why: str | None = None,
              steps: int | None = None) -> None:
        """Raise RuntimeError on every rank if the ranks differ in (phase, optimizer steps
        taken: `steps`, by default this rank's count, fingerprint). `detail()` says in words
        what the fingerprint stands for (stage 3: the units in the order they ran; for
        "gather", a dict: the unit's name and the units this forward gathered before it); it
        is called, and gathered from every rank, only when the ranks differ. `why` explains a
        difference in the fingerprint alone (default: stage 3's unit order)."""
        if not self.enabled:
            return
        mine = torch.tensor([PHASES[phase], self.steps if steps is None else steps, fingerprint],
                            dtype=torch.int64, device=self.device)
        everyone = mine.new_empty(self.world_size, 3)  # row r: rank r's three integers
        with mark(LOCKSTEP_CHECK), control_message("all_gather", everyone, self.world_size,
                                                    "zero_lab.stages.lockstep"):
            dist.all_gather_single(everyone.view(-1), mine, group=self.process_group)
        if not torch.equal(everyone, mine.expand_as(everyone)):
            self._differ([tuple(row) for row in everyone.tolist()], detail, why)

    def _differ(self, rows: list[tuple[int, int, int]],
                detail: Callable[[], str | dict] | None, why: str | None) -> None:
        """The ranks differ (every rank found the same rows): every rank raises the same
        error, after one more gather, of what each rank's fingerprint stands for."""
        details: list = [None] * self.world_size
        dist.all_gather_object(details, detail() if detail else "", group=self.process_group)
        if PHASES["gather"] in {row[0] for row in rows} and len({row[1] for row in rows}) == 1:
            me = dist.get_rank(self.process_group)
            raise RuntimeError(_units_differ(rows, details, me))
        raise RuntimeError(_disagreement(rows, details, why))


def _units_differ(rows: list[tuple[int, int, int]], details: list, me: int) -> str:
    """Stage 3, the same steps taken: some rank is about to all-gather a unit, and another
    one another unit, or none (it ended its forward). Rank `me` says what it does first."""
    names = {code: name for name, code in PHASES.items()}
    gathering, after = {}, None
    for r, ((phase, _, _), detail) in enumerate(zip(rows, details, strict=True)):
        if names[phase] == "gather":
            gathering[r] = detail["unit"]
            if after is None:  # the checks before it passed: the same on every gathering rank
                after = detail["after"]
        else:
            gathering[r] = "(forward ended)" if names[phase] == "forward" else (
                f"({_DOING[names[phase]]})")
    doing = (f"gathers unit {gathering[me]!r}" if names[rows[me][0]] == "gather"
             else "ended its forward" if names[rows[me][0]] == "forward"
             else _DOING[names[rows[me][0]]])
    return (f"the ranks' forwards differ: rank {me} {doing} while the ranks gather "
            f"{gathering} ({_position(after)}). {GATHERS_DIFFER}")


def _position(after: list[str] | None) -> str:
    """Where the all-gather is: "all-gather 3 of the forward, after a, b"."""
    if after is None:  # check_order's checks in backward
        return "in backward"
    if not after:
        return "all-gather 1 of the forward"
    shown = ", ".join(after) if len(after) <= 8 else f"..., {', '.join(after[-4:])}"
    return f"all-gather {len(after) + 1} of the forward, after {shown}"


def _disagreement(rows: list[tuple[int, int, int]], details: list[str],
                  fingerprint_why: str | None = None) -> str:
    names = {code: name for name, code in PHASES.items()}
    ranks = "; ".join(
        f"rank {r} {_DOING[names[phase]]} ({steps} optimizer steps taken"
        + (f"; {detail})" if detail else ")")
        for r, ((phase, steps, _), detail) in enumerate(zip(rows, details, strict=True)))
    if len({row[1] for row in rows}) > 1 or len({row[0] for row in rows}) > 1:
        why = ("the ranks have taken different numbers of optimizer steps, or one steps "
               "where another computes: every rank must call forward, backward and "
               "opt.step() the same number of times, in the same order (no rank-dependent "
               "`if` around them)")
    elif fingerprint_why:
        why = fingerprint_why
    else:
        why = ("the ranks ran the units of this forward in different orders: at stage 3 each "
               "unit's all-gather meets the same-numbered all-gather on the other ranks, so "
               "every rank must call the same units in the same order (no rank-dependent "
               "control flow around units)")
    return f"the ranks left lockstep: {ranks}. {why}"
