"""Notebook 08, gradient accumulation: every stage at k = 1, 4, 8 micro-batches, one launch.

Each run shards a fresh deep MLP (`zero_lab.course.workloads.deep_mlp`, the same initialisation
everywhere), trains `--steps` optimizer steps of k micro-batches per rank with the loop of
`zero_lab.stages.accumulation.accumulate` (the first k - 1 under `model.no_sync()`), then one
more, measured: the collectives it issued (`CommLedger`, bytes per optimizer step), the model
states held between the last two micro-batches (`measure.memory.held_bytes`: what accumulation
keeps), the step's peak (`measure.memory.PeakMemory`), and how far the weights end from one
process trained on the whole global batch of every step. The runs:

    stage 0, stage 1                         no_sync: accumulate locally, send once
    stage 2 "sharded" / "unsharded"          grad_accumulation: reduce-scatter every
                                             micro-batch, or hold the full gradient
    stage 3 reshard / keep x the two modes   reshard_after_forward True / False

Beside them torch's FSDP2 (`fully_shard` on every Linear, then the root) runs the same loop
on the same batches, the first k - 1 backwards with `set_requires_gradient_sync(False)`, in
the four layouts of FSDP2_RUNS: reshard after forward or not x after those backwards or not.
Its bytes are counted by the same ledger: FSDP2 calls `dist.all_gather_single` and
`dist.reduce_scatter_single` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py),
which reach the dispatcher as `c10d::_allgather_base_` and `c10d::_reduce_scatter_base_`
on gloo as on NCCL: the ledger counts the messages FSDP2 asks for, whatever gloo does inside.
torch's `CommDebugMode` sees the same ops but keeps only counts, and its module tracker
fails on the second forward and backward of one block (IndexError, torch 2.13), which is
what an accumulated step is.

    knob_accumulation.py --width 64 --depth 4 --batch 32 --steps 2 --ks 1 4 8 --bucket-kb 16
    knob_accumulation.py --only fsdp2 ...      # FSDP2's runs alone (tests/test_fsdp2_*)

Reports {"runs": [{"label", "stage", "grad_accumulation", "reshard_after_forward", "k",
"comm", "psi_bytes", "shard_bytes", "n_groups", "held_between", "peak_bytes", "step_times",
"max_abs_diff"}], "fsdp2": [{"label", "reshard_after_forward", "reshard_after_backward",
"k", "comm", "psi_bytes", "n_groups", "step_times", "max_abs_diff"}],
"world_size"}: JSON, for zero_lab.grading.nb08_knobs_accumulation.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from zero_lab.collectives import CommLedger
from zero_lab.course.workloads import deep_mlp, mlp_batch, mse_loss, rank_slice
from zero_lab.launch import init_worker, report
from zero_lab.measure.memory import PeakMemory, held_bytes
from zero_lab.stages import full_state_dict, shard
from zero_lab.stages.accumulation import accumulate

# (label, stage, grad_accumulation, reshard_after_forward)
RUNS = [
    ("stage 0", 0, "sharded", True),
    ("stage 1", 1, "sharded", True),
    ("stage 2 sharded", 2, "sharded", True),
    ("stage 2 unsharded", 2, "unsharded", True),
    ("stage 3 sharded, reshard", 3, "sharded", True),
    ("stage 3 unsharded, reshard", 3, "unsharded", True),
    ("stage 3 sharded, keep", 3, "sharded", False),
    ("stage 3 unsharded, keep", 3, "unsharded", False),
]
# torch's FSDP2, gradient sync off for k - 1 backwards: (label, reshard_after_forward,
# reshard_after_backward in those backwards); what it reshards while it accumulates
FSDP2_RUNS = [
    ("FSDP2 reshard fwd + bwd", True, True),  # fully_shard's defaults
    ("FSDP2 reshard fwd", True, False),
    ("FSDP2 reshard bwd", False, True),  # reshard_after_forward=False: ZeRO-2-like
    ("FSDP2 reshard neither", False, False),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)  # global, split over ranks and k
    parser.add_argument("--steps", type=int, default=2)  # before the measured one
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8])
    # stages 0-2's flat groups (a few per model, as DDP's 25 MB buckets are on a large one)
    parser.add_argument("--bucket-kb", type=float, default=16.0)
    parser.add_argument("--only", choices=("all", "fsdp2"), default="all")
    return parser.parse_args(argv)


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def reference_weights(args, steps: int, device) -> dict[str, torch.Tensor]:
    """One process, the whole global batch of every step: where every run must end."""
    torch.manual_seed(0)
    model = deep_mlp(args.width, args.depth).to(device)
    opt = adam(list(model.parameters()))
    for step in range(steps):
        mse_loss(model, mlp_batch(step, args.batch, args.width, device=device)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def measured_step(model, opt, parts) -> tuple[dict, dict, int]:
    """One optimizer step of the micro-batches `parts`, as `accumulate` runs it, with the
    ledger, the peak, and the states held before the last micro-batch."""
    held: dict = {}
    with CommLedger() as ledger, PeakMemory(parts[0][0].device) as peak:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if last:
                held = held_bytes(model, opt)  # what the k - 1 backwards left behind
            with nullcontext() if last else model.no_sync():
                (mse_loss(model, part) / len(parts)).backward()
        opt.step()
        opt.zero_grad()
    return ledger.summary(), held, peak.peak_bytes


def run(args, label, stage, mode, reshard, k, batches, ref, device) -> dict:
    torch.manual_seed(0)
    model, opt = shard(deep_mlp(args.width, args.depth).to(device), stage, adam,
                       bucket_mb=args.bucket_kb / 1024, grad_accumulation=mode,
                       reshard_after_forward=reshard)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        accumulate(model, batches(step, k), mse_loss)
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    comm, held, peak = measured_step(model, opt, batches(args.steps, k))
    weights = full_state_dict(model)
    groups = opt.sync.groups
    return {
        "label": label, "stage": stage, "grad_accumulation": mode,
        "reshard_after_forward": reshard, "k": k, "comm": comm,
        "psi_bytes": sum(g.padded_numel for g in groups) * 4,  # fp32
        "shard_bytes": sum(g.shard_numel for g in groups) * 4,
        "n_groups": len(groups), "held_between": held, "peak_bytes": peak,
        "step_times": times,
        "max_abs_diff": max(float((weights[n] - ref[n]).abs().max()) for n in ref),
    }


def fsdp2_run(args, label, reshard_fwd, reshard_bwd, k, batches, ref, device) -> dict:
    """torch's FSDP2 on the same MLP, batches and loop; the last step under the ledger."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = deep_mlp(args.width, args.depth).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, reshard_after_forward=reshard_fwd)
    fully_shard(model, reshard_after_forward=reshard_fwd)
    opt = adam(model.parameters())

    def step(parts) -> None:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            model.set_requires_gradient_sync(last)  # reduce-scatter in the last backward only
            model.set_reshard_after_backward(last or reshard_bwd)
            (mse_loss(model, part) / len(parts)).backward()
        opt.step()
        opt.zero_grad()

    times = []
    for s in range(args.steps):
        start = time.perf_counter()
        step(batches(s, k))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    with CommLedger() as ledger:  # (no PeakMemory: on CPU it cannot read FSDP2's storages)
        step(batches(args.steps, k))
    world = dist.get_world_size()
    weights = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {
        "label": label, "reshard_after_forward": reshard_fwd,
        "reshard_after_backward": reshard_bwd, "k": k, "comm": ledger.summary(),
        # FSDP2 pads each parameter's dim 0 to a multiple of N (its DTensor shards)
        "psi_bytes": sum(world * -(-p.shape[0] // world) * math.prod(p.shape[1:])
                         * p.element_size() for p in model.parameters()),
        "n_groups": sum(isinstance(layer, torch.nn.Linear) for layer in model),
        "step_times": times,
        "max_abs_diff": max(float((weights[n] - ref[n]).abs().max()) for n in ref),
    }


def measure(args, info) -> dict:
    """Every run of RUNS (none with --only fsdp2) and of FSDP2_RUNS at every k of `args.ks`:
    {"runs": [...], "fsdp2": [...], "world_size"} (see above). notebook 08's knobs_demo.py
    calls it beside the recompute runs, in the same launch."""
    def batches(step: int, k: int):  # this rank's rows of global batch `step`, in k parts
        mine = rank_slice(mlp_batch(step, args.batch, args.width, device=info.device),
                          info.rank, info.world_size)
        return list(zip(*(t.chunk(k) for t in mine), strict=True))

    ref = reference_weights(args, args.steps + 1, info.device)
    runs, fsdp2 = [], []
    ours = RUNS if args.only == "all" else []
    for k in args.ks:
        start = time.perf_counter()
        for label, stage, mode, reshard in ours:
            runs.append(run(args, label, stage, mode, reshard, k, batches, ref, info.device))
        for label, fwd, bwd in FSDP2_RUNS:
            fsdp2.append(fsdp2_run(args, label, fwd, bwd, k, batches, ref, info.device))
        # FSDP2's finished modules sit in reference cycles with storages it freed, which the
        # next run's PeakMemory (on CPU: every tensor the collector tracks) cannot read
        gc.collect()
        worst = max(r["max_abs_diff"] for r in runs + fsdp2 if r["k"] == k)
        print(f"k = {k}: {len(ours)} + {len(FSDP2_RUNS)} FSDP2 runs in "
              f"{time.perf_counter() - start:.1f} s, weights within {worst:.1e} of one process")
    return {"runs": runs, "fsdp2": fsdp2, "world_size": info.world_size}


def main() -> None:
    args = parse_args()
    report(measure(args, init_worker()))


if __name__ == "__main__":
    main()
