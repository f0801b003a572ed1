"""Per-rank cases of tests/test_accumulation.py: model.no_sync(), grad_accumulation and
reshard_after_forward (zero_lab/stages/accumulation.py, zero3.py), in the launch that
tests/workers/world_cases.py shares (N >= 2).

Every configuration trains STEPS optimizer steps of k micro-batches per rank (the first k - 1
under no_sync) from rank-dependent initialisations, and reports its full weights' distance
from one process trained on the whole global batch of every step (no accumulation), its
losses, the ledger of its last step, the model states held between two micro-batches, the
step's peak and step times.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from stage_cases import error_message

from zero_lab import checkpoint
from zero_lab.collectives import CommLedger
from zero_lab.course import workloads as W
from zero_lab.launch import init_worker, report, scratch_folder
from zero_lab.measure.memory import PeakMemory, held_bytes
from zero_lab.stages import full_state_dict, shard

STEPS = 3
GLOBAL_BATCH = 48  # 2, 3 or 4 ranks x k = 1 or 4 micro-batches
D, DEPTH = 24, 3
SEED = 4321
TINY_BUCKET_MB = 900 / 2**20  # a few flat groups at stages 0-2
KS = (1, 4)
FP32 = 4  # bytes per element: every case trains in fp32
# (stage, grad_accumulation, reshard_after_forward)
CONFIGS = [(0, "sharded", True), (1, "sharded", True), (2, "sharded", True),
           (2, "unsharded", True), (3, "sharded", True), (3, "unsharded", True),
           (3, "sharded", False), (3, "unsharded", False)]


def make_model() -> torch.nn.Module:
    return W.deep_mlp(D, DEPTH)


def global_batch(step: int):
    return W.mlp_batch(step, GLOBAL_BATCH, D)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def micro_batches(step: int, rank: int, world: int, k: int):
    local = W.rank_slice(global_batch(step), rank, world)
    return list(zip(*(t.chunk(k) for t in local), strict=True))


def sharded(rank: int, stage: int, mode: str, reshard: bool, **options):
    torch.manual_seed(SEED + rank)  # ranks start different: shard() broadcasts rank 0's
    return shard(make_model(), stage, adam, bucket_mb=TINY_BUCKET_MB if stage < 3 else 25.0,
                 grad_accumulation=mode, reshard_after_forward=reshard, **options)


def one_step(model, opt, parts, between=None) -> float:
    """k micro-batches, the first k - 1 under no_sync; `between()` runs before the last."""
    k, total = len(parts), 0.0
    for i, part in enumerate(parts):
        if i == k - 1 and between is not None:
            between()
        with nullcontext() if i == k - 1 else model.no_sync():
            loss = W.mse_loss(model, part) / k
            loss.backward()
        total += loss.item()
    opt.step()
    opt.zero_grad()
    return total


def reference() -> tuple[dict, list[float]]:
    """One process, the whole global batch of every step at once."""
    torch.manual_seed(SEED)
    ref = make_model()
    opt = adam(list(ref.parameters()))
    losses = []
    for step in range(STEPS + 1):  # + the ledger's step
        loss = W.mse_loss(ref, global_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}, losses


def run_config(stage, mode, reshard, k, rank, world, ref_state) -> dict:
    model, opt = sharded(rank, stage, mode, reshard)
    losses, times = [], []
    for step in range(STEPS):
        start = time.perf_counter()
        losses.append(one_step(model, opt, micro_batches(step, rank, world, k)))
        times.append(time.perf_counter() - start)
    held: dict = {}

    def between():  # after the k - 1 backwards under no_sync
        held.update(held_bytes(model, opt))

    parts = micro_batches(STEPS, rank, world, k)
    with CommLedger() as ledger, PeakMemory() as peak:
        losses.append(one_step(model, opt, parts, between if k > 1 else None))
    full = full_state_dict(model)
    sync = opt.sync
    return {
        "stage": stage, "mode": mode, "reshard": reshard, "k": k,
        "name": f"stage{stage}-{mode}-{'reshard' if reshard else 'keep'}-k{k}",
        "losses": losses,
        "max_abs_diff": max((full[n] - ref_state[n]).abs().max().item() for n in ref_state),
        "ledger": ledger.summary(),
        "psi_bytes": sum(g.padded_numel * FP32 for g in sync.groups),
        "shard_bytes": sum(g.shard_numel * FP32 for g in sync.groups),
        "n_groups": len(sync.groups),
        "held_between": held, "peak_bytes": peak.peak_bytes, "step_times": times,
    }


def mismatched_micro_batches(stage: int, mode: str, rank: int, world: int) -> str:
    """Rank 0 accumulates 3 micro-batches, the others 2: every rank must raise, named."""
    model, opt = sharded(rank, stage, mode, True)
    parts = micro_batches(0, rank, world, 4)[:3 if rank == 0 else 2]
    try:
        one_step(model, opt, parts)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def unsynced_step(rank: int) -> str:
    model, opt = sharded(rank, 1, "sharded", True)
    with model.no_sync():
        W.mse_loss(model, micro_batches(0, rank, dist.get_world_size(), 2)[0]).backward()
    try:
        opt.step()
    except RuntimeError as exc:
        opt.zero_grad()
        return str(exc)
    return "no error"


def keep_gathered_habits(rank: int, world: int, ref_state: dict) -> dict:
    """reshard_after_forward=False with check_order, the at-rest guard, prefetch off,
    full_state_dict and a checkpoint round trip."""
    out = {}
    model, opt = sharded(rank, 3, "sharded", False, check_order=True, prefetch=False)
    for step in range(STEPS + 1):
        one_step(model, opt, micro_batches(step, rank, world, 2))
    full = full_state_dict(model)
    out["check_order_diff"] = max((full[n] - ref_state[n]).abs().max().item()
                                  for n in ref_state)
    try:  # between steps every unit rests: a read of a piece is refused
        sum(p.pow(2).sum() for p in model.parameters())
        out["guard"] = "no error"
    except RuntimeError as exc:
        out["guard"] = str(exc)
    # A checkpoint of the kept-gathered model, loaded into a fresh one: same weights.
    directory = scratch_folder("accum_ckpt")
    checkpoint.save(model, opt, directory)
    fresh, fresh_opt = sharded(rank + 1, 3, "sharded", False)
    checkpoint.load(fresh, fresh_opt, directory)
    loaded = full_state_dict(fresh)
    out["checkpoint_diff"] = max((loaded[n] - full[n]).abs().max().item() for n in full)
    # One more step on each from there: still the same.
    for m, o in ((model, opt), (fresh, fresh_opt)):
        one_step(m, o, micro_batches(STEPS + 1, rank, world, 2))
    a, b = full_state_dict(model), full_state_dict(fresh)
    out["after_resume_diff"] = max((a[n] - b[n]).abs().max().item() for n in a)
    return out


def refusals(rank: int) -> dict:
    """shard()'s refusals of the two settings (before any collective), and ranks given
    different settings refusing together (one all-gather of the descriptions)."""
    def mlp():
        return make_model()

    return {
        "mode_at_stage_1": error_message(lambda: shard(mlp(), 1, grad_accumulation="unsharded")),
        "mode_unknown": error_message(lambda: shard(mlp(), 2, grad_accumulation="full")),
        "reshard_at_stage_2": error_message(lambda: shard(mlp(), 2, reshard_after_forward=False)),
        "reshard_int": error_message(lambda: shard(mlp(), 3, reshard_after_forward=2)),
        "ranks_disagree": error_message(lambda: shard(
            mlp(), 3, grad_accumulation="unsharded" if rank == 1 else "sharded")),
        "ranks_disagree_reshard": error_message(lambda: shard(
            mlp(), 3, reshard_after_forward=rank != 1)),
    }


def run(rank: int, world: int) -> dict:
    start = time.perf_counter()
    ref_state, ref_losses = reference()
    cases = [run_config(*c, k, rank, world, ref_state) for c in CONFIGS for k in KS]
    return {
        "refusals": refusals(rank) if world == 2 else {},
        "ref_losses": ref_losses, "cases": cases,
        "mismatch": {f"stage{s}-{m}": mismatched_micro_batches(s, m, rank, world)
                     for s, m in ((0, "sharded"), (1, "sharded"), (2, "unsharded"),
                                  (3, "unsharded"))},
        "unsynced_step": unsynced_step(rank),
        "keep_gathered": keep_gathered_habits(rank, world, ref_state),
    } | {"seconds": time.perf_counter() - start}


def main() -> None:
    """This part alone: torchrun("tests/workers/accumulation_cases.py", nproc=2)."""
    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
