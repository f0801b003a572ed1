"""Rank side of notebook 07: what ONE rank of N holds, for N up to 1024, on one machine.

    memory_at_scale.py --model mlp --width 1024 --depth 6 --worlds 1 2 ... 1024 --batch 8
                       [--bucket-mb 4.00390625]

torch's fake process group (`FakeStore`, backend "fake") lets this single process act as
rank 0 of a world of N: every collective returns at once and moves nothing. Memory is real:
each stage builds its flat buffers, slices, gradients and Adam states for rank 0 of N exactly
as on a real cluster. The numbers the model computes are meaningless (nothing is summed
across ranks), and that does not matter here. For every (N, stage) this worker shards a
fresh model (seeded), trains one step, then measures a second: what rank 0 holds after
backward (`measure.memory.held_bytes`), and the step's peak (`measure.memory.MemoryTimeline`, which
also sees stage 3 regrow freed storage), next to `memory.model_state_bytes`. Stage 0 does
not depend on N: it is measured at the smallest and the largest N only. `--bucket-mb` sizes
stages 0-2's buckets (shard's `bucket_mb`, 25 by default); notebook 07 passes one Linear's
MiB, so that a bucket is a unit at every width. Launched with
`torchrun(..., nproc=1)` for its report; it joins no real process group.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

from zero_lab import memory
from zero_lab.course.workloads import TinyGPT, count_parameters, deep_mlp
from zero_lab.launch import report
from zero_lab.measure.memory import MemoryTimeline, held_bytes, model_state_tensors
from zero_lab.stages import shard


def build(args) -> torch.nn.Module:
    """The model, its memory allocated but not initialised: the values do not matter here,
    and initialising 100M parameters would take longer than sharding and stepping them."""
    with torch.device("meta"):
        if args.model == "mlp":
            model = deep_mlp(args.width, args.depth)
        else:
            model = TinyGPT(vocab_size=args.vocab, seq_len=args.seq, d_model=args.width,
                            n_heads=args.heads, n_layers=args.depth, bias=False)
    psi = count_parameters(model)  # on the meta device the head is still tied
    model = model.to_empty(device="cpu")
    if isinstance(model, TinyGPT):
        model.tie_weights()  # to_empty() gave the head its own storage: re-tie it
    assert count_parameters(model) == psi, (count_parameters(model), psi)
    with torch.no_grad():
        for p in model.parameters():
            # finite values so what the stages compute stays finite; a constant 1/fan-in
            # keeps every layer's output the size of its input and fills 400 MB 15x
            # faster than random numbers would
            p.fill_(1.0 / p.shape[-1])
    return model


def batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if args.model == "mlp":
        x = torch.randn(args.batch, args.width, generator=g)
        return x, x
    idx = torch.randint(args.vocab, (args.batch, args.seq), generator=g)
    return idx, idx


def loss(model, args, x, y) -> torch.Tensor:
    out = model(x)
    if args.model == "mlp":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def measure(args, world: int, stage: int) -> dict:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        model = build(args)
        psi = count_parameters(model)
        model, opt = shard(model, stage, optimizer=lambda p: torch.optim.Adam(p, lr=1e-4),
                           bucket_mb=args.bucket_mb,
                           transport="torch")  # torch's collectives: the fake group's no-ops
        x, y = batch(args)
        loss(model, args, x, y).backward()
        opt.step()
        opt.zero_grad()
        start = [t for ts in model_state_tensors(model, opt).values() for t in ts] + [x, y]
        with MemoryTimeline("cpu", start) as timeline:
            loss(model, args, x, y).backward()
            held = held_bytes(model, opt)
            opt.step()
            opt.zero_grad()
        groups = len(opt.sync.groups)
    finally:
        dist.destroy_process_group()
    predicted = memory.model_state_bytes(psi, stage, world, "fp32", "adam")
    return {"world_size": world, "stage": stage, "psi": psi, "groups": groups,
            "held": held, "predicted": predicted["total"],
            "start": timeline.start_bytes, "peak": timeline.peak_bytes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256, 1024])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--bucket-mb", type=float, default=25.0)  # stages 0-2, as shard's
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        for stage in args.stages:
            if stage == 0 and world not in (min(args.worlds), max(args.worlds)):
                continue  # replicated: the same at every N
            started = time.perf_counter()
            rows.append(measure(args, world, stage))
            rows[-1]["seconds"] = time.perf_counter() - started
            print(f"{args.model} N={world:5d} stage {stage}: holds "
                  f"{rows[-1]['held']['total'] / 2**20:9.1f} MiB (formula "
                  f"{rows[-1]['predicted'] / 2**20:9.1f}), peak {rows[-1]['peak'] / 2**20:9.1f} "
                  f"MiB  [{rows[-1]['seconds']:.1f} s]", flush=True)
    report({"model": args.model, "rows": rows})


if __name__ == "__main__":
    main()
