"""Per-rank worker for tests/test_stages.py and tests/test_partition.py.

One launch per world size runs every case and reports numbers; the tests assert on them.
Each rank initialises its model from a different seed, so `shard()` must broadcast rank 0's
weights; the single-process reference starts from rank 0's seed and trains on the whole
global batch of every step.
"""

from __future__ import annotations

import hashlib
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from zero_lab.collectives import CommLedger
from zero_lab.course import workloads as W
from zero_lab.launch import init_worker, report
from zero_lab.stages import ZeroRedundancyOptimizer, full_state_dict, shard, sharded_optimizer
from zero_lab.stages.mixed_precision import mixed_precision_reference
from zero_lab.stages.partition import FlatParamGroup, allocate_storage, free_storage

STEPS = 10
GLOBAL_BATCH = 24  # splits evenly over 1, 2, 3, 4 ranks, then into 2 micro-batches
SEED = 1234
TINY_BUCKET_MB = 400 / 2**20  # 400 bytes: many flat groups per model
# The optimizer steps flat slices in chunks of OPTIMIZER_CHUNK elements (4 MiB by default,
# more than these small models hold): 37 makes every case step many chunks, so the
# equivalence checks cover the chunked path too (zero3_cases imports this module).
sharded_optimizer.OPTIMIZER_CHUNK = 37


class Nested(nn.Module):
    """Odd sizes, nested modules, LayerNorm, a bias-free Linear, a 0-d parameter, a frozen
    layer and a layer applied twice (one module, so its weights are used twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(7, 9), nn.LayerNorm(9), nn.GELU())
        self.inner = nn.ModuleDict({"a": nn.Linear(9, 9, bias=False), "b": nn.Linear(9, 5)})
        self.frozen = nn.Linear(5, 5)
        self.frozen.requires_grad_(False)
        self.shared = nn.Linear(5, 5)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner["b"](torch.tanh(self.inner["a"](self.encoder(x))))
        h = self.shared(torch.relu(self.shared(self.frozen(h))))
        return self.head(h * self.scale)


def nested_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(77 + step)
    return torch.randn(batch_size, 7, generator=gen), torch.randn(batch_size, 3, generator=gen)


MODELS = {  # name: (constructor, global batch of a step, loss)
    "mlp_odd": (lambda: W.deep_mlp(13, 3), lambda s: W.mlp_batch(s, GLOBAL_BATCH, 13), W.mse_loss),
    "mlp_nobias": (lambda: W.deep_mlp(11, 2, bias=False),
                   lambda s: W.mlp_batch(s, GLOBAL_BATCH, 11), W.mse_loss),
    "nested": (Nested, lambda s: nested_batch(s, GLOBAL_BATCH), W.mse_loss),
    "gpt": (lambda: W.TinyGPT(vocab_size=23, seq_len=6, d_model=8, n_heads=2, n_layers=2,
                              bias=False),
            lambda s: W.gpt_batch(s, GLOBAL_BATCH, 6, 23), W.next_token_loss),
}
OPTIMIZERS = {  # name (as zero_lab.memory spells it): (class, hyperparameters)
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


def optimizer_function(name: str):
    cls, kwargs = OPTIMIZERS[name]
    return lambda params: cls(params, **kwargs)


def case(model, optimizer, stage, accumulation=1, clip=None, bucket_mb=25.0,
         precision="fp32", variant="reduce_scatter", standalone=False,
         transport="auto") -> dict:
    name = f"{model}-{optimizer}-stage{stage}"
    if variant != "reduce_scatter":
        name += f"-{variant}"
    if standalone:
        name = f"{model}-{optimizer}-ZeroRedundancyOptimizer"
    name += f"-acc{accumulation}" + (f"-clip{clip}" if clip else "")
    name += "-tinybucket" if bucket_mb < 1 else ""
    name += f"-{precision}" if precision != "fp32" else ""
    name += f"-{transport}" if transport != "auto" else ""
    return dict(name=name, model=model, optimizer=optimizer, stage=stage,
                accumulation=accumulation, clip=clip, bucket_mb=bucket_mb, precision=precision,
                variant=variant, standalone=standalone, transport=transport)


CASES = [c for s in (0, 1, 2) for c in (
    case("mlp_odd", "adam", s),
    case("mlp_nobias", "sgd_momentum", s, accumulation=2, bucket_mb=TINY_BUCKET_MB),
    case("nested", "adamw", s, clip=0.05, bucket_mb=TINY_BUCKET_MB),
    case("gpt", "adam", s, accumulation=2, clip=0.5, bucket_mb=TINY_BUCKET_MB),
    case("mlp_odd", "adam", s, precision="mixed", bucket_mb=TINY_BUCKET_MB),
)] + [
    case("gpt", "adamw", 2, accumulation=2, clip=0.5, precision="mixed"),
    case("mlp_odd", "adam", 1, variant="all_reduce"),
    case("nested", "sgd_momentum", 1, variant="all_reduce", accumulation=2, clip=0.05),
    case("mlp_odd", "adam", 1, standalone=True),
    case("mlp_odd", "adamw", 1, standalone=True, bucket_mb=TINY_BUCKET_MB),
] + [  # torch's collectives instead of the direct exchange gloo gets by default
    case("gpt", "adam", s, accumulation=2, clip=0.5, bucket_mb=TINY_BUCKET_MB, transport="torch")
    for s in (1, 2)
] + [case("mlp_odd", "adam", 2, precision="mixed", bucket_mb=TINY_BUCKET_MB, transport="torch")]


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def models_for_case(c: dict, rank: int, models: dict = MODELS):
    """(model, reference, global_batch, loss_fn, make_opt) for case `c` on this rank."""
    make_model, global_batch, loss_fn = models[c["model"]]
    torch.manual_seed(SEED + rank)  # ranks start different: shard() must broadcast rank 0's
    model = make_model()
    torch.manual_seed(SEED)  # the reference starts from rank 0's initialisation
    ref = make_model()
    return model, ref, global_batch, loss_fn, optimizer_function(c["optimizer"])


def reference_optimizer(c: dict, ref: nn.Module, make_opt):
    """(reference model, its optimizer): plain fp32, or the single-process mixed recipe."""
    if c["precision"] == "mixed":
        return mixed_precision_reference(ref, make_opt)
    return ref, make_opt([p for p in ref.parameters() if p.requires_grad])


def local_batches(global_batch, rank: int, world: int):
    """step -> this rank's rows of global batch `step`."""
    return lambda step: W.rank_slice(global_batch(step), rank, world)


