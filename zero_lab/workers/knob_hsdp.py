"""Hybrid sharding measured live (notebook 08): flat stage 3 against HSDP on the same ranks,
and torch's FSDP2 as HSDP beside ours.

On N ranks laid out as R x S (`--mesh R S`, R x S = N) it trains the same MLP three ways
from the same initialisation on this rank's share of the same global batches:

    zero3   shard(model, 3): every unit sharded over all N ranks
    hsdp    shard(model, 3, mesh=(R, S)): sharded over the S ranks of a group, replicated
            across the R groups
    fsdp2   torch's fully_shard on every Linear and the root, on a 2-D DeviceMesh
            ("replicate", "shard"), only for its weights

Per system it reports what one step sent per level (a CommLedger's `by_level()`: "shard"
inside a group, "replicate" across groups, "world" for a flat stage), the unit sizes the
formula needs, the model states held after a step, the peak of a step, and the step times
(every step but the first and the memory-tracked last); and how far FSDP2's final weights
are from ours. Parent side: zero_lab/grading/nb08_knobs_hsdp.py checks it against
projection.hybrid_bytes_per_step and memory.model_state_bytes.

    knob_hsdp.py --mesh 2 2 --width 256 --depth 4 --steps 6
"""

from __future__ import annotations

import argparse

import torch

from zero_lab.collectives import CommLedger
from zero_lab.course.workloads import deep_mlp, mlp_batch, mse_loss, rank_slice, train
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard

SEED = 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", type=int, nargs=2, default=[2, 2], metavar=("R", "S"))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)  # the global batch, split over ranks
    parser.add_argument("--steps", type=int, default=6)
    return parser.parse_args()


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def fresh_model(args) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return deep_mlp(args.width, args.depth)


def run_ours(args, rank: int, world: int, mesh) -> tuple[dict, dict[str, torch.Tensor]]:
    model, opt = shard(fresh_model(args), 3, adam, mesh=mesh)
    batches = lambda step: rank_slice(mlp_batch(step, args.batch, args.width), rank, world)  # noqa: E731
    res = train(model, opt, batches, steps=args.steps)
    with CommLedger() as ledger:  # one more step: what it sends, level by level
        mse_loss(model, batches(args.steps)).backward()
        opt.step()
        opt.zero_grad()
    return {
        "by_level": ledger.by_level(),
        "unit_numels": [unit.group.numel for unit in opt.sync.units],
        "held_bytes": res["held_after_step"]["total"],
        "peak_bytes": res["peak_bytes"],
        "step_s": res["step_times"][1:],  # the first step records the units' order
    }, full_state_dict(model)


def run_fsdp2(args, rank: int, world: int, mesh_shape) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("replicate", "shard"))
    model = fresh_model(args)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adam(model.parameters())
    for step in range(args.steps + 1):  # as many steps as ours took
        mse_loss(model, rank_slice(mlp_batch(step, args.batch, args.width), rank,
                                   world)).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.full_tensor().detach() for name, p in model.named_parameters()}


def main() -> None:
    args = parse_args()
    info = init_worker()
    rank, world = info.rank, info.world_size
    out = {"mesh": list(args.mesh), "world_size": world, "element_size": 4,
           "psi": sum(p.numel() for p in fresh_model(args).parameters())}
    out["zero3"], _ = run_ours(args, rank, world, None)
    out["hsdp"], ours = run_ours(args, rank, world, tuple(args.mesh))
    theirs = run_fsdp2(args, rank, world, args.mesh)
    out["fsdp2"] = {"same_names": sorted(theirs) == sorted(ours),
                    "max_abs_diff": max((ours[k] - theirs[k]).abs().max().item()
                                        for k in theirs)}
    report(out)


if __name__ == "__main__":
    main()
