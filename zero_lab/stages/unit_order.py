"""Stage 3: the order a step runs its units in, learnt once, prefetched from, checked.

The first forward and the first backward record the order they run their units in; from
then on, when a unit starts, the next `depth` units of that order start their all-gathers
(prefetch: the gather overlaps the unit's compute; `depth` + 1 units gathered at most). The
reduce-scatters go out in the reverse of the forward order (backward completes units so).

The ranks must gather the same units in the same order: an all-gather pairs with whatever
all-gather the other ranks issue (lockstep.py). So the order is checked: before every
all-gather of the first forward (and of every forward with `check_order=True`), and once at
the end of every forward, by the fingerprint of the order it ran. A forward that leaves the
recorded order (a branch on one rank) stops prefetching and gathers each unit when it is
called, so every rank still issues one all-gather per call and the checks can name the unit.
"""

from __future__ import annotations

from zero_lab.stages.accumulation import FORWARDS_DIFFER, describe_forward, forward_fingerprint
from zero_lab.stages.lockstep import Lockstep


class UnitOrder:
    """The recorded orders, what each unit prefetches, and the ranks' checks on them."""

    def __init__(self, units: list, depth: int, check_order: bool) -> None:
        self.units = units
        self.depth = depth  # units gathered ahead of the one computing
        self.check_order = check_order  # check every all-gather of every forward
        self._order_lockstep: Lockstep | None = None  # check_order without check_lockstep
        self.forward_order: list[int] | None = None  # recorded on the first forward
        self.backward_order: list[int] | None = None  # recorded on the first backward
        self._forward_record: list[int] | None = []  # the first forward's, until it ends
        self._backward_record: list[int] = []
        self.gathers: list[int] | None = None  # units this forward gathered, in order
        self._position, self._derailed = 0, False  # where this forward is in `forward_order`
        # phase -> unit -> the units to gather ahead when it starts (the next `depth` ones)
        self._ahead: dict[str, dict[int, list[int]]] = {"forward": {}, "backward": {}}

    def forward_starts(self) -> None:
        self.gathers = []
        self._position, self._derailed = 0, False

    def next_units(self, phase: str, u: int) -> list[int]:
        """Unit u has started `phase`: the units to gather ahead now. The first forward and
        the first backward are recorded; a later forward prefetches only while it runs its
        units in the recorded order (a unit called again prefetches nothing; a unit out of
        that order ends prefetching for the rest of the forward)."""
        if phase == "backward":
            if self.backward_order is None and u not in self._backward_record:
                self._backward_record.append(u)
            return self._ahead["backward"].get(u, [])
        if self._forward_record is not None:  # the first forward: recorded, nothing ahead
            if u not in self._forward_record:
                self._forward_record.append(u)
            return []
        order, at = self.forward_order, self._position
        if self._derailed or at >= len(order) or order[at] != u:
            self._derailed |= u not in order[:at]  # another path, not a second call of a unit
            return []
        self._position += 1
        return self._ahead["forward"].get(u, [])

    def before_gather(self, u: int, sync) -> None:
        """Unit u's all-gather is about to go out (`sync`: the stage, zero3.Zero3): in the first
        forward, or with check_order, the ranks check first that they gather the same unit.

        It is a synchronisation per all-gather, so by default only the first forward pays it:
        that forward learns the order later ones prefetch in, and a branch that depends on the
        rank is there from the first step. A later forward is checked once, at its end, which
        a rank that gathers another unit may never reach: a branch on the data, first taken at
        a later step, hangs or aborts there unless check_order=True, a debug aid."""
        if self.check_order or self._forward_record is not None:
            checker = sync.lockstep
            if self.check_order and not checker.enabled:
                if self._order_lockstep is None:  # check_lockstep=False: still checks
                    self._order_lockstep = Lockstep(None, self.units[u].local.device)
                checker = self._order_lockstep
            gathers = self.gathers  # None outside a forward (check_order's in backward)
            checker.check("gather", u, steps=sync.lockstep.steps, detail=lambda: {
                "unit": self.units[u].name,
                "after": None if gathers is None else [self.units[g].name for g in gathers]})
        if self.gathers is not None:
            self.gathers.append(u)

    def forward_ends(self, sync) -> None:
        """Learn the first forward's order; then the ranks compare this forward's (24 bytes a
        rank, lockstep.py): an order that depends on the rank paired each unit's all-gather
        with another unit's, so every rank raises now, before backward pairs more of them."""
        if self._forward_record is not None:
            order, self._forward_record = self._forward_record, None
            self.forward_order = order
            self._learn("forward", order)
            unused = [u for u in range(len(self.units)) if u not in order]
            sync.handover_order = order[::-1] + unused  # reduce-scatters: backward's order
        gathers, self.gathers = self.gathers or [], None
        n, syncs = sync.lockstep.backwards, sync.requires_sync  # (accumulation.py)
        sync.lockstep.check("forward", forward_fingerprint(gathers, n, syncs),
                            detail=lambda: describe_forward(
                                [self.units[u].name for u in gathers], n, syncs),
                            why=FORWARDS_DIFFER)

    def backward_ends(self, completed: bool = True) -> None:
        """Learn the first backward's order; from a backward that raised, learn nothing."""
        if self.backward_order is None:
            if completed and self._backward_record:
                self.backward_order = self._backward_record
                self._learn("backward", self.backward_order)
            self._backward_record = []

    def _learn(self, phase: str, order: list[int]) -> None:
        self._ahead[phase] = {u: order[i + 1:i + 1 + self.depth] for i, u in enumerate(order)}
