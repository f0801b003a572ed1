"""Per-rank cases for tests/test_contract_habits.py: the loops people write in real training
code, at every stage, against one process on the global batch (issue 21, "round two").

Each case returns what it observed; a case that raises reports the error's text instead, so
one launch per world size covers every case. The habits:

- backward_raises: an exception inside backward, caught, and training goes on (an OOM-skip
                   or NaN-guard loop: `except RuntimeError: opt.zero_grad(); continue`)
- torch_clip:      torch.nn.utils.clip_grad_norm_(model.parameters(), c), as in one process
                   (made right: the global norm); on a subset of the parameters: refused
- load_weights:    model.load_state_dict(W) after shard(), in fp32 and in mixed precision
                   (W must reach the fp32 masters; at stage 3, W has the model's shapes)
- stage3_state:    model.state_dict() at stage 3 (refused: it would be this rank's pieces);
                   a tensor of the wrong shape in load_state_dict (refused, named)
- opt_state_rank0: rank 0's opt.state_dict() loaded on every rank, the DDP habit (refused at
                   stages 1-3, where each rank's state is its slices'; right at stage 0)
- add_group:       opt.add_param_group(...) after shard() (refused: say so in shard())
- unfrozen:        a parameter frozen before shard() and unfrozen later (refused at the next
                   backward, named)
- batchnorm:       a frozen BatchNorm in eval mode (fine-tuning): exact, accepted; one in
                   training mode: refused at its first forward, with advice for CPU/gloo
- buffers:         a buffer forward updates and reads (an EMA), against torch's DDP with
                   broadcast_buffers=True (its default) and False
- compiled:        torch.compile(model) after shard(): stages 0-2 against one process (the
                   aot_eager backend: quick on CPU); stage 3 refused with the reason; at
                   N = 2 only (AT_TWO_RANKS_ONLY)
- lockstep_steps:  one rank calls opt.step() once more than the others, mid-training and at
                   the very end (every rank raises, naming it, instead of a hang or a
                   silent drift)
- lockstep_order:  stage 3, a forward whose unit order depends on the rank, from its third
                   step (every rank raises in that forward, naming both orders)
- lockstep_ledger: the check a ledger sees: one control record a step, apart from the data
- small:           full_state_dict("x"); the standalone ZeroRedundancyOptimizer checks that
                   the ranks agree and refuses a torch optimizer of one's own, as shard() does
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from stage_cases import error_message  # a sibling worker: `Type: message` of what fn() raises
from torch import nn

from zero_lab.course import workloads as W
from zero_lab.launch import init_worker, report
from zero_lab.stages import ZeroRedundancyOptimizer, full_state_dict, shard
from zero_lab.stages.mixed_precision import mixed_precision_reference

STEPS = 5
GLOBAL_BATCH = 12  # splits over 2 and 3 ranks
SEED = 7
D = 9
BUCKET_MB = 300 / 2**20  # several buckets: some are sent before backward fails


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return W.mlp_batch(step, GLOBAL_BATCH, D, seed=SEED)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


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
        out[stage] = error_message(lambda model=model: torch.nn.utils.clip_grad_norm_(
            list(model.parameters())[:2], CLIP))
    return out


# ------------------------------------------------ 3, 12. load_state_dict after shard()
LOAD_AT = 2  # steps before the load; as many after


def load_weights(rank: int, world: int) -> list[dict]:
    """Train, load other weights W with model.load_state_dict(W), train on. Right after the
    load full_state_dict must be W exactly (the masters too); after it, the same steps as
    one process that loads W (its masters too, in mixed precision)."""
    torch.manual_seed(SEED + 50)
    new = {k: v.clone() for k, v in W.deep_mlp(D, depth=3).state_dict().items()}

    def train(model, opt, batches, steps):
        for step in steps:
            W.mse_loss(model, batches(step)).backward()
            opt.step()
            opt.zero_grad()

    out = []
    for precision in ("fp32", "bf16"):
        for stage in range(4):
            torch.manual_seed(SEED + 1 + rank)
            model, opt = shard(W.deep_mlp(D, depth=3), stage, adam, precision=precision)

            def local(step):
                return W.rank_slice(batch(step), rank, world)

            torch.manual_seed(SEED + 1)
            if precision == "fp32":
                ref = W.deep_mlp(D, depth=3)
                ref_opt = adam(ref.parameters())
            else:
                ref, ref_opt = mixed_precision_reference(W.deep_mlp(D, depth=3), adam)
            result = {"stage": stage, "precision": precision}
            try:
                train(model, opt, local, range(LOAD_AT))
                model.load_state_dict(new)
                result["after_load"] = max_diff(full_state_dict(model), new)
                train(model, opt, local, range(LOAD_AT, 2 * LOAD_AT))
            except Exception as exc:  # noqa: BLE001
                result["error"] = f"{type(exc).__name__}: {exc}"
                out.append(result)
                continue
            train(ref, ref_opt, batch, range(LOAD_AT))
            ref.load_state_dict(new)
            if precision != "fp32":  # one process: the masters take W as well
                with torch.no_grad():
                    for master, name in zip(ref_opt.master_weights,
                                            [n for n, _ in ref.named_parameters()],
                                            strict=True):
                        master.copy_(new[name])
            train(ref, ref_opt, batch, range(LOAD_AT, 2 * LOAD_AT))
            ref_full = (ref.state_dict() if precision == "fp32"
                        else ref_opt.full_state_dict(ref))
            result["max_abs_diff"] = max_diff(full_state_dict(model), ref_full)
            out.append(result)
    return out


def stage3_state(rank: int, world: int) -> dict:
    torch.manual_seed(SEED)
    model, _ = shard(W.deep_mlp(D, depth=3), 3, adam)
    wrong = {k: v.clone() for k, v in W.deep_mlp(D, depth=3).state_dict().items()}
    wrong["2.weight"] = torch.zeros(D, D + 1)
    return {"state_dict": error_message(model.state_dict),
            "wrong_shape": error_message(lambda: model.load_state_dict(wrong))}


# ------------------------------------------------------- 7. rank 0's optimizer state
def opt_state_rank0(rank: int, world: int) -> dict:
    out = {}
    for stage in range(4):
        torch.manual_seed(SEED)
        model, opt = shard(W.deep_mlp(D, depth=3), stage, adam)
        W.mse_loss(model, W.rank_slice(batch(0), rank, world)).backward()
        opt.step()
        saved = [opt.state_dict() if rank == 0 else None]
        dist.broadcast_object_list(saved, src=0)  # "rank 0 saves, every rank loads"
        own = opt.state_dict()
        out[stage] = {"rank0": error_message(lambda opt=opt, s0=saved[0]: opt.load_state_dict(s0)),
                      "own": error_message(lambda opt=opt, own=own: opt.load_state_dict(own))}
    return out


# ------------------------------------------------------------- 5. add_param_group
def add_group(rank: int, world: int) -> dict:
    out = {}
    for stage in range(4):
        torch.manual_seed(SEED)
        model, opt = shard(W.deep_mlp(D, depth=3), stage, adam)
        extra = nn.Linear(D, D)
        out[stage] = error_message(lambda opt=opt, extra=extra: opt.add_param_group(
            {"params": list(extra.parameters()), "lr": 1e-3}))
    return out


# ----------------------------------------------- 6. frozen before shard(), unfrozen later
def unfrozen(rank: int, world: int) -> dict:
    out = {}
    for stage in range(4):
        torch.manual_seed(SEED)
        mlp = W.deep_mlp(D, depth=3)
        mlp[0].weight.requires_grad_(False)
        model, opt = shard(mlp, stage, adam)
        x = W.rank_slice(batch(0), rank, world)

        def train_unfrozen(model=model, opt=opt, x=x):
            W.mse_loss(model, x).backward()  # frozen: fine
            opt.step()
            opt.zero_grad()
            model[0].weight.requires_grad_(True)  # progressive unfreezing
            W.mse_loss(model, x).backward()

        out[stage] = error_message(train_unfrozen)
    return out


# ------------------------------------------------------------------- 13. BatchNorm
def bn_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh(), nn.Linear(D, D))


def loop_frozen_bn(model, opt, batches) -> None:
    for step in range(STEPS):
        model.train()
        model[1].eval()  # fine-tuning: the pretrained statistics are kept
        W.mse_loss(model, batches(step)).backward()
        opt.step()
        opt.zero_grad()


def frozen_bn_model() -> nn.Sequential:
    model = bn_mlp()
    with torch.no_grad():  # "pretrained" statistics
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    model[1].requires_grad_(False)
    return model


def batchnorm(rank: int, world: int) -> dict:
    frozen = [compare(frozen_bn_model, loop_frozen_bn, stage, rank, world)
              for stage in range(4)]
    refused = {}
    for stage in range(4):
        torch.manual_seed(SEED)
        model, _ = shard(bn_mlp(), stage, adam)
        refused[stage] = error_message(
            lambda model=model: W.mse_loss(model, W.rank_slice(batch(0), rank, world)))
    return {"frozen": frozen, "training": refused}


# ------------------------------------------------------------------- 14. small ones
def small(rank: int, world: int) -> dict:
    def zero_disagree():
        model = nn.Linear(4, 6, bias=False) if rank == 0 else nn.Linear(6, 4, bias=False)
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

    def zero_outside():
        model = W.deep_mlp(D, depth=2)
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        mine = torch.optim.SGD(model.parameters(), lr=0.1)
        W.mse_loss(model, W.rank_slice(batch(0), rank, world)).backward()
        mine.step()

    return {"full_state_dict_str": error_message(lambda: full_state_dict("x")),
            "zero_disagree": error_message(zero_disagree),
            "zero_outside": error_message(zero_outside)}


# ------------------------------------------------------------------- 8. buffers
class EMAShift(nn.Module):
    """A layer whose output subtracts an EMA of its own mean, updated by every training
    forward (as running statistics are): ranks that keep their own EMA drift apart."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("ema", torch.zeros(D))

    # Rank 0 never updates the EMA (as a data-dependent update might skip a rank's batch):
    # the ranks then disagree on whether a buffer changed.
    not_on_rank0 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training and not (self.not_on_rank0 and dist.get_rank() == 0):
            with torch.no_grad():
                self.ema.mul_(0.5).add_(0.5 * h.mean(0))
        return h - self.ema