def run_case(c: dict, rank: int, world: int) -> dict:
    model, ref, global_batch, loss_fn, make_opt = models_for_case(c, rank)

    if c["standalone"]:
        cls, kwargs = OPTIMIZERS[c["optimizer"]]
        opt = ZeroRedundancyOptimizer(model.parameters(), cls, bucket_mb=c["bucket_mb"],
                                      transport=c["transport"], **kwargs)
    else:
        model, opt = shard(model, c["stage"], make_opt, bucket_mb=c["bucket_mb"],
                           precision=c["precision"], zero1_variant=c["variant"],
                           transport=c["transport"])
    ref, ref_opt = reference_optimizer(c, ref, make_opt)
    local = local_batches(global_batch, rank, world)

    def ref_state():
        return (ref_opt.full_state_dict(ref) if c["precision"] == "mixed"
                else full_state_dict(ref))

    initial = ref_state()
    res = W.train(model, opt, local, loss_fn, STEPS, c["accumulation"], c["clip"])
    # fp32: one process, the whole global batch at once. Mixed precision: the same recipe,
    # micro-batches included (bf16 sums of two halves differ from the bf16 gradient of all).
    ref_accumulation = c["accumulation"] if c["precision"] == "mixed" else 1
    ref_res = W.train(ref, ref_opt, global_batch, loss_fn, STEPS, ref_accumulation, c["clip"])

    full = full_state_dict(model)
    ref_full = ref_state()
    moved = max((ref_full[k].float() - initial[k].float()).abs().max().item() for k in initial)
    diffs = {k: (full[k].float() - ref_full[k].float()).abs().max().item() for k in ref_full}
    scale = max(ref_full[k].float().abs().max().item() for k in ref_full)
    precision_gap = None
    if c["precision"] == "mixed":  # how far mixed precision itself moves the weights
        torch.manual_seed(SEED)
        fp32 = MODELS[c["model"]][0]()  # a third copy from rank 0's initialisation
        fp32_opt = make_opt([p for p in fp32.parameters() if p.requires_grad])
        W.train(fp32, fp32_opt, global_batch, loss_fn, STEPS, ref_accumulation, c["clip"],
                measure_memory=False)
        fp32_full = full_state_dict(fp32)
        precision_gap = max((fp32_full[k].float() - ref_full[k].float()).abs().max().item()
                            for k in ref_full)

    groups = opt.sync.groups
    out = {
        "name": c["name"], "stage": c["stage"], "precision": c["precision"],
        "optimizer": c["optimizer"], "variant": c["variant"], "standalone": c["standalone"],
        "clip": c["clip"], "model": c["model"], "transport": c["transport"],
        "direct": [g.sends.name == "direct" for g in opt.sync.groups],  # (transports.py)
        "keys_match": sorted(full) == sorted(ref.state_dict()),
        "max_abs_diff": max(diffs.values()), "worst_key": max(diffs, key=diffs.get),
        "max_abs_weight": scale, "ref_moved": moved, "precision_gap": precision_gap,
        "digest": digest(full),
        "losses": res["losses"], "ref_losses": ref_res["losses"],
        "grad_norms": res["grad_norms"], "ref_grad_norms": ref_res["grad_norms"],
        "held_after_backward": res["held_after_backward"],
        "held_after_step": res["held_after_step"], "peak_bytes": res["peak_bytes"],
        "n_trainable": W.count_parameters(model, trainable_only=True),
        "n_frozen": W.count_parameters(model) - W.count_parameters(model, trainable_only=True),
        "n_groups": len(groups),
        "padded_numel": sum(g.padded_numel for g in groups),
        "shard_numel": sum(g.shard_numel for g in groups),
        # the elements the optimizer steps (and keeps state for): real ones, no padding
        "stepped_numel": sum(g.numel for g in groups) if c["stage"] == 0 and not c["standalone"]
        else sum(pc.numel for g in groups for pc in g.shard_pieces()),
        "element_size": groups[0].flat.element_size(),
    }

    # One more step under the ledger (after the comparison: it changes the weights).
    batch = local(STEPS)
    with CommLedger() as ledger:
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    out["ledger"] = {op: {k: v for k, v in s.items()} for op, s in ledger.summary().items()}
    out["ledger_volume"] = ledger.volume()
    out["ledger_in_backward"] = sorted({r.op for r in ledger.records if r.in_backward})
    out["ledger_async"] = sorted({r.op for r in ledger.records if r.async_op})
    return out


