"""Notebook 02's rank work, batched into one launch per world size.

Reports, per rank:
  tables     each collective on a tiny tensor: this rank's tensor before and after
  identity   max |all_reduce - all_gather(reduce_scatter)| on random data
  ring       max |ring op - torch op| on random data, sizes divisible by N and not
  ring_steps each rank's chunks after every step of a ring all-reduce of 2^rank (figure)
  ledger     what CommLedger recorded for torch's and the ring's collectives on PSI elements
  patterns   the collectives a training step of each stage issues, as the ledger counts them
"""

import argparse

import torch
import torch.distributed as dist

from zero_lab.collectives import (
    CommLedger,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from zero_lab.course.seed_blog import owner_ranks
from zero_lab.launch import init_worker, report

parser = argparse.ArgumentParser()
parser.add_argument("--psi", type=int, default=12_000, help="elements in the ledger's message")
args = parser.parse_args()

info = init_worker()
rank, n, device = info.rank, info.world_size, info.device
torch.manual_seed(rank)  # every rank different data


def tiny(numel: int) -> torch.Tensor:
    """Rank r's tiny tensor: 10*r + [1, 2, ...], so every number says whose it is."""
    return (torch.arange(1, numel + 1) + 10 * rank).to(device)


# ---------------------------------------------------------------- tiny tables
tables = {}
x = tiny(n)
before = x.tolist()
dist.all_reduce(x)
tables["all_reduce"] = {"before": before, "after": x.tolist()}

x = tiny(n)
out = torch.empty(1, dtype=x.dtype, device=device)
dist.reduce_scatter_single(out, x)
tables["reduce_scatter"] = {"before": x.tolist(), "after": out.tolist()}

x = tiny(1)
out = torch.empty(n, dtype=x.dtype, device=device)
dist.all_gather_single(out, x)
tables["all_gather"] = {"before": x.tolist(), "after": out.tolist()}

x = tiny(n)
before = x.tolist()
dist.broadcast(x, src=0)
tables["broadcast"] = {"before": before, "after": x.tolist()}

# ---------------------------------------------------------------- the identity
data = torch.randn(n * 1000, dtype=torch.float64, device=device)
all_reduced = data.clone()
dist.all_reduce(all_reduced)
my_slice = torch.empty(1000, dtype=torch.float64, device=device)
dist.reduce_scatter_single(my_slice, data)
rebuilt = torch.empty_like(data)
dist.all_gather_single(rebuilt, my_slice)
identity_error = (rebuilt - all_reduced).abs().max().item()

# ---------------------------------------------------------------- ring == torch
ring = []
for numel in (n * 1000, 1001, 5):  # divisible by N, then not, then tiny
    x = torch.randn(numel, dtype=torch.float64, device=device)
    mine, ref = x.clone(), x.clone()
    ring_all_reduce(mine)
    dist.all_reduce(ref)
    ring.append({"op": "all_reduce", "numel": numel,
                 "max_error": (mine - ref).abs().max().item()})
for chunk in (1000, 7):
    x = torch.randn(n * chunk, dtype=torch.float64, device=device)
    mine = torch.empty(chunk, dtype=torch.float64, device=device)
    ref = torch.empty_like(mine)
    ring_reduce_scatter(mine, x)
    dist.reduce_scatter_single(ref, x)
    ring.append({"op": "reduce_scatter", "numel": n * chunk,
                 "max_error": (mine - ref).abs().max().item()})
    part = torch.randn(chunk, dtype=torch.float64, device=device)
    mine = torch.empty(n * chunk, dtype=torch.float64, device=device)
    ref = torch.empty_like(mine)
    ring_all_gather(mine, part)
    dist.all_gather_single(ref, part)
    ring.append({"op": "all_gather", "numel": n * chunk,
                 "max_error": (mine - ref).abs().max().item()})

# ---------------------------------------------------------------- the ledger
psi = args.psi - args.psi % n  # N equal chunks
full = torch.randn(psi, device=device)  # fp32: 4 bytes per element
part = torch.empty(psi // n, device=device)
ledger_out = {}
for name, call in {
    "all_reduce": lambda: dist.all_reduce(full),
    "reduce_scatter": lambda: dist.reduce_scatter_single(part, full),
    "all_gather": lambda: dist.all_gather_single(full, part),
    "broadcast": lambda: dist.broadcast(full, src=0),
    "ring_all_reduce": lambda: ring_all_reduce(full),
    "ring_reduce_scatter": lambda: ring_reduce_scatter(part, full),
    "ring_all_gather": lambda: ring_all_gather(full, part),
}.items():
    with CommLedger() as ledger:
        call()
    ledger_out[name] = {"records": ledger.as_dicts(), "total_bytes": ledger.total_bytes(),
                        "sent_by_send": ledger.total_bytes("send"), "table": ledger.table()}

# ---------------------------------------------------------------- per-step patterns
# A toy model's parameter sizes (not multiples of N) and its flat buffer padded to N chunks.
sizes = [3000, 50, 1500, 7, 900]
flat_numel = -(-sum(sizes) // n) * n
flat = torch.randn(flat_numel, device=device)
shard = torch.empty(flat_numel // n, device=device)
params = [torch.randn(s, device=device) for s in sizes]
owner = owner_ranks(len(sizes), n)  # the seed blog gives whole parameters to ranks


def seed_zero1_step():
    # The seed blog's ZeRO-1: a full all-reduce of every gradient, then each parameter's
    # owner broadcasts it after its update.
    for p in params:
        dist.all_reduce(p)
    for p, src in zip(params, owner, strict=True):
        dist.broadcast(p, src=src)


def seed_zero2_step():
    # The seed blog's "reduce-scatter": N concatenated copies of each gradient go in, so every
    # rank gets the whole summed gradient back, then owners broadcast updated parameters.
    for p in params:
        out = torch.empty_like(p)
        dist.reduce_scatter_single(out, torch.cat([p] * n))
    for p, src in zip(params, owner, strict=True):
        dist.broadcast(p, src=src)


patterns = {
    "stage 0 (DP): all-reduce gradients": (
        flat_numel, lambda: dist.all_reduce(flat)),
    "stages 1-2: reduce-scatter gradients, all-gather parameters": (
        flat_numel, lambda: (dist.reduce_scatter_single(shard, flat),
                             dist.all_gather_single(flat, shard))),
    "stage 1, all-reduce variant: all-reduce gradients, all-gather parameters": (
        flat_numel, lambda: (dist.all_reduce(flat), dist.all_gather_single(flat, shard))),
    "stage 3: all-gather (forward), all-gather (backward), reduce-scatter gradients": (
        flat_numel, lambda: (dist.all_gather_single(flat, shard),
                             dist.all_gather_single(flat, shard),
                             dist.reduce_scatter_single(shard, flat))),
    "blog post's ZeRO-1: all-reduce each gradient, owners broadcast parameters": (
        sum(sizes), seed_zero1_step),
    "blog post's ZeRO-2: 'reduce-scatter' of N copies, owners broadcast parameters": (
        sum(sizes), seed_zero2_step),
}
pattern_out = {}
for name, (numel, step) in patterns.items():
    with CommLedger() as ledger:
        step()
    pattern_out[name] = {"psi_bytes": numel * 4, "volume": ledger.volume(),
                         "total_bytes": ledger.total_bytes(), "summary": ledger.summary()}

# ---------------------------------------------------------------- the ring, step by step
# Rank r starts with 2^r in every chunk, so a chunk's value says whose contributions it holds
# (bit r set: rank r's). Recorded after every step of the course's ring all-reduce.
marked = torch.full((n,), 2.0**rank, dtype=torch.float64, device=device)
ring_steps = [{"phase": "start", "step": 0, "chunks": marked.tolist()}]
ring_all_reduce(marked, after_step=lambda phase, step: ring_steps.append(
    {"phase": phase, "step": step + 1, "chunks": marked.tolist()}))

report({"world_size": n, "tables": tables, "identity_error": identity_error, "ring": ring,
        "psi": psi, "ledger": ledger_out, "patterns": pattern_out, "ring_steps": ring_steps})