def ema_model() -> nn.Sequential:
    return nn.Sequential(EMAShift(), nn.Tanh(), nn.Linear(D, D))


def buffers(rank: int, world: int) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(model, opt):
        for step in range(STEPS):
            W.mse_loss(model, W.rank_slice(batch(step), rank, world)).backward()
            opt.step()
            opt.zero_grad()

    out = []
    for broadcast, not_on_rank0 in ((True, False), (False, False), (True, True)):
        EMAShift.not_on_rank0 = not_on_rank0
        torch.manual_seed(SEED + 1)
        ddp = DDP(ema_model(), broadcast_buffers=broadcast)
        train(ddp, adam(ddp.parameters()))
        ref = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
        for stage in range(4):
            torch.manual_seed(SEED + 1 + rank)
            kwargs = {} if broadcast else {"broadcast_buffers": False}
            result = {"stage": stage, "broadcast_buffers": broadcast,
                      "not_on_rank0": not_on_rank0}
            try:
                model, opt = shard(ema_model(), stage, adam, **kwargs)
                train(model, opt)
                own = dict(model.named_buffers())["0.ema"].clone()  # as the last forward left it
                full = full_state_dict(model)
            except Exception as exc:  # noqa: BLE001
                out.append({**result, "error": f"{type(exc).__name__}: {exc}"})
                continue
            params = [k for k in ref if k != "0.ema"]
            everyone = [None] * world
            dist.all_gather_object(everyone, full)
            result["params_diff"] = max_diff({k: full[k] for k in params},
                                             {k: ref[k] for k in params})
            result["own_ema_diff"] = (own - ref["0.ema"]).abs().max().item()
            result["full_ema_vs_rank0"] = (full["0.ema"] - everyone[0]["0.ema"]).abs().max().item()
            out.append(result)
    EMAShift.not_on_rank0 = False
    return out


