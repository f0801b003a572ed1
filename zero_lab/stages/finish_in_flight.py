"""What a stage 1-2 may leave in flight between backward, the step and the next forward.

Part of every stage's base class (`GradientSync` inherits it): with shard()'s overlap options
the all-gathers of updated parameters stay in flight for the next forward to wait on
(param_gather.py), and with `overlap_step` the last gradient reductions stay in flight for the
optimizer to step bucket by bucket (reductions_in_flight.py). Whatever reads parameters or gradients
outside that order calls one of these first; with no overlap they do nothing.
"""

from __future__ import annotations

from zero_lab.stages.param_gather import ParamGather
from zero_lab.stages.reductions_in_flight import InFlight


class InFlightWork:
    """The collectives a stage left in flight, and the ways to finish them."""

    def init_in_flight(self) -> None:
        # Overlap (shard()'s options, stages 1-2): the all-gathers of updated parameters left
        # in flight for the next forward (param_gather.py), and reductions left in flight
        # after backward for the optimizer to step bucket by bucket (`overlap_step`).
        self.param_gather: ParamGather | None = None
        self.reductions: InFlight | None = None  # stages 1-2: reductions sent, not landed
        self.overlap_step = False

    def all_gather_params(self, gs: list[int] | None = None) -> None:
        """Stages 1 and 2, after the optimizer step: every rank's updated slice -> the full
        parameters everywhere, one all_gather_single per group (not N broadcasts); with
        overlap_param_gather only issued, for the next forward to wait on (param_gather.py)."""
        if self.param_gather is not None:
            self.param_gather.issue(gs)
            return
        for g in range(len(self.groups)) if gs is None else gs:
            group = self.groups[g]
            group.all_gather(group.flat, group.shard(group.flat))  # in place

    # ------------------------------------------------------------------ what is in flight
    def wait_for_params(self) -> None:
        """Every parameter whole and up to date: the all-gathers opt.step() left in flight
        (overlap_param_gather) are finished. Nothing to do otherwise."""
        if self.param_gather is not None:
            self.param_gather.wait_all()

    def finish_reductions(self) -> None:
        """Every gradient reduction still in flight has landed (stages 1-2 send them)."""
        if self.reductions is not None:
            self.reductions.land(keep=0)

    def land_through(self, g: int) -> None:
        """overlap_step: group g's reduction (and those sent before it) has landed."""
        if self.reductions is not None:
            self.reductions.land_through(g)

    def settle(self) -> None:
        """Nothing in flight any more: gradients final, parameters whole."""
        self.finish_reductions()
        self.wait_for_params()

    def landing_order(self) -> list[int]:
        """overlap_step: the order the optimizer steps groups in: those landed already, then
        those in flight, in the order they were sent."""
        sent = self.reductions.groups() if self.reductions is not None else []
        return [g for g in range(len(self.groups)) if g not in sent] + sent
