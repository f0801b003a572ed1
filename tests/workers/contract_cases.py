"""Per-rank cases for tests/test_contract.py: the edges of the contract torch users know
(tests/workers/world_cases.py runs `run` in the launch it shares with the other workers).

Each case trains a model at one stage with a loop that exercises one habit of plain PyTorch,
and runs the same loop in one process on the global batch (rank 0's initialisation, plain
torch optimizer). It reports how far the weights end apart, and what `.grad` looked like
where one process has None. The habits:

- unused:       a parameter no step uses, and one used only on even steps (AdamW decays
                and Adam moves a parameter only when it has a gradient)
- rank_usage:   a branch only rank 0's data takes (one process on the global batch uses it:
                its gradient is the average with zeros from the other ranks); stages 0-2
- zero_grad:    zero_grad(set_to_none=True/False), model.zero_grad(), an opt.step() with
                no backward since the last zero_grad
- groups:       AdamW parameter groups as nanoGPT builds them (decay only for p.dim() >= 2,
                its own learning rate per group) and an LR scheduler
"""

from __future__ import annotations

import torch
from torch import nn

from zero_lab.course import workloads as W
from zero_lab.launch import init_worker, report
from zero_lab.stages import full_state_dict, shard, sharded_optimizer
from zero_lab.stages.mixed_precision import COMPUTE_DTYPES, mixed_precision_reference

STEPS = 6
GLOBAL_BATCH = 12  # splits over 1, 2, 3, 4 ranks
SEED = 99
sharded_optimizer.OPTIMIZER_CHUNK = 37  # many chunks per parameter: the chunked path too


Gated = W.SometimesMLP  # a spare layer, a layer used when asked


def gated_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=gen), torch.randn(GLOBAL_BATCH, 3, generator=gen)


def gpt() -> nn.Module:
    # bias=False: the key bias's gradient is rounding noise, which Adam amplifies (see
    # TinyGPT); the LayerNorm weights still make a no-decay group of 1-D parameters.
    return W.TinyGPT(vocab_size=19, seq_len=5, d_model=8, n_heads=2, n_layers=2, bias=False)


def gpt_batch(step: int):
    return W.gpt_batch(step, GLOBAL_BATCH, 5, 19)