# ------------------------------------------------------------------- 11. torch.compile
def loop_compiled(model, opt, batches) -> None:
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(STEPS):
        W.mse_loss(compiled, batches(step)).backward()
        opt.step()
        opt.zero_grad()


def compiled(rank: int, world: int) -> dict:
    runs = [compare(lambda: W.deep_mlp(D, depth=3), loop_compiled, stage, rank, world)
            for stage in range(3)]
    refused = {}
    for backend in ("aot_eager", "inductor"):
        torch.manual_seed(SEED)
        model, _ = shard(W.deep_mlp(D, depth=3), 3, adam)
        fast = torch.compile(model, backend=backend)
        refused[backend] = error_message(
            lambda fast=fast: W.mse_loss(fast, W.rank_slice(batch(0), rank, world)).backward())
    return {"stages": runs, "stage3": refused}


# ------------------------------------------------------- 9-10. ranks that leave lockstep
EXTRA_STEP_AT = 2


def lockstep_steps(rank: int, world: int) -> list[dict]:
    """The last rank calls opt.step() twice at step EXTRA_STEP_AT (mid-training), or at the
    last step followed by full_state_dict() (at the end): where each rank raised, and what."""
    out = []
    for stage in range(4):
        for when in ("mid", "end"):
            torch.manual_seed(SEED)
            model, opt = shard(W.deep_mlp(D, depth=3), stage, adam, bucket_mb=BUCKET_MB)
            last = STEPS - 1 if when == "mid" else EXTRA_STEP_AT
            where = "finished"
            try:
                for step in range(last + 1):
                    where = f"step {step}"
                    W.mse_loss(model, W.rank_slice(batch(step), rank, world)).backward()
                    opt.step()
                    if rank == world - 1 and step == EXTRA_STEP_AT:
                        where = f"extra step {step}"
                        opt.step()
                    opt.zero_grad()
                where = "full_state_dict"
                full_state_dict(model)
                where, error = "finished", ""
            except RuntimeError as exc:
                error = str(exc)
            out.append({"stage": stage, "when": when, "where": where, "error": error})
    return out


