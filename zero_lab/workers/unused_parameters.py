"""Notebook 04's rank work on parameters that get no gradient in a step.

    torchrun(WORKERS / "unused_parameters.py", nproc=2, args=["--steps", 6])

`zero_lab.course.workloads.SometimesMLP` has a `spare` layer no forward uses and a `sometimes`
layer used on even steps only. Each stage trains it with AdamW (weight decay: a parameter
that is stepped with a zero gradient still shrinks) and `find_unused_parameters=True`, and
one process trains it on the global batch. Reported per stage: the largest weight difference
from one process, how far `spare` moved, what `.grad` held after an odd step's backward, and
the collectives of one step. Also reported once: the refusal without the option.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from zero_lab.collectives import CommLedger
from zero_lab.course import workloads as W
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, default=12, help="global batch, split over the ranks")
args = parser.parse_args()
info = init_worker()
rank, n = info.rank, info.world_size


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return (torch.randn(args.batch, 7, generator=gen), torch.randn(args.batch, 3, generator=gen))


def adamw(params):
    return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)


def train(model, opt, batches, record=None) -> None:
    for step in range(args.steps):
        x, y = batches(step)
        use = step % 2 == 0  # `sometimes` takes part on even steps only
        with CommLedger() as ledger:
            F.mse_loss(model(x.to(info.device), use=use), y.to(info.device)).backward()
            if record is not None and step == 1:  # an odd step: `sometimes` was not used
                record["grad_is_none"] = {name: p.grad is None
                                          for name, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        if record is not None and step == 1:
            record["ledger"] = ledger.summary()


torch.manual_seed(0)
reference = W.SometimesMLP().to(info.device)
start = {k: v.clone() for k, v in reference.state_dict().items()}
train(reference, adamw(reference.parameters()), batch)
expected = reference.state_dict()

runs = {}
for stage in (0, 1, 2, 3):
    torch.manual_seed(0)
    model, opt = shard(W.SometimesMLP().to(info.device), stage, adamw,
                       find_unused_parameters=True)
    record: dict = {}
    train(model, opt, lambda step: W.rank_slice(batch(step), rank, n), record)
    weights = full_state_dict(model)
    record["max_abs_diff"] = max((weights[k] - expected[k]).abs().max().item() for k in expected)
    record["spare_moved"] = (weights["spare.weight"] - start["spare.weight"]).abs().max().item()
    runs[f"stage {stage}"] = record

torch.manual_seed(0)
model, opt = shard(W.SometimesMLP().to(info.device), 2, adamw)  # without the option
try:
    x, y = W.rank_slice(batch(0), rank, n)
    F.mse_loss(model(x.to(info.device)), y.to(info.device)).backward()
    refused = "no error"
except RuntimeError as exc:
    refused = str(exc)

n_params = sum(1 for p in reference.parameters() if p.requires_grad)
report({"runs": runs, "refused": refused, "n_params": n_params,
        "reference_spare_moved": (expected["spare.weight"] - start["spare.weight"]).abs().max()
        .item()})
if rank == 0:
    print(f"trained {len(runs)} runs ({', '.join(runs)}) beside one process")
