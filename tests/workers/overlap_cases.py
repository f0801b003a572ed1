"""Per-rank cases for tests/test_overlap.py: shard()'s overlap options (stages/param_gather.py,
InFlight in stages/partition.py) train as one process does, send the same bytes, and every reader of
parameters or gradients outside a forward waits for what is still in flight.

Equivalence: each variant trains 3 steps of a small model (width 64, a bucket per layer) and
reports its full weights against the one-process reference on the global batch, its digest
(the overlapped variant must equal its plain stage bit for bit: the same collectives, only
later) and the ledger of one more step.

Readers: to make "still in flight" certain rather than a race, `defer_collectives` replaces
a group's asynchronous all-gather and reduce-scatter by a handle that takes its input when
issued (what a real send reads) and writes its output only when waited for (what a real
receive may do at the last moment). Each reader then reads what one process would; the same
reader with the waits switched off (the mutant) must read something else.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch
import torch.distributed as dist
from stage_cases import SEED, digest
from torch import nn

from zero_lab import checkpoint
from zero_lab.collectives import CommLedger
from zero_lab.course import workloads as W
from zero_lab.launch import scratch_folder
from zero_lab.stages import full_state_dict, shard
from zero_lab.stages.mixed_precision import mixed_precision_reference

WIDTH = 64
STEPS = 3
GLOBAL_BATCH = 24
BUCKET_MB = 20_000 / 2**20  # about one Linear(64, 64) per bucket: several buckets in flight
CLIP = 0.05  # below the gradient norm of these models: clipping is active

PG, GR, ST = "overlap_param_gather", "overlap_grad_reduce", "overlap_step"
VARIANTS = {  # name: (stage, shard() options); "plain" ones are what the others must equal
    "stage1": (1, {PG: False}),
    "stage1_param_gather": (1, {PG: True}),
    "stage1_grad_reduce": (1, {GR: True}),
    "stage1_all": (1, {PG: True, GR: True, ST: True}),
    "stage2": (2, {PG: False}),
    "stage2_param_gather": (2, {PG: True}),
    "stage2_all": (2, {PG: True, ST: True}),
}
CONFIGS = {  # name: (model, accumulation under no_sync, clip, precision, find_unused)
    "adam": ("mlp", 1, None, "fp32", False),
    "no_sync": ("mlp", 2, CLIP, "fp32", False),
    "unused": ("unused", 2, None, "fp32", True),
    "bf16": ("mlp", 1, None, "bf16", False),
}
# N = 3, 4: the code paths that differ from the plain stages, on the plain stages' configs.
WIDE_VARIANTS = ("stage1", "stage1_all", "stage2", "stage2_all")
WIDE_CONFIGS = ("adam", "no_sync")


class WithUnused(nn.Module):
    """An MLP and a layer no forward uses (its .grad stays None, Adam leaves it alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = W.deep_mlp(WIDTH, 3)
        self.spare = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


MODELS = {"mlp": lambda: W.deep_mlp(WIDTH, 3), "unused": WithUnused}


# Adam divides by sqrt(v) + eps: with eps = 1e-8 an element whose gradient is rounding noise
# moves by up to lr, so float32 sums in another order drift by ~1e-5 in 3 steps (measured);
# eps = 1e-6 keeps that drift at ~2e-7 for the equivalence cases (lr 1e-3). The readers use
# lr 1e-2: a reader that did not wait is then off by ~1e-2, far above the ~3e-6 drift.
EQUIVALENCE_LR, READERS_LR = 1e-3, 1e-2


def adam(lr: float):
    return lambda params: torch.optim.Adam(params, lr=lr, eps=1e-6)


def global_batch(step: int):
    return W.mlp_batch(step, GLOBAL_BATCH, WIDTH)


def make(variant: str, config: str, rank: int, lr: float = READERS_LR):
    """(sharded model, optimizer, reference model, reference optimizer)."""
    stage, options = VARIANTS[variant]
    model_name, _, _, precision, unused = CONFIGS[config]
    torch.manual_seed(SEED + rank)  # ranks start different: shard() broadcasts rank 0's
    model = MODELS[model_name]()
    torch.manual_seed(SEED)
    ref = MODELS[model_name]()
    model, opt = shard(model, stage, adam(lr), bucket_mb=BUCKET_MB, precision=precision,
                       find_unused_parameters=unused, **options)
    if precision == "fp32":
        ref_opt = adam(lr)([p for p in ref.parameters() if p.requires_grad])
    else:
        ref, ref_opt = mixed_precision_reference(ref, adam(lr))
    return model, opt, ref, ref_opt


def train_step(model, opt, batch, k: int, clip: float | None) -> None:
    """k micro-batches, all but the last under no_sync, then clip, step and zero_grad."""
    parts = list(zip(*(t.chunk(k) for t in batch), strict=True))
    for j, part in enumerate(parts):
        with model.no_sync() if j < k - 1 else contextlib.nullcontext():
            (W.mse_loss(model, part) / k).backward()
    if clip:
        opt.clip_grad_norm_(clip)
    opt.step()
    opt.zero_grad()


def state_of(model, opt, mixed: bool) -> dict:
    return opt.full_state_dict(model) if mixed else full_state_dict(model)


def equivalence_case(variant: str, config: str, rank: int, world: int) -> dict:
    _, k, clip, precision, _ = CONFIGS[config]
    model, opt, ref, ref_opt = make(variant, config, rank, EQUIVALENCE_LR)
    for step in range(STEPS):
        train_step(model, opt, W.rank_slice(global_batch(step), rank, world), k, clip)
        # one process on the whole batch (mixed precision: the same micro-batches' recipe)
        train_step_ref(ref, ref_opt, global_batch(step), k if precision != "fp32" else 1, clip)
    full, ref_full = full_state_dict(model), state_of(ref, ref_opt, precision != "fp32")
    diffs = {n: (full[n].float() - ref_full[n].float()).abs().max().item() for n in ref_full}
    with CommLedger() as ledger:  # one more step: the bytes it sends
        train_step(model, opt, W.rank_slice(global_batch(STEPS), rank, world), k, clip)
        model.wait_for_params()
    return {"variant": variant, "config": config, "digest": digest(full),
            "max_abs_diff": max(diffs.values()), "worst_key": max(diffs, key=diffs.get),
            "ledger": ledger.summary()}


def train_step_ref(ref, ref_opt, batch, k: int, clip: float | None) -> None:
    parts = list(zip(*(t.chunk(k) for t in batch), strict=True))
    for part in parts:
        (W.mse_loss(ref, part) / k).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], clip)
    ref_opt.step()
    ref_opt.zero_grad()


