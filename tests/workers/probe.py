"""Test worker for tests/test_launch.py: reports what a rank sees; fails or hangs on request."""

import argparse
import os
import time

import torch
import torch.distributed as dist

from zero_lab.launch import init_worker, report, scratch_folder

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--late-fail-rank", type=int, default=None)
parser.add_argument("--hang-rank", type=int, default=None)
parser.add_argument("--bad-report", action="store_true")
parser.add_argument("--lines", type=int, default=1)
opts = parser.parse_args()

info = init_worker()
total = torch.tensor([float(info.rank + 1)])
dist.all_reduce(total)
for i in range(opts.lines):
    print(f"line {i} from rank {info.rank}")

scratch = scratch_folder("scratch")  # the same folder on every rank, gone with the launch
(scratch / f"rank{info.rank}").write_text("written")
report({"rank": info.rank, "world_size": info.world_size, "backend": info.backend,
        "scratch": str(scratch)})
report({  # a second call merges into the first
    "sum": total.item(),
    "omp_threads": os.environ.get("OMP_NUM_THREADS"),
    "marker": os.environ.get("ZERO_LAB_TEST_MARKER"),
    "pet": sorted(k for k in os.environ if k.startswith("PET_")),  # torchrun's own options
    "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
    "env_backend": os.environ.get("ZERO_LAB_BACKEND"),
})
if opts.bad_report:
    report({"loss": total})  # a tensor: not JSON
if opts.late_fail_rank == info.rank:
    time.sleep(2.0)
    raise RuntimeError(f"late failure on rank {info.rank}")
if opts.fail_rank == info.rank:
    raise ValueError(f"deliberate failure on rank {info.rank}")
if opts.hang_rank is not None:
    if info.rank == opts.hang_rank:
        time.sleep(3600)
    dist.barrier()  # the other ranks wait here for the one that never comes
