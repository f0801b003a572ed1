"""Per-rank cases for tests/test_stage3_reads.py: stage 3, a parameter read outside its
unit's call (issue 21, point 4), against one process on the global batch.

Each case returns what it observed; a case that raises reports the error's text instead, so
one launch per world size covers every case.

Reads outside the unit (each must be refused at the read, naming the parameter and its unit;
before, they read this rank's 1-D piece):
- parent_reads_grad:    a parent's forward divides by `self.fc.weight.norm()` while training
                        (was: autograd's "invalid gradient" in backward)
- parent_reads_no_grad: the same model evaluated under torch.no_grad() (was: silently off)
- l2_term:              `loss + c * sum(p.pow(2).sum() for p in model.parameters())`
- logged_norm:          `sum(p.norm() ** 2 ...)` under no_grad for a log line (each rank's part)
- old_weight_norm:      torch.nn.utils.weight_norm, whose forward pre-hook (added before
                        shard()) computes the weight before the unit is gathered

What keeps working, equal to one process:
- parent_unit:          the same parent, its child kept inside the parent's unit (unit_classes)
- parametrized:         torch's weight norm as a parametrization (computed inside the unit)
- own_optimizer:        a torch Adam of one's own on model.parameters() (the local pieces),
                        foreach and weight decay (it reads the parameters out of place)
- habits:               tied weights, activation checkpointing, torch's clip_grad_norm_ on
                        model.parameters(), fp32 and bf16, then load_state_dict(W) and a
                        zero_lab.checkpoint save / load round trip
"""

from __future__ import annotations

import warnings

import torch
from contract_habits import run_cases  # a sibling worker: one launch runs every case
from stage_cases import error_message  # a sibling worker: `Type: message` of what fn() raises
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_lab.checkpoint
from zero_lab.course import workloads as W
from zero_lab.launch import init_worker, report, scratch_folder
from zero_lab.stages import full_state_dict, shard
from zero_lab.stages.mixed_precision import mixed_precision_reference

STEPS = 4
GLOBAL_BATCH = 12  # splits over 2 and 3 ranks
SEED = 11
D = 9
CLIP = 0.05  # below the gradient norms of these models: every step clips


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return W.mlp_batch(step, GLOBAL_BATCH, D, seed=SEED)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def sgd(params):
    """For bf16 comparisons: Adam divides by sqrt(v), so a gradient element near zero whose
    sign bf16 rounding flips moves a weight by 2 lr; SGD moves it by lr times the rounding."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def torch_clip(model, opt) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # routed to opt.clip_grad_norm_


def train(model, opt, batches, loss_fn=W.mse_loss, clip=None) -> None:
    for step in range(STEPS):
        loss_fn(model, batches(step)).backward()
        if clip is not None:
            clip(model, opt)
        opt.step()
        opt.zero_grad()


def pair(make_model, rank: int, optimizer=adam, **shard_kwargs):
    """(sharded model, its optimizer, the one-process model): the same weights (rank 0's)."""
    torch.manual_seed(SEED + 1 + rank)  # shard() starts every rank from rank 0's weights
    model = make_model()
    torch.manual_seed(SEED + 1)
    ref = make_model()
    sharded, opt = shard(model, 3, optimizer, **shard_kwargs)
    return sharded, opt, ref


# ------------------------------------------------------------------ reads outside the unit
class Scaled(nn.Module):
    """A parent whose forward reads a child's weight without calling the child there."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.fc = nn.Linear(D, D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(torch.tanh(self.inp(x))))
        return self.out(h / self.fc.weight.norm())


def parent_reads_grad(rank: int, world: int) -> str:
    model, opt, _ = pair(Scaled, rank)
    return error_message(lambda: train(model, opt, lambda s: W.rank_slice(batch(s), rank, world)))


def parent_reads_no_grad(rank: int, world: int) -> dict | str:
    """Evaluation under no_grad: the loss of every rank's rows, against one process."""
    model, _, ref = pair(Scaled, rank)
    x, y = W.rank_slice(batch(0), rank, world)
    with torch.no_grad():
        try:
            loss = W.mse_loss(model, (x, y))
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return {"loss_diff": (loss - W.mse_loss(ref, (x, y))).abs().item()}


def l2_loss(model, b) -> torch.Tensor:
    return W.mse_loss(model, b) + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())


def l2_term(rank: int, world: int) -> str:
    model, opt, _ = pair(lambda: W.deep_mlp(D, depth=3), rank)
    return error_message(lambda: train(model, opt, lambda s: W.rank_slice(batch(s), rank, world),
                                       loss_fn=l2_loss))


def logged_norm(rank: int, world: int) -> str:
    model, _, _ = pair(lambda: W.deep_mlp(D, depth=3), rank)

    def log_weight_norm():
        with torch.no_grad():
            return sum(p.norm() ** 2 for p in model.parameters()) ** 0.5

    return error_message(log_weight_norm)


def old_weight_norm(rank: int, world: int) -> str:
    def make():
        with warnings.catch_warnings():  # deprecated in favour of the parametrization
            warnings.simplefilter("ignore")
            return nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(D, D)), nn.Tanh(),
                                 nn.Linear(D, D))

    model, opt, _ = pair(make, rank)
    return error_message(lambda: train(model, opt, lambda s: W.rank_slice(batch(s), rank, world)))


