"""Per-rank worker for tests/test_zero3.py: stage 3 on N ranks, everything in one launch.

Models, optimizers, seeds and the global batches are stage_cases.py's (the stages 0-2
worker), so stage 3 is held to the same single-process references. Ranks initialise
differently; the reference starts from rank 0's seed and trains on the whole global batch.
"""

from __future__ import annotations

import time
import warnings
from functools import partial

import torch
import torch.distributed as dist
from stage_cases import (
    GLOBAL_BATCH,
    MODELS,
    SEED,
    STEPS,
    digest,
    error_message,
    local_batches,
    models_for_case,
    optimizer_function,
    reference_optimizer,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from zero_lab.collectives import CommLedger
from zero_lab.course import workloads as W
from zero_lab.course.seed_blog import blog_zero3_gradient
from zero_lab.launch import init_worker, report
from zero_lab.measure.memory_timeline import activation_bytes, measure_step
from zero_lab.stages import full_state_dict, shard
from zero_lab.stages.zero3 import Zero3


class Checkpointed(nn.Module):
    """Blocks under non-reentrant activation checkpointing: backward recomputes each block's
    forward, which must find its unit gathered and leave it so."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(13, 13), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


MODELS = {**MODELS, "checkpointed": (Checkpointed, MODELS["mlp_odd"][1], W.mse_loss)}
UNIT_CLASSES = {None: None, "linear": (nn.Linear,), "block": (W.Block,),
                "block+linear": (W.Block, nn.Linear)}


def case(model, optimizer, accumulation=1, clip=None, precision="fp32", prefetch=True,
         units=None, torch_optimizer=False, blog_bug=False) -> dict:
    name = f"{model}-{optimizer}-acc{accumulation}" + (f"-clip{clip}" if clip else "")
    name += f"-{precision}" + ("-prefetch" if prefetch else "-noprefetch")
    name += f"-units:{units}" if units else ""
    name += "-torch_optimizer" if torch_optimizer else ""
    name += "-blog_bug" if blog_bug else ""
    return dict(name=name, model=model, optimizer=optimizer, accumulation=accumulation,
                clip=clip, precision=precision, prefetch=prefetch, units=units,
                torch_optimizer=torch_optimizer, blog_bug=blog_bug)


CASES = [
    case("mlp_odd", "adam"),
    case("mlp_nobias", "sgd_momentum", accumulation=2, prefetch=False),
    case("nested", "adamw", clip=0.05),  # frozen layer, a layer used twice, a 0-d parameter
    case("nested", "adam", units="linear", prefetch=False),
    case("gpt", "adam", accumulation=2, clip=0.5),  # tied head: the root unit holds it
    case("gpt", "adamw", units="block+linear"),  # nested units
    case("gpt", "adam", units="block", prefetch=False),
    case("mlp_odd", "adam", torch_optimizer=True),  # torch.optim.Adam(model.parameters())
    case("mlp_odd", "adam", precision="mixed"),
    case("gpt", "adamw", accumulation=2, clip=0.5, precision="mixed"),
    case("checkpointed", "adamw", accumulation=2),
    case("mlp_odd", "adam", blog_bug=True),  # must be caught: the equivalence test has teeth
]


class _Done:
    """A finished collective (what a synchronous call has already waited for)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def blog_gradients(sync: Zero3) -> None:
    """Give stage 3 the seed blog's gradient step (`zero_lab.course.seed_blog.blog_zero3_gradient`):
    instead of reduce-scattering, each rank cuts *its own* chunk out of its full gradient and
    all-reduces that, so rank 0's chunk 0 is averaged with rank 1's chunk 1. A group's full
    buffer is padded to N equal slices, so the blog's dim-0 chunk r is this rank's slice."""
    for group in sync.groups:
        def all_reduce_own_chunk(shard_out, full_in, op=None, async_op=False, group=group):
            shard_out.copy_(blog_zero3_gradient(full_in, group=group.process_group))
            return _Done()

        group.reduce_scatter = all_reduce_own_chunk


def build(c: dict, model: nn.Module):
    make_opt = optimizer_function(c["optimizer"])
    model, opt = shard(model, 3, make_opt, prefetch=c["prefetch"], precision=c["precision"],
                       unit_classes=UNIT_CLASSES[c["units"]])
    if c["blog_bug"]:
        blog_gradients(model._zero_lab_sharded.sync)
    if c["torch_optimizer"]:
        opt = make_opt(list(model.parameters()))  # the local slices, as FSDP2's
    return model, opt


def run_case(c: dict, rank: int, world: int) -> dict:
    model, ref, global_batch, loss_fn, make_opt = models_for_case(c, rank, MODELS)
    model, opt = build(c, model)
    sync = model._zero_lab_sharded.sync
    ref, ref_opt = reference_optimizer(c, ref, make_opt)
    local = local_batches(global_batch, rank, world)

    res = W.train(model, opt, local, loss_fn, STEPS, c["accumulation"], c["clip"])
    ref_res = W.train(ref, ref_opt, global_batch, loss_fn, STEPS, 1, c["clip"])
    full = full_state_dict(model)
    ref_full = (ref_opt.full_state_dict(ref) if c["precision"] == "mixed"
                else full_state_dict(ref))
    diffs = {k: (full[k].float() - ref_full[k].float()).abs().max().item() for k in ref_full}
    precision_gap = None
    if c["precision"] == "mixed":  # how far mixed precision itself moves the weights
        torch.manual_seed(SEED)
        fp32 = MODELS[c["model"]][0]()  # a third copy from rank 0's initialisation
        fp32_opt = make_opt([p for p in fp32.parameters() if p.requires_grad])
        W.train(fp32, fp32_opt, global_batch, loss_fn, STEPS, 1, c["clip"], measure_memory=False)
        fp32_full = full_state_dict(fp32)
        precision_gap = max((fp32_full[k].float() - ref_full[k].float()).abs().max().item()
                            for k in ref_full)

    # One more step under the ledger: what a step sends, unit by unit.
    with CommLedger() as ledger:
        loss_fn(model, local(STEPS)).backward()
        opt.step()
        opt.zero_grad()
    units = sync.units
    return {
        "name": c["name"], "model": c["model"], "precision": c["precision"],
        "optimizer": c["optimizer"], "units": [u.name for u in units],
        "blog_bug": c["blog_bug"], "torch_optimizer": c["torch_optimizer"],
        "keys_match": sorted(full) == sorted(ref.state_dict()),
        "max_abs_diff": max(diffs.values()), "worst_key": max(diffs, key=diffs.get),
        "precision_gap": precision_gap, "digest": digest(full),
        "losses": res["losses"], "ref_losses": ref_res["losses"],
        "grad_norms": res["grad_norms"], "ref_grad_norms": ref_res["grad_norms"],
        "held_after_backward": res["held_after_backward"],
        "n_trainable": W.count_parameters(ref, trainable_only=True),  # Ψ
        "n_frozen": W.count_parameters(ref) - W.count_parameters(ref, trainable_only=True),
        "unit_numels": [u.group.numel for u in units],
        "unit_padded": [u.group.padded_numel for u in units],
        # frozen parameters, sharded with their unit (zero3.FrozenPart; 0: none)
        "frozen_padded": [u.frozen.group.padded_numel if u.frozen else 0 for u in units],
        "frozen_at_rest": sum(u.frozen.local.nbytes for u in units if u.frozen),
        "shard_numel": sum(u.group.shard_numel for u in units),
        "stepped_numel": sum(piece.numel for piece in opt.pieces) if not c["torch_optimizer"]
        else None,
        "element_size": units[0].local.element_size(),
        "local_param_numels": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "gathered_after": sync.gathered_bytes(),
        "all_gather_sizes": sorted(r.nbytes for r in ledger.records if r.op == "all_gather"),
        "reduce_scatter_sizes": sorted(r.nbytes for r in ledger.records
                                       if r.op == "reduce_scatter"),
        "other_ops": sorted({r.op for r in ledger.records} - {"all_gather", "reduce_scatter"}),
        "in_backward": sorted({r.op for r in ledger.records if r.in_backward}),
    }


def grads_after_backward(rank: int, world: int) -> dict:
    """Right after backward (two calls, accumulating), every parameter's .grad is its piece
    of the one-process gradient; after opt.zero_grad() or a torch optimizer's zero_grad on
    model.parameters() (grads set to None) the next backward starts from zero."""
    make_model, global_batch, loss_fn = MODELS["gpt"]
    torch.manual_seed(SEED + rank)
    model = make_model()
    torch.manual_seed(SEED)
    ref = make_model()
    model, opt = shard(model, 3, optimizer_function("adam"))
    sync = opt.sync
    errors, views, cleared = [], [], []
    for trial in range(3):
        for step in (trial, trial + 1):  # two backward calls accumulate
            loss_fn(model, W.rank_slice(global_batch(step), rank, world)).backward()
            loss_fn(ref, global_batch(step)).backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for unit, step_param in zip(sync.units, sync.step_params, strict=True):
            expected = unit.group.shard(unit.group.flatten([ref_grads[n]
                                                            for n in unit.group.names]))
            errors.append((step_param.grad - expected).abs().max().item())
            for p, piece in zip(unit.params, unit.pieces(step_param.grad), strict=True):
                views.append(p.grad is not None and p.grad.data_ptr() == piece.data_ptr()
                             and p.grad.shape == p.shape)
        # trial 0: the optimizer's zero_grad; 1: set to None through model.parameters()
        # (what a torch optimizer built on them does); 2: zero in place, keep the views
        if trial == 0:
            opt.zero_grad()
        elif trial == 1:
            torch.optim.SGD(model.parameters(), lr=0.0).zero_grad()
        else:
            opt.zero_grad(set_to_none=False)
        cleared.append(all(p.grad is None or not p.grad.any() for p in model.parameters()))
        ref.zero_grad()
    return {"max_error": max(errors), "grads_are_views": all(views), "cleared": cleared,
            "gathered_after": sync.gathered_bytes()}


def inference(rank: int, world: int) -> dict:
    """Forward under no_grad and in eval mode with grad enabled (no backward follows):
    outputs equal one process's, and nothing stays gathered."""
    make_model, global_batch, loss_fn = MODELS["nested"]
    torch.manual_seed(SEED)
    ref = make_model()
    torch.manual_seed(SEED + rank)
    model, opt = shard(make_model(), 3, optimizer_function("adam"))
    x = global_batch(0)[0]
    out = {}
    for mode in ("no_grad", "eval_grad_enabled"):
        model.eval()
        with CommLedger() as ledger, torch.set_grad_enabled(mode != "no_grad"):
            for _ in range(2):  # the second forward prefetches (order recorded by the first)
                y = model(x)
        out[mode] = {"error": (y - ref(x)).abs().max().item(),
                     "gathered_after": opt.sync.gathered_bytes(),
                     "busy_units": sum(u.busy for u in opt.sync.units),
                     "all_gathers": ledger.count("all_gather"),
                     "other_ops": sorted({r.op for r in ledger.records} - {"all_gather"})}
    out["n_units"] = len(opt.sync.units)
    out["n_frozen_parts"] = sum(u.frozen is not None for u in opt.sync.units)
    out["shared_calls"] = 2  # Nested applies `shared` twice per forward
    return out


def lifecycle(rank: int, world: int) -> dict:
    """The 6-block MLP: memory timeline, held bytes, what is left after a step; prefetch
    off and on."""
    width, depth, rows = 64, 6, 8

    def batches():
        return [W.rank_slice(W.mlp_batch(s, rows * world, width), rank, world)
                for s in range(2)]

    out = {"psi": W.count_parameters(W.deep_mlp(width, depth))}
    for prefetch in (False, True):
        torch.manual_seed(SEED)
        out[f"prefetch_{prefetch}"] = measure_step(
            lambda: W.deep_mlp(width, depth), batches(), torch.device("cpu"), 3, prefetch,
            walk_live_tensors=prefetch)  # one walk of every live tensor (about a second)
    # Adam's foreach implementation, torch's default on CUDA (on CPU the for-loop one)
    torch.manual_seed(SEED)
    out["foreach_adam"] = measure_step(
        lambda: W.deep_mlp(width, depth), batches(), torch.device("cpu"), 3, True,
        walk_live_tensors=False, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True))
    torch.manual_seed(SEED)
    out["activations"] = activation_bytes(W.deep_mlp(width, depth), *batches()[-1],
                                          torch.device("cpu"))
    return out


