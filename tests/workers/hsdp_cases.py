"""Hybrid sharding (HSDP) on 4 ranks as 2 x 2, for tests/test_hsdp.py (a part of
world_cases.py's launch at N = 4).

Every case trains the same small MLP from rank 0's initialisation on rank slices of the same
global batches as one process on the whole batch (stage_cases.py's seeds): ours at stages
0-3 on mesh=(2, 2), and torch's FSDP2 on a 2-D DeviceMesh (replicate, shard). Reported: the
losses and final weights against one process, what one step sent per level (the ledger),
FSDP2's weights beside ours, and the refusals a layout must keep (lockstep, agreement).
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist
from stage_cases import SEED, error_message

from zero_lab import checkpoint
from zero_lab.collectives import CommLedger
from zero_lab.collectives.exchange import Exchange
from zero_lab.course import workloads as W
from zero_lab.stages import full_state_dict, shard
from zero_lab.stages.mixed_precision import mixed_precision_reference

MESH = (2, 2)  # (replicas, shards)
WIDTH, DEPTH, STEPS, BATCH = 24, 3, 3, 8  # 8 rows: 2 per rank
LR = 1e-2
CLIP = 0.05  # below every step's gradient norm: clipping is active


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return W.deep_mlp(WIDTH, DEPTH)


def _batch(step: int):
    return W.mlp_batch(step, BATCH, WIDTH)


def _adam(params):
    return torch.optim.Adam(params, lr=LR)


def reference(clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the global batch: losses and final weights (gradients clipped to a
    global norm of `clip`, if given)."""
    model = _model(SEED)
    opt = _adam(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = W.mse_loss(model, _batch(step))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _nothing_across(piece, op):
    return Exchange([])  # the across-groups all-reduce, not sent


def mixed_reference() -> dict[str, torch.Tensor]:
    """One process on the global batch in bf16 with fp32 masters: the final weights."""
    model, opt = mixed_precision_reference(_model(SEED), _adam)
    for step in range(STEPS):
        W.mse_loss(model, _batch(step)).backward()
        opt.step()
        opt.zero_grad()
    return opt.full_state_dict(model)


def ours(stage: int, rank: int, world: int, mutant: bool = False, mesh=MESH,
         clip: float | None = None, precision: str = "fp32") -> dict:
    """shard(model, stage, mesh=(2, 2)) (or the torch DeviceMesh `mesh`); the last step
    under a CommLedger. `mutant`: the slices are never averaged across the groups (each
    group trains on its half of the batch): a negative control the tests must catch.
    `clip`: opt.clip_grad_norm_(clip) before every step (the global norm: each slice counted
    once, though every group holds it)."""
    model, opt = shard(_model(SEED + rank), stage, _adam, bucket_mb=400 / 2**20, mesh=mesh,
                       precision=precision)
    if mutant:
        for group in opt.sync.groups:
            group._across = _nothing_across
    losses, norms = [], []
    for step in range(STEPS):
        with CommLedger() as ledger:  # the last step's is kept
            loss = W.mse_loss(model, W.rank_slice(_batch(step), rank, world))
            loss.backward()
            if clip is not None:
                norms.append(opt.clip_grad_norm_(clip).item())
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    groups = opt.sync.groups
    return {"losses": losses, "norms": norms, "weights": full_state_dict(model),
            "by_level": ledger.by_level(), "group_numels": [g.numel for g in groups],
            "group_world": groups[0].world_size,
            "levels_of_control": sorted({r.level for r in ledger.control})}


def device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))


