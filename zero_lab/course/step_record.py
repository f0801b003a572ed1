"""One training step of DDP and ZeRO stages 1-3, recorded phase by phase on every rank.

Runs on the ranks (zero_lab/workers/step_record.py; tests/workers/world_cases.py). A model of
13 parameters, small enough to read every number: Linear(4, 2), tanh, Linear(2, 1). Each
rank trains it on a batch of its own, so the gradients differ between ranks until they are
averaged. For each system the step is written out with its collectives on one flat buffer,
the way notebook 03's exercise writes it (zero_lab/stages holds the real stages); after each
phase this rank notes what it holds:

    params   the flat parameters (Ψ elements padded to N·S), None where not held
    grads    the flat gradient: "local" (this rank's batch) or "mean" (averaged over ranks)
    state    Adam's first moment (exp_avg), None where not held
    message  the collective that ran in the phase: op and the bytes this rank sent

Adam's states exist from the first step on, so a warm-up step runs first, unrecorded. Every
system ends on the same parameters (DDP's): the record says so (`final_params`).

`record(rank, world)` returns {"numel", "padded", "systems": {name: [phase, ...]}} for this
rank; `zero_lab.course.step_view` draws the ranks' records side by side.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

SYSTEMS = ("ddp", "stage1", "stage2", "stage3")
LR = 0.1


def model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Linear(4, 2), nn.Tanh(), nn.Linear(2, 1)).double()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
    return torch.randn(3, 4, generator=g, dtype=torch.float64), \
        torch.randn(3, 1, generator=g, dtype=torch.float64)


def _flat(tensors, padded: int) -> torch.Tensor:
    out = torch.zeros(padded, dtype=torch.float64)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    out[:flat.numel()] = flat
    return out


def _local_grad(net: nn.Module, flat_params: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """This rank's gradient of its own batch at `flat_params` (padding: zero)."""
    torch.nn.utils.vector_to_parameters(flat_params[:_numel(net)], net.parameters())
    net.zero_grad()
    x, y = batch(rank, step)
    nn.functional.mse_loss(net(x), y).backward()
    return _flat([p.grad for p in net.parameters()], flat_params.numel())


def _numel(net: nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


_GROUP = None  # gloo's world, or a gloo group beside NCCL's: these are CPU tensors


def _sent(collective, *args, **kwargs) -> dict:
    """Run `collective(*args, **kwargs)` under a CommLedger: its op and the bytes this rank
    sent."""
    from zero_lab.collectives import CommLedger

    with CommLedger() as ledger:
        collective(*args, group=_GROUP, **kwargs)
    (op,) = {r.op for r in ledger.records}
    return {"op": op, "sent": int(ledger.total_bytes())}


class _Recorder:
    def __init__(self) -> None:
        self.phases = []

    def note(self, name, params, grads, grad_kind, state, message=None, owned=None):
        """`params`/`grads`/`state`: full-length tensors with NaN where not held."""
        def values(t):
            return [None if v != v else round(v, 4) for v in t.tolist()]
        self.phases.append({"name": name, "params": values(params), "grads": values(grads),
                            "grad_kind": grad_kind, "state": values(state),
                            "message": message, "owned": owned})


def _only(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    out = torch.full_like(t, float("nan"))
    out[lo:hi] = t[lo:hi]
    return out


def _run(system: str, rank: int, n: int) -> tuple[list[dict], list[float]]:
    net = model()
    numel = _numel(net)
    shard = -(-numel // n)
    padded, lo, hi = shard * n, rank * shard, (rank + 1) * shard
    nothing = torch.full((padded,), float("nan"), dtype=torch.float64)
    params = _flat([p.detach() for p in net.parameters()], padded)
    sharded = system != "ddp"
    # Adam on what this rank steps: everything (DDP) or its slice (ZeRO).
    mine = nn.Parameter(params[lo:hi].clone() if sharded else params.clone())
    opt = torch.optim.Adam([mine], lr=LR)
    rec = _Recorder()
    for step in (0, 1):  # step 0 warms Adam's states up; step 1 is recorded
        note = rec.note if step == 1 else (lambda *a, **k: None)

        def state():
            m = opt.state[mine].get("exp_avg")
            if m is None or not sharded:
                return nothing.clone() if m is None else m.detach().clone()
            full = nothing.clone()
            full[lo:hi] = m
            return full

        if system == "stage3":
            note("at rest", _only(params, lo, hi), nothing, None, state(), owned=[lo, hi])
            gathered = torch.empty(padded, dtype=torch.float64)
            sent = _sent(dist.all_gather_into_tensor, gathered, mine.detach().clone())
            note("all-gather the parameters", gathered, nothing, None, state(), sent, [lo, hi])
            grad = _local_grad(net, gathered, rank, step)
            note("forward and backward, then free the gathered parameters",
                 _only(params, lo, hi), grad, "local", state(), owned=[lo, hi])
            # (real stage 3 gathers again for backward and frees after forward: notebook 05)
        else:
            grad = _local_grad(net, params, rank, step)
            note("backward: each rank its own gradient", params, grad, "local", state(),
                 owned=[lo, hi] if sharded else None)
        if not sharded:
            sent = _sent(dist.all_reduce, grad, op=dist.ReduceOp.AVG)
            note("all-reduce the gradient", params, grad, "mean", state(), sent)
            mine.grad = grad.clone()
        else:
            piece = torch.empty(shard, dtype=torch.float64)
            sent = _sent(dist.reduce_scatter_tensor, piece, grad.clone(),
                         op=dist.ReduceOp.AVG)
            mine.grad = piece
            held = grad.clone() if system == "stage1" else nothing.clone()  # 1 keeps it
            held[lo:hi] = piece
            note("reduce-scatter the gradient" + ("" if system == "stage1" else
                                                  ", free the full one"),
                 params if system != "stage3" else _only(params, lo, hi), held,
                 "mean_slice", state(), sent, [lo, hi])
        opt.step()
        opt.zero_grad()
        if not sharded:
            params = mine.detach().clone()
            note("Adam steps every element", params, nothing, None, state())
        else:
            stepped = params.clone()
            stepped[lo:hi] = mine.detach()
            shown = stepped if system != "stage3" else _only(stepped, lo, hi)
            note("Adam steps this rank's slice", shown, nothing, None, state(), owned=[lo, hi])
            # Stage 3 keeps its slice: the rest is gathered at the next forward. The gather
            # below is that one, run here so the record can end on the full parameters.
            params = torch.empty(padded, dtype=torch.float64)
            sent = _sent(dist.all_gather_into_tensor, params, mine.detach().clone())
            if system != "stage3":
                note("all-gather the updated slices", params, nothing, None, state(), sent,
                     [lo, hi])
    return rec.phases, [round(v, 12) for v in params[:numel].tolist()]


def record(rank: int, world: int) -> dict:
    """This rank's record of one step of every system (see the module's docstring)."""
    global _GROUP
    if dist.get_backend() != "gloo" and _GROUP is None:  # NCCL's world takes no CPU tensors
        _GROUP = dist.new_group(backend="gloo")
    numel = _numel(model())
    out = {"numel": numel, "padded": -(-numel // world) * world, "world_size": world,
           "systems": {}, "final_params": {}}
    for system in SYSTEMS:
        out["systems"][system], out["final_params"][system] = _run(system, rank, world)
    return out
