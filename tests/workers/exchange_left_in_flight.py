"""Rank 1 issues an all-gather by the direct exchange and ends its script without waiting
(as a stage 1-2 run ends after its last opt.step(), the gathers left for a next forward);
rank 0 reaches the same all-gather a second later. Without launch/rank_side.py finishing rank 1's
exchanges before it leaves, rank 0's receive meets a closed connection."""

import time

import torch

from zero_lab.collectives import exchange
from zero_lab.launch import init_worker, report

info = init_worker()
part = torch.full((4,), float(info.rank))
full = torch.empty(4 * info.world_size)
if info.rank == 0:
    time.sleep(1.5)
handle = exchange.all_gather(full, part, async_op=True)
if info.rank == 0:
    handle.wait()
    report({"gathered": full.tolist()})
else:
    report({"left_in_flight": not handle.is_completed()})