def fsdp2(rank: int, world: int, mesh) -> dict[str, torch.Tensor]:
    """torch's FSDP2 as HSDP: fully_shard on every Linear and on the root, on a 2-D mesh."""
    from torch.distributed.fsdp import fully_shard

    model = _model(SEED)  # FSDP2 does not broadcast: every rank starts from rank 0's seed
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _adam(model.parameters())
    for step in range(STEPS):
        W.mse_loss(model, W.rank_slice(_batch(step), rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def lockstep_error(rank: int, world: int) -> str:
    """Rank 3 steps once more than the others, at stage 3 on the mesh: the next forward's
    lockstep check (over the whole world, not one group) must stop every rank."""
    model, opt = shard(_model(SEED + rank), 3, _adam, mesh=MESH)
    x = W.rank_slice(_batch(0), rank, world)
    W.mse_loss(model, x).backward()
    opt.step()
    if rank == 3:
        opt.step()
    return error_message(lambda: W.mse_loss(model, x))


def run(rank: int, world: int) -> dict:
    ref_losses, ref_weights = reference()
    out = {"ref_losses": ref_losses, "stages": {}}
    for stage in (0, 1, 2, 3):
        case = ours(stage, rank, world)
        weights = case.pop("weights")
        case["max_abs_diff"] = max((weights[k] - ref_weights[k]).abs().max().item()
                                   for k in ref_weights)
        if stage == 3:
            mesh = device_mesh()
            theirs = fsdp2(rank, world, mesh)
            case["fsdp2_keys_match"] = sorted(theirs) == sorted(weights)
            case["fsdp2_max_abs_diff"] = max((weights[k] - theirs[k]).abs().max().item()
                                             for k in theirs)
            # the values themselves, for assert_close in the test (rank 0 only: small)
            if rank == 0:
                case["weights"] = {k: v.flatten().tolist() for k, v in weights.items()}
                case["fsdp2_weights"] = {k: v.flatten().tolist() for k, v in theirs.items()}
        out["stages"][str(stage)] = case  # JSON keys are strings
    # the same layout given as FSDP2's DeviceMesh instead of (2, 2)
    case = ours(3, rank, world, mesh=mesh)
    weights = case.pop("weights")
    case["max_abs_diff"] = max((weights[k] - ref_weights[k]).abs().max().item()
                               for k in ref_weights)
    out["device_mesh"] = case
    # clipped to a global norm: stages 2 and 3 hold slices, each in every group
    _, clipped_ref = reference(CLIP)
    for stage in (2, 3):
        case = ours(stage, rank, world, clip=CLIP)
        weights = case.pop("weights")
        case["max_abs_diff"] = max((weights[k] - clipped_ref[k]).abs().max().item()
                                   for k in clipped_ref)
        out[f"clipped_stage{stage}"] = case
    # mixed precision (bf16 collectives): within what bf16 itself moves the weights
    mixed_ref = mixed_reference()
    case = ours(3, rank, world, precision="mixed")
    weights = case.pop("weights")
    case["max_abs_diff"] = max((weights[k].float() - mixed_ref[k].float()).abs().max().item()
                               for k in mixed_ref)
    case["precision_gap"] = max((ref_weights[k] - mixed_ref[k].float()).abs().max().item()
                                for k in mixed_ref)
    out["mixed"] = case
    # Checkpoints of a mesh: every group holds the same slices; refused by name, not left to
    # fail on "two pieces hold the same elements" (every rank, before anything is written).
    model, opt = shard(_model(SEED), 3, _adam, mesh=MESH)
    with tempfile.TemporaryDirectory() as empty:
        out["checkpoint_errors"] = [
            error_message(lambda: checkpoint.save(model, opt, f"{empty}/ckpt{rank}")),
            error_message(lambda: checkpoint.load(model, opt, empty))]
    out["unused_error"] = error_message(
        lambda: shard(_model(SEED), 3, _adam, mesh=MESH, find_unused_parameters=True))
    mutant = ours(3, rank, world, mutant=True)
    weights = mutant.pop("weights")
    mutant["max_abs_diff"] = max((weights[k] - ref_weights[k]).abs().max().item()
                                 for k in ref_weights)
    out["mutant_nothing_across"] = mutant
    out["lockstep_error"] = lockstep_error(rank, world)
    # A rank given another layout: refused on every rank before any group is made.
    mesh = (4, 1) if rank == 1 else MESH
    out["agreement_error"] = error_message(lambda: shard(_model(SEED), 3, _adam, mesh=mesh))
    out["bad_mesh_error"] = error_message(lambda: shard(_model(SEED), 3, _adam, mesh=(3, 2)))
    dist.barrier()
    return out
