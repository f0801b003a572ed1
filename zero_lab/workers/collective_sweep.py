"""Time collectives over message sizes (notebook 02's bandwidth sweep, notebook 07's link).

    torchrun("zero_lab/workers/collective_sweep.py", nproc=2,
             args=["--min-bytes", "1024", "--max-bytes", "67108864", "--factor", "4"])

`--ops` are timed as torch's collectives; `--direct-ops` (reduce_scatter, all_gather) as the
direct exchange the stages send on gloo (`zero_lab.collectives.exchange`), which prices
differently: one round of messages, not a ring's N-1. Every rank reports the same list of
timings (the slowest rank's time per call, each with its "transport"), in the format
`zero_lab.collectives.fit_alpha_beta` and `zero_lab.predict.links.fit_op_links` read.
"""

import argparse
import time

from zero_lab.collectives import RING_OPS, message_sizes, sweep
from zero_lab.launch import init_worker, report

parser = argparse.ArgumentParser()
parser.add_argument("--ops", nargs="*", default=list(RING_OPS))
parser.add_argument("--direct-ops", nargs="*", default=[],
                    choices=["reduce_scatter", "all_gather"],
                    help="also timed as the direct exchange")
parser.add_argument("--min-bytes", type=int, default=1 << 10)
parser.add_argument("--max-bytes", type=int, default=64 << 20)
parser.add_argument("--factor", type=int, default=4, help="ratio between successive sizes")
parser.add_argument("--repeats", type=int, default=3,
                    help="timed batches per size (the fastest is kept)")
parser.add_argument("--target-s", type=float, default=0.01, help="length of one timed batch")
args = parser.parse_args()

info = init_worker()
start = time.perf_counter()
sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor)
timings = [*sweep(args.ops, sizes, repeats=args.repeats, target_s=args.target_s,
                  device=info.device),
           *sweep(args.direct_ops, sizes, repeats=args.repeats, target_s=args.target_s,
                  device=info.device, transport="direct")]
elapsed = time.perf_counter() - start
if info.rank == 0:
    print(f"timed {len(timings)} (op, size) points on {info.world_size} ranks "
          f"({info.backend}) in {elapsed:.1f} s")
report({"timings": timings, "sweep_seconds": elapsed, "backend": info.backend})