# ------------------------------------------------------------------ what keeps working
def compare(make_model, rank: int, world: int, loss_fn=W.mse_loss, **shard_kwargs) -> dict:
    """Train sharded on this rank's rows and in one process on the global batch."""
    model, opt, ref = pair(make_model, rank, **shard_kwargs)
    try:
        train(model, opt, lambda s: W.rank_slice(batch(s), rank, world), loss_fn)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    train(ref, adam(ref.parameters()), batch, loss_fn)
    return {"max_abs_diff": max_diff(full_state_dict(model), ref.state_dict())}


def parent_unit(rank: int, world: int) -> dict:
    """unit_classes=(Scaled,): no module below the root is a unit, so the child's weight is
    gathered with the parent's (one unit, the root); the no-grad evaluation is exact too."""
    out = compare(Scaled, rank, world, unit_classes=(Scaled,))
    model, _, ref = pair(Scaled, rank, unit_classes=(Scaled,))
    x, y = W.rank_slice(batch(0), rank, world)
    with torch.no_grad():
        out["loss_diff"] = (W.mse_loss(model, (x, y)) - W.mse_loss(ref, (x, y))).abs().item()
    return out


def weight_normed() -> nn.Sequential:
    wn = torch.nn.utils.parametrizations.weight_norm
    return nn.Sequential(wn(nn.Linear(D, D)), nn.Tanh(), wn(nn.Linear(D, D)))


def parametrized(rank: int, world: int) -> dict:
    return compare(weight_normed, rank, world)


def own_optimizer(rank: int, world: int) -> dict:
    """Stage 3's model.parameters() are the local pieces with their gradients: an element-wise
    torch optimizer of one's own on them trains as one process (Adam's weight decay and the
    foreach path read the parameters out of place, inside the optimizer's step)."""
    def make(params):
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.1, foreach=True)

    model, _, ref = pair(lambda: W.deep_mlp(D, depth=3), rank)
    try:
        train(model, make(model.parameters()), lambda s: W.rank_slice(batch(s), rank, world))
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    train(ref, make(ref.parameters()), batch)
    return {"max_abs_diff": max_diff(full_state_dict(model), ref.state_dict())}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class TiedNet(nn.Module):
    """An input projection tied to the output head (the root's unit holds the weight), blocks
    under non-reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D, bias=False)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(D, D, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.head(h)


def habits(rank: int, world: int) -> list[dict]:
    """fp32 and bf16 training (SGD with momentum) with every habit above, against one
    process (bf16: the same recipe in one process, mixed_precision_reference); then W loaded
    with model.load_state_dict is what full_state_dict returns, and a checkpoint saved and
    loaded back after more steps brings W back."""
    out = []
    for precision in ("fp32", "bf16"):
        result = {"precision": precision}
        model, opt, ref = pair(TiedNet, rank, sgd, precision=precision)
        torch.manual_seed(SEED + 99)
        new = {k: v.detach().clone() for k, v in TiedNet().state_dict().items()}
        try:
            train(model, opt, lambda s: W.rank_slice(batch(s), rank, world), clip=torch_clip)
            trained = full_state_dict(model)
            model.load_state_dict(new)
            result["after_load"] = max_diff(full_state_dict(model), new)
            directory = scratch_folder(f"stage3_reads_{precision}")
            zero_lab.checkpoint.save(model, opt, directory)
            train(model, opt, lambda s: W.rank_slice(batch(s), rank, world))  # moves away
            zero_lab.checkpoint.load(model, opt, directory)
            result["after_checkpoint"] = max_diff(full_state_dict(model), new)
        except Exception as exc:  # noqa: BLE001
            result["error"] = f"{type(exc).__name__}: {exc}"
            out.append(result)
            continue
        if precision == "fp32":
            train(ref, sgd(ref.parameters()), batch, clip=torch_clip)
            result["max_abs_diff"] = max_diff(trained, ref.state_dict())
        else:
            ref, ref_opt = mixed_precision_reference(ref, sgd)
            # one process clips as the sharded optimizer does, the norm summed in fp32
            train(ref, ref_opt, batch, clip=lambda _model, o: o.clip_grad_norm_(CLIP))
            result["max_abs_diff"] = max_diff(trained, ref_opt.full_state_dict(ref))
        out.append(result)
    return out


CASES = {
    "parent_reads_grad": parent_reads_grad,
    "parent_reads_no_grad": parent_reads_no_grad,
    "l2_term": l2_term,
    "logged_norm": logged_norm,
    "old_weight_norm": old_weight_norm,
    "parent_unit": parent_unit,
    "parametrized": parametrized,
    "own_optimizer": own_optimizer,
    "habits": habits,
}


def run(rank: int, world: int) -> dict:
    """Every case on this rank; the report tests/test_stage3_reads.py reads
    (tests/workers/world_cases.py runs it in the launch it shares with the other workers)."""
    return run_cases(CASES, rank, world)


def main() -> None:
    """This worker alone, e.g. to debug it: torchrun("tests/workers/stage3_reads.py", nproc=2)."""
    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