def adamw(params):
    return torch.optim.AdamW(params, lr=2e-2, weight_decay=0.1)


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def nanogpt_groups(params):
    """nanoGPT's configure_optimizers: weight decay for matrices only; here each group also
    gets its own learning rate, so a group applied to the wrong parameters shows."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.2},
                              {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}],
                             lr=2e-2, betas=(0.9, 0.95))


# ----------------------------------------------------------------------------- loops
# Each loop runs `model` with `opt`; `batch(step)` gives the batch this process trains on
# (a rank's rows, or the global batch in the reference). Returns what it observed.


def loop_unused(model, opt, batch, rank, world, reference):
    seen = []
    for step in range(STEPS):
        x, y = batch(step)
        use = step % 2 == 0
        nn.functional.mse_loss(model(x, use=use), y).backward()
        seen.append(_grad_is_none(model, ("spare.weight", "sometimes.weight", "gate")))
        opt.step()
        opt.zero_grad()
    return {"grad_none": seen}


def loop_rank_usage(model, opt, batch, rank, world, reference):
    for step in range(STEPS):
        if reference:  # one process: each rank's rows through the path that rank takes
            x, y = batch(step)
            parts = zip(x.chunk(world), y.chunk(world), strict=True)
            loss = sum(nn.functional.mse_loss(model(xr, use=r == 0), yr)
                       for r, (xr, yr) in enumerate(parts)) / world
        else:
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x, use=rank == 0), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {}


def loop_zero_grad(model, opt, batch, rank, world, reference):
    seen = []
    for step in range(STEPS):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        how = step % 3
        if how == 0:
            opt.zero_grad(set_to_none=True)
        elif how == 1:
            opt.zero_grad(set_to_none=False)
        else:
            model.zero_grad()
        seen.append(_grad_is_none(model, ("head.weight",)))
        opt.step()  # no backward since the zero_grad: a no-op, or zero gradients stepped
    return {"grad_none": seen}


def loop_groups(model, opt, batch, rank, world, reference):
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(STEPS):
        W.next_token_loss(model, batch(step)).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return {"lrs": [group["lr"] for group in opt.param_groups],
            "decays": [group["weight_decay"] for group in opt.param_groups]}


def loop_root(model, opt, batch, rank, world, reference):
    """Stage 3 with root_params="replicate": the tied embedding (claimed by no unit but the
    root) stays full-shaped on every rank, its gradient averaged; clipping counts it once."""
    seen = {}
    for step in range(STEPS):
        W.next_token_loss(model, batch(step)).backward()
        if step == 0:
            weight = dict(model.named_parameters())["tok_emb.weight"]
            seen = {"shape": list(weight.shape), "grad_shape": list(weight.grad.shape),
                    "grad_norm": weight.grad.double().norm().item()}
        if reference:
            seen.setdefault("norms", []).append(
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
        else:
            seen.setdefault("norms", []).append(opt.clip_grad_norm_(0.05).item())
        opt.step()
        opt.zero_grad()
    return seen


def _grad_is_none(model, names) -> list[bool]:
    params = dict(model.named_parameters())
    return [params[n].grad is None for n in names]


SCENARIOS = {  # name: (model, batch, optimizer function, loop, stages)
    "unused": (Gated, gated_batch, adamw, loop_unused, (0, 1, 2, 3)),
    "rank_usage": (Gated, gated_batch, adamw, loop_rank_usage, (0, 1, 2)),
    "zero_grad": (Gated, gated_batch, adamw, loop_zero_grad, (0, 1, 2, 3)),
    "groups": (gpt, gpt_batch, nanogpt_groups, loop_groups, (0, 1, 2, 3)),
    # SGD: Adam would turn the rounding noise of tiny clipped gradients into full steps
    "root_replicate": (gpt, gpt_batch, sgd, loop_root, (3,)),
}


def run_scenario(scenario: str, stage: int, rank: int, world: int) -> dict:
    make_model, batch, make_opt, loop, _ = SCENARIOS[scenario]
    torch.manual_seed(SEED + rank)  # shard() must start every rank from rank 0's weights
    model = make_model()
    torch.manual_seed(SEED)
    ref = make_model()
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    extra = {"root_params": "replicate"} if scenario == "root_replicate" else {}
    model, opt = shard(model, stage, make_opt, bucket_mb=300 / 2**20,  # several buckets
                       find_unused_parameters=make_model is Gated,  # it has a spare layer
                       **extra)

    def local(step):
        return W.rank_slice(batch(step), rank, world)

    seen = loop(model, opt, local, rank, world, reference=False)
    ref_opt = make_opt([p for p in ref.parameters() if p.requires_grad])
    ref_seen = loop(ref, ref_opt, batch, rank, world, reference=True)
    full, ref_full = full_state_dict(model), ref.state_dict()
    diffs = {k: (full[k] - ref_full[k]).abs().max().item() for k in ref_full}
    return {"name": f"{scenario}-stage{stage}", "scenario": scenario, "stage": stage,
            "max_abs_diff": max(diffs.values()), "worst_key": max(diffs, key=diffs.get),
            "moved": {k: (ref_full[k] - initial[k]).abs().max().item() for k in initial},
            "moved_here": {k: (full[k] - initial[k]).abs().max().item() for k in initial},
            "seen": seen, "ref_seen": ref_seen}


def precision_run(stage: int, precision: str, rank: int, world: int) -> dict:
    """Mixed precision in the compute dtype asked for, against one process with the same
    recipe in the same dtype; and how far that recipe itself lands from fp32 training."""
    def batch(step):
        return W.mlp_batch(step, GLOBAL_BATCH, 13)

    def train(model, opt, batches):
        for step in range(STEPS):
            W.mse_loss(model, batches(step)).backward()
            opt.step()
            opt.zero_grad()

    def adam(params):
        return torch.optim.Adam(params, lr=1e-2)

    def smooth_mlp():  # ReLU's kinks would turn rounding into flipped activations, which
        # hide the dtype's precision behind chaos; tanh keeps errors proportional
        return nn.Sequential(nn.Linear(13, 13), nn.Tanh(), nn.Linear(13, 13), nn.Tanh(),
                             nn.Linear(13, 13))

    torch.manual_seed(SEED + rank)
    model, opt = shard(smooth_mlp(), stage, adam, precision=precision)
    train(model, opt, lambda step: W.rank_slice(batch(step), rank, world))
    torch.manual_seed(SEED)
    ref, ref_opt = mixed_precision_reference(smooth_mlp(), adam, COMPUTE_DTYPES[precision])
    train(ref, ref_opt, batch)
    torch.manual_seed(SEED)
    fp32 = smooth_mlp()
    train(fp32, adam(fp32.parameters()), batch)
    full, ref_full, fp32_full = full_state_dict(model), ref_opt.full_state_dict(ref), \
        fp32.state_dict()
    return {"stage": stage, "precision": precision,
            "dtype": str(next(model.parameters()).dtype),
            "max_abs_diff": max((full[k] - ref_full[k]).abs().max().item() for k in ref_full),
            "precision_gap": max((fp32_full[k] - ref_full[k]).abs().max().item()
                                 for k in ref_full)}


def unused_refused(stage: int, rank: int, world: int) -> str:
    """Without find_unused_parameters, a backward that leaves a parameter without a gradient
    is refused (on every rank here: no rank uses `spare`), as torch's DDP refuses it."""
    torch.manual_seed(SEED)
    model, _ = shard(Gated(), stage, adamw)
    x, y = W.rank_slice(gated_batch(0), rank, world)
    try:
        nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


