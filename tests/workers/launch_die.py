"""Test worker for tests/test_launch_deaths.py: rank 1 dies without a Python exception while
the other ranks wait for it in an all-reduce.

    launch_die.py sigkill|exit|abort
"""

import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist

from zero_lab.launch import init_worker, report

how = sys.argv[1]
info = init_worker()
if info.rank == 1:
    time.sleep(0.3)  # the others are in the all-reduce by now
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file for the abort
    print("rank 1 about to die", file=sys.stderr, flush=True)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
    elif how == "exit":
        os._exit(3)
    else:
        os.abort()  # what an uncaught C++ exception does
total = torch.ones(1)
dist.all_reduce(total)
report({"sum": total.item()})
