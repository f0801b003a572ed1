"""Notebook 08's two-rank launch: gradient accumulation (with reshard_after_forward), then
recompute and the precision policy, one after the other in the same processes.

One launch instead of two saves a torchrun start-up and a process-group set-up (seconds on
a busy 2-core machine). Each part is the function of its own worker, which still runs alone:

    knob_accumulation.measure             8 configurations x k micro-batches, deep MLP
    knob_recompute_precision.recompute_runs   stages 0-3, recompute off and on, tiny GPT
    knob_recompute_precision.precision_runs   4 bf16 recipes at --policy-stage

    knobs_demo.py --mlp-width 1024 --mlp-depth 6 --mlp-batch 32 --mlp-steps 3 --ks 1 4 8
                  --bucket-kb 25600 --gpt-width 32 --gpt-layers 2 --gpt-heads 2 --gpt-seq 16
                  --gpt-batch 8 --gpt-steps 4

(notebook 08's sizes: the course MLP and the course GPT; the defaults below are smaller)

Reports {"accumulation": {"runs", "world_size"}, "recompute": [...], "precision": [...],
"world_size", "gpt", "seconds": {part: wall seconds}}, each rank its own numbers. Parent
side: zero_lab.grading.nb08_knobs_accumulation and nb08_knobs_recompute.
"""

from __future__ import annotations

import argparse
import time

from zero_lab.launch import init_worker, report
from zero_lab.workers import knob_accumulation, knob_recompute_precision


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlp-width", type=int, default=64)
    parser.add_argument("--mlp-depth", type=int, default=4)
    parser.add_argument("--mlp-batch", type=int, default=32)
    parser.add_argument("--mlp-steps", type=int, default=3)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--bucket-kb", type=float, default=16.0)
    parser.add_argument("--gpt-width", type=int, default=64)
    parser.add_argument("--gpt-layers", type=int, default=4)
    parser.add_argument("--gpt-heads", type=int, default=4)
    parser.add_argument("--gpt-seq", type=int, default=32)
    parser.add_argument("--gpt-batch", type=int, default=8)
    parser.add_argument("--gpt-steps", type=int, default=4)
    parser.add_argument("--policy-stage", type=int, default=3)
    return parser.parse_args()


def main() -> None:
    a = parse_args()
    info = init_worker()
    # each part's own argument parser, so its defaults and meanings stay where they are written
    accumulation_args = knob_accumulation.parse_args(
        ["--width", str(a.mlp_width), "--depth", str(a.mlp_depth), "--batch", str(a.mlp_batch),
         "--steps", str(a.mlp_steps), "--bucket-kb", str(a.bucket_kb),
         "--ks", *map(str, a.ks)])
    gpt_args = knob_recompute_precision.parse_args(
        ["--width", str(a.gpt_width), "--layers", str(a.gpt_layers), "--heads", str(a.gpt_heads),
         "--seq", str(a.gpt_seq), "--batch", str(a.gpt_batch), "--steps", str(a.gpt_steps),
         "--policy-stage", str(a.policy_stage)])
    seconds = {}
    start = time.perf_counter()
    accumulation = knob_accumulation.measure(accumulation_args, info)
    seconds["accumulation"] = time.perf_counter() - start
    start = time.perf_counter()
    recompute = knob_recompute_precision.recompute_runs(gpt_args, info.rank, info.world_size)
    seconds["recompute"] = time.perf_counter() - start
    start = time.perf_counter()
    precision = knob_recompute_precision.precision_runs(gpt_args, info.rank, info.world_size)
    seconds["precision"] = time.perf_counter() - start
    print(f"recompute: 8 runs in {seconds['recompute']:.1f} s; precision: "
          f"{len(precision)} recipes in {seconds['precision']:.1f} s")
    report({"accumulation": accumulation, "recompute": recompute, "precision": precision,
            "world_size": info.world_size, "gpt": vars(gpt_args), "seconds": seconds})


if __name__ == "__main__":
    main()
