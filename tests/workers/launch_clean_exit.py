"""Test worker for tests/test_launch_exit.py: one Adam step and an all-reduce on every rank.

    launch_clean_exit.py            the all-reduce is the last thing the script does: a rank
                                    then exits while gloo's threads may still hold its work
    launch_clean_exit.py --destroy  then destroys the process group and reports whether the
                                    group object was freed and how many threads are left

Building the first optimizer imports torch._dynamo and with it torch.distributed.nn.functional,
whose functions bind `dist.group.WORLD` into default arguments if the group exists by then.
"""

import gc
import os
import sys
import threading
import weakref

import torch
import torch.distributed as dist

from zero_lab.launch import init_worker, report


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


threads_at_start = os_threads()
info = init_worker()
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
model(torch.ones(4, 8)).sum().backward()
optimizer.step()
total = torch.tensor([float(info.rank + 1)])
report({"rank": info.rank})
dist.all_reduce(total)

if "--destroy" in sys.argv:
    threads_in_group = os_threads()
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    left = group()
    report({
        "sum": total.item(),
        "group_freed": left is None,
        "group_references": sys.getrefcount(left) - 2 if left is not None else 0,  # not ours
        "threads_at_start": threads_at_start,
        "threads_in_group": threads_in_group,
        "threads_after_destroy": os_threads(),
        "python_threads_after_destroy": threading.active_count(),
    })