def grads_final_after_backward(stage: int, rank: int, world: int) -> dict:
    """Right after backward (two calls, accumulating), the gradient each rank holds for what it
    updates equals the single-process gradient on the global batch; model.zero_grad() clears."""
    make_model, global_batch, loss_fn = MODELS["mlp_odd"]
    torch.manual_seed(SEED + rank)
    model = make_model()
    torch.manual_seed(SEED)
    ref = make_model()
    model, opt = shard(model, stage, optimizer_function("adam"), bucket_mb=TINY_BUCKET_MB)
    ref_grads = {}
    errors = []
    for trial in range(2):
        for step in (0, 1):  # two backward calls accumulate
            loss_fn(model, W.rank_slice(global_batch(step), rank, world)).backward()
            loss_fn(ref, global_batch(step)).backward()
        ref_grads = dict(ref.named_parameters())
        for group, step_param in zip(opt.sync.groups, opt.sync.step_params, strict=True):
            expected = group.flatten([ref_grads[n].grad for n in group.names])
            if stage > 0:
                expected = group.shard(expected)
            errors.append((step_param.grad - expected).abs().max().item())
        model_grads = [p.grad for p in model.parameters()]
        # trial 0 ends with the optimizer's zero_grad, trial 1 with the model's
        (opt.zero_grad if trial == 0 else model.zero_grad)()
        ref.zero_grad()
    cleared = [0.0 if sp.grad is None else sp.grad.abs().max().item()
               for sp in opt.sync.step_params]
    return {"stage": stage, "max_error": max(errors), "after_zero_grad": max(cleared),
            "model_grads_none": all(g is None for g in model_grads)}