PREFETCH_WIDTH, PREFETCH_UNITS, PREFETCH_STEPS = 16, 5, 3
# name: (shard()'s prefetch, options); "unlimited" and "kept" are the checks' mutants
PREFETCH_VARIANTS = {
    "False": (False, {}), "True": (True, {}), "2": (2, {}), "3": (3, {}),
    "unlimited": (2, {"unlimited": True}),  # prefetch=2, but every later unit gathered ahead
    "kept": (True, {"reshard_after_forward": False}),  # 2Ψ a step: other bytes
}


def _watch_gathered(sync: Zero3) -> dict[str, dict[str, int]]:
    """From now on, per phase (outside backward, inside): the most full-parameter bytes
    gathered at once, and how many all-gathers started. Full buffers get their memory only
    when a unit's all-gather starts (Unit.start_gather), so sampling right after each start
    sees every maximum."""
    seen = {"peak": {"forward": 0, "backward": 0}, "starts": {"forward": 0, "backward": 0}}
    for unit in sync.units:
        def start(start_gather=unit.start_gather):
            start_gather()
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            seen["peak"][phase] = max(seen["peak"][phase], sync.gathered_bytes())
            seen["starts"][phase] += 1
        unit.start_gather = start
    return seen


def _ignore_the_limit(sync: Zero3) -> None:
    """Mutant: every unit prefetches all the units after it, whatever the depth says."""
    def learn(phase: str, order: list[int]) -> None:
        sync.order._ahead[phase] = {u: order[i + 1:] for i, u in enumerate(order)}
    sync.order._learn = learn


