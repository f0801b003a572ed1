"""Rank side of notebook 07's checkpoint section: train, save, and resume elsewhere.

    checkpoint_demo.py --case train --stage 3 --dir runs/checkpoints/demo --save-at 3 --steps 5
    checkpoint_demo.py --case resume --stage 2 --dir runs/checkpoints/demo --steps 5

The seed blog's MLP shape, small: `depth` x Linear(width, width) + ReLU with width 10, so
each layer's 110 parameters leave padding at N = 3 (and 4). Every rank trains on its rows of
the same global batches (`workloads.mlp_batch`, 12 rows: N = 1, 2, 3, 4 divide it).
    train   shard at --stage, train to --save-at, save, train on to --steps; report the
            full weights at the save and at the end (the uninterrupted run)
    resume  shard a differently seeded model at --stage (any N), load, train to --steps,
            report the full weights
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from zero_lab import checkpoint
from zero_lab.course.workloads import deep_mlp, mlp_batch, mse_loss, rank_slice
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard

WIDTH, DEPTH, ROWS = 10, 3, 12


def train(model, opt, first: int, last: int, rank: int, world: int) -> None:
    for step in range(first, last):
        mse_loss(model, rank_slice(mlp_batch(step, ROWS, WIDTH), rank, world)).backward()
        opt.step()
        opt.zero_grad()


def weights(model) -> dict:
    return {k: v.flatten().tolist() for k, v in full_state_dict(model).items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["train", "resume"], required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    info = init_worker()
    rank, world = info.rank, info.world_size
    torch.manual_seed(0 if args.case == "train" else 1)
    model, opt = shard(deep_mlp(WIDTH, DEPTH), args.stage,
                       optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    if args.case == "train":
        train(model, opt, 0, args.save_at, rank, world)
        started = time.perf_counter()
        checkpoint.save(model, opt, args.dir, step=args.save_at)
        saved_in = time.perf_counter() - started
        at_save = weights(model)
        train(model, opt, args.save_at, args.steps, rank, world)
        report({"at_save": at_save, "final": weights(model), "save_s": saved_in})
    else:
        started = time.perf_counter()
        manifest = checkpoint.load(model, opt, args.dir)
        loaded_in = time.perf_counter() - started
        train(model, opt, manifest["step"], args.steps, rank, world)
        report({"final": weights(model), "load_s": loaded_in, "from_step": manifest["step"]})


if __name__ == "__main__":
    main()
