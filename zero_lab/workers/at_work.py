"""Notebook 10, what you meet at work: a hang, FSDP2 with tensor parallelism, a loss scaler.

    at_work.py --part skip --folder DIR   # 2 ranks: rank 1 skips a collective; it fails
    at_work.py --part all  --folder DIR   # 4 ranks: everything below, in one launch
    at_work.py --part nccl --folder DIR   # 2 GPUs: the mistake under NCCL's watchdog

`--part skip` is the mistake as it reaches you: rank 0 all-reduces a number to log it, rank 1
does not, and both go on to the next collective. The group's timeout is 2 s, so gloo raises
and the launch fails with the rank's traceback (without it, gloo waits 30 minutes).

`--part all` reports, each under its own key:
- "detail": the same mistake in a group made under TORCH_DISTRIBUTED_DEBUG=DETAIL
  (`dist.set_debug_level`): torch wraps the group and checks every collective's fingerprint
  across the ranks first, so each rank raises at once, naming both collectives;
- "flight": the same mistake with the flight recorder on (TORCH_FR_BUFFER_SIZE, set by the
  launch): the group times out after 2 s, each rank dumps its recorder
  (`torch._C._distributed_c10d._dump_fr_trace`) into DIR/flight/ for the analyzer;
- "tp": FSDP2 over "dp" on top of tensor parallelism over "tp", a 2 x 2 DeviceMesh: what each
  rank holds (local shards) and every collective of one step, with the mesh dim it ran on;
- "scaler": fp16 with an inf in rank 1's gradient shard, checked by torch.amp's GradScaler on
  FSDP2's DTensor gradients, by ShardedGradScaler, and on each rank's local shard alone: who
  saw the inf, who stepped, the new scales, and the collectives the check issued as the
  ledger saw them and as the flight recorder did.
Ranks pair up as (0, 1) and (2, 3) for the debug parts; rank r of a pair plays rank r % 2.
"""

from __future__ import annotations

import argparse
import datetime
import pickle
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.collectives.ledger import name_level
from zero_lab.course import models
from zero_lab.launch import init_worker, report

SHORT = datetime.timedelta(seconds=2)  # a group's timeout: a hang becomes an error in 2 s
# The TP model: the course GPT's feed-forward blocks (zero_lab/course/models.py), its width,
# layers and sequence; BATCH rows per dp rank.
H, BLOCKS, SEQ = models.GPT["d_model"], models.GPT["n_layers"], models.GPT["seq_len"]
BATCH = 4


def the_mistake(rank: int, group: dist.ProcessGroup, device: str = "cpu") -> None:
    """Rank 0 all-reduces a loss to log it; rank 1 skips that, and both all-gather next."""
    x = torch.ones(4, device=device)
    if rank == 0:
        dist.all_reduce(x, group=group)  # `if rank == 0: log(all_reduce(loss))`
    out = torch.empty(4 * group.size(), device=device)
    dist.all_gather_into_tensor(out, x, group=group)


def pairs() -> list[list[int]]:
    n = dist.get_world_size()
    return [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]


def pair_group(rank: int, **kwargs) -> tuple[dist.ProcessGroup, int]:
    """Every rank makes every pair's group (new_group is collective); returns its own."""
    mine = None
    for ranks in pairs():
        group = dist.new_group(ranks, **kwargs)
        if rank in ranks:
            mine = group
    return mine, rank % 2


def caught(fn) -> str:
    try:
        fn()
    except RuntimeError as err:
        return " ".join(str(err).split())
    return ""


def detail_facts(rank: int) -> dict:
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # what TORCH_DISTRIBUTED_DEBUG=DETAIL sets
    try:
        group, local = pair_group(rank, timeout=SHORT)
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)  # the groups made later stay plain
    backend = type(group._get_backend(torch.device("cpu"))).__name__
    return {"backend": backend, "error": caught(lambda: the_mistake(local, group))}


def flight_facts(rank: int, folder: Path) -> dict:
    group, local = pair_group(rank, timeout=SHORT)
    error = caught(lambda: the_mistake(local, group))
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    name = group.group_name
    entries = [e for e in dump["entries"] if e["process_group"][0] == name]
    facts = {"error": error, "group": name, "pg_config_from_gloo": dump["pg_config"],
             "ops": [e["profiling_name"] for e in entries],
             "seq": [e["collective_seq_id"] for e in entries]}
    if rank < 2:  # the first pair's dumps, for the analyzer (one file per rank)
        # gloo's dump leaves the table of groups empty in torch 2.13 (NCCL's fills it at
        # init); the analyzer needs each group's ranks, so they are written in here.
        dump["entries"] = entries
        dump["pg_config"] = {name: {"name": name, "desc": "undefined",
                                    "ranks": str(dist.get_process_group_ranks(group))}}
        out = folder / "flight"
        out.mkdir(exist_ok=True)
        (out / f"rank_{rank}").write_bytes(pickle.dumps(dump))
    return facts


