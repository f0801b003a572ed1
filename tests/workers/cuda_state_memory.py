"""Test worker for tests/test_cuda.py: stages 0-3's model states as the CUDA allocator sees them.

After a warm-up (`warm_up`), for each stage on this rank's GPU: the allocator's live bytes
before the model exists, then after one full step (Adam's states exist) and the next backward,
the moment every state is alive at once (parameters, gradients, Adam's m and v). The batch and
the loss are freed before the reading, so the allocator's difference is the model states and
whatever else the stage kept alive. Reported beside it: `measure.memory.held_bytes` (the
course's own storage-by-storage count, the one the CPU notebooks use), the number of storages
it counted (the allocator rounds each block up to 512 bytes) and `memory.model_state_bytes`,
the formula.
"""

import argparse
import gc

import torch
import torch.distributed as dist

from zero_lab.course.workloads import count_parameters, deep_mlp, mlp_batch, mse_loss, rank_slice
from zero_lab.launch import init_worker, report
from zero_lab.measure.memory import held_bytes, model_state_tensors
from zero_lab.memory import model_state_bytes
from zero_lab.stages import shard

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--depth", type=int, default=3)
parser.add_argument("--batch", type=int, default=8)
args = parser.parse_args()

info = init_worker()
device = info.device


def allocated() -> int | None:
    """The allocator's live bytes on this GPU (None on CPU, where a rehearsal runs)."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def warm_up() -> int:
    """One matmul forward and backward and one all-reduce before any reading: cuBLAS keeps a
    workspace from the caching allocator for each handle (the forward's thread and autograd's
    each have one), allocated at its first matmul and kept. Returns their bytes."""
    before = allocated()
    layer = torch.nn.Linear(8, 8, device=device)
    layer(torch.ones(2, 8, device=device)).sum().backward()
    dist.all_reduce(torch.ones(1, device=device))
    del layer
    return (allocated() or 0) - (before or 0)


def one_stage(stage: int) -> dict:
    before = allocated()
    torch.manual_seed(0)
    model = deep_mlp(args.width, args.depth).to(device)
    psi = count_parameters(model)  # before shard(): stage 3's parameters are its slices
    model, opt = shard(model, stage=stage,
                       optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    for step in range(2):
        batch = rank_slice(mlp_batch(step, args.batch, args.width, device=device),
                           info.rank, info.world_size)
        loss = mse_loss(model, batch)
        loss.backward()
        if step == 0:
            opt.step()
            opt.zero_grad()
    del batch, loss
    after = allocated()
    held = held_bytes(model, opt)
    storages = {t.untyped_storage().data_ptr()
                for tensors in model_state_tensors(model, opt).values() for t in tensors}
    row = {"stage": stage, "psi": psi, "held": held["total"], "storages": len(storages),
           "allocator": None if after is None else after - before,
           "formula": model_state_bytes(psi, stage, info.world_size, "fp32", "adam")["total"]}
    del model, opt
    return row


workspace = warm_up()
report({"world_size": info.world_size, "device": str(device), "workspace": workspace,
        "stages": [one_stage(s) for s in range(4)]})