class TwoPaths(nn.Module):
    """Two units of the same size; `order` says which runs first."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, order: str = "ab") -> torch.Tensor:
        first, second = (self.a, self.b) if order == "ab" else (self.b, self.a)
        return second(torch.tanh(first(x)))


def disagreements(rank: int, world: int) -> dict:
    """Ranks that were given different things fail together, loudly."""
    def attempt(fn):
        try:
            fn()
        except (RuntimeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    def rank_dependent_order():
        torch.manual_seed(SEED)
        model, _ = shard(TwoPaths(), 3, adamw, check_order=True)
        model(torch.ones(2, 6), order="ab" if rank == 0 else "ba").sum().backward()

    return {
        "stage": attempt(lambda: shard(Gated(), 1 if rank == 0 else 2, adamw)),
        # the same number of elements (24), other shapes
        "shapes": attempt(lambda: shard(nn.Linear(4, 6, bias=False) if rank == 0
                                        else nn.Linear(6, 4, bias=False), 1, adamw)),
        "order": attempt(rank_dependent_order),
    }


def run(rank: int, world: int) -> dict:
    """Every case on this rank; the report tests/test_contract.py reads."""
    cases = [run_scenario(name, stage, rank, world)
             for name, (*_, stages) in SCENARIOS.items() for stage in stages]
    refused = {stage: unused_refused(stage, rank, world) for stage in range(4)}
    precisions = [precision_run(stage, precision, rank, world)
                  for stage in range(4) for precision in ("bf16", "fp16")]
    return {"cases": cases, "refused": refused, "precisions": precisions,
            "disagree": disagreements(rank, world)}


def main() -> None:
    """This worker alone, e.g. to debug it: torchrun("tests/workers/contract_cases.py", nproc=2)."""
    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