# ------------------------------------------------------------------ readers


class Deferred:
    """An asynchronous collective's handle whose output is written only when waited for."""

    def __init__(self, finish) -> None:
        self._finish = finish

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return True


def defer_collectives(groups) -> None:
    """Every asynchronous all-gather and reduce-scatter of `groups` lands only when waited."""
    for group in groups:
        all_gather, reduce_scatter = group.all_gather, group.reduce_scatter

        def deferred_all_gather(full, shard, async_op=False, _send=all_gather):
            if not async_op:
                return _send(full, shard)
            sent = shard.clone()  # what a send reads when issued
            return Deferred(lambda: _send(full, sent))

        def deferred_reduce_scatter(out, full, op=dist.ReduceOp.AVG, async_op=False,
                                    _send=reduce_scatter):
            if not async_op:
                return _send(out, full, op)
            sent = full.clone()
            return Deferred(lambda: _send(out, sent, op))

        group.all_gather, group.reduce_scatter = deferred_all_gather, deferred_reduce_scatter


def switch_off_waits(opt) -> None:
    """The mutant: nothing waits for a collective in flight outside the optimizer step."""
    sync = opt.sync
    if sync.param_gather is not None:
        sync.param_gather.wait = lambda g: None
        sync.param_gather.wait_all = lambda: None
    sync.land_reductions = lambda: None


def after_one_step(variant: str, rank: int, world: int, mutant: bool, k: int = 1):
    """A model one step into training with its step's collectives deferred, and its
    one-process reference after the same step."""
    model, opt, ref, ref_opt = make(variant, "adam", rank)
    defer_collectives(opt.sync.groups)
    if mutant:
        switch_off_waits(opt)
    train_step(model, opt, W.rank_slice(global_batch(0), rank, world), k, None)
    train_step_ref(ref, ref_opt, global_batch(0), 1, None)
    return model, opt, ref, ref_opt


def max_diff(a: dict, b: dict) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in b)


