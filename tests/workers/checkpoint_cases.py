"""Per-rank worker for tests/test_checkpoint.py: the cases one launch names, in turn.

`--jobs` is JSON, {name: {"case": ..., "dir": ..., "stage": ..., ...}}; every rank runs the
jobs in that order and reports {name: what the case returned}. A launch costs seconds before a
rank runs anything, so the tests group the jobs of one world size into one launch.

The model's every flat group has an odd size that 3 does not divide either (35, 25, 55
elements; 115 in one bucket), so every layout at N = 2 or 3 has padding, which must never
reach a parameter. It has a buffer too. The global batch (12 rows) divides at N = 1, 2, 3.

    train_save   shard at `stage`, train `steps`, save to `dir`, then train to `total` and
                 report the full weights at the save and at the end
    resume       shard a differently initialised model at `stage`, load `dir`, train to
                 `total`, report the full weights
    fsdp2        load consolidate(`dir`) into torch FSDP2 (set_model_state_dict), report it
    bad_inputs   load each broken checkpoint under `dir`/broken/*, report the errors and
                 whether the model or optimizer changed
    die_in_save  save into `dir`, rank 1 dying right after writing its shard
    save_big     the seed blog's MLP shape, 8 x Linear(1024, 1024), one Adam step at stage 3,
                 saved (for the consolidation's memory)
`precision` (fp32 by default) applies to train_save and resume.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from zero_lab import checkpoint
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard

GLOBAL_ROWS = 12


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5, bias=False)   # 35 elements
        self.b = nn.Linear(5, 5, bias=False)   # 25
        self.c = nn.Linear(5, 11, bias=False)  # 55
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))) * self.scale[0]


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_ROWS, 7, generator=g), torch.randn(GLOBAL_ROWS, 11, generator=g)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def train(model, opt, first: int, last: int, rank: int, world: int) -> None:
    rows = GLOBAL_ROWS // world
    for step in range(first, last):
        x, y = global_batch(step)
        F.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows]
                   ).backward()
        opt.step()
        opt.zero_grad()


def as_lists(state: dict) -> dict:
    return {k: v.double().flatten().tolist() for k, v in state.items()}


def reference(total: int) -> dict:
    """One process, the whole global batch, `total` steps."""
    torch.manual_seed(0)
    model = Net()
    opt = adamw(model.parameters())
    for step in range(total):
        x, y = global_batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return as_lists(model.state_dict())


def train_save(job: dict, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model, opt = shard(Net(), job["stage"], optimizer=adamw, precision=job["precision"])
    train(model, opt, 0, job["steps"], rank, world)
    checkpoint.save(model, opt, job["dir"], step=job["steps"])
    at_save = as_lists(full_state_dict(model))
    train(model, opt, job["steps"], job["total"], rank, world)
    return {"at_save": at_save, "final": as_lists(full_state_dict(model)),
            "reference": reference(job["total"])}


def resume(job: dict, rank: int, world: int) -> dict:
    torch.manual_seed(123)  # not the saved weights: the load must overwrite everything
    model, opt = shard(Net(), job["stage"], optimizer=adamw, precision=job["precision"])
    model.scale.fill_(-1.0)
    manifest = checkpoint.load(model, opt, job["dir"])
    train(model, opt, manifest["step"], job["total"], rank, world)
    return {"final": as_lists(full_state_dict(model)), "step": manifest["step"]}


def fsdp2(job: dict, rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(123)
    model = Net()
    for layer in (model.a, model.b, model.c):
        fully_shard(layer)
    fully_shard(model)
    weights = checkpoint.consolidate(job["dir"])
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
            for k, v in model.state_dict().items()}
    return {"loaded": as_lists(full)}


def bad_inputs(job: dict, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model, opt = shard(Net(), job["stage"], optimizer=adamw)
    train(model, opt, 0, 2, rank, world)  # some optimizer state to protect
    before = {**as_lists(full_state_dict(model)),
              **{f"state{i}.{k}": v.double().flatten().tolist()
                 for i, s in enumerate(opt.optim.state.values()) for k, v in s.items()}}
    errors = {}
    for broken in sorted((job["dir"] / "broken").iterdir()):
        try:
            checkpoint.load(model, opt, broken)
            errors[broken.name] = None
        except checkpoint.CheckpointError as exc:
            errors[broken.name] = str(exc)
    after = {**as_lists(full_state_dict(model)),
             **{f"state{i}.{k}": v.double().flatten().tolist()
                for i, s in enumerate(opt.optim.state.values()) for k, v in s.items()}}
    return {"errors": errors, "unchanged": before == after}


def save_big(job: dict, rank: int, world: int) -> dict:
    from zero_lab.course.workloads import deep_mlp

    torch.manual_seed(0)
    model, opt = shard(deep_mlp(1024, 8), 3, optimizer=adamw)
    x = torch.randn(4, 1024)
    F.mse_loss(model(x), x).backward()
    opt.step()
    checkpoint.save(model, opt, job["dir"], step=1)
    return {"saved": True}


def die_in_save(job: dict, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model, opt = shard(Net(), job["stage"], optimizer=adamw)
    train(model, opt, 0, 1, rank, world)
    if rank == 1:
        import zero_lab.checkpoint.saving as saving

        def write_then_die(tensors, path):
            from safetensors.torch import save_file

            save_file(tensors, path)
            os._exit(3)  # killed after its shard, before the manifest

        saving.save_file = write_then_die
    checkpoint.save(model, opt, job["dir"], step=99)
    return {"saved": True}


CASES = {f.__name__: f for f in (train_save, resume, fsdp2, bad_inputs, save_big, die_in_save)}
DEFAULTS = {"stage": 0, "steps": 3, "total": 5, "precision": "fp32"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True,
                        help='JSON {name: {"case": ..., "dir": ..., "stage": ..., ...}}')
    jobs = json.loads(parser.parse_args().jobs)
    info = init_worker()
    results = {}
    for name, job in jobs.items():  # in order: every rank runs the same collectives
        job = {**DEFAULTS, **job, "dir": Path(job["dir"])}
        results[name] = CASES[job["case"]](job, info.rank, info.world_size)
    report(results)


if __name__ == "__main__":
    main()
