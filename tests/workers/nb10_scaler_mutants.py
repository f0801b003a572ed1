"""Test worker for tests/test_nb10_at_work.py: notebook 10's fp16 step (an inf in rank 1's
gradient shard) with one piece of torch's agreement taken away, so the notebook's check must
fail on what it reports:
- "no DTensor reduce": DTensor's handler for `_amp_foreach_non_finite_check_and_unscale_`
  replaced by the local op, so torch.amp's GradScaler checks each rank's shard alone;
- "no scaler all-reduce": ShardedGradScaler with its `dist.all_reduce` of the flag removed.
Reports, per mutant, the entry notebook 10's scaler cell reads under the matching kind."""

import pickle
from types import SimpleNamespace

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, sharded_grad_scaler
from torch.distributed.tensor import DTensor

from zero_lab.collectives import CommLedger
from zero_lab.launch import init_worker, report

AMP_CHECK = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default


def recorded() -> list[dict]:
    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]


def step(rank: int, sharded: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model[2], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = (sharded_grad_scaler.ShardedGradScaler(device="cpu", init_scale=1024.0) if sharded
              else torch.amp.GradScaler("cpu", init_scale=1024.0))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    before = [p.to_local().detach().clone() for p in model.parameters()]
    scaler.scale(model(x).float().pow(2).mean()).backward()
    if rank == 1:
        next(iter(model.parameters())).grad.to_local()[0, 0] = float("inf")
    last = max((e["record_id"] for e in recorded()), default=-1)
    with CommLedger() as ledger:
        scaler.unscale_(opt)
        found = sum(scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
    issued = [[e["profiling_name"], e["input_sizes"]] for e in recorded() if e["record_id"] > last]
    scaler.step(opt)
    scaler.update()
    moved = max((p.to_local() - b).abs().max().item()
                for p, b in zip(model.parameters(), before, strict=True))
    return {"inf_found": bool(found.item()), "stepped": moved > 0, "scale": scaler.get_scale(),
            "ledger": [[r.op, r.nbytes] for r in ledger.records], "flight_recorder": issued}


def local_only(op_call, args, kwargs):
    """The mutant handler: the check on this rank's local shards, no reduction."""
    grads, found, inv = args
    return op_call([g.to_local() for g in grads], found, inv, **kwargs)


info = init_worker()
handlers = DTensor._op_dispatcher._custom_op_handlers
real = handlers[AMP_CHECK]
handlers[AMP_CHECK] = local_only
no_dtensor_reduce = step(info.rank, sharded=False)
handlers[AMP_CHECK] = real
# the scaler's module finds an all-reduce that does nothing (it calls no other dist function)
sharded_grad_scaler.dist = SimpleNamespace(all_reduce=lambda *a, **k: SimpleNamespace(
    wait=lambda: None))
no_scaler_all_reduce = step(info.rank, sharded=True)
report({"no DTensor reduce": no_dtensor_reduce, "no scaler all-reduce": no_scaler_all_reduce})