def param_readers(variant: str, rank: int, world: int, mutant: bool, directory: str) -> dict:
    """overlap_param_gather: each reader of parameters after opt.step(), before a forward,
    against one process (max |difference|)."""
    out = {}

    def fresh():
        return after_one_step(variant, rank, world, mutant)

    model, opt, ref, ref_opt = fresh()  # the next forward: its pre-hooks wait
    batch = global_batch(1)
    local = W.mse_loss(model, W.rank_slice(batch, rank, world)).detach()
    dist.all_reduce(local, op=dist.ReduceOp.AVG)
    out["forward"] = abs(local.item() - W.mse_loss(ref, batch).item())
    model, opt, ref, ref_opt = fresh()
    out["full_state_dict"] = max_diff(full_state_dict(model), ref.state_dict())
    model, opt, ref, ref_opt = fresh()
    out["state_dict"] = max_diff(model.state_dict(), ref.state_dict())
    model, opt, ref, ref_opt = fresh()
    model.wait_for_params()
    out["wait_for_params"] = max_diff(dict(model.named_parameters()), ref.state_dict())
    # checkpoint.load writes the parameters: a gather landing after it would undo it. Its
    # mutant: load alone does not wait (the next wait lands the step's gather over it).
    torch.manual_seed(SEED)
    start = MODELS["mlp"]().state_dict()  # the weights before the step, as saved below
    model, opt, ref, ref_opt = make(variant, "adam", rank)
    checkpoint.save(model, opt, directory)
    defer_collectives(opt.sync.groups)
    train_step(model, opt, W.rank_slice(global_batch(0), rank, world), 1, None)
    gather = opt.sync.param_gather
    wait_all = gather.wait_all
    if mutant:  # nothing inside load waits (its model.state_dict() call would, too)
        opt.sync.settle = gather.wait_all = lambda: None
    checkpoint.load(model, opt, directory)
    wait_all()  # what the next forward would do
    out["checkpoint_load"] = max_diff(dict(model.named_parameters()), start)
    if mutant:
        return out
    # A step with no forward since the last one (same gradients again, no zero_grad): no
    # stale read is possible here (a step reads only its own slice, which no gather writes),
    # but it waits so that one gather per bucket is ever in flight.
    model, opt, ref, ref_opt = make(variant, "adam", rank)
    W.mse_loss(model, W.rank_slice(global_batch(0), rank, world)).backward()
    W.mse_loss(ref, global_batch(0)).backward()
    for _ in range(2):
        opt.step()
        ref_opt.step()
    out["step_again"] = max_diff(full_state_dict(model), ref.state_dict())
    return out


RAW_READS = ("sum", "clone", "equal", "detach")


def raw_reads(variant: str, rank: int, world: int, mutant: bool) -> dict:
    """overlap_param_gather: a raw read of a parameter after opt.step(), with no wait of one's
    own (its flag, zero_lab_state "in flight", makes it wait for its bucket), against one
    process (|diff|) or, for torch.equal, against a twin run that waited (bit-identical: the
    same run). The mutant clears the flag: every parameter "whole" after the step."""
    out: dict = {}
    for read in RAW_READS:
        model, opt, ref, _ = after_one_step(variant, rank, world, mutant=False)
        gather = opt.sync.param_gather
        if read == "sum":
            out["states_after_step"] = sorted({p.zero_lab_state for p in model.parameters()})
            out["buckets_in_flight"] = len(gather.in_flight())
        if mutant:
            for p in model.parameters():
                p.zero_lab_state = "whole"
        w, r = model[0].weight, ref[0].weight.detach()
        if read == "sum":
            out[read] = abs(w.sum().item() - r.sum().item())
            out["in_flight_after_read"] = len(gather.in_flight())  # its own bucket only
            out["state_after_read"] = w.zero_lab_state
        elif read == "clone":
            out[read] = (w.clone() - r).abs().max().item()
        elif read == "detach":
            out[read] = (w.detach() - r).abs().max().item()
        else:
            twin, twin_opt, _, _ = after_one_step(variant, rank, world, mutant=False)
            twin.wait_for_params()
            out[read] = 0.0 if torch.equal(w, twin[0].weight) else float("inf")
            del twin, twin_opt
        gather.wait_all()  # the deferred all-gathers, every rank alike
    # the next forward makes every parameter whole again before compute
    model, opt, _, _ = after_one_step(variant, rank, world, mutant=False)
    model(W.rank_slice(global_batch(1), rank, world)[0])
    out["states_after_forward"] = sorted({p.zero_lab_state for p in model.parameters()})
    return out


