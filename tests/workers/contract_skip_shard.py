"""Per-rank worker for tests/test_contract_habits.py: rank 1 never calls shard() (it trains
alone and finishes); rank 0 waits for it in shard()'s first collective."""

from __future__ import annotations

import torch

from zero_lab.course import workloads as W
from zero_lab.launch import init_worker
from zero_lab.stages import shard

info = init_worker()
model = W.deep_mlp(8, depth=2)
if info.rank == 0:
    model, opt = shard(model, 1)
else:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
W.mse_loss(model, W.mlp_batch(0, 4, 8)).backward()
opt.step()
