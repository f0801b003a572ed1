"""Per-rank worker for tests/test_two_nodes.py, started by two hand-run torchrun agents
(`--nnodes 2 --node-rank 0/1`, c10d rendezvous): stage 3 on 2 x 2 ranks. Rank 0 writes the
trained weights and the one-process reference to --out (no zero_lab launcher here)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from checkpoint_cases import Net, adamw, as_lists, reference, train

from zero_lab.launch import init_worker
from zero_lab.stages import full_state_dict, shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    info = init_worker()
    torch.manual_seed(0)
    model, opt = shard(Net(), 3, optimizer=adamw)
    train(model, opt, 0, args.steps, info.rank, info.world_size)
    weights = as_lists(full_state_dict(model))
    if info.rank == 0:
        args.out.write_text(json.dumps({
            "world_size": info.world_size, "final": weights, "reference": reference(args.steps),
            "node_of_rank": os.environ.get("GROUP_RANK"), "local_world": os.environ.get(
                "LOCAL_WORLD_SIZE")}))


if __name__ == "__main__":
    main()
