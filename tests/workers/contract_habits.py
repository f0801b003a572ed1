"""Per-rank worker for tests/test_contract_habits.py: the loops people write in real training
code, at every stage, against one process on the global batch (issue 21, "round two").

Each case returns what it observed; a case that raises reports the error's text instead, so
one launch per world size covers every case. The habits:

- backward_raises: an exception inside backward, caught, and training goes on (an OOM-skip
                   or NaN-guard loop: `except RuntimeError: opt.zero_grad(); continue`)
- torch_clip:      torch.nn.utils.clip_grad_norm_(model.parameters(), c), as in one process
                   (made right: the global norm); on a subset of the parameters: refused
"""

from __future__ import annotations

import torch
from torch import nn

from zero_lab import workloads as W
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard

STEPS = 5
GLOBAL_BATCH = 12  # splits over 2 and 3 ranks
SEED = 7
D = 9
BUCKET_MB = 300 / 2**20  # several buckets: some are sent before backward fails


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return W.mlp_batch(step, GLOBAL_BATCH, D, seed=SEED)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def attempt(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the case reports what it got
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def compare(make_model, loop, stage: int, rank: int, world: int, **shard_kwargs) -> dict:
    """Train with `loop` at `stage` on this rank's rows and in one process on the global
    batch; how far apart the weights end (or the error the sharded loop raised)."""
    torch.manual_seed(SEED + 1 + rank)  # shard() starts every rank from rank 0's weights
    model = make_model()
    torch.manual_seed(SEED + 1)
    ref = make_model()
    sharded, opt = shard(model, stage, adam, bucket_mb=BUCKET_MB, **shard_kwargs)
    ref_opt = adam([p for p in ref.parameters() if p.requires_grad])
    try:
        loop(sharded, opt, lambda step: W.rank_slice(batch(step), rank, world))
    except Exception as exc:  # noqa: BLE001
        return {"stage": stage, "error": f"{type(exc).__name__}: {exc}"}
    loop(ref, ref_opt, batch)
    return {"stage": stage, "max_abs_diff": max_diff(full_state_dict(sharded), ref.state_dict())}


# ------------------------------------------------------------------- 1. backward raises


class _Trip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("simulated out of memory in backward")


class Tripwire(nn.Module):
    """Identity whose backward raises while `armed`: a backward that fails half-way, after the
    layers above it have produced their gradients (and their buckets were sent)."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Trip.apply(x) if self.armed else x


def tripwire_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), Tripwire(), nn.Linear(D, D), nn.Tanh(),
                         nn.Linear(D, D))


def loop_backward_raises(model, opt, batches) -> None:
    for step in range(STEPS):
        model[2].armed = step == 1  # the second step fails in backward, on every rank
        loss = W.mse_loss(model, batches(step))
        try:
            loss.backward()
        except RuntimeError:
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()


def backward_raises(rank: int, world: int) -> list[dict]:
    return [compare(tripwire_mlp, loop_backward_raises, stage, rank, world)
            for stage in range(4)]


# ------------------------------------------------------------- 2. torch's clip_grad_norm_
CLIP = 0.05  # below the gradients' norm (~0.5): every step clips


def loop_torch_clip(model, opt, batches) -> list[float]:
    norms = []
    for step in range(STEPS):
        W.mse_loss(model, batches(step)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
    return norms


def torch_clip(rank: int, world: int) -> list[dict]:
    out = []
    for stage in range(4):
        seen = {}

        def loop(model, opt, batches, seen=seen):
            seen.setdefault("norms", []).append(loop_torch_clip(model, opt, batches))

        result = compare(lambda: W.deep_mlp(D, depth=3), loop, stage, rank, world)
        sharded_norms, ref_norms = (seen.get("norms", []) + [None, None])[:2]
        out.append({**result, "norms": sharded_norms, "ref_norms": ref_norms})
    return out


def torch_clip_subset(rank: int, world: int) -> dict:
    """Clipping some of the parameters by their own norm needs the norm of just those."""
    out = {}
    for stage in range(1, 4):
        torch.manual_seed(SEED)
        model, opt = shard(W.deep_mlp(D, depth=3), stage, adam)
        W.mse_loss(model, W.rank_slice(batch(0), rank, world)).backward()
        out[stage] = attempt(lambda model=model: torch.nn.utils.clip_grad_norm_(
            list(model.parameters())[:2], CLIP))
    return out


CASES = {
    "backward_raises": backward_raises,
    "torch_clip": torch_clip,
    "torch_clip_subset": torch_clip_subset,
}


def main() -> None:
    info = init_worker()
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = case(info.rank, info.world_size)
        except Exception as exc:  # noqa: BLE001 - reported, the test says which case
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    report(results)


if __name__ == "__main__":
    main()
