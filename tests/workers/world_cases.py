"""One launch per world size for the case workers: the collectives (N > 1), stages 0-2,
stage 3 and hybrid sharding (N = 4) cases, each reported under its own key.

A launch costs seconds before a rank runs anything (torchrun's agent and every rank import
torch; 8-12 s at N = 4 on two cores): sharing it saves two of every three. The parts run in
turn in one process group and keep their own random seeds, so each computes what it computed
alone. A part that raises fails the launch, and with it every test of that world size, with
its rank's traceback (catching it would leave the other ranks waiting in a collective).

    {"collectives": ..., "stages": ..., "zero3": ..., "hsdp": ...}   read by tests/common.py
                                                                  case_reports
"""

from __future__ import annotations

import gc

import accumulation_cases
import collectives_cases
import hsdp_cases
import recompute_cases
import stage_cases
import zero3_cases

from zero_lab.launch import init_worker, report

PARTS = {  # key: (the part's run(rank, world), the smallest world size it runs at)
    "collectives": (collectives_cases.run, 2),
    "stages": (stage_cases.run, 1),
    "zero3": (zero3_cases.run, 1),
    "recompute": (recompute_cases.run, 2),  # and the precision policy; N = 2 and 4 only
    "accumulation": (accumulation_cases.run, 2),
    "hsdp": (hsdp_cases.run, 4),  # hybrid sharding on a 2 x 2 mesh
}


def main() -> None:
    info = init_worker()
    out = {}
    for key, (run, min_world) in PARTS.items():
        if info.world_size >= min_world:
            out[key] = run(info.rank, info.world_size)
            gc.collect()  # the next part's live-tensor walks start from what it makes
    report(out)


if __name__ == "__main__":
    main()
