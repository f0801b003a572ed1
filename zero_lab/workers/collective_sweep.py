"""Time torch's collectives over message sizes (notebook 02's bandwidth sweep).

    torchrun("zero_lab/workers/collective_sweep.py", nproc=2,
             args=["--min-bytes", "1024", "--max-bytes", "67108864", "--factor", "4"])

Every rank reports the same list of timings (the slowest rank's time per call), in the
format `zero_lab.collectives.fit_alpha_beta` reads.
"""

import argparse
import time

from zero_lab.collectives import RING_OPS, message_sizes, sweep
from zero_lab.launch import init_worker, report

parser = argparse.ArgumentParser()
parser.add_argument("--ops", nargs="+", default=list(RING_OPS))
parser.add_argument("--min-bytes", type=int, default=1 << 10)
parser.add_argument("--max-bytes", type=int, default=64 << 20)
parser.add_argument("--factor", type=int, default=4, help="ratio between successive sizes")
parser.add_argument("--repeats", type=int, default=3, help="timed batches per size (median)")
parser.add_argument("--target-s", type=float, default=0.01, help="length of one timed batch")
args = parser.parse_args()

info = init_worker()
start = time.perf_counter()
timings = sweep(args.ops, message_sizes(args.min_bytes, args.max_bytes, args.factor),
                repeats=args.repeats, target_s=args.target_s, device=info.device)
elapsed = time.perf_counter() - start
if info.rank == 0:
    print(f"timed {len(timings)} (op, size) points on {info.world_size} ranks "
          f"({info.backend}) in {elapsed:.1f} s")
report({"timings": timings, "sweep_seconds": elapsed, "backend": info.backend})
