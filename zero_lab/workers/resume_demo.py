"""Rank side of notebook 07's durable-checkpoint cells: a resume that carries the training
state beyond model and optimizer, and a job killed while it saves.

    resume_demo.py --case save --dir runs/checkpoints/state
    resume_demo.py --case forever --dir runs/checkpoints/killed      (dies on purpose)
    resume_demo.py --case resume --dir runs/checkpoints/state --killed runs/checkpoints/killed

What a resume needs besides weights and Adam's moments, here all three at once: a learning-
rate schedule (StepLR), random state (dropout masks, seeded differently on each rank) and the
position in a shuffled data order (`DataOrder`). `checkpoint.save(..., extras=...)` carries
anything with `state_dict` / `load_state_dict`, per rank where it differs per rank.

    save     train STEPS steps (the uninterrupted run) and, from the same start, SAVE_AT steps
             then save with the extras; report both runs' final weights
    forever  save after every step; the third save is killed (SIGKILL) while it publishes:
             its step directory complete, its `latest` written, not yet in place
    resume   from --dir, differently seeded: load with the extras and train to STEPS, then
             the same without the extras; from --killed, load and train two more steps
"""

from __future__ import annotations

import argparse
import os
import random
import signal
from pathlib import Path

import torch
from torch import nn

from zero_lab import checkpoint
from zero_lab.checkpoint import publication
from zero_lab.course.workloads import mlp_batch, rank_slice
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard

WIDTH, ROWS, BATCHES = 10, 12, 24  # 12 rows: 1, 2, 3, 4 ranks divide it
STEPS, SAVE_AT = 8, 4


class DataOrder:
    """Which batch comes next: a shuffled order of the batch ids, reshuffled every epoch."""

    def __init__(self, seed: int) -> None:
        self.seed, self.epoch, self.index = seed, 0, 0

    def next(self) -> int:
        order = torch.randperm(BATCHES,
                               generator=torch.Generator().manual_seed(self.seed + self.epoch))
        batch = int(order[self.index])
        self.index += 1
        if self.index == BATCHES:
            self.epoch, self.index = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


def build(seed: int, rank: int):
    """A stage-2 model with dropout, Adam, StepLR, a data order (its shuffling seed is the
    run's configuration, not state) and the random state."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(WIDTH, WIDTH))
    model, opt = shard(model, 2, optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    extras = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
              "data": DataOrder(seed=100), "rng": checkpoint.RNGState()}
    torch.manual_seed(seed * 10 + rank)  # dropout masks differ per rank
    random.seed(seed * 10 + rank)
    return model, opt, extras


def train(model, opt, extras, first: int, last: int, rank: int, world: int,
          save_to: Path | None = None, after_saves=None) -> None:
    for step in range(first, last):
        x, y = rank_slice(mlp_batch(extras["data"].next(), ROWS, WIDTH), rank, world)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        extras["scheduler"].step()
        if save_to is not None:
            checkpoint.save(model, opt, save_to, step=step + 1, extras=extras)
            if after_saves is not None:
                after_saves(step + 1)


def weights(model) -> dict:
    return {k: v.flatten().tolist() for k, v in full_state_dict(model).items()}


def kill_in_next_publication(saves_done: int) -> None:
    """Once two saves are complete, make the next one die while it publishes: right after
    the new step directory is complete and a link to it written, before that link replaces
    the name (`publication.STEPS[1]`; tests/test_checkpoint_real_world.py kills at each step).
    The process that publishes is killed by SIGKILL: no `finally`, no clean-up runs."""
    if saves_done != 2:
        return
    publish = publication.publish

    def publish_then_die(*args, **kwargs):
        def on_step(name: str) -> None:
            if name == publication.STEPS[1]:
                os.kill(os.getpid(), signal.SIGKILL)
        return publish(*args, **kwargs, on_step=on_step)

    publication.publish = publish_then_die


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["save", "forever", "resume"], required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--killed", type=Path)
    args = parser.parse_args()
    info = init_worker()
    rank, world = info.rank, info.world_size
    out = {}
    if args.case == "save":
        model, opt, extras = build(0, rank)
        train(model, opt, extras, 0, STEPS, rank, world)
        out["uninterrupted"] = weights(model)
        model, opt, extras = build(0, rank)
        train(model, opt, extras, 0, SAVE_AT, rank, world)
        checkpoint.save(model, opt, args.dir, step=SAVE_AT, extras=extras)
    elif args.case == "forever":
        model, opt, extras = build(0, rank)
        train(model, opt, extras, 0, 10**6, rank, world, save_to=args.dir,
              after_saves=kill_in_next_publication)
    else:
        for carried in (True, False):
            model, opt, extras = build(1, rank)
            manifest = checkpoint.load(model, opt, args.dir, extras=extras if carried else None)
            train(model, opt, extras, manifest["step"], STEPS, rank, world)
            out["with_extras" if carried else "without_extras"] = weights(model)
        if args.killed is not None:
            model, opt, extras = build(1, rank)
            manifest = checkpoint.load(model, opt, args.killed, extras=extras)
            train(model, opt, extras, manifest["step"], manifest["step"] + 2, rank, world)
            out["killed_resumed_from"] = manifest["step"]
    report(out)


if __name__ == "__main__":
    main()