class TwinLayers(nn.Module):
    """Two units of the same size: an all-gather of one pairs with the other's without a
    size mismatch, so a rank-dependent order would compute with a mix of both."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        return self.head(torch.tanh(second(torch.tanh(first(x)))))


def lockstep_order(rank: int, world: int) -> list[dict]:
    """Stage 3: from step EXTRA_STEP_AT on, the last rank runs unit b before unit a."""
    out = []
    for prefetch in (True, False):
        torch.manual_seed(SEED)
        model, opt = shard(TwinLayers(), 3, adam, prefetch=prefetch)
        where, error = "finished", ""
        try:
            for step in range(STEPS):
                model.swap = rank == world - 1 and step >= EXTRA_STEP_AT
                where = f"forward {step}"
                loss = W.mse_loss(model, W.rank_slice(batch(step), rank, world))
                where = f"backward {step}"
                loss.backward()
                opt.step()
                opt.zero_grad()
        except RuntimeError as exc:
            error = str(exc)
        out.append({"prefetch": prefetch, "where": where, "error": error})
    return out


def lockstep_ledger(rank: int, world: int) -> list[dict]:
    """What a CommLedger sees of the check in one training step, at every stage."""
    from zero_lab.collectives import CommLedger

    out = []
    for stage in range(4):
        torch.manual_seed(SEED)
        model, opt = shard(W.deep_mlp(D, depth=3), stage, adam, bucket_mb=BUCKET_MB)
        for step in range(2):  # the second step is the one recorded
            with CommLedger() as ledger:
                W.mse_loss(model, W.rank_slice(batch(step), rank, world)).backward()
                opt.step()
                opt.zero_grad()
        out.append({"stage": stage, "ops": sorted({r.op for r in ledger.records}),
                    "control": [(r.op, r.nbytes) for r in ledger.control],
                    "table": ledger.table()})
    return out


CASES = {
    "backward_raises": backward_raises,
    "torch_clip": torch_clip,
    "torch_clip_subset": torch_clip_subset,
    "load_weights": load_weights,
    "stage3_state": stage3_state,
    "opt_state_rank0": opt_state_rank0,
    "add_group": add_group,
    "unfrozen": unfrozen,
    "batchnorm": batchnorm,
    "small": small,
    "buffers": buffers,
    "compiled": compiled,
    "lockstep_steps": lockstep_steps,
    "lockstep_order": lockstep_order,
    "lockstep_ledger": lockstep_ledger,
}


def run_cases(cases: dict, rank: int, world: int) -> dict:
    """Every case on this rank: what each observed, or its error's text."""
    results = {}
    for name, case in cases.items():
        try:
            results[name] = case(rank, world)
        except Exception as exc:  # noqa: BLE001 - reported, the test says which case
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


# Cases run at N = 2 only: torch.compile traces the model's forward, which the world size does
# not change (the stages' hooks run eagerly), and three ranks compiling on two cores cost about
# 5 s of a CI run's launch at N = 3.
AT_TWO_RANKS_ONLY = {"compiled"}


def run(rank: int, world: int) -> dict:
    """Every case on this rank; the report tests/test_contract_habits.py reads
    (tests/workers/world_cases.py runs it in the launch it shares with the other workers)."""
    return run_cases({name: case for name, case in CASES.items()
                      if world == 2 or name not in AT_TWO_RANKS_ONLY}, rank, world)


def main() -> None:
    """This worker alone, to debug it: torchrun("tests/workers/contract_habits.py", nproc=2)."""
    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