def prefetch_limits(rank: int, world: int) -> dict:
    """Stage 3 with each prefetch depth on a 5-unit MLP of equal units: trained 3 steps
    against one process on the global batch; the third step's collectives (CommLedger) and
    the most bytes gathered at once in its forward and its backward (orders are recorded by
    the first step)."""
    torch.manual_seed(SEED)
    ref = W.deep_mlp(PREFETCH_WIDTH, PREFETCH_UNITS)
    global_batch = partial(_mlp_batch, width=PREFETCH_WIDTH)
    W.train(ref, optimizer_function("adam")(list(ref.parameters())), global_batch, W.mse_loss,
            PREFETCH_STEPS, measure_memory=False)
    ref_full = full_state_dict(ref)
    local = local_batches(global_batch, rank, world)
    out = {}
    for name, (prefetch, options) in PREFETCH_VARIANTS.items():
        torch.manual_seed(SEED + rank)
        model, opt = shard(W.deep_mlp(PREFETCH_WIDTH, PREFETCH_UNITS), 3,
                           optimizer_function("adam"), prefetch=prefetch,
                           reshard_after_forward=options.get("reshard_after_forward", True))
        sync = opt.sync
        if options.get("unlimited"):
            _ignore_the_limit(sync)
        W.train(model, opt, local, W.mse_loss, PREFETCH_STEPS - 1, measure_memory=False)
        seen = _watch_gathered(sync)
        with CommLedger() as ledger:
            W.mse_loss(model, local(PREFETCH_STEPS - 1)).backward()
            opt.step()
            opt.zero_grad()
        full = full_state_dict(model)
        out[name] = {
            "depth": sync.order.depth, "units": len(sync.units),
            "unit_bytes": sorted({u.group.padded_numel * u.local.element_size()
                                  for u in sync.units}),
            "peak_gathered": seen["peak"], "gathers_started": seen["starts"],
            "gathered_after": sync.gathered_bytes(),
            "max_abs_diff": max((full[k] - ref_full[k]).abs().max().item() for k in ref_full),
            "collectives": sorted((r.op, r.nbytes) for r in ledger.records),
        }
    return out


