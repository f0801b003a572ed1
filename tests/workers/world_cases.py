"""One launch per world size for the case workers: the collectives (N > 1), stages 0-2,
stage 3, the knobs (recompute and precision, accumulation, hybrid sharding at N = 4), the
contract's edges, habits and stage-3 reads, and the plain reading layer beside shard()
(N = 2, 3); at N = 2 also the collective seam, .grad after backward, fp32 masters and frozen
parameters, and the expert findings; each reported under its own key.

A launch costs seconds before a rank runs anything (torchrun's agent and every rank import
torch; 8-12 s at N = 4 on two cores): sharing it saves all of them but one. The parts run in
turn in one process group and keep their own random seeds, so each computes what it computed
alone. A part that raises fails the launch, and with it every test of that world size, with
its rank's traceback (catching it would leave the other ranks waiting in a collective); the
contract parts catch what their cases raise on purpose, every rank alike, and report it.

    {"collectives": ..., "stages": ..., "zero3": ..., ...}   read by tests/common.py case_reports
"""

from __future__ import annotations

import gc

import accumulation_cases
import collectives_cases
import contract_cases
import contract_habits
import finding_cases
import grad_after_backward
import hsdp_cases
import masters_frozen_cases
import overlap_cases
import plain_cases
import recompute_cases
import reshard_int_cases
import stage3_reads
import stage_cases
import transport_cases
import zero3_cases

from zero_lab.course import step_record
from zero_lab.launch import init_worker, report

PARTS = {  # key: (the part's run(rank, world), the smallest world size it runs at[, the largest])
    "collectives": (collectives_cases.run, 2),
    # stages 0-3 and accumulation at N = 1-3 (even and odd, padding at 3): N = 4 would add
    # about 55 s of a CI run (four ranks on two cores) and nothing the others do not check
    "stages": (stage_cases.run, 1, 3),
    "zero3": (zero3_cases.run, 1, 3),
    "recompute": (recompute_cases.run, 2),  # and the precision policy; N = 2 and 4 only
    "accumulation": (accumulation_cases.run, 2, 3),
    "overlap": (overlap_cases.run, 2),  # shard()'s overlap options; readers at N = 2
    "hsdp": (hsdp_cases.run, 4),  # hybrid sharding on a 2 x 2 mesh
    "reshard_int": (reshard_int_cases.run, 4),  # reshard_after_forward=2 at stage 3
    "plain": (plain_cases.run, 2, 3),  # zero_lab/plain beside shard() and one process
    "step_record": (step_record.record, 2, 3),  # notebook 03's step view: one step, phase by phase
    "contract": (contract_cases.run, 2, 3),
    # at N = 2 only: the collective seam, what .grad holds after backward, fp32 masters and
    # frozen parameters, the expert findings measured against FSDP2 (each was a launch of its
    # own, about 4 s of a CI run's CPU)
    "transports": (transport_cases.run, 2, 2),
    "grad_after_backward": (grad_after_backward.run, 2, 2),
    "masters_frozen": (masters_frozen_cases.run, 2, 2),
    "findings": (finding_cases.run, 2, 2),
    # before contract_habits: its lockstep case raises inside opt.step() on the last rank
    # only; that optimizer's step never ends (stages/at_rest.py forgets it once it is gone),
    # and while it lives a read at rest under no_grad passes there while the other ranks
    # refuse it: stage3_reads' refusals would hang the launch.
    "stage3_reads": (stage3_reads.run, 2, 3),
    "contract_habits": (contract_habits.run, 2, 3),
}


def main() -> None:
    info = init_worker()
    out = {}
    for key, (run, smallest, *largest) in PARTS.items():
        if smallest <= info.world_size <= min(largest, default=info.world_size):
            out[key] = run(info.rank, info.world_size)
            gc.collect()  # the next part's live-tensor walks start from what it makes
    report(out)


if __name__ == "__main__":
    main()