def partition_checks(rank: int, world: int) -> dict:
    """FlatParamGroup's collectives and storage handling on real ranks."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(3, 5), (7,), (), (2, 2, 3)]
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    originals = [p.detach().clone() for p in params]
    group = FlatParamGroup(params, world, rank, names=["w", "b", "scalar", "cube"])
    flat = group.flatten()
    group.bind(flat)
    # reduce-scatter: rank r contributes (r + 1) x [0, 1, 2, ...]; AVG gives (N + 1) / 2 x it
    # (small integers and halves: exact in fp32, so any error is a wrong slice or a wrong op)
    counting = torch.arange(group.padded_numel, dtype=torch.float32)
    owned = group.new_shard()
    group.reduce_scatter(owned, counting * (rank + 1))
    rs_error = (owned - group.shard(counting) * (world + 1) / 2).abs().max().item()
    # all-gather after freeing the full buffer: the parameters (views) come back intact.
    mine = group.shard(flat).clone()
    free_storage(flat)
    freed = [p.untyped_storage().nbytes() for p in params]
    allocate_storage(flat)
    group.all_gather(flat, mine)
    ag_error = max((p - o).abs().max().item() for p, o in zip(params, originals, strict=True))
    return {"numel": group.numel, "padded": group.padded_numel, "shard": group.shard_numel,
            "rs_error": rs_error, "ag_error": ag_error, "freed_bytes": freed,
            "restored_bytes": flat.untyped_storage().nbytes(),
            "pieces": [[p.index, p.param_start, p.param_end, p.shard_start]
                       for p in group.shard_pieces()]}


def error_message(fn) -> str:
    """`ExceptionType: message` of what fn() raises, or "no error"."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is tested
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def error_cases() -> dict:
    """The text of every refusal (ranks fail identically before any collective)."""
    message = error_message

    def mlp():
        return W.deep_mlp(5, 1)

    def shared_storage():
        m = W.deep_mlp(5, 2)
        m[2].weight = nn.Parameter(m[0].weight.data)  # a second Parameter on the same memory
        return m

    def all_frozen():
        return mlp().requires_grad_(False)

    def with_empty_parameter():
        m = mlp()
        m.register_parameter("nothing", nn.Parameter(torch.empty(0)))
        return m

    def outside_optimizer(stage):
        model, _ = shard(mlp(), stage)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # not through shard()
        model(torch.ones(2, 5)).sum().backward()
        opt.step()

    def nested(inner: int, outer: int, depth: int = 1):
        """A model holding one that shard() returned, at `depth` below the root."""
        part = shard(mlp(), inner)[0]
        for _ in range(depth):
            part = nn.Sequential(nn.Linear(5, 5), part)
        return shard(part, outer)

    sharded = shard(mlp(), 0)[0]
    probe_model = mlp()
    return {
        **{f"nested_{i}_in_{o}": message(lambda i=i, o=o: nested(i, o))
           for i in range(4) for o in range(4)},
        "nested_deep": message(lambda: nested(2, 1, depth=2)),
        "stage_float": message(lambda: shard(mlp(), 1.0)),
        "stage_bool": message(lambda: shard(mlp(), True)),
        "bucket_nan": message(lambda: shard(mlp(), 2, bucket_mb=float("nan"))),
        "bucket_inf": message(lambda: shard(mlp(), 2, bucket_mb=float("inf"))),
        "max_norm": message(lambda: shard(nn.Sequential(nn.Embedding(9, 4, max_norm=1.0)), 1)),
        "empty_param": message(lambda: shard(with_empty_parameter(), 1)),
        "meta": message(lambda: shard(mlp().to("meta"), 1)),
        "zero_redundancy_empty": message(lambda: ZeroRedundancyOptimizer([], torch.optim.Adam)),
        "outside_optimizer_1": message(lambda: outside_optimizer(1)),
        "outside_optimizer_2": message(lambda: outside_optimizer(2)),
        "stage5": message(lambda: shard(mlp(), 5)),
        "precision": message(lambda: shard(mlp(), 1, precision="fp8")),
        "bucket": message(lambda: shard(mlp(), 2, bucket_mb=0)),
        "variant": message(lambda: shard(mlp(), 2, zero1_variant="all_reduce")),
        "unit_classes": message(lambda: shard(mlp(), 1, unit_classes=(nn.Linear,))),
        "batchnorm": message(lambda: shard(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
                                           1)[0](torch.ones(2, 4))),
        "sparse": message(lambda: shard(nn.Sequential(nn.Embedding(9, 4, sparse=True)), 2)),
        "frozen": message(lambda: shard(all_frozen(), 1)),
        "float64": message(lambda: shard(mlp().double(), 1)),
        "shared_storage": message(lambda: shard(shared_storage(), 2)),
        "twice": message(lambda: shard(sharded, 1)),
        "lbfgs": message(lambda: shard(mlp(), 1, lambda ps: torch.optim.LBFGS(ps))),
        "stranger": message(lambda: shard(
            mlp(), 1, lambda ps: torch.optim.Adam(probe_model.parameters()))),
        "instance": message(lambda: shard(
            probe_model, 1, torch.optim.Adam(probe_model.parameters(), lr=1e-3))),
        "not_optimizer": message(lambda: shard(mlp(), 1, lambda ps: None)),
        "uneven_batch": message(lambda: W.rank_slice(W.mlp_batch(0, 5, 3), 0, 2)),
    }


def run(rank: int, world: int) -> dict:
    """Every case on this rank; the report tests/test_stages.py and test_partition.py read
    (tests/workers/world_cases.py runs it in the launch it shares with the other workers)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cases = []
        for c in CASES:
            start = time.perf_counter()
            cases.append(run_case(c, rank, world))
            cases[-1]["seconds"] = time.perf_counter() - start
        grads = [grads_final_after_backward(s, rank, world) for s in (0, 1, 2)]
        partition = partition_checks(rank, world)
        errors = error_cases() if world == 2 else {}
        dist.barrier()
    return {"cases": cases, "grads_after_backward": grads, "partition": partition,
            "errors": errors, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def main() -> None:
    """This worker alone, e.g. to debug it: torchrun("tests/workers/stage_cases.py", nproc=2)."""
    info = init_worker()
    report(run(info.rank, info.world_size))


if __name__ == "__main__":
    main()