def grad_readers(variant: str, rank: int, world: int, mutant: bool, directory: str) -> dict:
    """overlap_step: each reader of gradients after backward, while the last reductions are
    still in flight, against one process."""
    out = {}

    def backward_only():
        model, opt, ref, ref_opt = make(variant, "adam", rank)
        defer_collectives(opt.sync.groups)
        if mutant:
            switch_off_waits(opt)
        W.mse_loss(model, W.rank_slice(global_batch(0), rank, world)).backward()
        W.mse_loss(ref, global_batch(0)).backward()
        return model, opt, ref, ref_opt

    model, opt, ref, ref_opt = backward_only()
    norm = opt.clip_grad_norm_(CLIP).item()
    ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), CLIP).item()
    out["clip_grad_norm_"] = abs(norm - ref_norm) / ref_norm
    model, opt, ref, ref_opt = backward_only()
    opt.wait_for_grads()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    errors = []
    for group, step_param in zip(opt.sync.groups, opt.sync.step_params, strict=True):
        expected = group.shard(group.flatten([ref_grads[n] for n in group.names]))
        got = step_param.grad if step_param.grad is not None else torch.zeros_like(expected)
        errors.append((got - expected).abs().max().item())
    out["wait_for_grads"] = max(errors)
    # checkpoint.save after backward: it saves values and optimizer states, which no
    # reduction writes; it waits anyway (nothing may land under a save).
    model, opt, ref, ref_opt = backward_only()
    opt.step()
    ref_opt.step()
    checkpoint.save(model, opt, directory)
    dist.barrier()
    out["checkpoint_save"] = max_diff(checkpoint.consolidate(directory), ref.state_dict())
    return out


# ------------------------------------------------------------------ dropped in flight
LATE = 0.5  # seconds the last rank waits before its step: the others drop their model first


def dropped_in_flight(rank: int, world: int) -> dict:
    """Each overlap variant's model and optimizer dropped while its collectives are in flight
    (after a step: the all-gathers for the next forward; after backward with overlap_step:
    the last reductions). The last rank starts its step (or backward) LATE, so the other
    ranks drop theirs before its messages come: a receive dropped then would be written
    after its buffer is freed (or never matched: the launch hangs). Then more collectives and
    a second model must train as one process does."""
    out: dict = {"in_flight": {}}
    drops = [(v, "step") for v in ("stage1_param_gather", "stage1_all", "stage2_param_gather",
                                   "stage2_all")] + [(v, "backward")
                                                     for v in ("stage1_all", "stage2_all")]
    for variant, after in drops:
        model, opt, _, _ = make(variant, "adam", rank)
        batch = W.rank_slice(global_batch(0), rank, world)
        if after == "step":
            W.mse_loss(model, batch).backward()
        if rank == world - 1:
            time.sleep(LATE)
        if after == "backward":
            W.mse_loss(model, batch).backward()
            out["in_flight"][f"{variant}-{after}"] = len(opt.sync.reductions)
        else:
            opt.step()
            out["in_flight"][f"{variant}-{after}"] = len(opt.sync.param_gather.in_flight())
        del model, opt
        gc.collect()
        junk = [torch.randn(1 << 14) for _ in range(16)]  # what may reuse the freed memory
        del junk
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    out["all_reduce"] = total.item()
    out["after"] = [equivalence_case(v, "adam", rank, world)
                    for v in ("stage1_all", "stage2_all")]
    return out


def run(rank: int, world: int) -> dict:
    """Every case on this rank (tests/workers/world_cases.py runs it at N = 2, 3, 4)."""
    wide = world > 2
    cases = [equivalence_case(v, c, rank, world)
             for v in (WIDE_VARIANTS if wide else VARIANTS)
             for c in (WIDE_CONFIGS if wide else CONFIGS)
             if not (c == "bf16" and wide)]
    out: dict = {"cases": cases}
    if world == 2:
        base = [scratch_folder("overlap")]  # one directory, the same on every rank
        readers = {}
        for mutant in (False, True):
            for variant in ("stage1_param_gather", "stage2_param_gather"):
                readers[f"{variant}{'-mutant' if mutant else ''}"] = param_readers(
                    variant, rank, world, mutant, f"{base[0]}/{variant}{int(mutant)}")
                readers[f"{variant}-raw{'-mutant' if mutant else ''}"] = raw_reads(
                    variant, rank, world, mutant)
            for variant in ("stage1_all", "stage2_all"):
                readers[f"{variant}{'-mutant' if mutant else ''}"] = grad_readers(
                    variant, rank, world, mutant, f"{base[0]}/{variant}{int(mutant)}")
        out["readers"] = readers
        out["dropped"] = dropped_in_flight(rank, world)
    dist.barrier()
    return out


def main() -> None:
    """This part alone, to debug it: torchrun("tests/workers/overlap_cases.py", nproc=2)."""
    from zero_lab.launch import init_worker, report

    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