def _mlp_batch(step: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return W.mlp_batch(step, GLOBAL_BATCH, width)


def error_cases() -> dict:
    message = error_message

    return {
        "unit_classes": message(lambda: shard(W.deep_mlp(4, 1), 3, unit_classes=("Linear",))),
        "twice": message(lambda: shard(shard(W.deep_mlp(4, 1), 3)[0], 3)),
        "batchnorm": message(lambda: shard(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
                                           3)[0](torch.ones(2, 4))),
        "frozen": message(lambda: shard(W.deep_mlp(4, 1).requires_grad_(False), 3)),
        **{f"prefetch={k!r}" + (f" stage {stage}" if stage != 3 else ""):
           message(lambda k=k, stage=stage: shard(W.deep_mlp(4, 1), stage, prefetch=k))
           for k, stage in ((0, 3), (-1, 3), (1.0, 3), ("2", 3), (None, 3), (2, 2))},
    }


def run(rank: int, world: int) -> dict:
    """Every case on this rank; the report tests/test_zero3.py reads (tests/workers/
    world_cases.py runs it in the launch it shares with the other workers)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cases, seconds = [], {}
        for c in CASES:
            start = time.perf_counter()
            cases.append(run_case(c, rank, world))
            cases[-1]["seconds"] = time.perf_counter() - start
        out = {"cases": cases, "global_batch": GLOBAL_BATCH}
        for name, fn in (("grads", grads_after_backward), ("inference", inference),
                         ("lifecycle", lifecycle), ("prefetch", prefetch_limits)):
            start = time.perf_counter()
            out[name] = fn(rank, world)
            seconds[name] = time.perf_counter() - start
        out["errors"] = error_cases() if world == 2 else {}
        out["seconds"] = seconds
        dist.barrier()
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return out


def main() -> None:
    """This worker alone, e.g. to debug it: torchrun("tests/workers/zero3_cases.py", nproc=2)."""
    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