class Block(nn.Module):
    """An MLP block without biases: Ψ = 8·H² parameters, all in the two matrices."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(h, 4 * h, bias=False)
        self.down = nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def tp_facts() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):  # the ledger records each collective with its mesh dim
        name_level(mesh[dim].get_group(), dim)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(H) for _ in range(BLOCKS)])
    psi = sum(p.numel() for p in model.parameters())
    hidden = {}

    def keep_shape(module, inputs, output) -> None:  # the hidden activation, as a rank has it
        hidden["shape"] = list(output.shape)

    for block in model:
        # `up` split by output rows (Colwise), `down` by input columns (Rowwise): the hidden
        # 4H activations stay split, and `down`'s partial sums are all-reduced over "tp".
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        block.up.register_forward_hook(keep_shape)
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["dp"])
    held = {n: {"global": list(p.shape), "local": list(p.to_local().shape),
                "placements": [str(pl) for pl in p.placements],
                "bytes": p.to_local().numel() * p.element_size()}
            for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # One batch per dp rank; the two tp ranks of a dp rank must see the same rows.
    dp = mesh["dp"].get_local_rank()
    x = torch.randn(BATCH, SEQ, H, generator=torch.Generator().manual_seed(dp))
    for _step in range(2):  # the first step builds FSDP2's state; the second is measured
        with CommLedger() as ledger:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    records = [{"op": r.op, "level": r.level, "nbytes": r.nbytes, "sent_bytes": r.sent_bytes,
                "in_backward": r.in_backward, "torch_op": r.torch_op} for r in ledger.records]
    return {"psi": psi, "h": H, "blocks": BLOCKS, "batch": BATCH, "seq": SEQ,
            "held": held, "hidden_shape": hidden["shape"], "records": records,
            "mesh": {"dp": mesh["dp"].get_local_rank(), "tp": mesh["tp"].get_local_rank()}}


def recorded() -> list[dict]:
    """What the flight recorder holds now: every collective this process issued, wherever it
    was issued from (the ledger misses those DTensor issues inside its own dispatch)."""
    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]


def scaler_run(rank: int, kind: str) -> dict:
    """One fp16 step with an inf in rank 1's gradient shard, its overflow check by `kind`:
    "GradScaler" (torch.amp's, on FSDP2's DTensor gradients), "ShardedGradScaler", or
    "local check" (the same check on each rank's local shards alone, as code written for
    plain tensors does: FSDP1's flat parameters with torch.amp's GradScaler, or a hand-written
    check on `p.grad.to_local()`)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A small initial scale, so that only the injected inf overflows (2**16 overflows fp16
    # here on every rank: a real overflow, which every rank sees anyway).
    scale = 1024.0
    scaler = (ShardedGradScaler(device="cpu", init_scale=scale) if kind == "ShardedGradScaler"
              else torch.amp.GradScaler("cpu", init_scale=scale))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    before = [p.to_local().detach().clone() for p in model.parameters()]
    scaler.scale(model(x).float().pow(2).mean()).backward()
    if rank == 1:  # an overflow in one rank's shard only: the others' shards are finite
        next(iter(model.parameters())).grad.to_local()[0, 0] = float("inf")
    last = max((e["record_id"] for e in recorded()), default=-1)
    with CommLedger() as ledger:
        if kind == "local check":
            found = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [p.grad.to_local() for p in model.parameters()], found, torch.full((1,), 1 / scale))
        else:
            scaler.unscale_(opt)  # where the check runs (and, sharded, its all-reduce)
            found = sum(scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values())
    issued = [[e["profiling_name"], e["input_sizes"]] for e in recorded() if e["record_id"] > last]
    if kind == "local check":
        if not found.item():
            opt.step()
        new_scale = scale / 2 if found.item() else scale
    else:
        scaler.step(opt)  # skipped where the (agreed) flag is set
        scaler.update()
        new_scale = scaler.get_scale()
    moved = max((p.to_local() - b).abs().max().item()
                for p, b in zip(model.parameters(), before, strict=True))
    return {"inf_found": bool(found.item()), "stepped": moved > 0, "scale": new_scale,
            "ledger": [[r.op, r.nbytes] for r in ledger.records], "flight_recorder": issued}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["skip", "all", "nccl"], required=True)
    parser.add_argument("--folder", type=Path, required=True)
    args = parser.parse_args()
    info = init_worker()
    if args.part == "skip":
        group = dist.new_group(timeout=SHORT)
        the_mistake(info.rank, group)  # raises on every rank after 2 s
        return
    if args.part == "nccl":  # one GPU a rank, TORCH_NCCL_* set by the launch
        group = dist.new_group(timeout=datetime.timedelta(seconds=5))
        the_mistake(info.rank, group, info.device)  # NCCL returns at once; the GPU waits
        torch.cuda.synchronize(info.device)  # the watchdog times out, dumps, tears down
        time.sleep(60)  # a rank that got through stays to dump when the other signals
        return
    out = {"detail": detail_facts(info.rank),
           "flight": flight_facts(info.rank, args.folder)}
    out["tp"] = tp_facts()
    out["scaler"] = {kind: scaler_run(info.rank, kind)
                     for kind in ("GradScaler", "ShardedGradScaler", "local check")}
    report(out)


if __name__ == "__main__":
    main()
